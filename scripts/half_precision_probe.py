"""How far the fused kernels' half-precision gradients lie from float64, beside eager PyTorch in the same dtype.

The tests ``test_half_precision_gradients_take_delta_from_the_unrounded_output`` (top-k) and
``test_plain_half_precision_gradients_take_p_from_the_unrounded_output`` (plain Self-Adjusted)
bound the fused dq/dk error on peaked rows.  Under the interpreter bfloat16 operands are read
as float32, so only a GPU shows what the MMAs' 2-byte operands (``p`` and ``ds`` rounded
before their products, as FlashAttention-2 does) add.  This prints, per family and dtype, the
worst of dq and dk relative to the float64 gradient's largest value for: the fused backward
given the forward's float32 output (``exact``), the fused backward given the rounded output
(``rounded``), and the same reference materialised and differentiated by PyTorch in the
half dtype (``eager``: FlashAttention's yardstick is twice that).

Usage::

    PYTHONPATH=. python scripts/half_precision_probe.py          # CUDA when present, else the interpreter
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnorm.kernels.triton import attention_self_adjusted as self_adjusted  # noqa: E402
from attnorm.kernels.triton import attention_topk as topk  # noqa: E402
from tests.kernels import test_attention_self_adjusted as sa_tests  # noqa: E402
from tests.kernels import test_attention_topk as topk_tests  # noqa: E402

F64 = torch.float64


def worst(grads, truth) -> float:
    """The larger of dq's and dk's largest error relative to the float64 gradient's largest value."""
    return max(((g.to(F64) - t).abs().max() / t.abs().max()).item() for g, t in zip(grads, truth, strict=True))


def probe(family: str, dtype: torch.dtype, device: str) -> tuple[float, float, float]:
    q, k, v = sa_tests.make_qkv(2, 2, 1, 24, 24, 32, 16, dtype, device, seed=3)
    mask = sa_tests.MASKS["causal"](2, 24, 24, device)
    grad_out = torch.randn(2, 2, 24, 16, generator=torch.Generator().manual_seed(4)).to(dtype).to(device)
    if family == "topk":
        args = (mask, 1.0, 2, False, 1.0)

        def reference(*leaves):
            return topk_tests.reference(*leaves, *args)

        forward, backward = topk.topk_attention_forward, topk.topk_attention_backward
    else:
        q = q * 3  # peaked rows, as the test's
        args = (mask, sa_tests.SCALE, False)

        def reference(*leaves):
            return sa_tests.reference(*leaves, *args)

        forward = self_adjusted.self_adjusted_attention_forward
        backward = self_adjusted.self_adjusted_attention_backward
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    reference(*leaves).backward(grad_out.to(F64))
    truth = [leaf.grad for leaf in leaves[:2]]
    half = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    reference(*half).backward(grad_out)
    eager = worst([t.grad for t in half[:2]], truth)
    out, stats, out_float = forward(q, k, v, *args, float_out=True)
    exact = worst(backward(q, k, v, out, grad_out, stats, *args, out_float=out_float)[:2], truth)
    rounded = worst(backward(q, k, v, out, grad_out, stats, *args)[:2], truth)
    return exact, rounded, eager


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "interpreter"
    print(f"worst dq/dk error relative to the float64 gradient's largest value ({name})\n")
    print("| family | dtype | fused, float32 out | fused, rounded out | eager in dtype |")
    print("|---|---|---|---|---|")
    for family in ("topk", "self_adjusted_plain"):
        for dtype in (torch.bfloat16, torch.float16):
            exact, rounded, eager = probe(family, dtype, device)
            print(f"| {family} | {str(dtype)[6:]} | {exact:.2e} | {rounded:.2e} | {eager:.2e} |")


if __name__ == "__main__":
    main()
