"""Host replay of Triton backend functions (attnorm.kernels.triton.replay) against the same calls run as written.

No GPU is needed: the kernels become real ``JITFunction`` objects whose Triton path and
compiled launcher are stand-ins that run the interpreted kernel with the values they are
given (:mod:`tests.kernels.standin`).  So a replayed call computes for real, from nothing but its plan's recorded
arguments with the new call's tensors swapped in, and is compared with the interpreter
running the function as written (fast launch off), outputs poisoned with NaN first.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from attnorm.kernels import fast_launch, shortcut  # noqa: E402
from attnorm.kernels.rules import NO_MASK, RowMask  # noqa: E402
from attnorm.kernels.triton import entmax, launch, replay, self_adjusted, softmax, topk  # noqa: E402
from tests.conftest import REPLAY_CHECK, poisoned_empty  # noqa: E402
from tests.kernels import standin  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in runs the interpreter on CPU tensors")


@pytest.fixture
def replaying(monkeypatch):
    """Fast launch on with JIT kernels (:mod:`tests.kernels.standin`); yields ``(direct launches, replays)``."""
    launches = []
    standin.install(monkeypatch, launches)
    monkeypatch.setattr(fast_launch, "_KEPT", {})
    monkeypatch.setattr(replay, "_PLANS", OrderedDict())
    monkeypatch.setattr(replay, "_SEEN", OrderedDict())

    monkeypatch.setattr(launch, "empty", poisoned_empty)
    replays = []
    real_replay = replay._replay
    monkeypatch.setattr(replay, "_replay", lambda *args: replays.append(1) or real_replay(*args))
    yield launches, replays


def written(function, *args, **kwargs):
    """``function`` run as written: the switch off (outputs poisoned all the same)."""
    previous = fast_launch.enabled()
    fast_launch.set_enabled(False)
    try:
        return function(*args, **kwargs)
    finally:
        fast_launch.set_enabled(previous)


def assert_same(got, want):
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b)
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    else:
        assert got == want


def scores(shape, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator).to(dtype)
    x[..., 0] = -math.inf if shape[-1] > 2 else x[..., 0]
    return x


# (function, extra arguments, expected to replay): every call of the row functions' shapes
FORWARDS = [
    pytest.param(lambda x: softmax.softmax_forward(x, NO_MASK, 0, 0.5, 0.0, weights_only=True), True,
                 id="softmax-temperature"),
    pytest.param(lambda x: softmax.softmax_forward(x, NO_MASK, 1, 0.4, 0.1), True, id="ssmax-stats"),
    pytest.param(lambda x: softmax.softmax_forward(x, RowMask(None, 0, None), 1, 0.4, 0.1, softcap=3.0), True,
                 id="ssmax-causal-softcap"),
    pytest.param(lambda x: entmax.entmax_forward(x, NO_MASK, 2.0), True, id="sparsemax"),
    pytest.param(lambda x: entmax.entmax_forward(x, RowMask(None, -1, None), 1.5), True, id="entmax15-causal"),
    pytest.param(lambda x: topk.topk_forward(x, NO_MASK, 3.0, False, 1.0), True, id="topk"),
    pytest.param(lambda x: topk.topk_forward(x, NO_MASK, 0.25, True, 2.0), True, id="topk-fraction"),
    pytest.param(lambda x: self_adjusted.self_adjusted_forward(x, NO_MASK, True), True, id="sa-normalized"),
    pytest.param(lambda x: softmax.softmax_forward(x, RowMask(x > 0, None, None), 0, 1.0, 0.0), True,
                 id="softmax-bool-mask"),
    # a mask broadcast over each row's keys: viewed as (rows, L) with stride 0 along L
    pytest.param(lambda x: softmax.softmax_forward(x, RowMask(x[..., :1] > 0, None, None), 0, 1.0, 0.0), True,
                 id="softmax-bool-mask-broadcast"),
    # a float64 temperature per row for float32 scores: cast by a torch operation, never replayed
    pytest.param(lambda x: softmax.softmax_forward(x, NO_MASK, 0, torch.full((*x.shape[:-1], 1), 0.5,
                                                                              dtype=torch.float64), 0.0),
                 False, id="softmax-cast-temperature"),
]


@pytest.mark.parametrize("call, replayable", FORWARDS)
def test_forwards_replay_what_they_compute_as_written(replaying, call, replayable):
    _, replays = replaying
    shape = (2, 3, 37)
    for seed in range(4):
        x = scores(shape, seed)
        want = written(call, x)
        before = len(replays)
        got = call(x)
        assert_same(got, want)
        replayed = len(replays) > before
        assert replayed == (replayable and seed > 1), (seed, replayed)  # the first runs as written, the second records
    assert replay.planned() == ((1, 0) if replayable else (0, 1))


def test_backwards_replay(replaying):
    _, replays = replaying
    x = scores((4, 50), 0)
    y, multiplier, log_count = written(softmax.softmax_forward, x, NO_MASK, 1, 0.4, 0.1)
    sparse, gate = written(entmax.entmax_forward, x, NO_MASK, 1.5)
    for seed in range(4):
        g = scores((4, 50), seed + 10).nan_to_num(neginf=0.0)
        for call in (lambda g=g: softmax.softmax_backward(y, g, multiplier, x, 2),
                     lambda g=g: softmax.softmax_backward(y, g, multiplier, x, 0, softcap=2.0),
                     lambda g=g: entmax.entmax_backward(sparse, g, gate, 1.5, True)):
            want = written(call)
            assert_same(call(), want)
    assert replay.planned() == (3, 0) and len(replays) == 6


def test_modules_replay_forward_and_backward(replaying):
    import attnorm

    _, replays = replaying
    modules = [attnorm.Sparsemax(backend="triton"), attnorm.Entmax(1.5, backend="triton"),
               attnorm.ScalableSoftmax(backend="triton"), attnorm.TopKSoftmax(4, backend="triton"),
               attnorm.SelfAdjustedSoftmax(backend="triton")]
    for module in modules:
        for seed in range(4):
            x = scores((3, 20), seed).requires_grad_()
            g = scores((3, 20), seed + 5).nan_to_num(neginf=0.0)
            want = written(module, x)
            (want_grad,) = torch.autograd.grad(want, x, g)
            count = len(replays)
            got = module(x)
            (got_grad,) = torch.autograd.grad(got, x, g)
            assert_same((got, got_grad), (want, want_grad))
            if seed > 1:
                assert len(replays) == count + 2, type(module).__name__  # forward and backward replayed
            with torch.no_grad():
                assert_same(module(x), want.detach())


@pytest.mark.parametrize(("kernel", "params"), [
    pytest.param("sparsemax", (), id="sparsemax"),
    pytest.param("entmax", (("alpha", 1.5),), marks=pytest.mark.slow, id="entmax15"),
    pytest.param("topk_softmax", (("k", 5), ("temperature", 1.0)), id="top5"),
    pytest.param("self_adjusted_softmax", (("normalized", False),), marks=pytest.mark.slow, id="sa-plain")])
def test_decoding_weights_replay_both_launches_as_one_plan(replaying, kernel, params):
    """The rows route's scores kernel and row kernel keyed once and replayed together (float16: no copies off CUDA)."""
    from attnorm.kernels.triton import attention_decoding

    _, replays = replaying
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 4, 1, 16, generator=generator).half()
        k = torch.randn(2, 2, 37, 16, generator=generator).half()
        want = written(attention_decoding.decoding_weights_forward, q, k, 0.25, kernel, params)
        count = len(replays)
        got = attention_decoding.decoding_weights_forward(q, k, 0.25, kernel, params)
        assert_same(got, want)
        assert got.shape == (2, 4, 1, 37) and got.dtype == torch.float16  # rounded by the row kernel as it stores
        if seed > 1:
            assert len(replays) == count + 1
            assert got._base is None  # allocated in the result's shape, not a view of the kernel's (rows, L) output
    assert replay.planned() == (1, 0)
    (plan,) = replay._PLANS.values()
    assert len(plan.launches) == 2  # the scores kernel and the row kernel


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_decoding_weights_with_a_padded_batch_mask_replay_reading_the_mask_in_place(replaying, softcap):
    """A left-padded batch's ``(B, 1, 1, Lk)`` mask reaches the row kernel as a view of itself (batch, head and
    query strides): the call is replayed, with each call's own mask swapped in, not refused for a copy; a cap
    (Gemma 2's) is a kept constant of the plan."""
    from attnorm.kernels.triton import attention_decoding

    _, replays = replaying
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 4, 1, 16, generator=generator).half()
        k = torch.randn(2, 2, 37, 16, generator=generator).half()
        keep = torch.arange(37) >= torch.tensor([0, 5 + 3 * seed])[:, None]  # left padding, new every call
        mask = RowMask(keep.reshape(2, 1, 1, 37), None, None)
        want = written(attention_decoding.decoding_weights_forward, q, k, 0.25, "sparsemax", (), mask, softcap)
        got = attention_decoding.decoding_weights_forward(q, k, 0.25, "sparsemax", (), mask, softcap)
        assert_same(got, want)
        assert (got[:, :, :, : 5 + 3 * seed][1] == 0).all()
    assert len(replays) == 2 and replay.planned() == (1, 0)


