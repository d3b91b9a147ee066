"""The direct launch (attnorm.kernels.fast_launch) against Triton's own binder, and against Triton's launch on CUDA.

Off CUDA no kernel runs: the kernels are real ``JITFunction`` objects, but their
``run`` (Triton's path) and the compiled kernel's launcher are stand-ins that record
what they are given.  The references are Triton's own generated binder (what
``JITFunction.run`` binds and specialises) and ``inspect.Signature``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.runtime import jit  # noqa: E402

from attnorm.kernels import fast_launch, inductor  # noqa: E402


def _body(X, Y, n, scale: tl.float64, flag, BLOCK: tl.constexpr, ACC: tl.constexpr = tl.float32, extra=3):
    pass


def make_kernel():
    """A real JITFunction (built directly: under the interpreter ``triton.jit`` would return another kind)."""
    return jit.JITFunction(_body)


def triton_binding(kernel, args, kwargs):
    """``(bound values, specialisation, options)`` from Triton's own generated binder (no GPU needed)."""
    binder = jit.create_function_from_signature(kernel.signature, kernel.params, CUDABackend)
    params, specialization, options = binder(*args, **kwargs)
    return list(params.values()), [tuple(part) for part in specialization], options


class Compiled:
    """A stand-in compiled kernel: its launcher records each call."""

    function, packed_metadata = "function handle", ("packed",)

    def __init__(self):
        self.calls = []

    @property
    def run(self):
        return lambda *call: self.calls.append(call)


@pytest.fixture
def switched_on(monkeypatch):
    monkeypatch.setattr(fast_launch, "_ENABLED", True)
    monkeypatch.setattr(fast_launch, "_KEPT", {})
    monkeypatch.setattr(fast_launch, "_device_and_stream", lambda: (0, 1234))


def test_bound_arguments_are_tritons(switched_on):
    kernel = make_kernel()
    x = torch.zeros(8)
    cases = [
        ((x, x, 16, 0.5, True), dict(BLOCK=64, num_warps=4)),
        ((x,), dict(Y=x, n=3, scale=1.0, flag=False, BLOCK=16, ACC=tl.float64, extra=5, num_stages=2)),
        ((x, x, 1, 0.5, True, 32, tl.float16, 7), {}),
    ]
    for args, kwargs in cases:
        values, _, _ = triton_binding(kernel, args, kwargs)
        bound = fast_launch.bind(kernel, args, kwargs)
        assert len(bound) == len(values) and all(a is b for a, b in zip(bound, values, strict=True))
        parameters = kernel.signature.parameters
        signature = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in parameters})
        signature.apply_defaults()
        assert list(bound) == list(signature.arguments.values())
    with pytest.raises(TypeError, match="a missing argument"):
        fast_launch.bind(kernel, (x, x, 1), {})
    assert fast_launch.key(kernel, 0, (x, x, 1), {}) is None  # Triton's path raises its own error


def test_key_is_finer_than_tritons_specialisation():
    """Two launches with one key always get one Triton specialisation and one set of options."""
    kernel = make_kernel()
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], base.to(torch.float16), base.to(torch.float16)[8:]]
    ints = [0, 1, 2, 15, 16, 17, 32, -16, 2**31, 2**40]
    by_key = {}
    for x, y, n, flag, block, warps in itertools.product(tensors, tensors[:2], ints, (True, False), (16, 64), (4, 8)):
        kwargs = dict(BLOCK=block, num_warps=warps)
        args = (x, y, n, 0.25, flag)
        launch_key = fast_launch.key(kernel, 0, args, kwargs)
        _, specialization, options = triton_binding(kernel, args, kwargs)
        seen = by_key.setdefault(launch_key, (specialization, options))
        assert seen == (specialization, options), (launch_key, seen, specialization)
    assert len(by_key) > 1
    assert fast_launch.key(kernel, 0, (base, (1, 2), 1, 0.5, True), {"BLOCK": 16}) is None  # a tuple: not taken
    assert fast_launch.key(kernel, 0, (base, base, 1, 0.5, True), {"BLOCK": 16}) != fast_launch.key(
        kernel, 1, (base, base, 1, 0.5, True), {"BLOCK": 16})  # another device


