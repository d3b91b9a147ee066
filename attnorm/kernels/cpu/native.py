"""The native backend: the seven functions of the kernel contract (``kernels/README.md``) in C.

Each function validates what it hands to C (CPU float32/float64 tensors, shapes,
rows shorter than 2^31), hands C the mask as per-row prefixes and a bool mask in its own
broadcast shape (:func:`_bounds`: no masked copy of the scores) and runs one kernel of
``csrc/rows.c`` over all rows, which applies the mask and every other row rule itself (fully
masked rows, +inf, NaN, no overflow).  Loading and building live in :mod:`attnorm.kernels.cpu.build`;
``build.usable()`` says whether these functions can run.

Per-row parameters are python numbers or tensors ``(..., 1)`` broadcastable to ``x``
(per-row inputs of the backward passes may also have the per-row shape
``x.shape[:-1]``), handed to C in the rows' dtype; per-row outputs have shape ``x.shape[:-1]`` and dtype
:func:`attnorm.kernels.rules.accumulation_dtype`, which for the float32 and float64 rows
C takes is the rows' own dtype.  The functions are plain (no autograd):
:mod:`attnorm.kernels.ops` wraps them.

A sink per row (``kernels/README.md``, "A sink per row") goes to C as one more per-row
parameter: its score (-inf, which takes no part, when there is none) for the forwards and
Self-Adjusted's backward, its weight (0 when there is none) for the other backwards.  C
returns its weight or gradient per row, and the functions return it last only when the
sink is given.

Soft-capping (``kernels/README.md``, "Soft-capping"): ``softcap`` goes to C as one
number, the cap (0 when off), and C caps each score as it reads the row,
``c(x) = cap tanh(x / cap)`` with ``c(-inf) = -inf``; no capped tensor is made here.  The
backward passes take the raw scores and return ``dx = (1 - tanh(x / cap)^2) dc`` with
``dc`` the gradient with respect to ``c(x)``.  Without it every kernel runs the loops it
ran before, bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import _C, Tensor

from attnorm import validation
from attnorm.kernels import rules
from attnorm.kernels.cpu import build

__all__ = [
    "entmax_backward",
    "entmax_forward",
    "self_adjusted_backward",
    "self_adjusted_forward",
    "softmax_backward",
    "softmax_forward",
    "topk_forward",
]

_MAX_LENGTH = 2**31 - 1  # positions are int32 in C
_SA_STATS = 5


def _new(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An output buffer the kernel fills completely (uninitialised).

    Sizes go unpacked: ``torch.empty(torch.Size)`` costs twice as much per call.  On the
    CPU always: a device context (``with torch.device("cuda")``, a function mode) would
    otherwise allocate elsewhere and hand C a pointer it cannot write; naming the device
    costs a call 0.7 us, so it is named only while a function mode is on.
    """
    if _C._is_torch_function_mode_enabled():
        return torch.empty(shape, dtype=dtype, device="cpu")
    return torch.empty(*shape, dtype=dtype) if shape else torch.empty((), dtype=dtype)


def _check_rows(tensor: Tensor, name: str) -> None:
    """Raise unless ``tensor`` is a CPU float32/float64 strided tensor of rows of 1 to 2^31 - 1 positions."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu or tensor.layout != torch.strided:
        raise ValueError(f"the native kernels take dense CPU tensors, got {name} on {tensor.device} ({tensor.layout})")
    if tensor.dtype not in build.SUFFIX:
        raise TypeError(f"the native kernels take float32 or float64 {name}, got {tensor.dtype}")
    if tensor.ndim == 0 or not 1 <= tensor.shape[-1] <= _MAX_LENGTH:
        raise ValueError(f"{name} must have rows of 1 to 2^31 - 1 positions on its last axis, got shape "
                         f"{tuple(tensor.shape)}")


def _like(tensor: Tensor, reference: Tensor, name: str) -> Tensor:
    """``tensor`` as a contiguous CPU tensor of ``reference``'s shape and dtype (a gradient or saved input)."""
    _check_rows(tensor, name)
    if tensor.shape != reference.shape:
        raise ValueError(f"{name} must have shape {tuple(reference.shape)}, got {tuple(tensor.shape)}")
    if tensor.dtype != reference.dtype:  # .to() costs a dispatch even when it has nothing to do
        tensor = tensor.to(reference.dtype)
    return tensor.contiguous()