@pytest.mark.parametrize("kernel", ["sparsemax", pytest.param("self_adjusted_softmax", marks=pytest.mark.slow)])
def test_decoding_weights_with_sinks_per_head_replay_reading_them_in_place(replaying, kernel):
    """gpt-oss's sinks, a bfloat16 ``(Hq,)`` parameter, reach the row kernel as a view of themselves (a batch of 2
    reads each head's value through ``(row // Lq) % Hq``): the step is replayed with each call's sinks swapped in,
    not refused for a float32 copy per row."""
    from attnorm.kernels.triton import attention_decoding

    _, replays = replaying
    params = (("normalized", True),) if kernel == "self_adjusted_softmax" else ()
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 4, 1, 16, generator=generator).half()
        k = torch.randn(2, 2, 37, 16, generator=generator).half()
        sinks = torch.nn.Parameter((torch.randn(4, generator=generator) * 3).to(torch.bfloat16))
        want = written(attention_decoding.decoding_weights_forward, q, k, 0.25, kernel, params, NO_MASK, None, sinks)
        got = attention_decoding.decoding_weights_forward(q, k, 0.25, kernel, params, NO_MASK, None, sinks)
        assert_same(got, want)
    assert len(replays) == 2 and replay.planned() == (1, 0)


def test_each_key_part_gets_its_own_plan(replaying):
    x = scores((2, 37), 0)
    calls = [
        lambda: softmax.softmax_forward(x, NO_MASK, 0, 0.5, 0.0),
        lambda: softmax.softmax_forward(x, NO_MASK, 0, 0.25, 0.0),  # another temperature
        lambda: softmax.softmax_forward(x, NO_MASK, 1, 1.0, -0.0),  # -0.0 is not 0.0
        lambda: softmax.softmax_forward(x, NO_MASK, 1, 1.0, 0.0),
        lambda: softmax.softmax_forward(x[:, :20], NO_MASK, 0, 0.5, 0.0),  # another shape and row stride
        lambda: softmax.softmax_forward(x.T.contiguous().T, NO_MASK, 0, 0.5, 0.0),  # other strides: copied
        lambda: softmax.softmax_forward(x.double(), NO_MASK, 0, 0.5, 0.0),  # another dtype
        lambda: softmax.softmax_forward(x[:, 1:], NO_MASK, 0, 0.5, 0.0),  # unaligned data pointer
    ]
    for call in calls:
        want = written(call)
        for _ in range(3):
            assert_same(call(), want)
    replayable, refused = replay.planned()
    assert replayable + refused == len(calls)
    assert refused == 1  # the non-contiguous rows, copied by a torch operation


