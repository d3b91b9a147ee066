"""The module-level shortcut (attnorm/kernels/shortcut.py): repeated module calls replayed, never a stale answer.

On CPU with the stand-in of :mod:`tests.kernels.standin` (JIT kernels whose launcher runs the
interpreter, outputs poisoned), so a replayed call computes for real.  Every value is compared
with torch's own softmax or with the module run with the direct launch off.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnorm
from attnorm.kernels import fast_launch, shortcut
from attnorm.kernels.triton import launch, replay
from tests.conftest import poisoned_empty
from tests.kernels import standin

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in runs the interpreter on CPU tensors")


@pytest.fixture
def shortcuts(monkeypatch):
    """Stand-in kernels, fresh tables; yields a list that gets one item per shortcut hit."""
    standin.install(monkeypatch)
    monkeypatch.setattr(fast_launch, "_KEPT", {})
    monkeypatch.setattr(replay, "_PLANS", OrderedDict())
    monkeypatch.setattr(replay, "_SEEN", OrderedDict())
    monkeypatch.setattr(shortcut, "_TABLE", {})
    monkeypatch.setattr(launch, "empty", poisoned_empty)
    hits = []
    real_call = shortcut.call

    def counted(module, x, run):
        def slow(scores):
            hits.pop()  # the call ran as written: not a hit
            return run(scores)

        hits.append(1)
        return real_call(module, x, slow)

    monkeypatch.setattr(shortcut, "call", counted)
    yield hits


def _fresh(shape=(4, 16), seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _warm(module, x, calls=3):
    """Calls enough for the replay to record the key and the shortcut to keep it."""
    for _ in range(calls):
        module(x)


def _softmax(x, temperature=1.0):
    return torch.softmax(x.double() / temperature, -1).float()


def test_a_repeated_call_is_replayed_and_computes_each_new_input(shortcuts):
    module = attnorm.Softmax(temperature=0.5, backend="triton")
    _warm(module, _fresh())
    assert shortcut.entries() == (1, 0)
    before = len(shortcuts)
    for seed in range(1, 4):  # new values, same layout: each a hit that must compute its own answer
        x = _fresh(seed=seed)
        torch.testing.assert_close(module(x), _softmax(x, 0.5))
    assert len(shortcuts) - before == 3


FAMILIES = [
    lambda: attnorm.Softmax(temperature=0.5, backend="triton"),
    lambda: attnorm.Sparsemax(backend="triton"),
    lambda: attnorm.Entmax(1.5, backend="triton"),
    lambda: attnorm.TopKSoftmax(4, backend="triton"),
    lambda: attnorm.TopKSoftmax(0.3, temperature=2.0, backend="triton"),
    lambda: attnorm.SelfAdjustedSoftmax(normalized=True, backend="triton"),
    lambda: attnorm.SelfAdjustedSoftmax(normalized=False, backend="triton"),
    lambda: attnorm.ScalableSoftmax(s=0.7, bias=0.2, backend="triton"),
]
FAMILY_IDS = ["softmax", "sparsemax", "entmax", "topk", "topk-fraction", "sa-normalized", "sa-plain", "ssmax"]


def _with_reference(make):
    """A module from ``make`` and its twin on the reference backend."""
    module = make()
    reference = copy.deepcopy(module)
    reference.backend = "reference"
    return module, reference


@pytest.mark.parametrize("make", FAMILIES, ids=FAMILY_IDS)
def test_every_family_replays_what_the_reference_computes(shortcuts, make):
    module, reference = _with_reference(make)
    _warm(module, _fresh())
    assert shortcut.entries() == (1, 0)
    x = _fresh(seed=5)
    torch.testing.assert_close(module(x), reference(x), atol=2e-6, rtol=1e-5)


def test_an_assignment_is_seen_by_the_next_call(shortcuts):
    module = attnorm.Softmax(backend="triton")
    _warm(module, _fresh())
    module.temperature = 0.25
    x = _fresh(seed=1)
    torch.testing.assert_close(module(x), _softmax(x, 0.25))
    _warm(module, x)
    torch.testing.assert_close(module(x), _softmax(x, 0.25))  # a hit, under the new state
    module.dim = 0
    torch.testing.assert_close(module(x), torch.softmax(x.double() / 0.25, 0).float())


def test_a_copy_changed_leaves_the_original_alone(shortcuts):
    module = attnorm.Entmax(1.5, backend="triton")
    _warm(module, _fresh())
    twin = copy.deepcopy(module)
    twin.alpha = 2.0
    x = _fresh(seed=2)
    torch.testing.assert_close(twin(x), attnorm.Sparsemax(backend="reference")(x))
    torch.testing.assert_close(module(x), attnorm.Entmax(1.5, backend="reference")(x), atol=2e-6, rtol=1e-5)


def test_layouts_and_dtypes_are_keys_of_their_own(shortcuts):
    module = attnorm.Softmax(backend="triton")
    base = _fresh((16, 8), seed=3)
    for x in (base, base.t(), base[:, :5], base.double(), base[1:]):
        _warm(module, x)
        torch.testing.assert_close(module(x), torch.softmax(x, -1))


def test_the_global_backend_and_the_switch_are_read_on_every_call(shortcuts):
    module = attnorm.Softmax()  # the global default: here the reference (CPU tensors)
    x = _fresh()
    with attnorm.use_backend("triton"):
        _warm(module, x)
        assert shortcut.entries() == (1, 0)
    launches = []
    real_direct = fast_launch.direct_call
    try:
        fast_launch.direct_call = lambda *args: launches.append(1) or real_direct(*args)
        torch.testing.assert_close(module(x), torch.softmax(x, -1))  # native or reference now: no launch
        assert not launches
        with attnorm.use_backend("triton"):
            module(x)
        assert launches
        fast_launch.set_enabled(False)
        launches.clear()
        with attnorm.use_backend("triton"):
            torch.testing.assert_close(module(x), torch.softmax(x, -1))
        assert not launches  # the switch off: Triton's own launch, not the kept plan
    finally:
        fast_launch.direct_call = real_direct
        fast_launch.set_enabled(True)


def test_calls_that_need_more_than_the_kernel_are_not_looked_up(shortcuts):
    module = attnorm.Softmax(temperature=2.0, backend="triton")
    x = _fresh()
    _warm(module, x)
    hits = len(shortcuts)
    leaf = x.clone().requires_grad_()
    module(leaf).sum().backward()  # a gradient: the autograd Function
    torch.testing.assert_close(leaf.grad, torch.zeros_like(x), atol=1e-6, rtol=0)

    class Count(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        torch.testing.assert_close(module(x), _softmax(x, 2.0))
    assert any("attnorm" in str(op) for op in Count.ops)  # the mode saw the op, as without the shortcut
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module(x)
    with torch.autograd.forward_ad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode"):
        module(x)  # as without the shortcut: the kernels take no forward-mode derivative
    torch.testing.assert_close(torch.func.vmap(module)(x[None]), _softmax(x, 2.0)[None])
    assert len(shortcuts) == hits  # none of those calls was a hit
    module(x)
    assert len(shortcuts) == hits + 1


def test_modules_with_tensor_parameters_or_foreign_classes_run_as_written(shortcuts):
    learnable = attnorm.ScalableSoftmax(s=0.5, learnable=True, backend="triton")
    x = _fresh()
    with torch.no_grad():
        _warm(learnable, x)
        learnable.s.fill_(2.0)  # in place: no assignment, the kernel reads the tensor
        n = torch.tensor(16.0)
        torch.testing.assert_close(learnable(x), torch.softmax(x * 2.0 * n.log(), -1))

    class Sharper(attnorm.Softmax):  # a kernel_params of its own, reading state the module does not assign
        sharpness = 1.0

        def kernel_params(self):
            return {"temperature": 1.0 / Sharper.sharpness}

    sharper = Sharper(backend="triton")
    _warm(sharper, x)
    Sharper.sharpness = 4.0
    torch.testing.assert_close(sharper(x), _softmax(x, 0.25))
    assert shortcut.entries() == (0, 0)


def test_a_replayed_function_that_is_cleared_is_forgotten(shortcuts):
    module = attnorm.Sparsemax(backend="triton")
    _warm(module, _fresh())
    assert shortcut.entries() == (1, 0)
    replay.clear()
    assert shortcut.entries() == (0, 0)
    x = _fresh(seed=4)
    torch.testing.assert_close(module(x), attnorm.Sparsemax(backend="reference")(x))


def test_threads_do_not_take_each_others_calls(shortcuts):
    modules = [attnorm.Softmax(temperature=t, backend="triton") for t in (0.5, 1.0, 3.0)]
    errors = []

    def work(module, seed):
        try:
            for i in range(6):
                x = _fresh(seed=seed * 10 + i)
                torch.testing.assert_close(module(x), _softmax(x, module.temperature))
        except Exception as error:  # pragma: no cover - reported below (a wrong value, or any failure)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(m, i)) for i, m in enumerate(modules)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


def test_without_triton_nothing_imports_it(shortcuts, monkeypatch):
    """A CUDA machine without triton: the lookup stops before Triton's knobs (whose first read imports triton)."""
    from attnorm.kernels import backends

    monkeypatch.setattr(backends, "_TRITON_INSTALLED", False)
    monkeypatch.setattr(fast_launch, "_knobs", lambda: pytest.fail("the lookup read Triton's knobs"))
    module = attnorm.Softmax()  # CPU tensors, which the stand-in's device types treat as CUDA's
    x = _fresh()
    for _ in range(3):
        torch.testing.assert_close(module(x), torch.softmax(x, -1))
    assert shortcut.entries() == (0, 0)


