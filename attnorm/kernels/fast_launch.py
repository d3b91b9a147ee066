"""A launch path that skips Triton's per-call binding once a kernel variant is compiled (CUDA, on by default).

``kernel[grid](*args, **kwargs)`` costs tens of microseconds of host time in Triton
(``JITFunction.run``): it binds the arguments to the signature, specialises each one
(dtype, 16-byte alignment, integers equal to 1 or divisible by 16) in C, hashes the
specialisation into a cache key, evaluates the launch metadata and only then calls the
compiled kernel's launcher.  Profiled on an H200 (``scripts/profile_overhead.py``,
``benchmarks/results/profile_overhead_h200_04232f7.txt``) that is ~45 of a sparsemax
call's ~140 profiled microseconds; the eager-overhead goal is 25 in all.

With the switch on (the default; ``ATTNORM_FAST_LAUNCH=0`` in the environment or :func:`set_enabled` turns it off),
:func:`launcher` wraps a ``JITFunction``: its first launch with a given **key** goes
through Triton unchanged, and the compiled kernel Triton returns is kept under that key;
later launches with the key call the compiled kernel's launcher directly, with the
arguments bound to the signature the way Triton binds them (positional, then keywords,
then defaults: ``inspect.Signature.bind`` + ``apply_defaults``, which Triton's generated
binder is equivalent to).  The key is strictly finer than Triton's specialisation, so a
kept kernel is always the one Triton would pick:

* each tensor: its dtype and whether its data pointer is 16-byte aligned (Triton's
  pointer specialisation), never its values;
* an integer bound to a parameter that is not a ``tl.constexpr``: only what Triton
  specialises it on (equal to 1, divisible by 16, within int32, within int64:
  :func:`_int_classes`; a test holds the key to Triton's own binder, under Triton 3.6
  and 3.9), so lengths, strides and counts that change from call to call (a KV cache one
  key longer every decoding step) keep the key of the kernel already compiled for them;
* every other argument and option (``num_warps``, ``num_stages``, constexprs, floats,
  bools): its exact type and value (Triton keys floats by type alone: more keys, no wrong one);
* the kernel, the current CUDA device, and Triton's ``debug`` and instrumentation knobs.

Not taken (Triton's own path, every time): off CUDA (the interpreter's functions are not
``JITFunction`` objects), while a launch hook is installed (a profiler such as Proton
reads the launch metadata this path does not compute; Triton's empty hook chains are
passed to the launcher as None, which it reads as "no hook"), for a grid given as a
function, for an argument of another kind (a ``TensorDescriptor``, a tuple), and once
:data:`MAX_KEPT` kernels are kept.  The kept kernels are never dropped: each is a
compiled variant Triton keeps anyway.

**Replay.**  With the switch on, the Triton backend functions go one step further
(:mod:`attnorm.kernels.triton.replay`): a call is recorded once per metadata key (its
outputs from ``launch.empty``, its launches here: :class:`Recording`), and later calls with
the key allocate the outputs and call :func:`direct_call` with the recorded arguments,
skipping the launcher Python too.  A kernel launched past this module (Triton's path for a
hook or a grid function, a kernel that is not a ``JITFunction``) spoils the recording.

**Status.**  On by default since 2026-11-27 (346fb76 measured on an H200): the direct launch and the
replay passed ``tests/kernels/test_fast_launch.py`` and the row, decoding and attention suites
(621 tests) on CUDA with the switch on, and took a 4x16 module call from 114-148 us to 44-62 us
without grad there (``benchmarks/bench_overhead.py --device cuda --triton-launch`` times both).
``tests/kernels/test_replay.py`` runs every replayed call's recorded arguments through the
interpreted kernels against the functions run as written; ``ATTNORM_FAST_LAUNCH=0`` gives
Triton's own launch for every call.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from operator import itemgetter
from typing import Any, NamedTuple

import torch

from attnorm.validation import check_bool

__all__ = ["MAX_KEPT", "Recording", "direct_call", "enabled", "kept", "launcher", "recording", "set_enabled",
           "version"]

MAX_KEPT = 4096
"""Most compiled kernels kept (one per key), and most call shapes planned; past it, launches take Triton's path."""

_ENABLED = os.environ.get("ATTNORM_FAST_LAUNCH", "1") != "0"
_KEPT: dict[tuple, Any] = {}
_PLANS: dict[tuple, Any] = {}
_MISSING = inspect.Parameter.empty
_SCALARS = frozenset((bool, int, float, str, type(None)))
_KNOBS: Any = None
_JIT_FUNCTION: Any = None
_check_switch = check_bool("value")
_STATE = threading.local()


class _Plan(NamedTuple):
    """How to read one call shape's values: ``values`` is ``(*args, *kwargs.values(), *defaults)``.

    ``scalars``: the values the key holds as they are; ``ints``: the integers bound to
    parameters that are not ``tl.constexpr``, which it holds by class (:func:`_int_classes`).
    """

    tensors: Callable[[tuple], tuple]
    scalars: Callable[[tuple], tuple]
    order: Callable[[tuple], tuple]
    defaults: tuple[Any, ...]
    ints: Callable[[tuple], tuple]