def _per_row(value: float | Tensor, rows: torch.Size, dtype: torch.dtype, name: str) -> tuple[float, Tensor | None]:
    """A per-row parameter as C takes it: one number for all rows, or a contiguous ``dtype`` tensor, one value a row.

    ``value`` is a number, a column ``(..., 1)`` broadcastable to the scores, or a
    per-row tensor broadcastable to ``rows`` (the scores' shape without its last axis).
    A tensor that already has one value per row in ``dtype`` goes as it is (no copy).
    The tensor must stay referenced until the kernel returns.
    """
    if not isinstance(value, Tensor):
        return float(value), None
    if not value.is_cpu:
        raise ValueError(f"the native kernels take CPU tensors, got {name} on {value.device}")
    shape = value.shape
    column = len(shape) == len(rows) + 1 and shape[-1] == 1
    if value.dtype == dtype and value.is_contiguous() and (shape == rows or column and shape[:-1] == rows):
        return 0.0, value
    per_row = _new(rows, dtype)
    try:
        per_row.copy_((value.squeeze(-1) if column else value).detach())  # broadcasts and converts in one pass
    except RuntimeError as error:
        raise ValueError(f"{name} of shape {tuple(shape)} does not broadcast to rows {tuple(rows)}") from error
    return 0.0, per_row


def _sink(sink: float | Tensor | None, rows: torch.Size, dtype: torch.dtype) -> tuple[float, Tensor | None]:
    """The sink's score per row as C takes it (:func:`_per_row`); -inf, which takes no part, without a sink."""
    return (-math.inf, None) if sink is None else _per_row(sink, rows, dtype, "sink")


def _cap(softcap: float | None) -> float:
    """The cap as C takes it: 0 when off.

    Raises:
        ValueError: a cap that is not a finite number > 0.
    """
    return 0.0 if softcap is None else validation.check_softcap(softcap)


def _raw_scores(x: Tensor | None, like: Tensor) -> Tensor:
    """The raw scores a capped backward needs.

    Raises:
        ValueError: no scores.
    """
    if x is None:
        raise ValueError("softcap needs the raw scores x (the forward's input), got x=None")
    return _like(x, like, "x")


def _address(tensor: Tensor | None) -> int:
    """A tensor's address as C takes it; 0 (NULL) for None."""
    return 0 if tensor is None else tensor.data_ptr()


def _launch(name: str, dtype: torch.dtype, *arguments: object) -> None:
    """Call kernel ``name`` for rows of ``dtype`` (tensors already as addresses), the thread count last.

    Raises:
        MemoryError: the kernel could not allocate its row buffers.
        RuntimeError: the library and this module disagree on the kernel's arguments.
    """
    status = build.kernel(name, dtype)(*arguments, torch.get_num_threads())
    if status == build.PACKED_MISMATCH:
        raise RuntimeError(f"attnorm native kernel {name} was built for other arguments: rebuild its cache")
    if status != 0:
        raise MemoryError(f"attnorm native kernel {name} could not allocate its row buffers")


def _scores(x: Tensor, mask: rules.RowMask) -> tuple[Tensor, tuple[Tensor | None, Tensor | None, Tensor | None]]:
    """Checked contiguous scores and the mask as C reads it (:func:`_bounds`; three Nones: no mask).

    C applies every mask itself, with no masked copy of the scores.
    """
    _check_rows(x, "x")
    return x.contiguous(), _UNBOUNDED if mask.unmasked else _bounds(x, mask)


_UNBOUNDED = (None, None, None)