def test_what_a_recording_refuses(replaying):
    x = scores((2, 16), 0)

    @replay.replayable
    def filled(x):
        y, multiplier = softmax.softmax_forward.__wrapped__(x, NO_MASK, 0, 1.0, 0.0)[:2]
        multiplier.fill_(1.0)  # a torch write into an output: not repeated by a replay
        return y, multiplier

    @replay.replayable
    def computed(x):
        y = softmax.softmax_forward.__wrapped__(x, NO_MASK, 0, 1.0, 0.0)[0]
        return y * 2  # a result made by torch

    @replay.replayable
    def unlaunched(x):
        return x  # no launch at all

    for function in (filled, computed, unlaunched):
        for _ in range(3):
            function(x)
    assert replay.planned() == (0, 3)


def test_aliased_inputs_record_again(replaying):
    x = scores((3, 16), 0).nan_to_num(neginf=0.0)
    y, multiplier, _ = written(softmax.softmax_forward, x, NO_MASK, 0, 1.0, 0.0)
    written(softmax.softmax_backward, y, y, multiplier, None, 0)
    for _ in range(2):  # seen, then recorded: y as its own gradient, which one a launch read is moot
        softmax.softmax_backward(y, y, multiplier, None, 0)
    assert replay.planned() == (0, 0)
    g = torch.ones_like(y)
    want = written(softmax.softmax_backward, y, g, multiplier, None, 0)
    for _ in range(3):
        assert_same(softmax.softmax_backward(y, g, multiplier, None, 0), want)
    assert replay.planned() == (1, 0)
    assert_same(softmax.softmax_backward(y, y, multiplier, None, 0),
                written(softmax.softmax_backward, y, y, multiplier, None, 0))


