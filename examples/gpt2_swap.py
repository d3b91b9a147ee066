"""Swap GPT-2's attention normalizer without retraining and measure perplexity.

``attnorm.integrations.transformers.patch(model, normalizer)`` reroutes every
self-attention layer through :func:`attnorm.attention`; ``softmax`` reproduces the
unpatched model exactly, the others show what each normalizer does to a model that
was trained with softmax.  Uses the pretrained ``gpt2`` weights when they are in the
local Hugging Face cache; otherwise a small randomly initialised GPT-2 on bytes
(the numbers then only show the mechanics).

Usage: ``python examples/gpt2_swap.py [TEXT_FILE] [--context 256] [--max-tokens 1024]``
(default text: ``attnorm/data/sample.txt``; under two minutes on two CPU cores).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast
from transformers.utils import logging

from attnorm.integrations.transformers import patch

NORMALIZERS = ["softmax", "ssmax", "sa_softmax", "sparsemax", "entmax", "topk:k=16"]
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "attnorm" / "data" / "sample.txt"


def load_gpt2(context: int) -> tuple[GPT2LMHeadModel, Callable[[str], list[int]]]:
    """The pretrained GPT-2 and its tokenizer if cached locally, else a random byte-level GPT-2."""
    try:
        tokenizer = GPT2TokenizerFast.from_pretrained("gpt2", local_files_only=True)
        model = GPT2LMHeadModel.from_pretrained("gpt2", local_files_only=True)
        print("loaded the pretrained gpt2 weights from the local Hugging Face cache")
        return model.eval(), lambda text: tokenizer(text)["input_ids"]
    except OSError:
        print(
            "No local copy of the pretrained 'gpt2' weights (Hugging Face cache, offline), so this run uses a small "
            "RANDOMLY INITIALISED GPT-2 on bytes: its perplexities only show the mechanics (around the vocabulary "
            "size, 256).  Download the weights once with GPT2LMHeadModel.from_pretrained('gpt2') for real numbers."
        )
        torch.set_num_threads(1)  # so small a model runs fastest on one thread
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=256, n_positions=context, n_embd=128, n_layer=4, n_head=4)
        return GPT2LMHeadModel(config).eval(), lambda text: list(text.encode("utf-8"))


@torch.no_grad()
def perplexity(model: GPT2LMHeadModel, windows: torch.Tensor, batch_size: int, progress: tqdm) -> float:
    """exp(mean next-token cross-entropy) over non-overlapping windows."""
    total_loss = 0.0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        total_loss += model(batch, labels=batch).loss.item() * len(batch)
        progress.update(len(batch))
    return math.exp(total_loss / len(windows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", type=Path, nargs="?", default=DEFAULT_TEXT)
    parser.add_argument("--context", type=int, default=256, help="tokens per window")
    parser.add_argument("--max-tokens", type=int, default=1024, help="evaluate on the first tokens only")
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    logging.set_verbosity_error()

    model, tokenize = load_gpt2(args.context)
    tokens = torch.tensor(tokenize(args.text.read_text(encoding="utf-8")))[: args.max_tokens]
    windows = tokens[: len(tokens) // args.context * args.context].view(-1, args.context)
    print(f"{args.text.name}: first {len(tokens)} tokens, {len(windows)} windows of {args.context}")

    results = {}
    with tqdm(total=len(windows) * (len(NORMALIZERS) + 1), unit="window") as progress:
        progress.set_postfix(normalizer="unpatched")
        results["unpatched"] = perplexity(model, windows, args.batch_size, progress)
        for name in NORMALIZERS:
            progress.set_postfix(normalizer=name)
            with patch(model, name):
                results[name] = perplexity(model, windows, args.batch_size, progress)

    print(f"\n{'attention':<12}{'perplexity':>12}")
    for name, value in results.items():
        print(f"{name:<12}{value:>12.2f}")


if __name__ == "__main__":
    main()