def _getter(positions: list[int]) -> Callable[[tuple], tuple]:
    """``values -> tuple(values[p] for p in positions)`` at C speed (one position: ``itemgetter`` gives no tuple)."""
    if len(positions) > 1:
        return itemgetter(*positions)
    if positions:
        one = itemgetter(positions[0])
        return lambda values: (one(values),)
    return lambda values: ()


def _make_plan(kernel: Any, kinds: tuple[type, ...], positional: int, names: tuple[str, ...]) -> _Plan | None:
    """The plan of one call shape, or None: a parameter without a value, or a value of a kind not taken."""
    parameters = list(inspect.signature(kernel.fn).parameters.values())
    if positional > len(parameters):
        return None
    defaults = tuple(p.default for p in parameters)
    passed = len(kinds)
    keyword = {name: positional + i for i, name in enumerate(names)}
    order, specialised = [], set()
    kernel_params = getattr(kernel, "params", None)
    if kernel_params is not None and len(kernel_params) != len(parameters):
        kernel_params = None  # not Triton's list of this signature: every value keyed as it is
    for i, parameter in enumerate(parameters):
        if i < positional:
            order.append(i)
        elif parameter.name in keyword:
            order.append(keyword[parameter.name])
        elif parameter.default is not _MISSING:
            order.append(passed + i)
        else:
            return None  # Triton's path raises its own error
        if kernel_params is not None and getattr(kernel_params[i], "is_constexpr", True) is False:
            specialised.add(order[-1])  # Triton keys a value here by its type and specialisation, not itself
    tensors, scalars, ints = [], [], []
    for i, kind in enumerate(kinds):
        if issubclass(kind, torch.Tensor):
            tensors.append(i)
        elif kind is int and i in specialised:
            ints.append(i)
        elif kind in _SCALARS or kind.__module__.startswith("triton") and kind.__hash__ is not None:
            scalars.append(i)  # tl.dtype and tl.constexpr values of constexpr arguments are hashable
        else:
            return None  # a tuple, a TensorDescriptor, ...
    return _Plan(_getter(tensors), _getter(scalars), _getter(order), defaults, _getter(ints))


def _int_classes(values: tuple[int, ...]) -> tuple[int, ...]:
    """What Triton specialises each non-constexpr integer on: -1 for 1 itself (a constant to Triton), else bit 0
    divisibility by 16, bit 1 int32 range, bit 2 int64 range (Triton's ``i32``/``i64``/``u64``)."""
    return tuple([-1 if v == 1 else (v & 15 == 0) + 2 * (-2147483648 <= v < 2147483648)
                  + 4 * (-9223372036854775808 <= v < 9223372036854775808) for v in values])


def _planned(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, _Plan | None, tuple]:
    """``(plan key, plan or None, values)`` of a call: the plan is made once per kernel and call shape."""
    values = (*args, *kwargs.values())
    names = tuple(kwargs)
    plan_key = (id(kernel), len(args), names, tuple(map(type, values)))  # id: JITFunction hashes in Python
    plan = _PLANS.get(plan_key, _MISSING)
    if plan is _MISSING:
        plan = _make_plan(kernel, plan_key[3], len(args), names)
        if len(_PLANS) < MAX_KEPT:
            _PLANS[plan_key] = plan
    return plan_key, plan, values


