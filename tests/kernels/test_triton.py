"""Triton kernels against the float64 torch reference (on CPU: Triton's interpreter).

Every normalizer x mask kind x row path (one block in registers, or multi-pass
with the single-block limit forced down) in float32, and float16/bfloat16 on a
key-padding mask.  The scores hold -inf entries, a fully masked row, a +inf row
and a +inf at a position some masks exclude.  Outputs (and per-row statistics)
are poisoned with NaN before every kernel run, so an element a kernel forgets to
write fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import attnorm  # noqa: E402
import attnorm.functional as F  # noqa: E402
from attnorm.kernels.triton import launch  # noqa: E402

# The interpreter evaluates masked-off lanes too (e.g. exp(-inf - -inf)); numpy warns about them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BATCH, HEADS, QUERIES = 2, 2, 3
SINGLE_LENGTH = 37  # one block of 64 lanes
MULTI_LENGTH = 21  # three blocks of 8 once the single-block limit is forced to 8
FORCED_BLOCK = 8

# float16/bfloat16 outputs are rounded to the input dtype (2^-11 and 2^-8 relative).
TOLERANCES = {
    torch.float32: {"atol": 2e-6, "rtol": 2e-5},
    torch.float16: {"atol": 1e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 8e-3, "rtol": 1.6e-2},
}
GRADIENT_SLACK = 5  # gradients (and parameter gradients, sums over rows) get 5x the tolerance


def per_head(*values: float) -> torch.Tensor:
    """A per-head parameter broadcasting over scores (B, H, Lq, Lk)."""
    return torch.tensor(values).reshape(-1, 1, 1)


CASES = {
    "softmax": (F.softmax, {"temperature": 0.7}),
    "softmax-per-head": (F.softmax, {"temperature": per_head(0.5, 1.5)}),
    "scalable-softmax": (F.scalable_softmax, {"s": 0.43, "bias": 0.0}),
    "scalable-softmax-per-head": (F.scalable_softmax, {"s": per_head(0.3, -0.2), "bias": per_head(0.1, 0.5)}),
    "self-adjusted": (F.self_adjusted_softmax, {}),
    "self-adjusted-plain": (F.self_adjusted_softmax, {"normalized": False}),
    "sparsemax": (F.sparsemax, {}),
    "entmax-1.5": (F.entmax, {"alpha": 1.5}),
    "entmax-per-head": (F.entmax, {"alpha": per_head(1.0, 1.3)}),  # head 0 is softmax
    "topk-3": (F.topk_softmax, {"k": 3}),
    "topk-fraction": (F.topk_softmax, {"k": 0.2, "temperature": per_head(0.5, 2.0)}),
}
MASK_KINDS = ("none", "bool", "causal", "key-padding")


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    def empty(shape, dtype, device):
        return torch.full(shape, math.nan, dtype=dtype, device=device)

    monkeypatch.setattr(launch, "empty", empty)


PATHS = ("single-block", "multi-pass")


def row_length(path: str, monkeypatch) -> int:
    """Row length for ``path``; multi-pass forces rows of 21 through blocks of 8."""
    if path == "multi-pass":
        monkeypatch.setattr(launch, "SINGLE_BLOCK_MAX", FORCED_BLOCK)
        monkeypatch.setattr(launch, "MULTI_PASS_BLOCK", FORCED_BLOCK)
        return MULTI_LENGTH
    return SINGLE_LENGTH


def grid(dtypes: tuple[torch.dtype, ...]) -> list:
    """Every (case, mask kind, path, dtype).  The interpreter is slow: the default run keeps
    every single-block float32 combination, every case and every mask kind once on the
    multi-pass path, and every case in half precision on one block; the rest is marked slow."""
    combinations = []
    for index, case in enumerate(CASES):
        for mask_kind in MASK_KINDS:
            for path in PATHS:
                for dtype in dtypes:
                    if path == "single-block":
                        fast = dtype == torch.float32 or mask_kind == "key-padding"
                    else:
                        fast = dtype == torch.float32 and mask_kind == MASK_KINDS[index % len(MASK_KINDS)]
                    marks = () if fast else (pytest.mark.slow,)
                    ids = f"{case}-{mask_kind}-{path}-{str(dtype).removeprefix('torch.')}"
                    combinations.append(pytest.param(case, mask_kind, path, dtype, marks=marks, id=ids))
    return combinations


def make_scores(length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(BATCH, HEADS, QUERIES, length, generator=generator)
    x[0, 0, 1, ::3] = -math.inf  # -inf scores count as masked
    x[1, 1, 2] = -math.inf  # a fully masked row
    x[1, 0, 0, [3, 7]] = math.inf  # a +inf row: uniform over its +inf positions
    x[0, 1, 2, length - 1] = math.inf  # excluded by the key-padding mask, a +inf row otherwise
    return x


def make_mask(kind: str, length: int) -> torch.Tensor | attnorm.StructuredMask | None:
    if kind == "none":
        return None
    if kind == "bool":
        generator = torch.Generator().manual_seed(1)
        allowed = torch.rand(QUERIES, length, generator=generator) > 0.3
        allowed[1] = False  # a fully masked query, broadcast over batch and heads
        allowed[:, [3, 7]] = True
        return allowed
    if kind == "causal":
        return attnorm.causal_mask(length - QUERIES)  # bottom-right aligned, as with a KV cache
    return attnorm.key_padding_mask(torch.tensor([length - 4, 9]))


def outputs_and_gradients(fn, x, mask, params, backend, dtype):
    """Weights and the gradients of ``sum(weights * upstream)`` w.r.t. x and every tensor parameter."""
    x = x.to(dtype).requires_grad_()
    params = {
        name: value.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        if isinstance(value, torch.Tensor)
        else value
        for name, value in params.items()
    }
    out = fn(x, mask=mask, backend=backend, **params)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    inputs = [x] + [value for value in params.values() if isinstance(value, torch.Tensor)]
    return out, torch.autograd.grad(out, inputs, upstream)


def assert_matches_reference(fn, params, x, mask, dtype, tolerance=None):
    tolerance = tolerance or TOLERANCES[dtype]
    x = x.to(dtype)  # the reference sees exactly the scores the kernel sees
    out, grads = outputs_and_gradients(fn, x, mask, params, "triton", dtype)
    expected_out, expected_grads = outputs_and_gradients(fn, x, mask, params, "torch", torch.float64)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected_out, **tolerance)
    grad_tolerance = {key: value * GRADIENT_SLACK for key, value in tolerance.items()}
    for name, grad, expected in zip(["x", *params], grads, expected_grads, strict=False):
        torch.testing.assert_close(grad.double(), expected, **grad_tolerance, msg=lambda m, n=name: f"d/d{n}: {m}")


@pytest.mark.parametrize(("case", "mask_kind", "path", "dtype"), grid(tuple(TOLERANCES)))
def test_matches_float64_reference(case, mask_kind, path, dtype, monkeypatch):
    fn, params = CASES[case]
    length = row_length(path, monkeypatch)
    assert_matches_reference(fn, params, make_scores(length), make_mask(mask_kind, length), dtype)
