"""Train a tiny causal transformer with each attention normalizer and compare the losses.

The model calls ``attnorm.attention(q, k, v, self.normalizer, is_causal=True)``, so
the normalizer is one constructor argument: swapping softmax for sparsemax is the
line ``TinyTransformer(config, normalizer="sparsemax")``.  Character-level language
modelling on a text file (default: ``attnorm/data/sample.txt``); 200 CPU steps per
normalizer, about a minute in all.  The model is so small that one thread is
fastest: more threads mostly wait on each other.

Usage: ``python examples/custom_transformer.py [--text FILE] [--steps 200] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import attnorm

NORMALIZERS = ["softmax", "ssmax", "sa_softmax", "sparsemax", "entmax", "topk:k=8"]
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "attnorm" / "data" / "sample.txt"


@dataclass
class Config:
    vocab_size: int
    context: int = 64
    width: int = 64
    heads: int = 4
    layers: int = 2


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config, normalizer: str | attnorm.Normalizer) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.normalizer = attnorm.make(normalizer)  # a spec string builds one normalizer per layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = attnorm.attention(q, k, v, self.normalizer, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, config: Config, normalizer: str | attnorm.Normalizer) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.width)
        self.attention = CausalSelfAttention(config, normalizer)
        self.mlp_norm = nn.LayerNorm(config.width)
        hidden = 4 * config.width
        self.mlp = nn.Sequential(nn.Linear(config.width, hidden), nn.GELU(), nn.Linear(hidden, config.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    """A pre-norm decoder-only transformer whose attention normalizer is a constructor argument."""

    def __init__(self, config: Config, normalizer: str | attnorm.Normalizer = "softmax") -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.width)
        self.positions = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config, normalizer) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, vocab)


def batches(data: torch.Tensor, context: int, batch_size: int, generator: torch.Generator):
    while True:
        starts = torch.randint(len(data) - context - 1, (batch_size,), generator=generator)
        window = torch.stack([data[start : start + context + 1] for start in starts])
        yield window[:, :-1], window[:, 1:]


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, context: int) -> float:
    usable = (len(data) - 1) // context * context
    inputs, targets = data[:usable].view(-1, context), data[1 : usable + 1].view(-1, context)
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    text = args.text.read_text(encoding="utf-8")
    alphabet = sorted(set(text))
    data = torch.tensor([alphabet.index(char) for char in text])
    split = int(0.9 * len(data))
    config = Config(vocab_size=len(alphabet))

    results = []
    progress = tqdm(total=args.steps * len(NORMALIZERS), unit="step")
    for name in NORMALIZERS:
        torch.manual_seed(0)
        model = TinyTransformer(config, normalizer=name)  # the one line that swaps the normalizer
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        stream = batches(data[:split], config.context, args.batch_size, torch.Generator().manual_seed(0))
        start, recent = time.perf_counter(), []
        for _ in range(args.steps):
            inputs, targets = next(stream)
            loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            recent = (recent + [loss.item()])[-20:]
            progress.set_postfix(normalizer=name, loss=f"{loss.item():.3f}")
            progress.update()
        model.eval()
        results.append((name, sum(recent) / len(recent), evaluate(model, data[split:], config.context),
                        time.perf_counter() - start))
    progress.close()

    print(f"\n{args.text.name}: {len(data)} characters, {len(alphabet)} symbols, {args.steps} steps of "
          f"{args.batch_size} x {config.context}; loss in nats per character")
    print(f"{'normalizer':<12}{'train loss':>12}{'val loss':>10}{'seconds':>9}")
    for name, train_loss, val_loss, seconds in results:
        print(f"{name:<12}{train_loss:>12.3f}{val_loss:>10.3f}{seconds:>9.1f}")


if __name__ == "__main__":
    main()