def test_lengths_share_a_key_within_tritons_integer_classes():
    """Integers of non-constexpr parameters count by Triton's classes: 15 and 17 share a key, 16 and 17 do not;
    a constexpr keeps its value (16 and 32 are two keys), and every key still maps to one specialisation."""
    kernel = make_kernel()
    base = torch.zeros(64, dtype=torch.float32)
    ints = [0, 1, 2, 15, 16, 17, 31, 32, 48, -16, -17, 2**31 - 1, 2**31, 2**31 + 16, 2**40, 2**40 + 1, 2**63, 2**63 + 1]
    by_key = {}
    for n, extra in itertools.product(ints, (3, 16, 17)):
        args, kwargs = (base, base, n, 0.25, True), dict(BLOCK=16, num_warps=4, extra=extra)
        _, specialization, options = triton_binding(kernel, args, kwargs)
        seen = by_key.setdefault(fast_launch.key(kernel, 0, args, kwargs), (specialization, options))
        assert seen == (specialization, options), (n, extra, seen, specialization)
    assert len(by_key) < len(ints) * 3

    def key(n, block=16):
        return fast_launch.key(kernel, 0, (base, base, n, 0.25, True), {"BLOCK": block})

    assert key(15) == key(17) == key(1001) != key(16) == key(32) != key(1)
    assert key(17, block=16) != key(17, block=32)


def test_integer_of_a_known_class_launches_directly(switched_on, monkeypatch):
    """A new length of a class already compiled (a growing KV cache) takes the direct launch, not Triton's path."""
    kernel = make_kernel()
    compiled, triton_calls = Compiled(), []
    monkeypatch.setattr(kernel, "run", lambda *args, grid, warmup, **kwargs: triton_calls.append(args) or compiled)
    x = torch.zeros(8)
    fast_launch.launch(kernel, (1,), (x, x, 17, 0.5, True), {"BLOCK": 64})
    for n in (19, 33, 1000001):
        fast_launch.launch(kernel, (2,), (x, x, n, 0.5, True), {"BLOCK": 64})
    assert len(triton_calls) == 1 and [call[9 + 2] for call in compiled.calls] == [19, 33, 1000001]
    fast_launch.launch(kernel, (2,), (x, x, 48, 0.5, True), {"BLOCK": 64})  # divisible by 16: another class
    fast_launch.launch(kernel, (2,), (x, x, 1, 0.5, True), {"BLOCK": 64})  # 1: Triton makes it a constant
    fast_launch.launch(kernel, (2,), (x, x, 17, 0.5, True), {"BLOCK": 32})  # another constexpr value
    assert len(triton_calls) == 4


def test_first_launch_is_tritons_then_direct(switched_on, monkeypatch):
    kernel = make_kernel()
    compiled, triton_calls = Compiled(), []

    def run(*args, grid, warmup, **kwargs):
        triton_calls.append((grid, args, kwargs))
        return compiled

    monkeypatch.setattr(kernel, "run", run)
    wrapped = inductor.launchable(kernel)
    assert isinstance(wrapped, fast_launch._Direct)
    x, y = torch.zeros(8), torch.ones(8)
    wrapped[(3, 2)](x, y, 16, 0.5, True, BLOCK=64, num_warps=4)
    assert len(triton_calls) == 1 and compiled.calls == [] and fast_launch.kept() == 1
    wrapped[(5,)](y, x, 16, 0.5, True, BLOCK=64, num_warps=4)  # same key: other tensors, other grid
    assert len(triton_calls) == 1
    values, _, _ = triton_binding(kernel, (y, x, 16, 0.5, True), {"BLOCK": 64, "num_warps": 4})
    (call,) = compiled.calls
    assert call[:9] == (5, 1, 1, 1234, "function handle", ("packed",), None, None, None)
    assert all(a is b for a, b in zip(call[9:], values, strict=True)) and len(call) == 9 + len(values)
    wrapped[(5,)](y, x, 17, 0.5, True, BLOCK=64, num_warps=4)  # another integer: Triton's path again
    assert len(triton_calls) == 2 and fast_launch.kept() == 2
    wrapped[lambda meta: (1,)](y, x, 16, 0.5, True, BLOCK=64, num_warps=4)  # a grid function: Triton's path
    assert len(triton_calls) == 3 and len(compiled.calls) == 1