# ---- calls that record a gradient: the row Function applied, its forward replayed ----------------------


def _leaf(shape=(4, 16), seed=0, dtype=torch.float32):
    return _fresh(shape, seed).to(dtype).requires_grad_()


@pytest.mark.parametrize("make", FAMILIES, ids=FAMILY_IDS)
def test_with_a_gradient_every_family_replays_and_differentiates_the_new_scores(shortcuts, make):
    module, reference = _with_reference(make)
    _warm(module, _leaf())
    assert shortcut.entries() == (1, 0)
    before = len(shortcuts)
    for seed in (5, 6):
        x, x_ref = _leaf(seed=seed), _leaf(seed=seed)
        upstream = _fresh(seed=seed + 100)
        y = module(x)
        y_ref = reference(x_ref)
        torch.testing.assert_close(y, y_ref, atol=2e-6, rtol=1e-5)
        (y * upstream).sum().backward()
        (y_ref * upstream).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, atol=2e-5, rtol=1e-4)
    assert len(shortcuts) - before == 2  # both were hits


@pytest.mark.parametrize("make", [FAMILIES[0], FAMILIES[2], FAMILIES[5]], ids=["softmax", "entmax", "sa-normalized"])
def test_replayed_gradient_calls_pass_gradcheck_and_gradgradcheck(shortcuts, make):
    module = make()
    x = _leaf(dtype=torch.float64)
    _warm(module, x)
    before = len(shortcuts)
    assert torch.autograd.gradcheck(module, (x,))
    assert torch.autograd.gradgradcheck(module, (x,))
    assert len(shortcuts) - before > 10  # gradcheck's calls on x's layout were hits


