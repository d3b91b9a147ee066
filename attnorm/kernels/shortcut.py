"""A normalizer module's repeated eager call sent straight to its replayed kernel launch (CUDA).

With :mod:`attnorm.kernels.fast_launch` on, a Triton backend function's repeated call is
already a replay (:mod:`attnorm.kernels.triton.replay`): outputs allocated, compiled
kernels launched with the recorded arguments.  What is left of a 4x16 module call is the
Python *above* that function, the same for every call of a given module on a given
tensor layout: :func:`attnorm.normalizers.base.normalize`'s checks, the backend's
resolution, :func:`attnorm.kernels.autograd._lane`'s tests, the parameters' packing,
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

**With a gradient** (scores that require grad, grad mode on) the call ends in a row
Function of :mod:`attnorm.kernels.autograd` instead, whose forward runs the op.  Such a
key is kept when the recorded call was exactly: the Function applied to the scores
themselves and numbers, strings or None (no tensor besides the scores), its forward one
replay on the scores alone whose outputs the op returned as they were (or an absent
per-row output, a fresh empty tensor), and the module returned the Function's first
output untouched.  Later calls apply the same Function to the new scores with the kept
arguments, and its forward (:func:`take`) replays the plan in place of the op's layers:
autograd records the node, ``setup_context`` saves what the backward reads, and the
backward runs as it always does (a third of the stand-in's call goes, 16.8-20.5 -> 11.3-13.2 us;
the H200 read 58-68 us before, against a bare op's 32 and a goal of 1.5x).

Only the calls whose result can depend on nothing else are looked up: scores a plain
``Tensor`` on a device of :data:`DEVICE_TYPES` (CUDA) with triton installed, nothing
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

__all__ = ["DEVICE_TYPES", "MAX_ENTRIES", "apply_with", "call", "clear", "entries", "forget", "listening", "note",
           "note_apply", "note_outputs", "take"]

DEVICE_TYPES = frozenset({"cuda"})
"""Devices whose calls are replayed (the direct-launch stand-ins of the tests and of
``scripts/launch_overhead.py`` add ``"cpu"``); :mod:`.triton.replay` reads it too."""
MAX_ENTRIES = 1024
"""Most keys kept; past it the table is emptied (a process meeting ever new shapes)."""
_TABLE: dict[tuple, Any] = {}
_REFUSED = object()
"""A key whose calls run as written."""


class _Never:
    """The token of a module that is never looked up; one object, kept by ``copy.deepcopy`` and pickling.

    A module's token travels in its ``__dict__``: a plain ``object()`` here came back from a deep copy or a
    pickle round trip as a new object, which :func:`_token` took for an ordinary state token, and such a
    copy's calls were looked up and replayed after a change the key does not see.
    """

    def __copy__(self) -> _Never:
        return self

    def __deepcopy__(self, memo: dict) -> _Never:
        return self

    def __reduce__(self) -> str:
        return "_NEVER"


_NEVER = _Never()
"""The token of a module that is never looked up (a tensor parameter, a class from outside attnorm)."""
_TOKEN = "_shortcut_token"
_STATE = threading.local()


_OFF, _NO_GRAD, _GRAD = 0, 1, 2
"""What :func:`_mode` says of a call: not looked up, looked up without a gradient, with one."""


class _Replay:
    """What a kept key replays: ``replay(plan, [scores], stream)``, or its first item when ``first``."""

    __slots__ = ("first", "plan", "replay")

    def __init__(self, replay: Callable[[Any, list[Tensor], int], Any], plan: Any, first: bool) -> None:
        self.replay, self.plan, self.first = replay, plan, first


class _GradReplay:
    """What a kept key with a gradient applies: ``function.eager_apply(scores, *args)``, its forward a replay.

    ``picks``: per output of the op, ``(index, None)`` for item ``index`` of the replay's result,
    ``(-1, dtype)`` for an absent per-row output (a fresh empty tensor of ``dtype``).
    """

    __slots__ = ("args", "function", "picks", "plan", "replay")

    def __init__(self, function: type, args: tuple, replay: Callable[[Any, list[Tensor], int], Any], plan: Any,
                 picks: tuple[tuple[int, torch.dtype | None], ...]) -> None:
        self.function, self.args, self.replay, self.plan, self.picks = function, args, replay, plan, picks

    def outputs(self, x: Tensor, stream: int) -> tuple[Tensor, ...]:
        """The op's outputs on scores ``x``: the plan replayed, absent outputs made afresh."""
        result = self.replay(self.plan, [x], stream)
        items = result if type(result) is tuple else (result,)
        return tuple([items[i] if i >= 0 else (x.new() if dtype is x.dtype else x.new_empty(0, dtype=dtype))
                      for i, dtype in self.picks])


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


def listening() -> bool:
    """Whether a call is being looked up in this thread (its notes are wanted)."""
    return getattr(_STATE, "notes", None) is not None


