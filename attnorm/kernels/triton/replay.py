"""Host replay of a Triton backend function: its launches recorded once, then repeated without the Python between them.

An eager call of a row kernel on a tiny tensor spends its host time in attnorm's Python,
not in the GPU: the launcher of :func:`attnorm.kernels.triton.softmax.softmax_forward`
computes the row view, block sizes, mask and parameter arguments, the kept constants and
the launch key before it calls the compiled kernel (~75 of a ~90 us module call on a
slow CPU with a stand-in driver, ``scripts/launch_overhead.py``).  Every one of those
values follows from the call's *metadata* alone.  With :mod:`attnorm.kernels.fast_launch`
on, :func:`replayable` functions therefore run once under a recorder and keep a **plan**
per call key; a later call with that key allocates the outputs and calls the compiled
kernels' launchers with the recorded arguments, its tensors swapped in.  A key is recorded
the second time it is called (the first runs as written, :data:`MAX_SEEN`): shapes that
never repeat, such as a KV cache growing by a key per decoding step, cost no recording.

**The key** of a call: the function; for each tensor among the arguments (walking tuples
such as a ``RowMask``) its dtype, shape, strides, device and whether its data pointer is
16-byte aligned; every other argument's type and value (floats by their bits); the CUDA
device and stream; Triton's ``debug`` and instrumentation knobs.  A call whose arguments
hold anything else (a tensor subclass such as a fake or functorch tensor, though a
``Parameter`` counts as a tensor; a list, an object) is not keyed and runs as written, and
so is a call off the devices of :data:`attnorm.kernels.shortcut.DEVICE_TYPES` (CUDA).

**What a plan may hold**, checked when it is recorded; any other call is marked not
replayable and runs as written every time:

* launches through the direct launch only (no launch hook, no grid function, a
  ``JITFunction``; a kernel launched any other way spoils the recording);
* launch arguments that are tensors: a fresh output from :func:`.launch.empty` (matched
  by identity, else by data pointer: a view of it), an input tensor (by data pointer: a
  view of it, whose strides the key fixes and the launch passes as numbers) or a kept
  one-element constant (:func:`.launch.constant`); so a tensor made by any other torch
  operation (a copy, a cast, a ``contiguous``) refuses the plan.  When two inputs or two
  outputs share a data pointer, which one a launch read is ambiguous: nothing is kept
  and the next call is recorded afresh;
* outputs untouched by torch (their version counters unchanged: no in-place fill or
  ``out=``) and inputs unchanged;
* a result made of those outputs (as contiguous views), inputs, ``None`` and numbers.

Allocations are aligned (the caching allocator rounds blocks to 512 bytes), so their
pointer specialisation never changes.  Not recorded or replayed: under ``torch.compile``
or a tracer (tensors there are not plain), while a CUDA graph is being captured (a
constant made then is filled only at replay), with a launch hook installed, or with the
switch off.  At most :data:`MAX_PLANS` plans are kept, the least recently used dropped
first (a plan holds no tensor; its compiled kernels stay kept by :mod:`.fast_launch`).
:func:`clear` forgets them (after patching a module-level block size, say).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor
from torch.nn import Parameter

from attnorm.kernels import fast_launch, shortcut
from attnorm.kernels.rules import NO_MASK
from attnorm.kernels.triton import launch

__all__ = ["clear", "planned", "replayable"]

_F = TypeVar("_F", bound=Callable[..., Any])
_PLANS: OrderedDict[tuple, Any] = OrderedDict()
"""Plans by call key, least recently used first."""
_REFUSED = object()
"""The plan of a key whose recording was refused: the call runs as written."""
MAX_PLANS = 4096
"""Most plans kept; past it the least recently used is dropped.

Dropping matters: a process that meets many shapes (generation against a growing KV cache,
a new length every step; training on varying lengths) fills any table, and a full table
that kept its first plans forever recorded every later key's calls without keeping the
plan, so each such call cost a recording on top of the code as written (~120 against
~67 us, switch off, on the stand-in of ``scripts/launch_overhead.py``)."""
_SEEN: OrderedDict[tuple, None] = OrderedDict()
"""Keys called once and not recorded yet (see :data:`MAX_SEEN`), oldest first."""
MAX_SEEN = 1024
"""Keys remembered between a first call and a second; past it the oldest is forgotten.