def _addresses(bounds: tuple[Tensor | None, Tensor | None, Tensor | None]) -> tuple[int, int, int]:
    """:func:`_bounds`' tensors as C takes them (a tiny unmasked call pays one identity test)."""
    if bounds is _UNBOUNDED:
        return 0, 0, 0
    stops, allow, allow_rows = bounds
    return _address(stops), _address(allow), _address(allow_rows)


def _bounds(x: Tensor, mask: rules.RowMask) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``mask`` as the C kernels read it: ``(stops, allow, allow_rows)``, None where a part is absent.

    ``stops``: each row's allowed prefix (int64, shape ``x.shape[:-1]``) under a causal mask and key
    lengths (:func:`attnorm.kernels.rules.allowed_prefix`), and under a bool mask constant along the
    row (whole rows, e.g. padded queries' ``(B, 1, Lq, 1)``: a prefix of all or nothing).  ``allow``: any other bool
    mask, contiguous in its own broadcast shape (never expanded to the scores'), with ``allow_rows`` the
    offset of each row's mask row in it (int64, shape ``x.shape[:-1]``: 8 bytes a row).

    Raises:
        ValueError: the mask does not broadcast to ``x``'s shape.
    """
    tensor = mask.tensor
    stops = rules.allowed_prefix(x, mask._replace(tensor=None)) if mask.structured else None
    if tensor is None:
        return stops, None, None
    if not rules.broadcasts_to(tensor.shape, x.shape):
        raise ValueError(f"the mask must broadcast to x's shape {tuple(x.shape)}, got a mask of {tuple(tensor.shape)}")
    tensor = tensor.to(device=x.device, dtype=torch.bool).reshape((1,) * (x.ndim - tensor.ndim) + tuple(tensor.shape))
    if tensor.shape[-1] == 1:  # all or nothing per row
        whole = torch.where(tensor[..., 0], x.shape[-1], 0)
        stops = (whole if stops is None else torch.minimum(stops, whole)).expand(x.shape[:-1]).contiguous()
        return stops, None, None
    allow = tensor.contiguous()
    allow_rows = torch.arange(0, allow.numel(), allow.shape[-1], device=x.device).reshape(allow.shape[:-1])
    return stops, allow, allow_rows.expand(x.shape[:-1]).contiguous()


def softmax_forward(
    x: Tensor,
    mask: rules.RowMask,
    variant: int,
    first: float | Tensor,
    second: float | Tensor,
    sink: float | Tensor | None = None,
    softcap: float | None = None,
    weights_only: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None] | tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """Softmax of scaled scores over the allowed positions: ``y = softmax(m x)``.

    Variant 0 (temperature): ``m = 1 / first``.  Variant 1 (Scalable-Softmax,
    Nakanishi 2025): ``m = first * log(max(n, 1)) + second`` with ``n`` the allowed
    positions of the row (+inf and NaN positions count, -inf ones do not).  Computed
    as ``exp(m (x - max x)) / sum`` (``m (x - min x)`` for ``m < 0``), so finite scores
    never overflow.  With a sink ``s``: ``[y, w] = softmax(m [x, s])``, ``n`` still the
    real positions.  With a cap, ``x`` is ``c(x) = cap tanh(x / cap)`` throughout (a +inf
    score becomes ``cap``), written into ``y``'s row as the row is read: one more pass, in
    cache (the row is still read from memory once).

    Args:
        x: scores ``(..., L)``, float32 or float64.
        mask: which positions each row may use.
        variant: 0 or 1.
        first: temperature (variant 0) or ``s`` (variant 1), per row.
        second: the bias (variant 1; ignored for variant 0), per row.
        sink: the score of a virtual key after the last position, per row (always
            allowed), or None.
        softcap: the cap (``> 0``), or None.
        weights_only: skip what only the backward reads (``multiplier``, ``log_count``:
            None), for a call that needs no gradient.

    Returns:
        ``(y, multiplier, log_count)``: ``multiplier`` is ``m`` per row (0 in rows
        holding +inf), ``log_count = log(max(n, 1))`` for variant 1, None for variant 0;
        with a sink, its weight per row follows.

    Raises:
        ValueError: ``variant`` not 0 or 1, a bad ``softcap``, or tensors the kernels cannot take.
    """
    if variant not in (0, 1):
        raise ValueError(f"variant must be 0 (temperature) or 1 (Scalable-Softmax), got {variant}")
    cap = _cap(softcap)
    scores, bounds = _scores(x, mask)
    shape, dtype = x.shape, x.dtype
    row_shape, length = shape[:-1], shape[-1]
    first, first_rows = _per_row(first, row_shape, dtype, "first")
    second, second_rows = _per_row(second, row_shape, dtype, "second")
    sink_score, sink_rows = _sink(sink, row_shape, dtype)
    y = torch.empty_like(scores)  # contiguous like scores; cheaper than _new
    multiplier = None if weights_only else _new(row_shape, dtype)
    log_count = _new(row_shape, dtype) if variant == 1 and not weights_only else None
    sink_weight = None if sink is None else _new(row_shape, dtype)
    _launch("attnorm_softmax_forward", dtype, scores.data_ptr(), y.data_ptr(), x.numel() // length, length, variant,
            first, _address(first_rows), second, _address(second_rows), _address(multiplier), _address(log_count),
            sink_score, _address(sink_rows), _address(sink_weight), cap, *_addresses(bounds))
    return (y, multiplier, log_count) if sink is None else (y, multiplier, log_count, sink_weight)


def softmax_backward(
    y: Tensor,
    grad: Tensor,
    multiplier: float | Tensor,
    x: Tensor | None,
    param_grad: int,
    sink_weight: float | Tensor | None = None,
    sink: float | Tensor | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    """Vector-Jacobian product of ``y = softmax(m x)``: ``dx = m y (g - sum(y g))``.

    Shared by softmax, Scalable-Softmax and top-k.  With ``dz = y (g - sum(y g))`` summed
    where ``y > 0``: ``param_grad`` 1 also returns ``-m sum(dz log y)`` (the gradient of
    a per-row temperature), 2 returns ``sum(dz x)`` over finite ``x`` (the gradient of
    ``m``; 0 in rows holding +inf).  With a sink of weight ``w``, all of it on the extended
    row ``[y, w]`` with gradient ``[g, 0]``: ``dx`` is unchanged, the sink receives
    ``dsink = -m w sum(y g)`` and adds its terms to the per-row sums.  With a cap, the
    forward ran on ``c(x) = cap tanh(x / cap)``: ``x`` holds the raw scores, ``param_grad`` 2
    sums ``dz c(x)`` (C caps ``x`` into ``dx``'s row first), and ``dx`` is carried to the raw
    scores, times ``1 - tanh(x / cap)^2`` (0 where ``x`` is infinite): one more pass.

    Args:
        y: the forward's weights ``(..., L)``.
        grad: incoming gradient, shaped like ``y``.
        multiplier: ``m`` per row (the forward's ``multiplier``).
        x: the forward's (masked) scores, needed for ``param_grad`` 2 and with a cap.
        param_grad: 0, 1 or 2.
        sink_weight: the forward's sink weight per row, or None (no sink).
        sink: the sink's scores per row, needed for ``param_grad`` 2 with a sink.
        softcap: the forward's cap, or None.

    Returns:
        ``(dx, per_row)``, ``per_row`` None for ``param_grad`` 0; with a sink, ``dsink``
        per row follows.

    Raises:
        ValueError: ``param_grad`` not 0, 1 or 2, 2 without ``x`` (or, with a sink,
            without ``sink``), ``sink`` without ``sink_weight``, a bad ``softcap`` or one
            without ``x``, or mismatched tensors.
    """
    if param_grad not in (0, 1, 2) or (param_grad == 2 and x is None):
        given = "with x" if x is not None else "without x"
        raise ValueError(f"param_grad must be 0, 1 or 2 (2 needs x), got {param_grad} {given}")
    if sink_weight is None and sink is not None:
        raise ValueError("sink needs sink_weight (the forward's weight of the sink), got sink_weight=None")
    if param_grad == 2 and sink_weight is not None and sink is None:
        raise ValueError("param_grad 2 with a sink needs sink (its scores), got sink=None")
    cap = _cap(softcap)
    _check_rows(y, "y")
    y = y.contiguous()
    grad = _like(grad, y, "grad")
    scores = _raw_scores(x, y) if cap else (_like(x, y, "x") if param_grad == 2 else None)
    shape, dtype = y.shape, y.dtype
    row_shape, length = shape[:-1], shape[-1]
    multiplier, multiplier_rows = _per_row(multiplier, row_shape, dtype, "multiplier")
    weight, weight_rows = (0.0, None) if sink_weight is None else _per_row(sink_weight, row_shape, dtype, "sink_weight")
    sink_score, sink_rows = _sink(sink if param_grad == 2 else None, row_shape, dtype)
    dx = _new(shape, dtype)
    per_row = _new(row_shape, dtype) if param_grad else None
    dsink = None if sink_weight is None else _new(row_shape, dtype)
    _launch("attnorm_softmax_backward", dtype, y.data_ptr(), grad.data_ptr(), _address(scores), dx.data_ptr(),
            y.numel() // length, length, multiplier, _address(multiplier_rows), param_grad, _address(per_row),
            weight, _address(weight_rows), sink_score, _address(sink_rows), _address(dsink), cap)
    return (dx, per_row) if sink_weight is None else (dx, per_row, dsink)


def topk_forward(
    x: Tensor,
    mask: rules.RowMask,
    k: float,
    is_fraction: bool,
    temperature: float | Tensor,
    sink: float | Tensor | None = None,
    softcap: float | None = None,
    weights_only: bool = False,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    """Softmax of ``x / temperature`` over the kept positions, exactly 0 elsewhere.

    Kept: the ``min(k, n)`` largest allowed scores, or ``max(1, ceil(k n - 1e-9))`` for a
    fraction ``0 < k < 1`` (``n`` the allowed positions); ties at the k-th value keep the
    lowest index.  A row holding +inf is uniform over its first kept +inf positions.
    With a sink, on the extended row ``[x, sink]``: an integer ``k`` counts the sink's
    slot, a fraction does not count it in ``n`` (it keeps 1 slot when ``n = 0``), and the
    sink loses every tie.  With a cap, on ``c(x) = cap tanh(x / cap)`` (a +inf score becomes
    ``cap``; ties are those of the capped scores), capped as C copies the row into its
    per-thread buffer (the copy the sink makes anyway: one more pass in cache).

    Args:
        x: scores ``(..., L)``, float32 or float64.
        mask: which positions each row may use.
        k: positions to keep, or the fraction of the allowed ones.
        is_fraction: read ``k`` as a fraction.
        temperature: per row.
        sink: the score of a virtual key after the last position, per row (always
            allowed), or None.
        softcap: the cap (``> 0``), or None.
        weights_only: skip ``multiplier`` (None), which only the backward reads.

    Returns:
        ``(y, multiplier)``, ``multiplier = 1 / temperature`` per row (0 in rows holding +inf);
        with a sink, its weight per row follows.

    Raises:
        ValueError: a bad ``softcap``.
    """
    cap = _cap(softcap)
    scores, bounds = _scores(x, mask)
    shape, dtype = x.shape, x.dtype
    row_shape, length = shape[:-1], shape[-1]
    temperature, temperature_rows = _per_row(temperature, row_shape, dtype, "temperature")
    sink_score, sink_rows = _sink(sink, row_shape, dtype)
    y = torch.empty_like(scores)  # contiguous like scores; cheaper than _new
    multiplier = None if weights_only else _new(row_shape, dtype)
    sink_weight = None if sink is None else _new(row_shape, dtype)
    _launch("attnorm_topk_forward", dtype, scores.data_ptr(), y.data_ptr(), x.numel() // length, length, float(k),
            int(bool(is_fraction)), temperature, _address(temperature_rows), _address(multiplier), sink_score,
            _address(sink_rows), _address(sink_weight), cap, *_addresses(bounds))
    return (y, multiplier) if sink is None else (y, multiplier, sink_weight)


def entmax_forward(
    x: Tensor,
    mask: rules.RowMask,
    alpha: float | Tensor,
    sink: float | Tensor | None = None,
    softcap: float | None = None,
    weights_only: bool = False,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    """alpha-entmax (Peters, Niculae & Martins, 2019) for any ``alpha >= 1`` per row.

    ``y = [(alpha - 1) x - tau]_+^(1 / (alpha - 1))`` with ``tau`` such that each row sums
    to 1: the solution of ``argmax_{p in simplex} p.x + H_alpha(p)`` (Tsallis entropy).
    alpha = 1 is softmax, 2 sparsemax (exact), 1.5 exact by its closed form; other
    alpha by a safeguarded Halley iteration, refined in double where it is ill
    conditioned (alpha > 2, and alpha < 1.1 for float32).  With a sink, on the
    extended row ``[x, sink]`` (the threshold includes it).  With a cap, on
    ``c(x) = cap tanh(x / cap)`` (a +inf score becomes ``cap``), capped as C copies the row
    into its per-thread buffer (one more pass in cache).

    Args:
        x: scores ``(..., L)``, float32 or float64.
        mask: which positions each row may use.
        alpha: per row, ``>= 1`` (a NaN row otherwise).
        sink: the score of a virtual key after the last position, per row (always
            allowed), or None.
        softcap: the cap (``> 0``), or None.
        weights_only: skip ``gate`` (None), which only the backward reads.

    Returns:
        ``(y, gate)``, ``gate`` 1 per row, 0 in rows holding +inf; with a sink, its weight
        per row follows.

    Raises:
        ValueError: a python ``alpha`` below 1, or a bad ``softcap``.
    """
    if not isinstance(alpha, Tensor) and not alpha >= 1:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    cap = _cap(softcap)
    scores, bounds = _scores(x, mask)
    shape, dtype = x.shape, x.dtype
    row_shape, length = shape[:-1], shape[-1]
    alpha, alpha_rows = _per_row(alpha, row_shape, dtype, "alpha")
    sink_score, sink_rows = _sink(sink, row_shape, dtype)
    y = torch.empty_like(scores)  # contiguous like scores; cheaper than _new
    gate = None if weights_only else _new(row_shape, dtype)
    sink_weight = None if sink is None else _new(row_shape, dtype)
    _launch("attnorm_entmax_forward", dtype, scores.data_ptr(), y.data_ptr(), x.numel() // length, length, alpha,
            _address(alpha_rows), _address(gate), sink_score, _address(sink_rows), _address(sink_weight), cap,
            *_addresses(bounds))
    return (y, gate) if sink is None else (y, gate, sink_weight)


def entmax_backward(
    y: Tensor,
    grad: Tensor,
    gate: float | Tensor,
    alpha: float | Tensor,
    alpha_grad: bool,
    sink_weight: float | Tensor | None = None,
    x: Tensor | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    """Vector-Jacobian product of alpha-entmax from its output.

    ``dx = gate (s g - s sum(s g) / sum(s))`` with ``s = y^(2 - alpha)`` on the support
    (``y`` itself for alpha = 1); with ``alpha_grad``, per row
    ``d alpha = gate beta (sum(g S) - sum(S) / sum(s) sum(g s))``, ``beta = 1 / (alpha - 1)``,
    ``S = y (beta - log y)`` on the support (0 for alpha = 1 rows).  With a sink of weight
    ``w``, all of it on the extended row ``[y, w]`` with gradient ``[g, 0]``: the sink's
    ``s`` and ``S`` join the sums and it receives ``dsink = -gate s_w sum(s g) / sum(s)``.
    With a cap, ``dx`` is carried to the raw scores ``x``, times ``1 - tanh(x / cap)^2``
    (0 where ``x`` is infinite): one more pass, reading ``x``.

    Args:
        y: the forward's weights ``(..., L)``.
        grad: incoming gradient, shaped like ``y``.
        gate: the forward's gate, per row.
        alpha: per row.
        alpha_grad: also return alpha's gradient per row.
        sink_weight: the forward's sink weight per row, or None (no sink).
        x: the forward's raw (masked) scores, needed with a cap only.
        softcap: the forward's cap, or None.

    Returns:
        ``(dx, per_row)``, ``per_row`` None without ``alpha_grad``; with a sink, ``dsink``
        per row follows.

    Raises:
        ValueError: a bad ``softcap``, or one without ``x``.
    """
    cap = _cap(softcap)
    _check_rows(y, "y")
    y = y.contiguous()
    grad = _like(grad, y, "grad")
    scores = _raw_scores(x, y) if cap else None
    shape, dtype = y.shape, y.dtype
    row_shape, length = shape[:-1], shape[-1]
    gate, gate_rows = _per_row(gate, row_shape, dtype, "gate")
    alpha, alpha_rows = _per_row(alpha, row_shape, dtype, "alpha")
    weight, weight_rows = (0.0, None) if sink_weight is None else _per_row(sink_weight, row_shape, dtype, "sink_weight")
    dx = _new(shape, dtype)
    per_row = _new(row_shape, dtype) if alpha_grad else None
    dsink = None if sink_weight is None else _new(row_shape, dtype)
    _launch("attnorm_entmax_backward", dtype, y.data_ptr(), grad.data_ptr(), dx.data_ptr(), y.numel() // length,
            length, gate, _address(gate_rows), alpha, _address(alpha_rows), _address(per_row), weight,
            _address(weight_rows), _address(dsink), _address(scores), cap)
    return (dx, per_row) if sink_weight is None else (dx, per_row, dsink)


def self_adjusted_forward(
    x: Tensor,
    mask: rules.RowMask,
    normalized: bool,
    sink: float | Tensor | None = None,
    softcap: float | None = None,
    weights_only: bool = False,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    """SA-Softmax (Zheng et al., 2025): ``y = phi(x) softmax(x)`` over the allowed positions.

    ``phi(x) = x`` (plain) or ``(x - low) / (high - low)`` with ``low = min(min x, 0)``,
    ``high = max(max x, 0)`` over the allowed finite scores (normalized; ``phi = 0`` when
    ``high = low``; the span is halved when it overflows and divided by, so denormal
    spans stay finite).  A row holding +inf has weights uniform over its +inf positions
    (normalized) or +inf there (plain).  With a sink, on the extended row ``[x, sink]``
    (its score joins ``max``, ``min``, ``low``, ``high`` and the softmax sum).  With a cap,
    on ``c(x) = cap tanh(x / cap)`` (``stats`` in capped units; a +inf score becomes
    ``cap``), capped as C reads the row into a per-thread buffer (one more pass in cache).

    Args:
        x: scores ``(..., L)``, float32 or float64.
        mask: which positions each row may use.
        normalized: use the normalized factor.
        sink: the score of a virtual key after the last position, per row (always
            allowed), or None.
        softcap: the cap (``> 0``), or None.
        weights_only: skip ``stats`` (None), which only the backward reads.

    Returns:
        ``(y, stats)``, ``stats`` of shape ``x.shape[:-1] + (5,)``: ``(c0, c1, low, high, gate)``
        with softmax weights ``w = exp((x - c0) - c1)``; ``gate`` 0 in rows holding +inf or
        fully masked (NaN rows: NaN statistics, gate 1); with a sink, its weight per row
        follows.

    Raises:
        ValueError: a bad ``softcap``.
    """
    cap = _cap(softcap)
    scores, bounds = _scores(x, mask)
    shape, dtype = x.shape, x.dtype
    row_shape, length = shape[:-1], shape[-1]
    sink_score, sink_rows = _sink(sink, row_shape, dtype)
    y = torch.empty_like(scores)  # contiguous like scores; cheaper than _new
    stats = None if weights_only else _new((*row_shape, _SA_STATS), dtype)
    sink_weight = None if sink is None else _new(row_shape, dtype)
    _launch("attnorm_self_adjusted_forward", dtype, scores.data_ptr(), y.data_ptr(), x.numel() // length, length,
            int(bool(normalized)), _address(stats), sink_score, _address(sink_rows), _address(sink_weight), cap,
            *_addresses(bounds))
    return (y, stats) if sink is None else (y, stats, sink_weight)


def self_adjusted_backward(
    x: Tensor,
    mask: rules.RowMask,
    grad: Tensor,
    stats: Tensor,
    normalized: bool,
    sink: float | Tensor | None = None,
    softcap: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Vector-Jacobian product of SA-Softmax, recomputing ``w = exp((x - c0) - c1)`` from ``x`` and ``stats``.

    With ``P = sum(g phi w)``, ``Q = sum(g w)``: ``dx = w (g phi - P) + g w phi'`` with
    ``phi' = 1`` (plain) or ``1 / (high - low)``, plus ``(P - Q) / (high - low)`` shared by
    the positions at ``low`` (when ``low < 0``) and ``-P / (high - low)`` by those at
    ``high`` (when ``high > 0``).  0 in rows with gate 0, NaN in rows holding NaN.  With a
    sink, on the extended row ``[x, sink]`` with gradient ``[g, 0]``: the sink receives
    ``dsink = -w_sink P`` plus its share of the paths through ``low`` and ``high``.  With a
    cap, ``x`` holds the raw scores: C caps them into ``dx``'s row, runs the above on
    ``c(x)`` in place and multiplies by ``1 - tanh(x / cap)^2`` (0 where ``x`` is infinite):
    two more passes, in cache.

    Args:
        x: the forward's scores ``(..., L)``.
        mask: the forward's mask.
        grad: incoming gradient, shaped like ``x``.
        stats: the forward's statistics ``x.shape[:-1] + (5,)``.
        normalized: the forward's ``normalized``.
        sink: the forward's sink scores per row, or None.
        softcap: the forward's cap, or None.

    Returns:
        ``dx`` shaped like ``x``; with a sink, ``(dx, dsink)``, ``dsink`` per row.

    Raises:
        ValueError: a bad ``softcap``, or ``stats`` of the wrong shape.
    """
    cap = _cap(softcap)
    scores, bounds = _scores(x, mask)
    grad = _like(grad, x, "grad")
    expected = (*x.shape[:-1], _SA_STATS)
    if not isinstance(stats, Tensor) or tuple(stats.shape) != expected or stats.device.type != "cpu":
        shape = tuple(stats.shape) if isinstance(stats, Tensor) else type(stats).__name__
        raise ValueError(f"stats must be a CPU tensor of shape {expected}, got {shape}")
    if stats.dtype != x.dtype:  # the accumulation dtype
        stats = stats.to(x.dtype)
    stats = stats.contiguous()
    row_shape, length = x.shape[:-1], x.shape[-1]
    sink_score, sink_rows = _sink(sink, row_shape, x.dtype)
    dx = _new(x.shape, x.dtype)
    dsink = None if sink is None else _new(row_shape, x.dtype)
    _launch("attnorm_self_adjusted_backward", x.dtype, scores.data_ptr(), grad.data_ptr(), dx.data_ptr(),
            x.numel() // length, length, int(bool(normalized)), stats.data_ptr(), sink_score, _address(sink_rows),
            _address(dsink), cap, *_addresses(bounds))
    return dx if sink is None else (dx, dsink)
