"""Functional normalizers: one function per normalizer, as ``F.softmax`` is to ``nn.Softmax``.

Every function maps ``x`` to weights along ``dim`` under the shared rules of
:mod:`attnorm.normalizers.base` (masks, -inf/+inf, fully masked rows, dtypes).
``mask`` is a bool tensor broadcastable to ``x`` (True = may attend) or a
:class:`attnorm.masks.StructuredMask`.  ``backend`` picks the implementation
(``"auto"``, ``"reference"``, ``"native"``, ``"triton"``; None = the global
default; see :mod:`attnorm.kernels.backends`).

The six functions with row kernels (softmax to top-k) also take two score modifiers,
computed inside the kernels:

* ``sink``: the score of a virtual key appended to every row, whose weight is dropped
  (an attention sink; softmax_1 is ``softmax(x, sink=0.0)``): a number or a tensor
  broadcastable to ``x`` and constant along ``dim``.  It is scaled like a key, takes part
  in every row statistic, may take a top-k slot (losing ties) and is not counted in
  ``n``; its gradient flows back like a parameter's.
* ``softcap``: normalise ``softcap * tanh(x / softcap)`` instead of ``x`` (Gemma 2's
  soft-capping); -inf stays -inf and the sink is not capped.

``kernels/README.md`` ("A sink per row", "Soft-capping") states both rules in full.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from attnorm.masks import StructuredMask
from attnorm.normalizers import normalized as _normalized_module
from attnorm.normalizers import taylor as _taylor_module
from attnorm.normalizers.base import normalize
from attnorm.validation import check_alpha, check_bool, check_finite, check_k, check_temperature

__all__ = [
    "check_alpha",
    "check_bool",
    "check_finite",
    "check_k",
    "check_temperature",
    "entmax",
    "normalized",
    "relu_normalized",
    "scalable_softmax",
    "self_adjusted_softmax",
    "sigmoid_attention",
    "softmax",
    "softmax1",
    "softplus_normalized",
    "sparsemax",
    "taylor_softmax",
    "topk_softmax",
]

Mask = Tensor | StructuredMask | None
Scalar = float | Tensor


def softmax(
    x: Tensor, dim: int = -1, *, temperature: Scalar = 1.0, mask: Mask = None, backend: str | None = None,
    sink: Scalar | None = None, softcap: float | None = None,
) -> Tensor:
    """Softmax with temperature: ``a_i = exp(x_i / T) / sum_j exp(x_j / T)`` over allowed positions.

    Args:
        x: scores.
        dim: axis to normalise over.
        temperature: T > 0 (float or tensor broadcastable to ``x``, constant along ``dim``).
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None.
        sink: a virtual key's score per row, its weight dropped (see the module docstring).
        softcap: normalise ``softcap * tanh(x / softcap)`` instead (see the module docstring).

    Returns:
        Weights like ``x``; each row with an allowed position sums to 1.

    Raises:
        ValueError: temperature <= 0 or not finite; mask not broadcastable.
        TypeError: non-floating ``x``, non-bool mask.
    """
    check_temperature(temperature)
    return normalize("softmax", x, mask, dim, {"temperature": temperature}, backend, sink, softcap)


def scalable_softmax(
    x: Tensor, dim: int = -1, *, s: Scalar = 0.43, bias: Scalar = 0.0, mask: Mask = None, backend: str | None = None,
    sink: Scalar | None = None, softcap: float | None = None,
) -> Tensor:
    """Scalable-Softmax (Nakanishi, 2025, arXiv 2501.19399): ``softmax((s log n + bias) x)``.

    ``n`` is the number of allowed positions in each row, so under a causal mask
    query ``i`` uses ``n = i + 1`` and padded keys do not count.  The multiplier
    grows with ``n`` and keeps attention from flattening toward ``1/n``.

    Args:
        x: scores.
        dim: axis to normalise over.
        s: scaling parameter (finite; float or tensor broadcastable to ``x``, constant along ``dim``).
        bias: additive term of the multiplier (same rules as ``s``).
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None.
        sink: a virtual key's score per row, its weight dropped (see the module docstring).
        softcap: normalise ``softcap * tanh(x / softcap)`` instead (see the module docstring).

    Returns:
        Weights like ``x``; rows sum to 1.

    Raises:
        ValueError: ``s`` or ``bias`` not finite; mask not broadcastable.
    """
    check_finite("s", s)
    check_finite("bias", bias)
    return normalize("scalable_softmax", x, mask, dim, {"s": s, "bias": bias}, backend, sink, softcap)


def self_adjusted_softmax(
    x: Tensor, dim: int = -1, *, normalized: bool = True, mask: Mask = None, backend: str | None = None,
    sink: Scalar | None = None, softcap: float | None = None,
) -> Tensor:
    """Self-Adjusted Softmax (Zheng et al., 2025, arXiv 2502.18277).

    Plain: ``a_i = x_i * softmax(x)_i``.  Normalized (default):
    ``a_i = (x_i - min(x_min, 0)) / (max(x_max, 0) - min(x_min, 0)) * softmax(x)_i``,
    min and max over allowed positions (a row of zeros gives zeros).  The weights do
    **not** sum to 1, and the plain variant can be negative.

    Args:
        x: scores.
        dim: axis to normalise over.
        normalized: use the min-max normalised factor (weights in [0, 1]).
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None.
        sink: a virtual key's score per row, its weight dropped (see the module docstring).
        softcap: normalise ``softcap * tanh(x / softcap)`` instead (see the module docstring).

    Returns:
        Weights like ``x``.
    """
    check_bool("normalized")(normalized)
    return normalize("self_adjusted_softmax", x, mask, dim, {"normalized": normalized}, backend, sink, softcap)


def sparsemax(
    x: Tensor, dim: int = -1, *, mask: Mask = None, backend: str | None = None, sink: Scalar | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Sparsemax (Martins & Astudillo, 2016): ``argmin_{p in simplex} ||p - x||^2``.

    Solution ``a_i = max(x_i - tau, 0)`` with ``tau`` such that the row sums to 1;
    positions below ``tau`` get exactly 0.  Backward saves only the output.

    Args:
        x: scores.
        dim: axis to normalise over.
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None.
        sink: a virtual key's score per row, its weight dropped (see the module docstring).
        softcap: normalise ``softcap * tanh(x / softcap)`` instead (see the module docstring).

    Returns:
        Sparse weights like ``x``; rows sum to 1.
    """
    return normalize("sparsemax", x, mask, dim, {}, backend, sink, softcap)