A key is recorded on its second call, not its first.  A decoding step against a growing KV
cache has a new shape, so a new key, every step: with one attention layer that key never
comes back, and recording each one (a recording, a plan, a slot among :data:`MAX_PLANS`)
made such a step slower than running it as written; now it costs the key and one entry
here.  With many layers of one shape, the step's key comes back once per layer: the second
layer records it and the others replay it."""
_INPUT, _OUTPUT = 0, 1
Builder = Callable[[list[Tensor], list[Tensor]], Any]
"""``(outputs, inputs) -> part of the result`` of a replay."""


class _Launch(NamedTuple):
    """One recorded launch: the compiled kernel, its grid, its arguments and which of them are swapped in."""

    compiled: Any
    grid: tuple[int, ...]
    template: tuple[Any, ...]
    slots: tuple[tuple[int, int, int], ...]  # (position, _INPUT or _OUTPUT, index)


class _Plan(NamedTuple):
    outputs: tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]
    launches: tuple[_Launch, ...]
    result: Builder


def clear() -> None:
    """Forget every plan (and every key seen once), and the module calls that replay them (:mod:`..shortcut`)."""
    _PLANS.clear()
    _SEEN.clear()
    shortcut.clear()


def planned() -> tuple[int, int]:
    """``(replayable, refused)``: how many call keys have a plan, and how many were refused one."""
    refused = sum(plan is _REFUSED for plan in _PLANS.values())
    return len(_PLANS) - refused, refused


def _walk(value: Any, parts: list, inputs: list[Tensor]) -> bool:
    """Append ``value``'s key parts (and its tensors to ``inputs``); False when it cannot be keyed."""
    kind = type(value)
    if kind is Tensor or kind is Parameter:  # a learnable module's parameter, under no_grad
        parts.append((value.dtype, value.shape, value.stride(), value.device, value.data_ptr() % 16 == 0))
        inputs.append(value)
    elif kind is float:
        parts.append(value.hex())  # bits: -0.0 is not 0.0
    elif value is None or kind is bool or kind is int or kind is str:
        parts.append((kind, value))
    elif value is NO_MASK:  # the common mask, one part
        parts.append(NO_MASK)
    elif isinstance(value, tuple):
        parts.append(kind)
        for item in value:
            if not _walk(item, parts, inputs):
                return False
    else:
        return False
    return True


