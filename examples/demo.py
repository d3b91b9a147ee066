"""attnorm demo: the same toy attention with each normalizer, side by side.

Part 1 swaps ``torch.softmax`` for each normalizer in a tiny causal attention and
prints what the heads do (entropy, support, max weight).  Part 2 is the paper's
vanishing-attention picture (Mudarisov et al., arXiv 2508.17821, Lemma 1): one
"needle" key scores ``gap`` above a haystack of L keys; softmax's weight on it
decays like 1/L, the remedies keep it.

Run: ``python examples/demo.py`` (a few seconds on a laptop CPU).
"""

from __future__ import annotations

import math
import time

import torch
from einops import rearrange

import attnorm

NORMALIZERS = {
    "softmax": attnorm.Softmax(),
    "softmax T=0.5": attnorm.Softmax(temperature=0.5),
    "ssmax s=0.43": attnorm.ScalableSoftmax(s=0.43),
    "sa_softmax": attnorm.SelfAdjustedSoftmax(),
    "sparsemax": attnorm.Sparsemax(),
    "entmax a=1.5": attnorm.Entmax(alpha=1.5),
    "entmax a=1.25": attnorm.Entmax(alpha=1.25),
    "topk k=8": attnorm.TopKSoftmax(k=8),
}


def toy_attention(x: torch.Tensor, normalizer: attnorm.Normalizer, heads: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal self-attention with random projections; the normalizer is the only moving part."""
    generator = torch.Generator().manual_seed(1)
    width = x.shape[-1]
    w_qkv = torch.randn(width, 3 * width, generator=generator) / math.sqrt(width)
    q, k, v = rearrange(x @ w_qkv, "b l (three h d) -> three b h l d", three=3, h=heads)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, L)
    weights = normalizer(scores, mask=attnorm.causal_mask())  # was: torch.softmax(scores, dim=-1)
    return rearrange(weights @ v, "b h l d -> b l (h d)"), weights


def head_table() -> None:
    x = torch.randn(2, 256, 64, generator=torch.Generator().manual_seed(0)) * 3
    print("Part 1 - one line swapped in a causal toy attention (B=2, H=4, L=256; ms: the attention call, best of 5):")
    print(f"{'normalizer':<15} {'mean entropy':>12} {'mean support':>12} {'mean max w':>10} {'row sum':>8} {'ms':>7}")
    for name, normalizer in NORMALIZERS.items():
        _, weights = toy_attention(x, normalizer)  # warm-up: the first call pays one-time costs
        elapsed = float("inf")
        for _ in range(5):  # the best of five calls: one cold call read 10-100x slow on a busy machine
            start = time.perf_counter()
            toy_attention(x, normalizer)
            elapsed = min(elapsed, (time.perf_counter() - start) * 1e3)
        probs = weights.clamp_min(0)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()
        support = (weights != 0).sum(-1).float().mean()
        print(
            f"{name:<15} {entropy.item():>12.3f} {support.item():>12.1f} {weights.amax(-1).mean().item():>10.3f} "
            f"{weights.sum(-1).mean().item():>8.3f} {elapsed:>7.1f}"
        )


def needle_table(gap: float = 3.0) -> None:
    lengths = [16, 256, 4096, 65536]
    print(f"\nPart 2 - weight on a needle scoring {gap} above the largest of L N(0, 1) keys:")
    print(f"{'normalizer':<15}" + "".join(f"{'L=' + str(n):>10}" for n in lengths))
    generator = torch.Generator().manual_seed(0)
    haystacks = {n: torch.randn(n, generator=generator) for n in lengths}
    for name, normalizer in NORMALIZERS.items():
        cells = []
        for n in lengths:
            scores = haystacks[n].clone()
            scores[0] = gap + scores.max()
            cells.append(f"{normalizer(scores)[0].item():>10.4f}")
        print(f"{name:<15}" + "".join(cells))
    print("softmax's needle weight falls toward 0 as L grows (Lemma 1); ssmax, sparsemax, entmax and top-k keep it.")


if __name__ == "__main__":
    torch.manual_seed(0)
    names = ", ".join(attnorm.available()[:6])
    print(f"attnorm {attnorm.__version__}, torch {torch.__version__}, normalizers: {names}\n")
    head_table()
    needle_table()