def entmax(
    x: Tensor, alpha: Scalar = 1.5, dim: int = -1, *, mask: Mask = None, backend: str | None = None,
    sink: Scalar | None = None, softcap: float | None = None,
) -> Tensor:
    """alpha-entmax (Peters, Niculae & Martins, 2019, arXiv 1905.05702).

    ``argmax_{p in simplex} p.x + H_alpha(p)`` with the Tsallis entropy ``H_alpha``;
    solution ``a_i = [(alpha - 1) x_i - tau]_+^(1 / (alpha - 1))``.  alpha = 1 is
    softmax, alpha = 2 sparsemax, alpha = 1.5 is solved exactly; other alpha by
    bisection on ``tau`` followed by renormalisation (row sums exact to rounding).
    ``alpha`` may be a tensor (e.g. one per head) and then receives a gradient.

    Args:
        x: scores.
        alpha: >= 1 (float, or tensor broadcastable to ``x`` and constant along ``dim``).
        dim: axis to normalise over.
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None.
        sink: a virtual key's score per row, its weight dropped (see the module docstring).
        softcap: normalise ``softcap * tanh(x / softcap)`` instead (see the module docstring).

    Returns:
        Sparse weights like ``x``; rows sum to 1.

    Raises:
        ValueError: alpha < 1 or not finite.
    """
    check_alpha(alpha)
    return normalize("entmax", x, mask, dim, {"alpha": alpha}, backend, sink, softcap)


def topk_softmax(
    x: Tensor,
    k: float,
    dim: int = -1,
    *,
    temperature: Scalar = 1.0,
    mask: Mask = None,
    backend: str | None = None,
    sink: Scalar | None = None, softcap: float | None = None,
) -> Tensor:
    """Softmax over the ``k`` largest allowed scores of each row, exactly 0 elsewhere.

    ``k`` is an int >= 1, or a float in (0, 1): a fraction of the ``n`` allowed
    positions, keeping ``max(1, ceil(k * n))``.  Ties at the k-th score: the lowest
    index wins, on every backend and device, so exactly ``min(k, n)`` positions are kept.

    Args:
        x: scores.
        k: positions to keep (int) or fraction of allowed positions (float).
        dim: axis to normalise over.
        temperature: T > 0, as in :func:`softmax`.
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None.
        sink: a virtual key's score per row, its weight dropped (see the module docstring).
        softcap: normalise ``softcap * tanh(x / softcap)`` instead (see the module docstring).

    Returns:
        Sparse weights like ``x``; rows sum to 1.

    Raises:
        ValueError: k < 1 or a float outside (0, 1); temperature <= 0.
    """
    check_k(k)
    check_temperature(temperature)
    return normalize("topk_softmax", x, mask, dim, {"k": k, "temperature": temperature}, backend, sink, softcap)