def test_replayed_gradient_calls_keep_autograds_rules(shortcuts):
    module = attnorm.Sparsemax(backend="triton")
    _warm(module, _leaf())
    before = len(shortcuts)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        module(_leaf(seed=1))
    assert packed  # setup_context still saved what the backward reads, through the hooks
    y = module(_leaf(seed=1))
    y.mul_(2)  # an in-place write to a saved output: the backward must refuse, as without the shortcut
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    with torch.no_grad():  # the key of a call without a gradient is another one
        assert module(_leaf(seed=2)).grad_fn is None
    assert module(_leaf(seed=3)).grad_fn is not None
    assert len(shortcuts) - before == 3


def test_a_gradient_call_that_moves_the_axis_runs_as_written(shortcuts):
    module = attnorm.Softmax(dim=0, backend="triton")  # normalize() hands the Function a moved view
    x = _leaf((16, 4))
    _warm(module, x)
    assert shortcut.entries() == (0, 1)
    x = _leaf((16, 4), seed=7)
    y = module(x)
    torch.testing.assert_close(y, torch.softmax(x.detach(), 0))
    y[:, 0].sum().backward()  # sum of a softmax column: zero gradient
    torch.testing.assert_close(x.grad, torch.zeros_like(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("clone", ["deepcopy", "pickle"])
def test_a_copied_module_that_is_never_looked_up_stays_so(shortcuts, clone):
    import pickle

    module = _Sharpened(backend="triton")
    x = _fresh()
    module(x)  # its token: never looked up (kernel_params reads state the module does not assign)
    twin = copy.deepcopy(module) if clone == "deepcopy" else pickle.loads(pickle.dumps(module))
    for grad in (False, True):
        leaf = x.clone().requires_grad_(grad)
        _warm(twin, leaf)
        _Sharpened.sharpness = 4.0
        try:
            torch.testing.assert_close(twin(leaf), _softmax(x, 0.25))
        finally:
            _Sharpened.sharpness = 1.0
    assert shortcut.entries() == (0, 0)


class _Sharpened(attnorm.Softmax):  # module level: pickled by reference
    sharpness = 1.0

    def kernel_params(self):
        return {"temperature": 1.0 / _Sharpened.sharpness}