def test_launch_hooks_and_the_switch_take_tritons_path(switched_on, monkeypatch):
    from triton import knobs

    kernel = make_kernel()
    compiled, triton_calls = Compiled(), []
    monkeypatch.setattr(kernel, "run", lambda *args, grid, warmup, **kwargs: triton_calls.append(1) or compiled)
    x = torch.zeros(8)
    for _ in range(2):
        fast_launch.launch(kernel, (1,), (x, x, 16, 0.5, True), {"BLOCK": 64})
    assert len(triton_calls) == 1 and len(compiled.calls) == 1
    chain = knobs.HookChain()
    chain.add(lambda *args: None)
    for hook in (lambda *args: None, chain):  # a hook function (older Triton), a chain holding one
        monkeypatch.setattr(knobs.runtime, "launch_exit_hook", hook)
        fast_launch.launch(kernel, (1,), (x, x, 16, 0.5, True), {"BLOCK": 64})
    assert len(triton_calls) == 3 and len(compiled.calls) == 1
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", knobs.HookChain())  # empty: no hook
    fast_launch.launch(kernel, (1,), (x, x, 16, 0.5, True), {"BLOCK": 64})
    assert len(triton_calls) == 3 and len(compiled.calls) == 2
    monkeypatch.setattr(fast_launch, "_ENABLED", False)
    assert inductor.launchable(kernel) is kernel
    assert fast_launch.launcher(lambda: None) is not None  # not a JITFunction: itself
    with pytest.raises(TypeError, match="must be a bool"):
        fast_launch.set_enabled(1)


def test_nothing_is_kept_past_the_limit(switched_on, monkeypatch):
    kernel = make_kernel()
    monkeypatch.setattr(fast_launch, "MAX_KEPT", 2)
    monkeypatch.setattr(kernel, "run", lambda *args, grid, warmup, **kwargs: Compiled())
    x = torch.zeros(8)
    for n in range(4):
        fast_launch.launch(kernel, (1,), (x, x, n, 0.5, True), {"BLOCK": 64})
    assert fast_launch.kept() == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_results_equal_triton_launch(monkeypatch):
    """Row kernels (forward, backward), decoding and a fused attention: the direct launch and its replays
    (:mod:`attnorm.kernels.triton.replay`) give Triton's launch's results, call after call, and a CUDA
    graph captured with them replays them too."""
    import attnorm
    from attnorm.kernels.triton import replay

    monkeypatch.setattr(fast_launch, "_KEPT", {})
    monkeypatch.setattr(replay, "_PLANS", OrderedDict())
    x = torch.randn(6, 300, device="cuda", requires_grad=True)
    g = torch.randn(6, 300, device="cuda")
    q, k, v = (torch.randn(2, 4, 130, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    modules = [attnorm.Sparsemax(backend="triton"), attnorm.Entmax(1.5, backend="triton"),
               attnorm.TopKSoftmax(7, backend="triton"), attnorm.SelfAdjustedSoftmax(backend="triton"),
               attnorm.ScalableSoftmax(backend="triton"), attnorm.Softmax(0.5, backend="triton")]

    def outputs():
        rows = [module(x) for module in modules]
        grads = [torch.autograd.grad(y, x, g)[0] for y in rows]
        with torch.no_grad():
            plain = [module(x) for module in modules]
            fused = [attnorm.attention(q, k, v, module, is_causal=True) for module in modules]
            decoding = [attnorm.attention(q[:, :, -1:], k, v, module) for module in modules]
        return [y.detach() for y in rows] + grads + plain + fused + decoding

    expected = outputs()
    monkeypatch.setattr(fast_launch, "_ENABLED", True)
    for _ in range(3):  # the first call keeps the kernels and records, the next launch them directly
        for got, want in zip(outputs(), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert fast_launch.kept() > 0 and replay.planned()[0] > 0
    module, scores = modules[0], torch.randn(6, 300, device="cuda")
    with torch.no_grad():
        module(scores)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.graph(graph, stream=stream):
            captured = module(scores)
    scores.copy_(x.detach())
    graph.replay()
    torch.testing.assert_close(captured, expected[12], rtol=0, atol=0)
