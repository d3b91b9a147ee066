"""A normalizer module's repeated eager call sent straight to its replayed kernel launch (CUDA, no gradient).

With :mod:`attnorm.kernels.fast_launch` on, a Triton backend function's repeated call is
already a replay (:mod:`attnorm.kernels.triton.replay`): outputs allocated, compiled
kernels launched with the recorded arguments.  What is left of a 4x16 module call is the
Python *above* that function, the same for every call of a given module on a given
tensor layout: :func:`attnorm.normalizers.base.normalize`'s checks, the backend's
resolution, :func:`attnorm.kernels.autograd._direct`'s tests, the parameters' packing,
the replay's own key (~13 of a ~27 us call on the stand-in of
``scripts/launch_overhead.py``; the H200 read ~27-31 us against a goal of 25).

:func:`call` keeps, per **key** (the module's state, the scores' dtype, shape, strides,
device and 16-byte alignment, the global backend, the CUDA device and stream, Triton's
``debug`` and instrumentation knobs), what the call ended in, found by running it once
as written while :func:`note` listens:

* when the whole call was one replay of a plan, on the scores alone, whose result (or
  its first item) came back unchanged (its version counter too: nothing wrote it after
  the launch), the key keeps that plan: later calls replay it directly;
* when the replay had no plan yet (a key's first and second calls, which
  :mod:`.triton.replay` records), nothing is kept: a later call looks again;
* otherwise (no replay: the reference, the native CPU kernels; a refused plan; several
  launches' functions; a result made by torch after the launch) the key is marked
  refused and its calls run as written, at the cost of the lookup.

Only the calls whose result can depend on nothing else are looked up: scores a plain
``Tensor`` on a device of :data:`DEVICE_TYPES` (CUDA) with triton installed, no gradient recorded, nothing
:func:`attnorm.kernels.ops.watched` (``torch.compile``, ``torch.func``, dispatch and
function modes, ``jit.trace``, autocast, the profiler), no forward-mode level, no CUDA
graph capture, the direct launch on and no launch hook or recording under way; and
modules of attnorm's own classes whose parameters are all numbers (a tensor parameter,
learnable or per head, is read by the kernel: not a function of the key).  A module's
state is a **token** it holds: any attribute assignment, buffer or parameter
registration or state-dict load replaces it (:func:`forget`).  At most
:data:`MAX_ENTRIES` keys are kept; past it the table starts over.  :func:`clear` (called
by :func:`attnorm.kernels.triton.replay.clear`) forgets every key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd import forward_ad

from attnorm.kernels import backends, fast_launch, ops

__all__ = ["DEVICE_TYPES", "MAX_ENTRIES", "call", "clear", "entries", "forget", "note"]

DEVICE_TYPES = frozenset({"cuda"})
"""Devices whose calls are replayed (the direct-launch stand-ins of the tests and of
``scripts/launch_overhead.py`` add ``"cpu"``); :mod:`.triton.replay` reads it too."""
MAX_ENTRIES = 1024
"""Most keys kept; past it the table is emptied (a process meeting ever new shapes)."""
_TABLE: dict[tuple, Any] = {}
_REFUSED = object()
"""A key whose calls run as written."""
_NEVER = object()
"""The token of a module that is never looked up (a tensor parameter, a class from outside attnorm)."""
_TOKEN = "_shortcut_token"
_STATE = threading.local()


class _Replay:
    """What a kept key replays: ``replay(plan, [scores], stream)``, or its first item when ``first``."""

    __slots__ = ("first", "plan", "replay")

    def __init__(self, replay: Callable[[Any, list[Tensor], int], Any], plan: Any, first: bool) -> None:
        self.replay, self.plan, self.first = replay, plan, first


def clear() -> None:
    """Forget every key."""
    _TABLE.clear()


def entries() -> tuple[int, int]:
    """``(replayed, refused)``: how many keys replay a plan, and how many run as written."""
    refused = sum(entry is _REFUSED for entry in _TABLE.values())
    return len(_TABLE) - refused, refused


def forget(module: torch.nn.Module) -> None:
    """Give ``module`` a new state token (its attributes, buffers or parameters changed)."""
    module.__dict__[_TOKEN] = None


def _token(module: torch.nn.Module) -> object:
    token = module.__dict__.get(_TOKEN)
    if token is None:
        params = module.kernel_params()
        own = type(module).__module__.startswith("attnorm.")
        token = object() if own and not any(isinstance(v, Tensor) for v in params.values()) else _NEVER
        module.__dict__[_TOKEN] = token
    return token


def note(kind: str, plan: Any = None, inputs: list[Tensor] | None = None, result: Any = None) -> None:
    """Tell the call being looked up (if any, in this thread) what a replayed function did.

    ``kind``: ``"replay"`` (``plan`` replayed on ``inputs``, giving ``result``), ``"pending"``
    (a key's first or recorded call), ``"other"`` (run as written).
    """
    notes = getattr(_STATE, "notes", None)
    if notes is not None:
        weights = result[0] if type(result) is tuple and result and isinstance(result[0], Tensor) else result
        version = fast_launch.version(weights) if isinstance(weights, Tensor) else None
        notes.append((kind, plan, inputs, result, version))


def _looked_up(x: Tensor) -> bool:
    """Whether a call on scores ``x`` may be looked up (the module doc's conditions)."""
    if type(x) is not Tensor or not fast_launch._ENABLED or x.device.type not in DEVICE_TYPES:
        return False
    if not backends.triton_installed():  # nothing is replayed, and the knobs below would import triton
        return False
    if torch.is_grad_enabled() and x.requires_grad or ops.watched() or forward_ad._current_level >= 0:
        return False
    if getattr(_STATE, "notes", None) is not None or fast_launch.recording() is not None or fast_launch._hooked():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def call(module: torch.nn.Module, x: Tensor, run: Callable[[Tensor], Tensor]) -> Tensor:
    """``run(x)``, the module's call on scores ``x`` as written, or the replay it is known to end in."""
    if not _looked_up(x):
        return run(x)
    token = _token(module)
    if token is _NEVER:
        return run(x)
    knobs = fast_launch._knobs()
    device, stream = fast_launch._device_and_stream()
    key = (token, x.dtype, x.shape, x.stride(), x.device, x.data_ptr() % 16 == 0, backends._default_backend,
           device, stream, knobs.runtime.debug, knobs.compilation.instrumentation_mode)
    entry = _TABLE.get(key)
    if entry is not None:
        if entry is _REFUSED:
            return run(x)
        result = entry.replay(entry.plan, [x], stream)
        return result[0] if entry.first else result
    notes: list = []
    _STATE.notes = notes
    try:
        out = run(x)
    finally:
        _STATE.notes = None
    entry = _entry(notes, x, out)
    if entry is not None:
        if len(_TABLE) >= MAX_ENTRIES:
            _TABLE.clear()
        _TABLE[key] = entry
    return out


def _entry(notes: list, x: Tensor, out: Tensor) -> _Replay | object | None:
    """What a key keeps after a call that made ``notes`` and returned ``out`` (the module doc's rules)."""
    if any(kind == "pending" for kind, *_ in notes):
        return None
    if len(notes) != 1 or notes[0][0] != "replay":
        return _REFUSED
    _, (replay, plan), inputs, result, version = notes[0]
    if len(inputs) != 1 or inputs[0] is not x or version is None or fast_launch.version(out) != version:
        return _REFUSED
    if out is result:
        return _Replay(replay, plan, False)
    if type(result) is tuple and result and out is result[0]:
        return _Replay(replay, plan, True)
    return _REFUSED