def test_not_replayed_with_a_hook_or_switched_off(replaying, monkeypatch):
    from triton import knobs

    _, replays = replaying
    x = scores((2, 16), 0)
    for _ in range(3):
        softmax.softmax_forward(x, NO_MASK, 0, 1.0, 0.0)
    assert replay.planned() == (1, 0) and len(replays) == 1
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *args: None)
    softmax.softmax_forward(x, NO_MASK, 0, 1.0, 0.0)
    assert len(replays) == 1  # Triton's path: the hook sees the launch
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    written(softmax.softmax_forward, x, NO_MASK, 0, 1.0, 0.0)
    assert len(replays) == 1
    softmax.softmax_forward(x, NO_MASK, 0, 1.0, 0.0)
    assert len(replays) == 2
    replay.clear()
    assert replay.planned() == (0, 0)


def test_a_key_is_recorded_on_its_second_call(replaying, monkeypatch):
    """A shape that never comes back (a KV cache growing by a key per step) is run as written, never recorded."""
    launches, replays = replaying
    recordings = []
    monkeypatch.setattr(replay, "_make_plan", lambda *args, real=replay._make_plan: recordings.append(1) or real(*args))
    x = scores((3, 64), 0)
    for length in range(40, 64):
        assert_same(softmax.softmax_forward(x[:, :length], NO_MASK, 0, 1.0, 0.0),
                    written(softmax.softmax_forward, x[:, :length], NO_MASK, 0, 1.0, 0.0))
    assert recordings == [] and replays == [] and replay.planned() == (0, 0)
    for _ in range(3):  # length 40 was seen: recorded now, then replayed
        softmax.softmax_forward(x[:, :40], NO_MASK, 0, 1.0, 0.0)
    assert recordings == [1] and len(replays) == 2 and replay.planned() == (1, 0)
    monkeypatch.setattr(replay, "MAX_SEEN", 4)
    for length in range(10, 16):  # new keys: a full memory forgets its oldest
        softmax.softmax_forward(x[:, :length], NO_MASK, 0, 1.0, 0.0)
    assert list(replay._SEEN)[-1] is not None and len(replay._SEEN) == 4
    softmax.softmax_forward(x[:, :41], NO_MASK, 0, 1.0, 0.0)  # seen before it was forgotten: run as written
    softmax.softmax_forward(x[:, :15], NO_MASK, 0, 1.0, 0.0)  # one of the last four seen: recorded
    assert recordings == [1, 1]


