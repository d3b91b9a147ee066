"""Threshold passes per query block of the fused entmax forward, counted under Triton's interpreter.

The forward's cost is dominated by its passes over K (:mod:`attnorm.kernels.triton.attention_entmax`):
one for the row max, the threshold search's, one for the output.  This script runs the real
kernel under ``TRITON_INTERPRET=1`` with a GPU's blocks of 64 and counts the calls of its
threshold pass (``_newton_sums``), so a change to the search can be judged without a GPU.
The inputs are a model of attention scores: q, k ~ N(0, 1), head dim 64, scale 1/8.

Usage::

    PYTHONPATH=. python scripts/threshold_passes.py                        # alpha 2, 1.5, 1.25; three shapes
    PYTHONPATH=. python scripts/threshold_passes.py --alphas 2 --shapes 16384:full

A shape ``L:causal`` is ``L`` queries and keys under a causal mask; ``L:full`` is one query
block of 64 rows against ``L`` keys.  About a minute per 16384-key shape on two cores.
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import attnorm  # noqa: E402
from attnorm.kernels.rules import AttentionMask  # noqa: E402
from attnorm.kernels.triton import attention_entmax, attention_launch  # noqa: E402


def count_passes(alpha: float, length: int, causal: bool, heads: int = 2, seed: int = 0) -> float:
    """Mean threshold passes per query block of one forward call (blocks of 64)."""
    queries = length if causal else 64
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, queries, 64, generator=gen)
    k = torch.randn(1, heads, length, 64, generator=gen)
    v = torch.randn(1, heads, length, 64, generator=gen)
    mask = AttentionMask()
    if causal:
        start, stop = attnorm.causal_mask().key_range(1, queries, length, "cpu")
        mask = AttentionMask(start, stop, None, None)
    calls = [0]
    original = attention_entmax._newton_sums

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    attention_entmax._newton_sums = counted
    try:
        attention_entmax.entmax_attention_forward(q, k, v, mask, 1 / 8, alpha, None)
    finally:
        attention_entmax._newton_sums = original
    return calls[0] / (heads * ((queries + 63) // 64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alphas", type=float, nargs="+", default=[2.0, 1.5, 1.25])
    parser.add_argument("--shapes", nargs="+", default=["1024:causal", "4096:full", "16384:full"])
    args = parser.parse_args()
    attention_launch.BLOCK_INTERPRETED = 64  # a GPU's blocks
    print("| alpha | keys | mask | threshold passes per query block |")
    print("|---|---|---|---|")
    for alpha in args.alphas:
        for shape in args.shapes:
            length, kind = shape.split(":")
            passes = count_passes(alpha, int(length), kind == "causal")
            print(f"| {alpha:g} | {length} | {kind} | {passes:.2f} |", flush=True)


if __name__ == "__main__":
    main()