def bind(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Every parameter's value in signature order (positional, keywords, defaults); options are left out.

    Raises:
        TypeError: a parameter without a value, or a value of a kind the direct path does not take.
    """
    _, plan, values = _planned(kernel, args, kwargs)
    if plan is None:
        raise TypeError(f"{getattr(kernel, '__name__', kernel)}: a missing argument or one of a kind not taken")
    return plan.order((*values, *plan.defaults))


def key(kernel: Any, device: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple | None:
    """The key of one launch (module docstring), or None when the direct path does not take the call.

    The call shape (kernel, positional count, keyword names, every value's type), each
    tensor's dtype and pointer alignment, every other value itself (a float ``0.0`` and
    ``-0.0`` share a key, which only the launched value tells apart; a NaN never matches, so
    takes Triton's path), the device and Triton's debug and instrumentation knobs.
    """
    plan_key, plan, values = _planned(kernel, args, kwargs)
    return None if plan is None else _key(plan_key, plan, values, device)


def _key(plan_key: tuple, plan: _Plan, values: tuple, device: int) -> tuple:
    knobs = _knobs()
    tensors = plan.tensors(values)
    return (plan_key, device, plan.scalars(values), _int_classes(plan.ints(values)), tuple([t.dtype for t in tensors]),
            tuple([t.data_ptr() % 16 == 0 for t in tensors]), knobs.runtime.debug,
            knobs.compilation.instrumentation_mode)


def _knobs() -> Any:
    """``triton.knobs``, imported on first use (this module loads without Triton)."""
    global _KNOBS
    if _KNOBS is None:
        from triton import knobs

        _KNOBS = knobs
    return _KNOBS


def enabled() -> bool:
    """Whether :func:`launcher` takes the direct launch."""
    return _ENABLED


def set_enabled(value: bool) -> None:
    """Turn the direct launch on or off (kept kernels stay kept)."""
    global _ENABLED
    _ENABLED = _check_switch(value)


def kept() -> int:
    """How many compiled kernels are kept."""
    return len(_KEPT)


def launcher(kernel: Any) -> Any:
    """``kernel`` itself, or with the switch on and ``kernel`` a ``JITFunction`` (CUDA), its direct launcher."""
    if not _ENABLED:
        return kernel
    global _JIT_FUNCTION
    if _JIT_FUNCTION is None:
        from triton.runtime.jit import JITFunction

        _JIT_FUNCTION = JITFunction
    if type(kernel) is _JIT_FUNCTION:
        return _Direct(kernel)
    _spoil()  # launched where no recording sees it
    return kernel


class _Direct:
    """``kernel[grid](*args, **kwargs)`` through the kept compiled kernel when its key is known."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return lambda *args, **kwargs: launch(self.kernel, grid, args, kwargs)


def _device_and_stream() -> tuple[int, int]:
    """The current CUDA device and its current stream's raw handle, as Triton's launch reads them."""
    device = torch.cuda.current_device()
    return device, torch._C._cuda_getCurrentRawStream(device)


def _hooked() -> bool:
    """Whether a launch hook is installed: a function, or a hook chain (Triton 3.5+) holding one."""
    runtime = _knobs().runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return enter is not None and getattr(enter, "calls", True) or leave is not None and getattr(leave, "calls", True)


def launch(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """One launch of ``kernel`` over ``grid``: direct when its key is kept, else Triton's (keeping what it compiles)."""
    if callable(grid) or _hooked():
        _spoil()
        kernel[grid](*args, **kwargs)
        return
    device, stream = _device_and_stream()
    plan_key, plan, values = _planned(kernel, args, kwargs)
    launch_key = None if plan is None else _key(plan_key, plan, values, device)
    compiled = None if launch_key is None else _KEPT.get(launch_key)
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if launch_key is not None and compiled is not None and len(_KEPT) < MAX_KEPT:
            _KEPT[launch_key] = compiled
        if plan is None:
            _spoil()
        else:
            _note_launch(compiled, grid, plan.order((*values, *plan.defaults)))
        return
    bound = plan.order((*values, *plan.defaults))
    _note_launch(compiled, grid, bound)
    direct_call(compiled, grid, stream, bound)


def direct_call(compiled: Any, grid: tuple[int, ...], stream: int, bound: tuple[Any, ...] | list[Any]) -> None:
    """Launch the compiled kernel ``compiled`` over ``grid`` on ``stream`` with every parameter's value ``bound``."""
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    # The launcher (a property: loads the module on first use); no launch metadata and no hooks.
    compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *bound)


# ---- recording the launches of one call (attnorm.kernels.triton.replay) ----------------------


class Recording:
    """What one call did, as :mod:`attnorm.kernels.triton.replay` reads it.

    Attributes:
        outputs: the fresh outputs the call allocated (noted by ``launch.empty``).
        launches: ``(compiled kernel, grid, bound values)`` of each launch, in order.
        usable: False once the call launched a kernel this module could not record.
    """

    __slots__ = ("launches", "outputs", "usable")

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []
        self.launches: list[tuple[Any, tuple[int, ...], tuple[Any, ...]]] = []
        self.usable = True


def version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter, 0 for an inference tensor (made under ``torch.inference_mode``, which has none).

    The counters tell a recording (:mod:`attnorm.kernels.triton.replay`) and the module shortcut
    (:mod:`attnorm.kernels.shortcut`) that a torch operation wrote a launched tensor or a result.  Under
    ``torch.inference_mode`` the outputs are inference tensors and the check cannot see such a
    write (reading ``_version`` raised there, so every eager Triton call under inference mode
    failed on CUDA); it rests on the function's code, the same in both modes, which the suite
    checks outside inference mode (``tests/kernels/test_replay.py``, ``ATTNORM_TEST_REPLAY=1``).
    """
    return 0 if tensor.is_inference() else tensor._version


def recording() -> Recording | None:
    """The recording under way in this thread, or None."""
    return getattr(_STATE, "recording", None)


def set_recording(value: Recording | None) -> None:
    """Start (a :class:`Recording`) or stop (None) recording this thread's launches."""
    _STATE.recording = value


def note_output(tensor: torch.Tensor) -> None:
    """A fresh output of the call being recorded, if one is."""
    current = getattr(_STATE, "recording", None)
    if current is not None:
        current.outputs.append(tensor)


def _note_launch(compiled: Any, grid: tuple[int, ...], bound: tuple[Any, ...]) -> None:
    current = getattr(_STATE, "recording", None)
    if current is not None:
        if compiled is None:
            current.usable = False
        else:
            current.launches.append((compiled, grid, bound))


def _spoil() -> None:
    current = getattr(_STATE, "recording", None)
    if current is not None:
        current.usable = False
