"""Fused alpha-entmax (any alpha >= 1 per row) and sparsemax (alpha = 2).

Forward, per row: ``y_i = [z_i - tau]_+^p`` with ``z = (alpha - 1) x``,
``p = 1 / (alpha - 1)`` and ``tau`` such that ``sum(y) = 1`` (Peters, Niculae &
Martins, 2019), computed on scores shifted by their max (the map is
shift-invariant; large scores then do not cancel).  ``tau`` is found by Newton's
method on ``F(tau) = ||[z - tau]_+||_p = 1``, safeguarded by the bracket
``[max z - 1, max z - n^(1 - alpha)]`` (bisection when a step leaves it).  For
``p >= 1`` (alpha <= 2) ``F`` is convex, so Newton started below the root climbs to
it monotonically; the start is the larger of two lower bounds, ``max z - 1`` and
``(sum z - n^(2 - alpha)) / n`` (Hölder).  With ``p = 1`` (sparsemax) this is
Michelot's algorithm, finished exactly: ``tau = (sum_{z_i > tau} z_i - 1) / |support|``.
Other alphas are renormalised (row sums exact to rounding); alpha = 1 rows are
softmax.  No sort: a single-block row stays in registers across iterations.

Backward (closed form, saves only ``y`` and a per-row gate that is 0 in +inf rows):
``dx = gppr * g - gppr * sum(gppr * g) / sum(gppr)`` with ``gppr = y^(2 - alpha)`` on
the support, and ``d alpha = beta * (sum(g S) - sum(S) / sum(gppr) * sum(g gppr))``
with ``beta = 1 / (alpha - 1)``, ``S_i = y_i (beta - log y_i)`` (0 for alpha = 1 rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd import Function

from attnorm.kernels.triton import launch
from attnorm.kernels.triton.blocks import (
    keep_posinf,
    load_block,
    load_output_and_grad,
    load_row,
    load_row_param,
    scan_row,
)

__all__ = ["EntmaxFunction"]


@triton.jit
def _power(u, exponent):
    """``u ** exponent`` where ``u > 0``, else 0 (exact for exponents 1 and 2)."""
    positive = u > 0
    safe = tl.where(positive, u, 1.0)
    if exponent == 1:
        value = safe
    elif exponent == 2:
        value = safe * safe
    elif exponent == 0.5:
        value = tl.sqrt(safe)
    else:
        value = tl.exp2(exponent * tl.log2(safe))
    return tl.where(positive, value, 0.0)


@triton.jit
def _mass(z, allowed, tau, power, softmax_row):
    """Unnormalised weights: ``exp(z - tau)`` (softmax rows) or ``[z - tau]_+^p``."""
    if softmax_row:
        mass = tl.where(allowed, tl.exp(z - tau), 0.0)
    else:
        mass = tl.where(allowed, _power(z - tau, power), 0.0)
    return mass


@triton.jit
def _block_sums(z, allowed, tau, power, softmax_row):
    """Over one block: total mass, ``sum [z - tau]_+^(p - 1)``, support size, ``sum z`` on the support."""
    support = allowed & (z > tau)
    mass = tl.sum(_mass(z, allowed, tau, power, softmax_row), 0)
    slope = tl.sum(tl.where(support, _power(z - tau, power - 1), 0.0), 0)
    return mass, slope, tl.sum(support.to(tl.int32), 0), tl.sum(tl.where(support, z, 0.0), 0)


@triton.jit
def _load_z(X, row, cols, length, x_row_stride, masking, posinf_row, top, multiplier,
            MASK_KIND, CAUSAL, LENGTHS, COMPUTE):
    """``z = (alpha - 1) (x - max x)`` for one block of a long row, and its allowed positions."""
    x, allowed = load_block(X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE)
    x, allowed = keep_posinf(x, allowed, posinf_row)
    return (x - top) * multiplier, allowed


@triton.jit
def _row_sums(
    X, row, length, x_row_stride, masking, posinf_row, top, multiplier, tau, power, softmax_row,
    BLOCK, MASK_KIND, CAUSAL, LENGTHS, COMPUTE,
):
    """:func:`_block_sums` over a long row, streamed from memory."""
    mass = tl.zeros((), COMPUTE)
    slope = tl.zeros((), COMPUTE)
    support = tl.zeros((), tl.int32)
    support_z = tl.zeros((), COMPUTE)
    for start in range(0, length, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z, allowed = _load_z(X, row, cols, length, x_row_stride, masking, posinf_row, top, multiplier,
                             MASK_KIND, CAUSAL, LENGTHS, COMPUTE)
        block_mass, block_slope, block_support, block_z = _block_sums(z, allowed, tau, power, softmax_row)
        mass += block_mass
        slope += block_slope
        support += block_support
        support_z += block_z
    return mass, slope, support, support_z


@triton.jit
def _weights(z, allowed, tau, power, softmax_row, exact_tau, total, nan_row):
    """Final weights of one block: exact sparsemax, or mass renormalised by ``total``."""
    if (power == 1) & ~softmax_row:
        y = tl.where(allowed, tl.maximum(z - exact_tau, 0.0), 0.0)
    else:
        y = _mass(z, allowed, tau, power, softmax_row) / total
    return tl.where(allowed & nan_row, float("nan"), y)


@triton.jit
def _entmax_forward_kernel(
    X, OUT, GRAD_SCALE, alpha_param, masking, length, x_row_stride, out_row_stride, max_iters,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LENGTHS: tl.constexpr, COMPUTE: tl.constexpr,
):
    """alpha-entmax of one row (see the module docstring for the method).

    Bytes moved (:func:`attnorm.kernels.traffic.bytes_moved`): a single-block row
    reads x and writes y once, ``L * (in + out)``, plus one per-row gate; every
    Newton step works on the row held in registers.  A multi-pass row reads x once
    per Newton step (1-6 for alpha <= 2, up to ~25 bisection-safeguarded ones above)
    plus twice (statistics, write).
    """
    row = tl.program_id(0).to(tl.int64)
    alpha = load_row_param(alpha_param, row).to(COMPUTE)
    softmax_row = alpha == 1
    multiplier = tl.where(softmax_row, 1.0, alpha - 1)
    power = tl.where(softmax_row, 1.0, 1.0 / multiplier)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        x, allowed, posinf_row, _ = load_row(
            X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
        )
        count = tl.sum(allowed.to(tl.int32), 0)
        nan_row = tl.sum((allowed & (x != x)).to(tl.int32), 0) > 0
        top = tl.max(tl.where(allowed, x, float("-inf")), 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        z = (x - top) * multiplier
        z_sum = tl.sum(tl.where(allowed, z, 0.0), 0)
    else:
        count, posinf_count, nan_count, top, _, sum_below_max, _ = scan_row(
            X, row, length, x_row_stride, masking, 1.0, BLOCK, False, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
        )
        posinf_row = posinf_count > 0
        count = tl.where(posinf_row, posinf_count, count)
        nan_row = nan_count > 0
        top = tl.where(top == float("-inf"), 0.0, top)
        z_sum = sum_below_max * multiplier
    # Scores are shifted so that max z = 0: the bracket is [-1, -n^(1 - alpha)].
    n = tl.maximum(count, 1).to(COMPUTE)
    low = tl.full((), -1.0, COMPUTE)
    high = -tl.exp2((1 - alpha) * tl.log2(n))
    hoelder = (z_sum - tl.exp2((2 - alpha) * tl.log2(n))) / n
    tau = tl.where(softmax_row, 0.0, tl.where(power >= 1, tl.maximum(low, hoelder), low))
    mass = tl.zeros((), COMPUTE)
    slope = tl.zeros((), COMPUTE)
    support = tl.zeros((), tl.int32)
    support_z = tl.zeros((), COMPUTE)
    searchable = ~softmax_row & (count > 0) & ~nan_row
    iteration = 0
    evaluating = True
    while evaluating:
        if SINGLE:
            mass, slope, support, support_z = _block_sums(z, allowed, tau, power, softmax_row)
        else:
            mass, slope, support, support_z = _row_sums(
                X, row, length, x_row_stride, masking, posinf_row, top, multiplier, tau, power, softmax_row,
                BLOCK, MASK_KIND, CAUSAL, LENGTHS, COMPUTE,
            )
        above = mass >= 1
        low = tl.where(above, tau, low)
        high = tl.where(above, high, tau)
        newton = tau + (mass - tl.exp2((1 - 1 / power) * tl.log2(mass))) / slope
        # Convex F (p >= 1): a Newton step never overshoots, only rounding can land it on
        # the bracket's end.  Otherwise a step onto an end would stall: bisect instead.
        inside = tl.where(power >= 1, (newton >= low) & (newton <= high), (newton > low) & (newton < high))
        step = tl.where(inside, newton, 0.5 * (low + high))
        iteration += 1
        # Stop when the step no longer moves tau.  Newton on a convex F (p >= 1) only
        # climbs, so a step back is rounding noise at the root; otherwise every step
        # lands strictly inside a shrinking bracket, so the search ends.
        climbing = (power < 1) | (step > tau)
        evaluating = searchable & (step != tau) & climbing & (iteration < max_iters)
        tau = tl.where(evaluating, step, tau)
    exact_tau = (support_z - 1) / tl.maximum(support, 1).to(COMPUTE)
    total = tl.where(mass > 0, mass, 1.0)
    if SINGLE:
        y = _weights(z, allowed, tau, power, softmax_row, exact_tau, total, nan_row)
        tl.store(OUT + row * out_row_stride + cols, y.to(OUT.dtype.element_ty), mask=cols < length)
    else:
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z, allowed = _load_z(X, row, cols, length, x_row_stride, masking, posinf_row, top, multiplier,
                                 MASK_KIND, CAUSAL, LENGTHS, COMPUTE)
            y = _weights(z, allowed, tau, power, softmax_row, exact_tau, total, nan_row)
            tl.store(OUT + row * out_row_stride + cols, y.to(OUT.dtype.element_ty), mask=cols < length)
    tl.store(GRAD_SCALE + row, tl.where(posinf_row, 0.0, 1.0))


@triton.jit
def _backward_block_sums(y, g, alpha, beta, ALPHA_GRAD):
    """``sum(gppr g)``, ``sum(gppr)`` and, for the alpha gradient, ``sum(g S)``, ``sum(S)``."""
    gppr = _power(y, 2 - alpha)
    gppr_g = tl.sum(gppr * g, 0)
    entropy_g = tl.zeros_like(gppr_g)
    entropy_sum = tl.zeros_like(gppr_g)
    if ALPHA_GRAD:
        on = y > 0
        entropy_term = tl.where(on, y * (beta - tl.log(tl.where(on, y, 1.0))), 0.0)
        entropy_g = tl.sum(entropy_term * g, 0)
        entropy_sum = tl.sum(entropy_term, 0)
    return gppr_g, tl.sum(gppr, 0), entropy_g, entropy_sum


@triton.jit
def _entmax_backward_kernel(
    Y, G, DX, GRAD_SCALE, D_ALPHA, alpha_param, length, y_row_stride, g_row_stride, dx_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, ALPHA_GRAD: tl.constexpr, COMPUTE: tl.constexpr,
):
    """Closed-form entmax backward for one row (formulas in the module docstring).

    Bytes moved: a single-block row reads y and g and writes dx once,
    ``3 * L * itemsize``, plus the per-row gate (and alpha's gradient); a multi-pass
    row re-reads y and g once.
    """
    row = tl.program_id(0).to(tl.int64)
    alpha = load_row_param(alpha_param, row).to(COMPUTE)
    gate = tl.load(GRAD_SCALE + row)
    beta = tl.where(alpha == 1, 0.0, 1.0 / tl.where(alpha == 1, 2.0, alpha - 1))
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        inside = cols < length
        y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, COMPUTE)
        gppr_g, gppr_sum, entropy_g, entropy_sum = _backward_block_sums(y, g, alpha, beta, ALPHA_GRAD)
        mean_g = gppr_g / tl.where(gppr_sum > 0, gppr_sum, 1.0)
        dx = gate * _power(y, 2 - alpha) * (g - mean_g)
        tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=inside)
    else:
        gppr_g = tl.zeros((), COMPUTE)
        gppr_sum = tl.zeros((), COMPUTE)
        entropy_g = tl.zeros((), COMPUTE)
        entropy_sum = tl.zeros((), COMPUTE)
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, COMPUTE)
            block_gppr_g, block_gppr, block_entropy_g, block_entropy = _backward_block_sums(
                y, g, alpha, beta, ALPHA_GRAD
            )
            gppr_g += block_gppr_g
            gppr_sum += block_gppr
            entropy_g += block_entropy_g
            entropy_sum += block_entropy
        mean_g = gppr_g / tl.where(gppr_sum > 0, gppr_sum, 1.0)
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < length
            y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, COMPUTE)
            dx = gate * _power(y, 2 - alpha) * (g - mean_g)
            tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=inside)
    if ALPHA_GRAD:
        ratio = entropy_sum / tl.where(gppr_sum > 0, gppr_sum, 1.0)
        tl.store(D_ALPHA + row, gate * beta * (entropy_g - ratio * gppr_g))


def _max_iterations(x: Tensor) -> int:
    """Cap on Newton/bisection steps: bisection alone resolves tau to the dtype's precision within it."""
    return 120 if x.dtype == torch.float64 else 60


class EntmaxFunction(Function):
    """alpha-entmax over the last axis; ``alpha`` a number >= 1 or a tensor of shape ``(..., 1)``."""

    @staticmethod
    def forward(ctx, x: Tensor, mask, alpha: float | Tensor) -> Tensor:
        run = launch.prepare(x)
        gate = run.row_stats()
        masking = launch.mask_args(mask, x)
        _entmax_forward_kernel[run.grid](
            run.rows, run.out, gate, launch.row_param(alpha, x), masking.args,
            run.length, run.rows.stride(0), run.out.stride(0), _max_iterations(x),
            BLOCK=run.config.block, SINGLE=run.config.single, COMPUTE=launch.compute_dtype(x),
            num_warps=run.config.num_warps, **masking.constants,
        )
        out = run.out.reshape(x.shape)
        ctx.save_for_backward(out, gate)
        ctx.alpha = alpha.detach() if isinstance(alpha, Tensor) else alpha
        ctx.alpha_spec = launch.ParamSpec.of(alpha)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out, gate = ctx.saved_tensors
        wants_alpha = ctx.needs_input_grad[2]
        run = launch.prepare(out)
        g = launch.rows_view(grad)
        d_alpha = run.row_stats() if wants_alpha else gate
        _entmax_backward_kernel[run.grid](
            run.rows, g, run.out, gate, d_alpha, launch.row_param(ctx.alpha, out),
            run.length, run.rows.stride(0), g.stride(0), run.out.stride(0),
            BLOCK=run.config.block, SINGLE=run.config.single, ALPHA_GRAD=wants_alpha,
            COMPUTE=launch.compute_dtype(out), num_warps=run.config.num_warps,
        )
        alpha_grad = launch.param_grad(d_alpha, out, ctx.alpha_spec) if wants_alpha else None
        return run.out.reshape(out.shape), None, alpha_grad