def test_a_full_table_drops_its_least_recently_used_plan(replaying, monkeypatch):
    """Past MAX_PLANS the plan used longest ago goes: new shapes keep being recorded and replayed.

    A table that kept its first plans forever recorded every later key's calls without keeping
    the plan (a generation or a training run meeting thousands of lengths made every new shape's
    call slower than with the switch off, for the rest of the process)."""
    _, replays = replaying
    recordings = []
    monkeypatch.setattr(replay, "_make_plan", lambda *args, real=replay._make_plan: recordings.append(1) or real(*args))
    monkeypatch.setattr(replay, "MAX_PLANS", 2)
    x = scores((3, 64), 0)

    def call(length):
        got = softmax.softmax_forward(x[:, :length], NO_MASK, 0, 1.0, 0.0)
        assert_same(got, written(softmax.softmax_forward, x[:, :length], NO_MASK, 0, 1.0, 0.0))

    for length in (20, 20, 30, 30):  # two plans: the table is full
        call(length)
    assert len(recordings) == 2 and replay.planned() == (2, 0)
    call(20)  # replayed: 20 is now the more recent
    assert len(replays) == 1
    for _ in range(3):  # a new key is recorded, kept (30 goes) and replayed
        call(40)
    assert len(recordings) == 3 and len(replays) == 2 and replay.planned() == (2, 0)
    call(20)  # still kept
    assert len(replays) == 3 and len(recordings) == 3
    call(30)
    call(30)  # dropped: seen again, recorded again
    assert len(recordings) == 4 and len(replays) == 3


def test_inference_mode_records_and_replays(replaying):
    """Inference tensors have no version counter (reading one raised, failing every call under inference mode)."""
    import attnorm

    _, replays = replaying
    module = attnorm.Sparsemax(backend="triton")
    with torch.inference_mode():
        for seed in range(4):
            x = scores((3, 20), seed)
            want = written(module, x)
            got = module(x)
            assert got.is_inference()
            assert_same(got, want)
    assert len(replays) == 2 and replay.planned() == (1, 0)


def test_plans_keep_no_tensor_of_the_recorded_call(replaying):
    import gc
    import weakref

    x = scores((4, 300), 0)
    softmax.softmax_forward(x, NO_MASK, 1, 0.5, 0.0)
    result = softmax.softmax_forward(x, NO_MASK, 1, 0.5, 0.0)  # the second call records
    watched = [weakref.ref(t) for t in (x, *result[:2])]
    replaying[0].clear()  # the stand-in's own log of launched values
    del x, result
    gc.collect()
    assert replay.planned() == (1, 0) and all(ref() is None for ref in watched)


@pytest.mark.skipif(REPLAY_CHECK, reason="ATTNORM_TEST_REPLAY=1 swaps the interpreted kernels for JIT stand-ins")
def test_cpu_calls_are_not_replayed_with_the_switch_on(monkeypatch):
    """ATTNORM_FAST_LAUNCH=1 on a machine without CUDA: interpreted kernels, no key, no CUDA query."""
    monkeypatch.setattr(fast_launch, "_ENABLED", True)
    monkeypatch.setattr(shortcut, "DEVICE_TYPES", frozenset({"cuda"}))  # as shipped (ATTNORM_TEST_REPLAY adds "cpu")
    monkeypatch.setattr(fast_launch, "_device_and_stream", lambda: pytest.fail("a CUDA query"))
    x = scores((2, 16), 0)
    assert replay._key(softmax.softmax_forward, (x,), {}) is None
    torch.testing.assert_close(softmax.softmax_forward(x, NO_MASK, 0, 1.0, 0.0)[0], torch.softmax(x, -1))


def test_tensor_subclasses_and_lists_are_not_keyed(replaying):
    from torch.testing._internal.two_tensor import TwoTensor

    x = scores((2, 16), 0)
    assert replay._key(softmax.softmax_forward, (x, [1]), {}) is None
    assert replay._key(softmax.softmax_forward, (TwoTensor(x, x),), {}) is None
    assert replay._key(softmax.softmax_forward, (1.0,), {}) is None  # no tensor
    assert replay._key(softmax.softmax_forward, (torch.nn.Parameter(x),), {}) is not None  # a parameter is plain
