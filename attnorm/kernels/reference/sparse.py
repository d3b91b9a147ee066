"""alpha-entmax and sparsemax in torch, with closed-form (twice differentiable) backward passes.

alpha-entmax (Peters, Niculae & Martins, 2019) solves
``argmax_{p in simplex} p.x + H_alpha(p)`` with the Tsallis entropy
``H_alpha(p) = (1 - sum p^alpha) / (alpha (alpha - 1))``; its solution is
``y = [(alpha - 1) x - tau]_+^(1 / (alpha - 1))`` with ``tau`` such that ``sum y = 1``.
alpha = 1 is softmax, alpha = 2 sparsemax (Martins & Astudillo, 2016), the Euclidean
projection ``argmin_{p in simplex} ||p - x||^2``.

The weights are computed without autograd (exactly by sorting for alpha in {1.5, 2},
by bisection otherwise) inside one :class:`torch.autograd.Function` whose backward is
:func:`attnorm.kernels.reference.jacobians.entmax_vjp`, itself differentiable, so
double backward, ``torch.func`` transforms and ``torch.compile`` all work.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnorm.kernels import rules
from attnorm.kernels.reference.jacobians import entmax_alpha_grad, entmax_jvp, entmax_vjp
from attnorm.kernels.reference.rows import finish, masked_softmax, rows_of, shifted_scaled

__all__ = ["bisect_iterations", "entmax", "entmax_weights", "sparsemax"]


def bisect_iterations(dtype: torch.dtype) -> int:
    """Halvings of the bracket ``[0, 1]`` of a weight: below the dtype's resolution."""
    return 64 if dtype == torch.float64 else 32


def _relative_to_top(scores: Tensor, active: Tensor) -> Tensor:
    """Scores minus the row's largest active score, clamped to the dtype's range (the maps are shift-invariant)."""
    top = torch.where(active, scores, -math.inf).amax(-1, keepdim=True)
    top = torch.where(active.any(-1, keepdim=True), top, 0.0)
    largest = torch.finfo(scores.dtype).max
    return (scores - top).clamp_min(-largest)


