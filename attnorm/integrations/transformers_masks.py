"""The mask function of the ``"attnorm"`` attention implementation: packed sequences as document masks.

transformers detects packed sequences itself (``masking_utils``, >= 4.54): when a causal
model is called with ``position_ids``, no 2-D ``attention_mask`` and no cache (a batch of
transformers' ``DataCollatorWithFlattening``, run with ``use_cache=False``),
``find_packed_sequence_indices`` numbers the sequence of every token (a new sequence
wherever ``position_ids`` do not grow by one, e.g. where they restart at 0), and the
registered mask function is called with the pattern::

    and_masks(packed_sequence_mask_function(sequence_ids),
              remap_positions_for_packed_sequence(causal_or_sliding_window, position_ids))

(the two parts in the other order in later releases, 5.24 for one; earlier releases, 5.17
for one, have no remapping and pass ``causal_or_sliding_window`` itself), which ``sdpa_mask``
would expand into a dense ``(B, 1, L, L)`` bool tensor.
:func:`attnorm_mask` recognises exactly that pattern, for a batch of one row, no padding,
no cache offsets and outside tracing, and returns the same mask as a
:class:`~attnorm.StructuredMask`: ``document_mask(cu_seqlens) & causal_mask()`` (or
``& sliding_window_mask(w)`` for sliding-window layers).  The model hands it unchanged
to the attention function, whose kernels then skip cross-document key blocks and count
Scalable-Softmax's ``n`` per document.  Anything else (padding, several rows, other
patterns, ``torch.compile``) goes to transformers' ``sdpa_mask``, unchanged.

Why the mask function, and not ``position_ids`` read by the attention function: the
mask function is called by every model built on ``masking_utils``, before any dense
mask exists, while ``position_ids`` reach the attention function only in models that
forward their ``**kwargs`` to it.  The pattern is recognised by the code objects of
transformers' own mask factories, so a transformers release that changes them gets
dense masks again (still exact), never a wrong mask.

No host synchronisation is added: ``cu_seqlens`` has the fixed shape ``(L + 1,)``,
``searchsorted(sequence_ids, arange(L + 1))``, the start of sequence ``d`` at index ``d``
and ``L`` past the last sequence (empty documents).  transformers' detection itself
reads one value to decide whether the row is packed, for every attention implementation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from attnorm.masks import StructuredMask, causal_mask, document_mask, sliding_window_mask

__all__ = ["attnorm_mask", "packed_causal_mask"]


def attnorm_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    **kwargs,
) -> Tensor | StructuredMask | None:
    """The ``AttentionMaskInterface`` function registered as ``"attnorm"``.

    Takes the arguments of transformers' ``sdpa_mask``.

    Returns:
        For transformers' packed causal (or sliding-window) pattern (one packing per batch row),
        ``document_mask(cu_seqlens) & causal_mask()`` (or ``& sliding_window_mask(local_size)``);
        otherwise what ``sdpa_mask`` returns: a bool ``(B, 1, Lq, Lk)`` mask (True = may
        attend), or None for the plain causal / bidirectional pattern.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    plain = (
        attention_mask is None and q_length == kv_length > 1
        and _is_zero(q_offset) and _is_zero(kv_offset) and not torch.compiler.is_compiling()
    )
    packed = _packed_pattern(mask_function, local_size) if plain else None
    if packed is not None and packed[0].shape == (batch_size, q_length):
        sequence_ids, within = packed
        return packed_causal_mask(sequence_ids[0] if batch_size == 1 else sequence_ids) & within
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=mask_function, attention_mask=attention_mask, local_size=local_size, **kwargs,
    )


def packed_causal_mask(sequence_ids: Tensor) -> StructuredMask:
    """``document_mask`` of packed rows from their per-token sequence numbers ``(L,)`` or ``(B, L)``: 0, 0, 1, 1, 2, ...

    The numbers start at 0 and grow by one at each new sequence (transformers'
    ``find_packed_sequence_indices``).  ``cu_seqlens`` keeps the fixed shape ``(L + 1,)``
    (trailing entries ``L``: empty documents), so no value is read on the host.
    """
    length = sequence_ids.shape[-1]
    sequence_ids = sequence_ids.contiguous()
    positions = torch.arange(length + 1, device=sequence_ids.device, dtype=sequence_ids.dtype)
    positions = positions.expand(*sequence_ids.shape[:-1], length + 1).contiguous()
    return document_mask(torch.searchsorted(sequence_ids, positions))


def _is_zero(offset) -> bool:
    return isinstance(offset, int) and offset == 0  # a tensor offset (static cache) is never packed


def _packed_pattern(mask_function: Callable, local_size: int | None) -> tuple[Tensor, StructuredMask] | None:
    """``(sequence_ids (B, L), mask within a sequence)`` when ``mask_function`` is transformers' packed pattern."""
    codes = _factory_codes()
    outer = _closure(mask_function, codes["and"])
    parts = () if outer is None else outer.get("mask_functions", ())
    if len(parts) != 2:
        return None
    if _closure(parts[0], codes["packed"]) is None:  # transformers >= 5.x puts the packed part second
        parts = parts[::-1]
    packed = _closure(parts[0], codes["packed"])
    if packed is None or not isinstance(packed.get("packed_sequence_mask"), Tensor):
        return None
    # Releases before remap_positions_for_packed_sequence (5.17, for one) pass the causal or sliding-window
    # function itself: on global positions, and-ed with the packed part, it is the same mask.
    remapped = _closure(parts[1], codes["remap"]) if codes["remap"] is not None else None
    within = _within_sequence(parts[1] if remapped is None else remapped.get("mask_function"), local_size)
    return None if within is None else (packed["packed_sequence_mask"], within)


def _within_sequence(mask_function: Callable | None, local_size: int | None) -> StructuredMask | None:
    """The structured mask of transformers' causal or sliding-window mask function, else None."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is causal_mask_function:
        return causal_mask() if local_size is None else None
    both = _closure(mask_function, _factory_codes()["and"])
    parts = () if both is None else both.get("mask_functions", ())
    if len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    overlay = _closure(parts[0], _factory_codes()["window"])
    window = None if overlay is None else overlay.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1 or window != local_size:
        return None
    return sliding_window_mask(window)


def _closure(function: Callable, code) -> dict | None:
    """The closure variables of ``function`` when it was made by the factory whose inner code is ``code``."""
    if getattr(function, "__code__", None) is not code or function.__closure__ is None:
        return None
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, function.__closure__, strict=True)}


@functools.cache
def _factory_codes() -> dict:
    """Code objects of the inner functions of transformers' mask factories."""
    from transformers import masking_utils as mu

    ids = torch.zeros(1, 1, dtype=torch.long)
    remap = getattr(mu, "remap_positions_for_packed_sequence", None)  # absent before transformers 5.2x
    return {
        "and": mu.and_masks(mu.causal_mask_function).__code__,
        "packed": mu.packed_sequence_mask_function(ids).__code__,
        "remap": None if remap is None else remap(mu.causal_mask_function, ids).__code__,
        "window": mu.sliding_window_overlay(1).__code__,
    }