def note_apply(function: type, args: tuple, first: Tensor) -> None:
    """Tell the call being looked up that ``function.eager_apply(*args)`` ran and gave ``first`` first."""
    _STATE.notes.append(("apply", function, args, first))


def note_outputs(outputs: Any) -> None:
    """Tell the call being looked up what a row Function's forward returned (the op's outputs)."""
    _STATE.notes.append(("outputs", outputs))


def apply_with(function: type, args: tuple, pending: tuple[_GradReplay, int] | Callable[..., Any]) -> Any:
    """``function.eager_apply(*args)``, its forward running ``pending`` in place of its op (:func:`take`).

    ``pending``: ``(entry, stream)``, a kept key's replay; or the op's device kernel itself
    (:func:`attnorm.kernels.ops.kernel`), for a plain eager call its caller has already checked
    (:func:`attnorm.kernels.autograd._lane`).
    """
    _STATE.pending = pending
    try:
        return function.eager_apply(*args)
    finally:
        _STATE.pending = None


def take() -> tuple[_GradReplay, int] | Callable[..., Any] | None:
    """What a row Function's forward is to run in place of its op, once (:func:`apply_with`), or None."""
    pending = getattr(_STATE, "pending", None)
    if pending is not None:
        _STATE.pending = None
    return pending


def _mode(x: Tensor) -> int:
    """How a call on scores ``x`` may be looked up (the module doc's conditions): ``_OFF``, ``_NO_GRAD``, ``_GRAD``."""
    # x.is_cpu first: x.device builds a device object (~0.2 us of a CPU call, where nothing is replayed).
    if type(x) is not Tensor or not fast_launch._ENABLED or x.is_cpu and "cpu" not in DEVICE_TYPES:
        return _OFF
    if x.device.type not in DEVICE_TYPES or not ops.plain_tensor(x):  # e.g. a negative view: the dispatcher resolves it
        return _OFF
    if not backends.triton_installed():  # nothing is replayed, and the knobs below would import triton
        return _OFF
    if ops.watched() or forward_ad._current_level >= 0:
        return _OFF
    if getattr(_STATE, "notes", None) is not None or fast_launch.recording() is not None or fast_launch._hooked():
        return _OFF
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return _OFF
    return _GRAD if x.requires_grad and torch.is_grad_enabled() else _NO_GRAD


def call(module: torch.nn.Module, x: Tensor, run: Callable[[Tensor], Tensor]) -> Tensor:
    """``run(x)``, the module's call on scores ``x`` as written, or the replay it is known to end in."""
    mode = _mode(x)
    if mode == _OFF:
        return run(x)
    token = _token(module)
    if token is _NEVER:
        return run(x)
    if mode == _GRAD:  # as the row Functions' callers do: tensors escaped from a finished torch.func call
        x = torch._C._functorch.unwrap_if_dead(x)
    knobs = fast_launch._knobs()
    device, stream = fast_launch._device_and_stream()
    key = (token, mode, x.dtype, x.shape, x.stride(), x.device, x.data_ptr() % 16 == 0, backends._default_backend,
           device, stream, knobs.runtime.debug, knobs.compilation.instrumentation_mode)
    entry = _TABLE.get(key)
    if entry is not None:
        if entry is _REFUSED:
            return run(x)
        if mode == _GRAD:
            return apply_with(entry.function, (x, *entry.args), (entry, stream))[0]
        result = entry.replay(entry.plan, [x], stream)
        return result[0] if entry.first else result
    notes: list = []
    _STATE.notes = notes
    try:
        out = run(x)
    finally:
        _STATE.notes = None
    entry = _grad_entry(notes, x, out) if mode == _GRAD else _entry(notes, x, out)
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


def _grad_entry(notes: list, x: Tensor, out: Tensor) -> _GradReplay | object | None:
    """What a key with a gradient keeps after a call that made ``notes`` and returned ``out`` (module doc)."""
    if any(note[0] == "pending" for note in notes):
        return None
    kinds = [note[0] for note in notes]
    if kinds != ["replay", "outputs", "apply"]:
        return _REFUSED
    (_, (replay, plan), inputs, result, version), (_, outputs), (_, function, args, first) = notes
    if len(inputs) != 1 or inputs[0] is not x or args[0] is not x or first is not out or type(outputs) is not tuple:
        return _REFUSED
    if any(isinstance(arg, Tensor) for arg in args[1:]):
        return _REFUSED  # the Function would read a tensor the key does not hold
    items = result if type(result) is tuple else (result,)
    picks = []
    for output in outputs:
        index = next((i for i, item in enumerate(items) if item is output), -1)
        if index >= 0:
            picks.append((index, None))
        elif isinstance(output, Tensor) and output.shape == (0,):
            picks.append((-1, output.dtype))
        else:
            return _REFUSED  # made or changed by torch after the launch
    if picks[0] != (0, None) or version is None or fast_launch.version(outputs[0]) != version:
        return _REFUSED
    return _GradReplay(function, tuple(args[1:]), replay, plan, tuple(picks))
