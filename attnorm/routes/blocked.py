"""Blocked route: any normalizer on any device in bounded memory, training included.

Query rows are processed in blocks: a block's scores ``(..., rows, Lk)`` are built,
normalised by the normalizer's own row kernels and multiplied by ``v``; only the
block's output is kept.  The backward recomputes each block's scores and weights
from ``q``, ``k`` and ``v`` (nothing of size ``Lq x Lk`` is saved) and
differentiates the block with autograd, so ``q``, ``k``, ``v``, an additive mask and
every learnable parameter of the normalizer get their gradients.  Dropout is
replayed exactly: the random state is saved before the forward's first block and
restored before the backward's.

A block holds ``rows`` query rows of every head and batch element and, under a structured mask,
only the keys those rows can reach (:func:`_spans`: half the products of a causal attention are
skipped; on the CPU also the keys outside a packed batch's documents and past its key lengths);
it is sized so its
float32 scores take at most ``max(MIN_BLOCK_BYTES, (q + k + v bytes) / BLOCKS_PER_INPUTS)``:
peak memory stays within a small multiple of the inputs whatever ``Lq x Lk`` is.
With grouped-query attention the query heads of a group are stacked on the row axis
(``(B, Hkv, groups * rows, D)``), so keys and values are never repeated.

The same block function with one block of every row is the **materialised** route
(:func:`materialised_attention`), which also returns the weights and, being plain
autograd, supports double backward; so does the blocked route, whose backward under ``create_graph=True``
recomputes the blocks as plain autograd (holding their graphs, as the materialised route does).

Both routes take the two score modifiers, which rule out SDPA (the fused kernels compute
them too, :mod:`attnorm.routes.fused`; these routes serve the calls that stay off it):

* ``softcap``: ``cap tanh(x / cap)`` on the scaled scores, before the additive mask
  and the normalizer (Gemma 2);
* ``sinks``: a virtual key per query head whose score is ``sinks[h]`` (after the scale,
  like gpt-oss's ``s_aux``) and whose value is zero.  It takes part in the normalizer
  like a key (scaled by ``1/T`` or the Scalable-Softmax multiplier, able to take a top-k
  slot, inside Self-Adjusted's min and max) but is not one of the ``n`` allowed keys
  Scalable-Softmax counts, nor one of those top-k's fractional ``k`` takes a fraction
  of (``max(1, ceil(k n))`` slots for the ``n`` real keys and the sink, which loses
  ties to them); its weight is dropped.

The six normalizers with row kernels take both as arguments of their row operation
(``normalizer(scores, mask, sink=..., softcap=...)``): the kernels cap the scores as
they read them and hold the sink as one more position, so no capped copy or extended
score row is built.  With an additive mask the cap must come before the mask is
added, so it stays a torch op there, as it does for the normalizers without row
kernels, which also get the sink as one more score column.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnorm.kernels.decoding_ops import decoding_scores
from attnorm.kernels.ops import forward_mode
from attnorm.masks import StructuredMask
from attnorm.normalizers.base import Normalizer, normalize
from attnorm.routes import decoding
from attnorm.routes.common import interval, interval_rows

__all__ = ["BLOCKS_PER_INPUTS", "MIN_BLOCK_BYTES", "block_rows", "blocked_attention", "computed_share",
           "materialised_attention"]

MIN_BLOCK_BYTES = 1 << 22
BLOCKS_PER_INPUTS = 8


def block_rows(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Query rows per block (all of them when the whole score matrix fits the budget)."""
    # sizes as products, not Tensor.nbytes: Dynamo cannot read nbytes of a tensor with symbolic sizes
    inputs = sum(math.prod(t.shape) * t.element_size() for t in (q, k, v))
    budget = max(MIN_BLOCK_BYTES, inputs // BLOCKS_PER_INPUTS)
    row_bytes = 4 * math.prod(q.shape[:-2]) * max(k.shape[-2], 1)  # no indexing op: this runs every step
    return max(1, min(q.shape[-2], budget // row_bytes))


def computed_share(mask, q: Tensor, lk: int, rows: int) -> float:
    """The share of the ``(Lq, Lk)`` scores the blocked route computes in blocks of ``rows`` query rows: each
    block's rows times the keys they can reach (:func:`_blocks`)."""
    computed = sum((stop - start) * (hi - lo) for start, stop, lo, hi in _blocks(mask, q, lk, rows))
    return computed / max(q.shape[-2] * lk, 1)


def _blocks(mask, q: Tensor, lk: int, rows: int) -> list[tuple[int, int, int, int]]:
    """``(start, stop, lo, hi)`` of each block: query rows ``start:stop`` (``rows`` of them, fewer in the last)
    and the keys ``lo:hi`` they can reach (:func:`_spans`).  A call computes them once, for its forward and
    its backward alike."""
    lq = q.shape[-2]
    return [(start, min(start + rows, lq), lo, hi)
            for start, (lo, hi) in zip(range(0, lq, rows), _spans(mask, q, lk, rows), strict=True)]


def _spans(mask, q: Tensor, lk: int, rows: int) -> list[tuple[int, int]]:
    """Keys ``[lo, hi)`` that each block of ``rows`` query rows can reach, block by block.

    On the CPU, where reading a structured mask's values costs nothing, from its key interval per row
    (:meth:`attnorm.masks.StructuredMask.key_range`): every structured mask narrows a block, documents and
    key lengths included (a packed batch's block reaches its own documents' keys only).  Elsewhere, and
    while ``torch.jit.trace`` records (values would be baked into the trace) or a ``torch.func`` transform
    runs, from the causal and window diagonals alone (:func:`_key_span`: Python numbers, no device sync).
    """
    lq = q.shape[-2]
    blocks = range(0, lq, rows)
    if not (isinstance(mask, StructuredMask) and q.is_cpu and lq and lk) or torch._C._get_tracing_state() \
            or torch._C._are_functorch_transforms_active():
        return [_key_span(mask, start, min(start + rows, lq), lk) for start in blocks]
    start, stop = mask.key_range(q.shape[0] if q.ndim >= 3 else 1, lq, lk, q.device)  # (B | 1, Lq)
    reaches = stop > start  # rows with no allowed key reach nothing
    first = torch.where(reaches, start, lk).amin(0)  # (Lq,): over the batch
    last = torch.where(reaches, stop, 0).amax(0)
    pad = len(blocks) * rows - lq
    first = F.pad(first, (0, pad), value=lk).reshape(len(blocks), rows).amin(1).tolist()
    last = F.pad(last, (0, pad), value=0).reshape(len(blocks), rows).amax(1).tolist()
    # A block that reaches no key keeps one, masked, so its rows give zeros like any fully masked row.
    return [(lo, hi) if hi > lo else (0, 1) for lo, hi in zip(first, last, strict=True)]


_HALF = (torch.float16, torch.bfloat16)


def blocked_attention(normalizer, q: Tensor, k: Tensor, v: Tensor, mask, additive: Tensor | None, scale: float,
                      dropout_p: float, groups: int, rows: int, softcap: float | None = None,
                      sinks: Tensor | None = None) -> Tensor:
    """``normalizer(scale q k^T + additive, mask) v`` a block of ``rows`` query rows at a time.

    Forward mode saves nothing for a backward: under it the blocks are plain torch (the
    recomputing Function has no JVP), memory bounded all the same.  So do ``torch.func``
    transforms and ``torch.jit.trace``, which take no old-style Function (its backward
    recomputes each block: the blocks' graphs are kept there, as the materialised route keeps
    its weights).
    """
    frozen = _Frozen.capture(normalizer)
    setup = (normalizer, frozen, mask, scale, softcap, dropout_p, groups, _blocks(mask, q, k.shape[-2], rows))
    if forward_mode() or torch._C._are_functorch_transforms_active() or torch._C._get_tracing_state():
        return torch.cat([out for _, _, out in _outputs(setup, q, k, v, additive, sinks)], dim=-2)
    return _BlockedAttention.apply(setup, q, k, v, additive, sinks, *frozen.differentiable())


class _Frozen:
    """The normalizer as this call's forward read it; the blocks weigh their scores with it, forward and backward.

    The backward used to call the module again, so it differentiated whatever the module held by then:
    ``torch.func.functional_call`` had swapped its parameters back (dq 1.7 off), a hyperparameter set between
    forward and backward (``entmax.alpha = 1.9``) was the backward's, and a tensor that is not a parameter
    (``Softmax(temperature=T)`` with ``T`` requiring grad) got no gradient.  Two kinds:

    * ``values``: attnorm's row normalizers called as they are (``Normalizer.forward``, no hook): their
      :meth:`~attnorm.normalizers.Normalizer.kernel_params` (numbers and tensors, a learnable alpha as
      computed from its logit), applied by :func:`attnorm.normalizers.base.normalize` as the module would;
    * ``state``: any other module (a hook to run, its own ``forward``, the F/sum F normalizers): called through
      ``torch.func.functional_call`` with its parameters and buffers as they were (a plain call without any),
      and ``extra``, the tensors that require grad it reads besides them: those its ``kernel_params`` holds,
      and those a function it holds (``Normalized(f)``'s ``f``) reads through its closure, its globals or the
      module it is bound to.  Its other attributes are read from the module again in the backward, so a
      change to one between forward and backward raises there (:meth:`check`).

    Every tensor is saved for the backward, so one changed in place before it raises.
    """

    def __init__(self, normalizer, values: dict | None, state: dict | None, extra: tuple[Tensor, ...] = (),
                 attributes: dict | None = None) -> None:
        self.normalizer, self.values, self.state, self.extra = normalizer, values, state, extra
        self.attributes = attributes

    @classmethod
    def capture(cls, normalizer) -> _Frozen:
        if getattr(normalizer, "kernel", "") and type(normalizer).forward is Normalizer.forward \
                and not decoding._hooked(normalizer):
            return cls(normalizer, normalizer.kernel_params(), None)
        state = {**dict(normalizer.named_parameters()), **dict(normalizer.named_buffers())}
        held = {id(tensor) for tensor in state.values()}
        params = normalizer.kernel_params() if hasattr(normalizer, "kernel_params") else {}
        attributes = {name: value for name, value in vars(normalizer).items() if name not in _UNWATCHED}
        read = [*params.values(), *(tensor for value in attributes.values() for tensor in _closure_tensors(value))]
        extra = _unique(value for value in read
                        if isinstance(value, Tensor) and value.requires_grad and id(value) not in held)
        return cls(normalizer, None, state or None, extra, attributes)

    def check(self) -> None:
        """Raise if a module called as such had an attribute set since the forward (its backward would differ)."""
        if self.attributes is None:
            return
        now = vars(self.normalizer)
        changed = [name.lstrip("_") for name, value in self.attributes.items()
                   if not _same(now.get(name, _MISSING), value)]
        if changed:
            raise RuntimeError(
                f"attention's blocked route recomputes {type(self.normalizer).__name__} in the backward, and its "
                f"{', '.join(changed)} changed after the forward: set attributes after the backward (or take the "
                f"materialised route, attention(..., return_weights=True))")

    def _held(self) -> list[Tensor]:
        return [value for value in (self.values or self.state or {}).values() if isinstance(value, Tensor)]

    def differentiable(self) -> tuple[Tensor, ...]:
        """The tensors the Function differentiates besides q, k, v, the additive mask and the sinks."""
        return _unique([*(tensor for tensor in self._held() if tensor.requires_grad), *self.extra])

    def others(self) -> tuple[Tensor, ...]:
        """The tensors it reads without differentiating them (saved all the same: in-place changes raise)."""
        return _unique(tensor for tensor in self._held() if not tensor.requires_grad)

    def with_leaves(self) -> tuple[_Frozen, tuple[Tensor, ...]]:
        """A copy whose differentiable tensors are detached leaves (the first-order backward's blocks), and the
        tensors to differentiate, in :meth:`differentiable`'s order (``extra`` as the module holds them)."""
        leaves = {id(tensor): tensor.detach().requires_grad_() for tensor in self.differentiable()
                  if not any(tensor is other for other in self.extra)}
        swap = lambda held: None if held is None else {name: leaves.get(id(value), value) if isinstance(value, Tensor)
                                                       else value for name, value in held.items()}
        copy = _Frozen(self.normalizer, swap(self.values), swap(self.state), self.extra, self.attributes)
        return copy, tuple(leaves.get(id(tensor), tensor) for tensor in self.differentiable())

    def __call__(self, scores: Tensor, mask, **options) -> Tensor:
        """``normalizer(scores, mask, **options)`` with the captured state."""
        normalizer = self.normalizer
        if self.values is not None:
            return normalize(normalizer.kernel, scores, mask, normalizer.dim, self.values, normalizer.backend,
                             options.get("sink"), options.get("softcap"))
        if self.state is not None:
            return torch.func.functional_call(normalizer, self.state, (scores, mask), options)
        return normalizer(scores, mask, **options)


_UNWATCHED = frozenset({"training", "_shortcut_token"})
"""Module attributes :meth:`_Frozen.check` does not compare (the mode, and the shortcut's lazily set token)."""
_MISSING = object()


def _same(now: object, then: object) -> bool:
    """The same attribute value: the same object, or an equal number or string (``module.k = 4`` again)."""
    if now is then:
        return True
    plain = (bool, int, float, str)
    return type(now) is type(then) and isinstance(then, plain) and now == then


def _closure_tensors(value, depth: int = 0) -> list[Tensor]:
    """The tensors a function attribute reads that autograd could differentiate: its closure cells and the
    globals it names, a ``functools.partial``'s arguments, the parameters of a module it is bound to or is."""
    if depth > 2 or isinstance(value, (Tensor, type)) or not callable(value):
        return []
    if isinstance(value, torch.nn.Module):
        return list(value.parameters())
    if isinstance(value, functools.partial):
        found = [*_closure_tensors(value.func, depth + 1), *value.args, *value.keywords.values()]
        return [item for item in found if isinstance(item, Tensor)]
    found = []
    owner = getattr(value, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        found += owner.parameters()
    code = getattr(value, "__code__", None)
    if code is not None:
        for cell in getattr(value, "__closure__", None) or ():
            try:
                found.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        scope = getattr(value, "__globals__", {})
        found += (scope.get(name) for name in code.co_names)
    return [item for item in found if isinstance(item, Tensor)]


def _unique(tensors) -> tuple[Tensor, ...]:
    found: dict[int, Tensor] = {}
    for tensor in tensors:
        found.setdefault(id(tensor), tensor)
    return tuple(found.values())


def _outputs(setup: tuple, q: Tensor, k: Tensor, v: Tensor, additive: Tensor | None, sinks: Tensor | None):
    """``(start, stop, out)`` for each block of query rows ``start:stop``."""
    normalizer, frozen, mask, scale, softcap, dropout_p, groups, blocks = setup
    lk, bounds = k.shape[-2], _bounds(normalizer, mask, q, k)
    for start, stop, lo, hi in blocks:
        q_rows, additive_rows = q[..., start:stop, :], _rows(additive, start, stop)
        yield start, stop, _block(normalizer, q, q_rows, k[..., lo:hi, :], v[..., lo:hi, :], mask, bounds,
                                  additive_rows, sinks, scale, softcap, dropout_p, groups, start, stop, lo, lk,
                                  frozen)[0]


def materialised_attention(normalizer, q: Tensor, k: Tensor, v: Tensor, mask, additive: Tensor | None, scale: float,
                           dropout_p: float, groups: int, softcap: float | None = None,
                           sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(out, weights)`` with the whole ``(..., Hq, Lq, Lk)`` weights (plain autograd)."""
    bounds = _bounds(normalizer, mask, q, k)
    return _block(normalizer, q, q, k, v, mask, bounds, additive, sinks, scale, softcap, dropout_p, groups, 0,
                  q.shape[-2])


def _bounds(normalizer, mask, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor] | None:
    """A structured mask's key interval per query row (:func:`interval`), computed once per call; None for other
    masks and for those the row kernels bound themselves (:func:`_row_prefixes`)."""
    if not isinstance(mask, StructuredMask) or _row_prefixes(normalizer, mask):
        return None
    return interval(mask, q, k.shape[-2])


def _row_prefixes(normalizer, mask) -> bool:
    """True when ``mask`` (causal and key lengths only) reaches ``normalizer``'s row kernels as each row's
    allowed prefix, which they bound themselves: no key intervals, no bool mask."""
    return bool(getattr(normalizer, "kernel", "")) and isinstance(mask, StructuredMask) and mask.row_fields_only


def _rows(x: Tensor | None, start: int, stop: int) -> Tensor | None:
    """Rows ``start:stop`` of a tensor that broadcasts over query rows."""
    return x if x is None or x.ndim < 2 or x.shape[-2] == 1 else x[..., start:stop, :]


def _key_span(mask, start: int, stop: int, lk: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that query rows ``start:stop`` can reach under a causal / sliding-window mask.

    Python numbers only (key lengths and documents would need the device's values).  A block
    that reaches no key keeps one, masked, so its rows give zeros like any fully masked row.
    """
    lo, hi = 0, lk
    if isinstance(mask, StructuredMask):
        if mask.causal_diagonal is not None:
            hi = min(hi, stop + mask.causal_diagonal)
        if mask.window_diagonal is not None:
            lo = max(lo, start + mask.window_diagonal)
    lo, hi = min(max(lo, 0), lk), min(max(hi, 0), lk)
    return (lo, hi) if hi > lo else (0, min(lk, 1))


def _prefix_mask(mask: StructuredMask, start: int) -> StructuredMask:
    """A causal / key-length ``mask`` as the query rows from ``start`` see it (their keys start at 0: only a
    sliding window trims a block's first keys, and a mask with one takes the bool path)."""
    diagonal = None if mask.causal_diagonal is None else mask.causal_diagonal + start
    return StructuredMask(causal_diagonal=diagonal, key_lengths=mask.key_lengths)


def _keys(x: Tensor | None, lo: int, hi: int) -> Tensor | None:
    """Keys ``lo:hi`` (the last axis) of a mask that may broadcast over keys."""
    return x if x is None or x.shape[-1] == 1 else x[..., lo:hi]


def _block(normalizer, q: Tensor, q_rows: Tensor, k: Tensor, v: Tensor, mask, bounds: tuple[Tensor, Tensor] | None,
           additive_rows: Tensor | None, sinks: Tensor | None, scale: float, softcap: float | None,
           dropout_p: float, groups: int, start: int, stop: int, lo: int = 0,
           lk: int | None = None, frozen: _Frozen | None = None) -> tuple[Tensor, Tensor]:
    """Output rows ``start:stop`` and their weights, from the query rows ``q_rows = q[..., start:stop, :]``.

    ``bounds`` are a structured ``mask``'s key intervals (:func:`_bounds`), None for other masks;
    ``frozen`` the normalizer as the call's forward read it (:class:`_Frozen`), None to call it as it is.

    ``k`` and ``v`` are keys ``lo:lo + k.shape[-2]`` of ``lk`` (default: all of them), e.g. only those
    a causal or sliding-window mask lets these rows reach (:func:`_key_span`; the weights then cover
    those keys only).
    """
    lk = k.shape[-2] if lk is None else lk
    hi = lo + k.shape[-2]
    if (lo, hi) != (0, lk):
        additive_rows = _keys(additive_rows, lo, hi)
    # Half-precision scores are computed in float32, as the fused kernels compute them: rounded to
    # bfloat16 (a spacing of 2^-8 relative) they would tie where the fused route does not, and a
    # top-k selection or an entmax support would differ (decoding against the full sequence).
    half = q_rows.dtype in _HALF
    if half and decoding.scores_kernel_applies(normalizer, q_rows, k):
        weights = None
        if (mask is None or isinstance(mask, Tensor)) and additive_rows is None:
            # scores and row kernel, one replay (a bool mask, a padded batch's, and the sinks read in place; the cap
            # in the kernel)
            weights = decoding.row_weights(normalizer, q_rows, k, scale, _rows(mask, start, stop), softcap, sinks)
        if weights is not None:
            return _attend(weights, v, dropout_p, groups, q.shape[-3], stop - start)  # in q's dtype
        scores = decoding_scores(q_rows, k, scale)  # float32, K read in its own dtype (no float32 copy)
    else:
        q_wide, k_wide = (q_rows.float(), k.float()) if half else (q_rows, k)
        if groups > 1:
            # (B, Hkv * g, rows, D) -> (B, Hkv, g * rows, D): one product with each key head, no repeated keys.
            lead, rows = q_rows.shape[:-3], stop - start
            stacked = q_wide.reshape(*lead, k.shape[-3], groups * rows, q.shape[-1])
            scores = torch.matmul(stacked, k_wide.transpose(-2, -1)).reshape(*lead, q.shape[-3], rows, k.shape[-2])
        else:
            scores = torch.matmul(q_wide, k_wide.transpose(-2, -1))  # (..., Hq, rows, Lk)
        scores = scores * scale
    kernel = getattr(normalizer, "kernel", "")
    if softcap is not None and (additive_rows is not None or not kernel):
        # The cap comes before the additive mask, which the row kernels would read already added.
        scores = softcap * torch.tanh(scores / softcap)
        softcap = None
    if additive_rows is not None:
        # Added at the wider precision, then back to the scores' dtype (a float32 mask on bfloat16 scores).
        scores = (scores + additive_rows).to(scores.dtype)
    if _row_prefixes(normalizer, mask):
        mask = _prefix_mask(mask, start)
    else:
        mask = interval_rows(bounds, start, stop, lo, hi) if bounds is not None else _keys(_rows(mask, start, stop),
                                                                                            lo, hi)
    weigh = normalizer if frozen is None else frozen
    if kernel:  # the row kernels take the sink and the cap themselves
        sink = None if sinks is None else sinks.reshape(-1, 1, 1).to(scores.device)  # (Hq, 1, 1): per head
        weights = weigh(scores, mask, sink=sink, softcap=softcap)
    else:
        weights = weigh(scores, mask) if sinks is None else _with_sinks(weigh, scores, mask, sinks)
    if half:
        weights = weights.to(q_rows.dtype)  # the weights a half-precision call returns and multiplies v with
    return _attend(weights, v, dropout_p, groups, q.shape[-3], stop - start)


def _attend(weights: Tensor, v: Tensor, dropout_p: float, groups: int, heads: int, rows: int) -> tuple[Tensor, Tensor]:
    """``(dropout(weights) v, weights)``: ``weights`` ``(..., Hq, rows, Lk)``, ``heads`` Hq (``groups`` per v head)"""
    attended = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    if groups > 1:
        lead = weights.shape[:-3]
        stacked = attended.reshape(*lead, v.shape[-3], groups * rows, v.shape[-2])
        return torch.matmul(stacked, v).reshape(*lead, heads, rows, v.shape[-1]), weights
    return torch.matmul(attended, v), weights


def _with_sinks(normalizer, scores: Tensor, mask: Tensor | None, sinks: Tensor) -> Tensor:
    """Weights of the real keys when each row also holds its head's sink (a last, always allowed key).

    For the normalizers without row kernels (the six with them take the sink as a
    per-row argument): the scores extended by the sink's column, one more key to them.
    """
    sink = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)  # (..., Hq, rows, 1)
    extended = torch.cat([scores, sink], dim=-1)
    keep = None if mask is None else torch.cat([mask.expand(scores.shape), mask.new_ones(sink.shape)], dim=-1)
    return normalizer(extended, keep)[..., :-1]


def _autocast_state(device: torch.device) -> tuple[torch.dtype, bool] | None:
    """``(dtype, enabled)`` of autocast on ``device``'s type now, as ``torch.autocast`` takes them (CPU, CUDA)."""
    kind = device.type
    if kind not in ("cpu", "cuda"):
        return None
    return torch.get_autocast_dtype(kind), torch.is_autocast_enabled(kind)


@contextlib.contextmanager
def _replaying(ctx, device: torch.device):
    """The forward's random state (its dropout masks, when it had dropout) and autocast
    (:func:`_autocast_state`), for the backward's recomputed blocks; the caller's random state after."""
    autocast = contextlib.nullcontext() if ctx.autocast is None else torch.autocast(device.type, *ctx.autocast)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], enabled=ctx.rng is not None), \
            autocast:
        if ctx.rng is not None:
            _set_rng_state(ctx.rng, device)
        yield


def _rng_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class _BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, setup, q, k, v, additive, sinks, *params):
        dropout_p = setup[5]
        ctx.setup = setup
        ctx.rng = _rng_state(q.device) if dropout_p > 0 else None
        ctx.autocast = _autocast_state(q.device)
        # The normalizer's tensors too: one changed in place before the backward raises there.
        ctx.save_for_backward(q, k, v, additive, sinks, *params, *setup[1].others())
        out = None
        for start, stop, block in _outputs(setup, q, k, v, additive, sinks):
            if out is None:  # the blocks' dtype: q's, or autocast's (as SDPA's output under autocast)
                out = block.new_empty(*q.shape[:-1], v.shape[-1])
            out[..., start:stop, :] = block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: gradients to differentiate again
            return _differentiable_backward(ctx, grad_out)
        normalizer, frozen, mask, scale, softcap, dropout_p, groups, blocks = ctx.setup
        q, k, v, additive, sinks, *_ = ctx.saved_tensors  # unpacked: tensors changed in place raise here
        frozen.check()
        frozen, params = frozen.with_leaves()  # the forward's state, each tensor to differentiate a leaf here
        k = k.detach().requires_grad_(ctx.needs_input_grad[2])
        v = v.detach().requires_grad_(ctx.needs_input_grad[3])
        if sinks is not None:
            sinks = sinks.detach().requires_grad_(ctx.needs_input_grad[5])
        wants_additive = additive is not None and ctx.needs_input_grad[4]
        wants_q = ctx.needs_input_grad[1]
        # Per-block gradients of q and of a per-row additive mask are concatenated, not written into a
        # zeroed tensor: the incoming gradient may be batched by vmap (autograd.functional.jacobian with
        # vectorize=True), which takes no in-place copy of a batched tensor into a plain one.
        dq_blocks, dadditive_blocks = [], []
        dk = dv = dadditive = dsinks = None
        dparams = [None] * len(params)
        inputs = [t for t in (k, v, sinks) if t is not None and t.requires_grad] + list(params)
        if not (inputs or wants_q or wants_additive):
            return (None,) * (6 + len(params))
        lk, bounds = k.shape[-2], _bounds(normalizer, mask, q, k)
        with _replaying(ctx, q.device):
            for start, stop, lo, hi in blocks:
                with torch.enable_grad():
                    q_rows = q[..., start:stop, :].detach().requires_grad_(wants_q)
                    # The block's keys as leaves of their own: their gradients are the block's keys only,
                    # not a zero-filled (..., Lk, D) tensor per block.
                    k_part = k[..., lo:hi, :].detach().requires_grad_(k.requires_grad)
                    v_part = v[..., lo:hi, :].detach().requires_grad_(v.requires_grad)
                    additive_rows = _rows(additive, start, stop)
                    if wants_additive:
                        additive_rows = additive_rows.detach().requires_grad_()
                    out = _block(normalizer, q, q_rows, k_part, v_part, mask, bounds, additive_rows, sinks, scale,
                                 softcap, dropout_p, groups, start, stop, lo, lk, frozen)[0]
                    leaves = [t for t in (k_part, v_part, sinks) if t is not None and t.requires_grad] + list(params)
                    wanted = leaves + ([q_rows] if wants_q else []) + ([additive_rows] if wants_additive else [])
                    grads = list(torch.autograd.grad(out, wanted, grad_out[..., start:stop, :], allow_unused=True))
                if wants_additive:
                    grad = grads.pop()
                    if additive.shape[-2] > 1:
                        dadditive_blocks.append(torch.zeros_like(additive_rows) if grad is None else grad)
                    else:
                        dadditive = _add(dadditive, grad)
                if wants_q:
                    grad = grads.pop()
                    dq_blocks.append(torch.zeros_like(q_rows) if grad is None else grad)
                if k.requires_grad:
                    dk = _add_keys(dk, grads.pop(0), lo, hi, lk)
                if v.requires_grad:
                    dv = _add_keys(dv, grads.pop(0), lo, hi, lk)
                if sinks is not None and sinks.requires_grad:
                    dsinks = _add(dsinks, grads.pop(0))
                dparams = [_add(total, grad) for total, grad in zip(dparams, grads, strict=True)]
        dq = torch.cat(dq_blocks, dim=-2) if wants_q else None
        if dadditive_blocks:
            dadditive = torch.cat(dadditive_blocks, dim=-2)
        return (None, dq, dk, dv, dadditive, dsinks, *dparams)


def _differentiable_backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
    """The gradients with a graph of their own (``create_graph=True``: double backward, gradient penalties,
    meta-learning): the forward's blocks recomputed as plain autograd on the saved inputs (every block's graph
    held at once, as the materialised route holds its weights) and differentiated with ``create_graph``.

    The first-order backward computes each block's gradients apart and keeps none of their graphs; under
    ``@once_differentiable`` its results came back detached and a second derivative through them was
    silently missing (or a misleading "not used in the graph" error).
    """
    frozen = ctx.setup[1]
    q, k, v, additive, sinks, *_ = ctx.saved_tensors  # unpacked: tensors changed in place raise here too
    frozen.check()
    params = frozen.differentiable()  # the forward's own tensors
    with _replaying(ctx, q.device):
        out = torch.cat([block for _, _, block in _outputs(ctx.setup, q, k, v, additive, sinks)], dim=-2)
    inputs = (q, k, v, additive, sinks, *params)
    wanted = [i for i, t in enumerate(inputs) if t is not None and ctx.needs_input_grad[1 + i]]
    grads = torch.autograd.grad(out, [inputs[i] for i in wanted], grad_out, create_graph=True, allow_unused=True)
    result: list[Tensor | None] = [None] * len(inputs)
    for i, grad in zip(wanted, grads, strict=True):
        result[i] = grad
    return (None, *result)


def _add_keys(total: Tensor | None, grad: Tensor | None, lo: int, hi: int, lk: int) -> Tensor | None:
    """``total`` plus the gradient ``grad`` of keys ``lo:hi`` of ``lk``.

    The first gradient is padded into a new tensor, so it is batched exactly when the incoming
    gradient is (vmap), and the others are added into it in place, keys ``lo:hi`` only.
    """
    if grad is None:
        return total
    if total is None:
        return F.pad(grad, (0, 0, lo, lk - hi))
    if (lo, hi) == (0, lk):  # every key: out of place (a batched gradient has no in-place add into an alias)
        return total + grad
    total[..., lo:hi, :] += grad
    return total


def _add(total: Tensor | None, grad: Tensor | None) -> Tensor | None:
    if grad is None:
        return total
    return grad if total is None else total + grad