def normalized(
    x: Tensor, f: Callable[[Tensor], Tensor], dim: int = -1, *, derivative: Callable[[Tensor], Tensor] | None = None,
    mask: Mask = None,
) -> Tensor:
    """Any ``F / sum F`` normalisation: ``a_i = F(x_i) / sum_j F(x_j)`` for an elementwise ``F >= 0``.

    The general form of Mudarisov et al. (arXiv 2508.17821); see :class:`attnorm.Normalized`.
    A row whose ``F`` sums to 0 gives zeros.

    Args:
        x: scores.
        f: ``F`` as a torch function of a tensor.
        dim: axis to normalise over.
        derivative: ``F'`` as a torch function (backward), or None for autograd.
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.

    Returns:
        Weights like ``x``.
    """
    return _normalized_module.Normalized(f, derivative, dim)(x, mask)


def relu_normalized(x: Tensor, dim: int = -1, *, power: float = 1.0, mask: Mask = None) -> Tensor:
    """``a_i = max(x_i, 0)^p / sum_j max(x_j, 0)^p`` (zeros when no allowed score is positive).

    Args:
        x: scores.
        dim: axis to normalise over.
        power: p > 0 (1: ``relu``, 2: ``relu2``).
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.

    Returns:
        Sparse weights like ``x``.

    Raises:
        ValueError: power <= 0 or not finite.
    """
    return _normalized_module.ReLUNormalized(power, dim)(x, mask)


def softplus_normalized(x: Tensor, dim: int = -1, *, mask: Mask = None) -> Tensor:
    """``a_i = softplus(x_i) / sum_j softplus(x_j)``, computed from ``log softplus`` (no underflow).

    Args:
        x: scores.
        dim: axis to normalise over.
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.

    Returns:
        Weights like ``x``; rows sum to 1.
    """
    return _normalized_module.SoftplusNormalized(dim)(x, mask)


def softmax1(x: Tensor, dim: int = -1, *, mask: Mask = None) -> Tensor:
    """softmax_1: ``a_i = e^{x_i} / (1 + sum_j e^{x_j})``, stable for any ``x``.

    Softmax with a sink key of logit 0 whose weight is dropped; rows sum to less than 1.

    Args:
        x: scores.
        dim: axis to normalise over.
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.

    Returns:
        Weights like ``x``.
    """
    return _normalized_module.Softmax1(dim)(x, mask)


def sigmoid_attention(x: Tensor, dim: int = -1, *, bias: float | None = None, mask: Mask = None) -> Tensor:
    """Sigmoid attention (Ramapuram et al., 2024, arXiv 2409.04431): ``a_i = sigmoid(x_i - log n)``.

    ``n`` is the number of allowed positions of the row; ``bias`` replaces ``-log n`` when given.
    Not normalised: each weight lies in (0, 1).

    Args:
        x: scores.
        dim: axis to normalise over.
        bias: a finite number, or None for ``-log n``.
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.

    Returns:
        Weights like ``x``.
    """
    return _normalized_module.SigmoidAttention(bias, dim)(x, mask)


def taylor_softmax(x: Tensor, n: int = 2, dim: int = -1, *, mask: Mask = None) -> Tensor:
    """Taylor-softmax (Mongaras & Larson, arXiv 2507.23632): ``a_i = T_n(x_i) / sum_j T_n(x_j)``.

    ``T_n(x) = sum_{m <= n} x^m / m!`` for even ``n`` (positive everywhere).  Scores are used
    as given (``T_n`` is not shift-invariant); masked and -inf positions are excluded.

    Args:
        x: scores.
        n: the even Taylor order.
        dim: axis to normalise over.
        mask: bool mask broadcastable to ``x``, True = may attend; or a StructuredMask.

    Returns:
        Weights like ``x``; rows with an allowed position sum to 1.

    Raises:
        ValueError: odd or negative ``n``.
    """
    return _taylor_module.TaylorSoftmax(n, dim=dim)(x, mask)