def _sorted(z: Tensor, active: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Active scores in decreasing order (0 after them), which sorted slots hold one, and the ranks 1..L."""
    count = active.sum(-1, keepdim=True)
    ordered = torch.where(active, z, -math.inf).sort(dim=-1, descending=True).values
    slots = torch.arange(z.shape[-1], device=z.device)
    valid = slots < count
    return torch.where(valid, ordered, 0.0), valid, (slots + 1).to(z.dtype)


def _sparsemax_weights(z: Tensor, active: Tensor) -> Tensor:
    """Sparsemax by sorting: ``tau = (sum_{i <= k} z_(i) - 1) / k`` for the largest ``k`` with ``k z_(k) > sum - 1``."""
    ordered, valid, rank = _sorted(z, active)
    cumulative = ordered.cumsum(-1) - 1
    support = (rank * ordered > cumulative) & valid
    size = support.sum(-1, keepdim=True).clamp_min(1)
    tau = cumulative.gather(-1, size - 1) / size.to(z.dtype)
    return torch.where(active, (z - tau).clamp_min(0), 0.0)


def _entmax15_weights(z: Tensor, active: Tensor) -> Tensor:
    """1.5-entmax by sorting (Peters, Niculae & Martins, 2019, Algorithm 2): ``y = [z / 2 - tau]_+^2``."""
    ordered, valid, rank = _sorted(z / 2, active)
    mean = ordered.cumsum(-1) / rank
    mean_sq = (ordered**2).cumsum(-1) / rank
    delta = ((1 - rank * (mean_sq - mean**2)) / rank).clamp_min(0)
    tau = mean - torch.sqrt(delta)
    support = (tau <= ordered) & valid
    size = support.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(active, (z / 2 - tau.gather(-1, size - 1)).clamp_min(0) ** 2, 0.0)


def _entmax_bisect_weights(z: Tensor, active: Tensor, alpha: Tensor) -> Tensor:
    """alpha-entmax (alpha > 1) by bisection on the weight of a reference position, in two passes.

    With ``r`` a support position, every weight is a function of ``y_r``:
    ``y_i = ((alpha - 1)(x_i - x_r) + y_r^(alpha - 1))^(1 / (alpha - 1))``, increasing in
    ``y_r``; bisection finds it with ``sum y = 1``.  The first pass takes ``r`` = the largest
    score, which locates ``tau`` but, at large alpha, cancels in ``(x_i - x_r) + ...`` for the
    smallest support weights.  The second pass takes ``r`` = the smallest support score (the
    score next to the first pass's threshold that passes the support test
    ``sum_{x_i > x_r} ((alpha - 1)(x_i - x_r))^(1 / (alpha - 1)) < 1``): every term is then a
    sum of non-negative numbers, exact to the dtype's resolution.

    What is bisected over ``[0, 1]``: ``y_r`` itself for alpha >= 2, and its base
    ``b_r = y_r^(alpha - 1)`` below 2, where the weights take ``b_r`` additively.  The bracket
    shrinks by absolute steps (``2^-32`` in float32), which ``y_r`` of the smallest support
    weight (1e-8, say) does not resolve below alpha 2: bisected on ``y_r``, float32 rows at
    alpha = 1.2 came out 5e-3 off; ``b_r = y_r^0.2`` is 0.025 there.
    """
    shrink = alpha - 1
    power = 1 / shrink
    on_base = shrink < 1

    def weights(reference: Tensor, bisected: Tensor) -> Tensor:
        base = torch.where(on_base, bisected, bisected.pow(shrink))
        reference_weight = torch.where(on_base, bisected.pow(power), bisected)
        gap = shrink * (z - reference) + base
        out = torch.where(z == reference, reference_weight, gap.clamp_min(0).pow(power))
        return torch.where(active, out, 0.0)

    def solve(reference: Tensor) -> Tensor:
        low = torch.zeros_like(reference)
        high = torch.ones_like(reference)
        for _ in range(bisect_iterations(z.dtype)):
            middle = (low + high) / 2
            heavy = weights(reference, middle).sum(-1, keepdim=True) >= 1
            high = torch.where(heavy, middle, high)
            low = torch.where(heavy, low, middle)
        return (low + high) / 2

    top = torch.zeros_like(z[..., :1])  # z is relative to the row's largest score
    bisected = solve(top)
    threshold = top - torch.where(on_base, bisected, bisected.pow(shrink)) / shrink
    below = torch.where(active & (z <= threshold), z, -math.inf).amax(-1, keepdim=True)
    above = torch.where(active & (z > threshold), z, math.inf).amin(-1, keepdim=True)
    above = torch.where(above.isinf(), top, above)
    mass_above_below = torch.where(active & (z > below), (shrink * (z - below)).pow(power), 0.0).sum(-1, keepdim=True)
    reference = torch.where(mass_above_below < 1, below, above)
    out = weights(reference, solve(reference))
    return out / out.sum(-1, keepdim=True).clamp_min(torch.finfo(z.dtype).tiny)


def entmax_weights(scores: Tensor, active: Tensor, alpha: Tensor, alpha_value: float | None) -> Tensor:
    """alpha-entmax weights over the active positions of finite ``scores`` (no autograd).

    ``alpha_value`` is alpha as a python number (its exact method is picked), or None for
    per-row alpha ``(..., 1)``: every method runs and each row takes the one its alpha
    selects, without a data-dependent branch.
    """
    z = _relative_to_top(scores, active)
    if alpha_value == 1:
        return torch.where(active, torch.softmax(torch.where(active, z, -math.inf), dim=-1), 0.0)
    if alpha_value == 1.5:
        return _entmax15_weights(z, active)
    if alpha_value == 2:
        return _sparsemax_weights(z, active)
    if alpha_value is not None:
        return _entmax_bisect_weights(z, active, alpha)
    is_softmax = alpha == 1
    out = _entmax_bisect_weights(z, active, torch.where(is_softmax, 2.0, alpha))
    out = torch.where(alpha == 1.5, _entmax15_weights(z, active), out)
    out = torch.where(alpha == 2, _sparsemax_weights(z, active), out)
    return torch.where(is_softmax, entmax_weights(scores, active, alpha, 1.0), out)


class _Entmax(torch.autograd.Function):
    """Weights from :func:`entmax_weights`; reverse and forward derivatives in ``scores`` and ``alpha`` from ``y``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(scores: Tensor, active: Tensor, alpha: Tensor, gate: Tensor, alpha_value: float | None) -> Tensor:
        return entmax_weights(scores, active, alpha, alpha_value)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, _, alpha, gate, _ = inputs
        ctx.save_for_backward(output, alpha, gate)
        ctx.save_for_forward(output, alpha, gate)

    @staticmethod
    def jvp(ctx, scores_tangent: Tensor | None, _active, alpha_tangent: Tensor | None, _gate, _alpha_value) -> Tensor:
        out, alpha, gate = ctx.saved_tensors
        return entmax_jvp(out, scores_tangent, alpha_tangent, gate, alpha)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out, alpha, gate = ctx.saved_tensors
        grad_scores = entmax_vjp(out, grad, gate, alpha)
        grad_alpha = None
        if ctx.needs_input_grad[2]:
            grad_alpha = rules.sum_to_shape(entmax_alpha_grad(out, grad, gate, alpha), alpha.shape)
        return grad_scores, None, grad_alpha, None, None


class _EntmaxTraced(_Entmax):
    """:class:`_Entmax` without its ``jvp``, for ``torch.compile``: Dynamo traces no Function that defines one
    (it broke the graph of every compiled call needing a gradient; forward mode runs eagerly)."""

    jvp = torch.autograd.Function.jvp


def entmax(x: Tensor, mask: rules.RowMask = rules.NO_MASK, alpha: float | Tensor = 1.5) -> Tensor:
    """alpha-entmax (Peters, Niculae & Martins, 2019) over the allowed positions of each row.

    ``y = argmax_{p in simplex} p.x + H_alpha(p) = [(alpha - 1) x - tau]_+^(1 / (alpha - 1))``
    with ``tau`` such that ``sum y = 1``; alpha = 1 is softmax, 2 sparsemax.  Exact by
    sorting for alpha in {1.5, 2}, by bisection (to the dtype's resolution) otherwise.

    Args:
        x: scores ``(..., L)``.
        mask: which positions each row may use.
        alpha: ``>= 1``, python number or tensor ``(..., 1)`` (rows may differ, alpha = 1 included).

    Returns:
        Weights shaped like ``x``.

    Raises:
        ValueError: a python ``alpha`` below 1.
    """
    if not isinstance(alpha, Tensor) and alpha < 1:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    if x.dtype != torch.float64 and (isinstance(alpha, Tensor) or 1 < alpha < rules.NEAR_SOFTMAX):
        # the weights [z - tau]^(1 / (alpha - 1)) amplify the rounding of z - tau by 1 / (alpha - 1): in float32 at
        # alpha = 1 + 1e-5, 1.5e-4 off, and NaN rows at 1 + 1e-4 on scores of ~100; in float64, rounded once
        wide = alpha.double() if isinstance(alpha, Tensor) else alpha
        return entmax(x.double(), mask, wide).to(x.dtype)
    rows = rows_of(x, mask)
    if not isinstance(alpha, Tensor) and alpha == 1:
        return finish(masked_softmax(shifted_scaled(rows, 1.0), rows), rows)
    alpha_value = None if isinstance(alpha, Tensor) else float(alpha)
    if isinstance(alpha, Tensor):
        alpha = alpha.to(device=x.device, dtype=x.dtype)
    else:
        alpha = torch.full((1,) * x.ndim, alpha_value, dtype=x.dtype, device=x.device)
    gate = (~rows.posinf_row).to(x.dtype)
    compiling = torch.compiler.is_compiling()
    if compiling and torch._C._are_functorch_transforms_active():
        return finish(_linearised_entmax(rows.scores, rows.active, alpha, gate, alpha_value), rows)
    function = _EntmaxTraced if compiling else _Entmax
    return finish(function.apply(rows.scores, rows.active, alpha, gate, alpha_value), rows)


def _linearised_entmax(scores: Tensor, active: Tensor, alpha: Tensor, gate: Tensor,
                       alpha_value: float | None) -> Tensor:
    """:func:`entmax_weights` plus their first-order change in ``scores`` and ``alpha``, which is zero-valued:
    plain torch ops whose derivative is the closed form (:func:`entmax_jvp`; the Jacobian is symmetric).

    For ``torch.compile`` of a torch.func transform, where Dynamo differentiates a Function's forward
    instead of calling its backward (through the bisection: 0.22 off) or cannot vmap it (learnable alpha).
    The second derivative is not the closed form's.
    """
    weights = entmax_weights(scores.detach(), active, alpha.detach(), alpha_value)
    return weights + entmax_jvp(weights, scores - scores.detach(), alpha - alpha.detach(), gate, alpha.detach())


def sparsemax(x: Tensor, mask: rules.RowMask = rules.NO_MASK) -> Tensor:
    """Sparsemax (Martins & Astudillo, 2016): ``argmin_{p in simplex} ||p - x||^2`` over the allowed positions.

    ``y = [x - tau]_+`` with ``tau`` such that ``sum y = 1``, exact by sorting.
    """
    return entmax(x, mask, 2.0)