def _key(function: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, list[Tensor], int] | None:
    """``(key, input tensors, CUDA stream)`` of a call, or None when it is not keyed (module doc)."""
    parts: list = [function]
    inputs: list[Tensor] = []
    for value in args:
        if type(value) is Tensor:  # the common argument, without a call to _walk
            parts.append((value.dtype, value.shape, value.stride(), value.device, value.data_ptr() % 16 == 0))
            inputs.append(value)
        elif not _walk(value, parts, inputs):
            return None
    if kwargs:
        for name, value in kwargs.items():
            parts.append(name)
            if not _walk(value, parts, inputs):
                return None
    if not inputs or inputs[0].device.type not in shortcut.DEVICE_TYPES:
        return None  # the interpreter's kernels take no direct launch
    if inputs[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    knobs = fast_launch._knobs()
    device, stream = fast_launch._device_and_stream()
    parts.append((device, stream, knobs.runtime.debug, knobs.compilation.instrumentation_mode))
    return tuple(parts), inputs, stream


def _find(tensor: Tensor, tensors: list[Tensor]) -> int:
    """Index of ``tensor`` among ``tensors`` by identity, else by data pointer (a view); -1: none.

    A launch reads a tensor argument's data pointer alone (its dtype is the compiled
    kernel's, its strides are passed as numbers), so a view starting where a tensor starts
    (``rows_view``, a bool mask viewed as uint8) launches as that tensor.
    """
    for i, candidate in enumerate(tensors):
        if candidate is tensor:
            return i
    pointer = tensor.data_ptr()
    for i, candidate in enumerate(tensors):
        if candidate.data_ptr() == pointer:
            return i
    return -1


def _aliased(tensors: list[Tensor]) -> bool:
    """Whether two of ``tensors`` share a data pointer (a launch's tensor would match either)."""
    return len({t.data_ptr() for t in tensors}) != len(tensors)


def _builder(value: Any, outputs: list[Tensor], inputs: list[Tensor], shapes: dict[int, tuple[int, ...]]) -> Builder:
    """How to rebuild ``value`` from a replay's outputs and inputs; raises LookupError when it cannot be.

    A result that is a reshaped output (a kernel's ``(rows, L)`` output returned as ``x.shape``)
    is allocated in the result's shape at replay (``shapes``: output index -> the shape to
    allocate, the first the result asks for), so no view is made per call: the launches read
    its data pointer alone, and a contiguous tensor of the same size lays out the same.
    """
    if isinstance(value, Tensor):
        for i, candidate in enumerate(inputs):
            if candidate is value:
                return lambda outs, ins, i=i: ins[i]
        i = _find(value, outputs)
        if i < 0 or not value.is_contiguous() or value.numel() != outputs[i].numel():
            raise LookupError("a result that is not a fresh output")
        shape = tuple(value.shape)
        if shapes.setdefault(i, shape) == shape:
            return lambda outs, ins, i=i: outs[i]
        return lambda outs, ins, i=i, shape=shape: outs[i].view(shape)
    if type(value) is tuple:
        parts = tuple(_builder(item, outputs, inputs, shapes) for item in value)
        return lambda outs, ins: tuple([part(outs, ins) for part in parts])
    if value is None or type(value) in (bool, int, float):
        return lambda outs, ins, value=value: value
    raise LookupError("a result of another kind")


def _make_plan(record: fast_launch.Recording, inputs: list[Tensor], result: Any) -> _Plan | None:
    """The plan of a recorded call, or None where the recording shows something a replay would not repeat."""
    outputs = record.outputs
    if not record.usable or not record.launches or any(fast_launch.version(t) for t in outputs):
        return None  # a launch not recorded, none at all, or an output written by a torch operation
    constants = launch.kept_constants()
    launches = []
    for compiled, grid, values in record.launches:
        slots, template = [], list(values)
        for position, value in enumerate(values):
            if not isinstance(value, Tensor):
                continue
            i = _find(value, outputs)
            kind = _OUTPUT
            if i < 0:
                i, kind = _find(value, inputs), _INPUT
            if i >= 0:
                slots.append((position, kind, i))
                template[position] = None  # the plan keeps no tensor of this call alive
            elif id(value) not in constants:
                return None  # made by some torch operation of the call
        launches.append(_Launch(compiled, tuple(grid), tuple(template), tuple(slots)))
    shapes: dict[int, tuple[int, ...]] = {}
    try:
        result_builder = _builder(result, outputs, inputs, shapes)
    except LookupError:
        return None
    allocations = tuple((shapes.get(i, tuple(t.shape)), t.dtype, t.device) for i, t in enumerate(outputs))
    return _Plan(allocations, tuple(launches), result_builder)


def _replay(plan: _Plan, inputs: list[Tensor], stream: int) -> Any:
    empty = launch.empty
    outputs = [empty(shape, dtype, device) for shape, dtype, device in plan.outputs]
    for recorded in plan.launches:
        values = list(recorded.template)
        for position, kind, index in recorded.slots:
            values[position] = outputs[index] if kind == _OUTPUT else inputs[index]
        fast_launch.direct_call(recorded.compiled, recorded.grid, stream, values)
    return plan.result(outputs, inputs)


def _touch(key: tuple) -> None:
    """Mark ``key``'s plan as just used (another thread may have dropped it meanwhile)."""
    try:
        _PLANS.move_to_end(key)
    except KeyError:
        pass


def _keep(table: OrderedDict, key: tuple, value: Any, limit: int) -> None:
    """``table[key] = value``, first dropping the oldest entries past ``limit - 1``."""
    try:
        while len(table) >= limit:
            table.popitem(last=False)
    except KeyError:  # emptied by another thread meanwhile
        pass
    table[key] = value


def _recorded(function: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, fast_launch.Recording]:
    """``(function(*args, **kwargs), the recording of its launches and outputs)``."""
    record = fast_launch.Recording()
    fast_launch.set_recording(record)
    try:
        return function(*args, **kwargs), record
    finally:
        fast_launch.set_recording(None)


def replayable(function: _F) -> _F:
    """``function`` (a Triton backend function), replayed from its plan when :mod:`.fast_launch` is on (module doc)."""

    @functools.wraps(function)
    def replayed(*args: Any, **kwargs: Any) -> Any:
        if not fast_launch._ENABLED or fast_launch.recording() is not None or fast_launch._hooked():
            return function(*args, **kwargs)
        keyed = _key(function, args, kwargs)
        if keyed is None:
            shortcut.note("other")
            return function(*args, **kwargs)
        key, inputs, stream = keyed
        plan = _PLANS.get(key)
        if plan is not None:
            _touch(key)
            if plan is _REFUSED:
                shortcut.note("other")
                return function(*args, **kwargs)
            result = _replay(plan, inputs, stream)
            shortcut.note("replay", (_replay, plan), inputs, result)
            return result
        shortcut.note("pending")
        if key not in _SEEN:  # a first sighting: run as written; record if the key comes back
            _keep(_SEEN, key, None, MAX_SEEN)
            # under a recording nobody reads, so that the replayable functions it calls run as written
            # without keys of their own (their calls come back only as part of this one)
            return _recorded(function, args, kwargs)[0]
        versions = [fast_launch.version(t) for t in inputs]
        result, record = _recorded(function, args, kwargs)
        if _aliased(inputs) or _aliased(record.outputs):
            return result  # which tensor a launch read is ambiguous: record the next call afresh
        changed = versions != [fast_launch.version(t) for t in inputs]
        plan = None if changed else _make_plan(record, inputs, result)
        _SEEN.pop(key, None)
        _keep(_PLANS, key, _REFUSED if plan is None else plan, MAX_PLANS)
        return result

    return replayed  # type: ignore[return-value]
