"""The torch.library operators as PyTorch sees them: opcheck, compile, export, trace, torch.func.

Every normalizer module (fixed and learnable parameters) under every mask kind is
compiled with ``fullgraph=True`` and must give zero graph breaks and the eager
values and gradients; ``vmap``, ``grad`` and ``jacrev`` must match loops and the
reference backend; ``torch.export`` and ``torch.jit.trace`` must reproduce eager.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import pathlib
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnorm
from attnorm.kernels import ops
from tests.conftest import central_difference, slow_under_interpreter

TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OP_BACKENDS = ["reference"] + ["native"] * (DEVICE == "cpu") + ["triton"] * TRITON

MODULES = {
    "softmax_T0.7": lambda **kw: attnorm.Softmax(temperature=0.7, **kw),
    "ssmax": lambda **kw: attnorm.ScalableSoftmax(s=0.6, bias=0.1, **kw),
    "ssmax_learnable": lambda **kw: attnorm.ScalableSoftmax(learnable=True, num_heads=2, **kw),
    "sa": lambda **kw: attnorm.SelfAdjustedSoftmax(**kw),
    "sa_plain": lambda **kw: attnorm.SelfAdjustedSoftmax(normalized=False, **kw),
    "sparsemax": lambda **kw: attnorm.Sparsemax(**kw),
    "entmax1.5": lambda **kw: attnorm.Entmax(alpha=1.5, **kw),
    "entmax1.3": lambda **kw: attnorm.Entmax(alpha=1.3, **kw),
    "entmax_learnable": lambda **kw: attnorm.Entmax(alpha=1.5, learnable=True, num_heads=2, **kw),
    "topk2": lambda **kw: attnorm.TopKSoftmax(k=2, **kw),
    "topk0.4": lambda **kw: attnorm.TopKSoftmax(k=0.4, temperature=2.0, **kw),
}
# Self-Adjusted Softmax's min/max make its Jacobian jump where scores tie; the others are smooth here.
MASKS = {
    "none": lambda: None,
    "bool": lambda: torch.tensor([[1, 1, 0, 1, 0, 1]] * 4, dtype=torch.bool, device=DEVICE),
    "causal": lambda: attnorm.causal_mask(),
    "padding": lambda: attnorm.key_padding_mask(torch.tensor([6, 3], device=DEVICE)),
}


def scores(*shape, dtype=torch.float32, requires_grad=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator, dtype=torch.float64).to(DEVICE, dtype)
    return x.requires_grad_(requires_grad)


def grads_of(module, x, mask, upstream):
    out = module(x, mask)
    tensors = [x, *(p for p in module.parameters())]
    return out, torch.autograd.grad(out, tensors, upstream, allow_unused=True)


# ---- opcheck ----------------------------------------------------------------------------------


def op_samples(backend: str):
    """(op, args) pairs covering every op with each kind of mask and parameter."""
    x = scores(2, 2, 3, 5, dtype=torch.float64)
    mask = torch.rand(1, 1, 3, 5, generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.3
    lengths = torch.tensor([5, 3], device=DEVICE)
    rows = torch.tensor([0.6, 1.3], dtype=x.dtype, device=DEVICE).reshape(1, 2, 1, 1)
    grad = scores(2, 2, 3, 5, dtype=torch.float64, seed=2)
    samples = [
        (ops.softmax_fwd, (x, mask, None, None, 0.7, None, None, None, backend)),
        (ops.softmax_fwd, (x, None, 0, lengths, 1.0, rows, None, None, backend)),
        (ops.scalable_softmax_fwd, (x, mask, None, None, 0.43, None, 0.1, rows, None, None, backend)),
        (ops.topk_softmax_fwd, (x, None, 0, None, 2.0, False, 1.0, None, None, None, backend)),
        (ops.topk_softmax_fwd, (x, mask, None, lengths, 0.5, True, 1.0, rows, None, None, backend)),
        (ops.entmax_fwd, (x, mask, None, None, 1.5, None, None, None, backend)),
        (ops.entmax_fwd, (x, None, 1, lengths, 1.0, rows + 0.5, None, None, backend)),
        (ops.self_adjusted_softmax_fwd, (x, mask, 0, None, True, None, None, backend)),
    ]
    y, multiplier, _ = ops.softmax_fwd(x, mask, None, None, 0.7, None, None, None, backend)
    samples.append((ops.softmax_bwd, (y, grad, multiplier, None, 1, None, None, None, backend)))
    y, multiplier, _, _ = ops.scalable_softmax_fwd(x, None, 0, None, 0.43, None, 0.0, None, None, None, backend)
    samples.append((ops.softmax_bwd, (y, grad, multiplier, x, 2, None, None, None, backend)))
    samples.append((ops.softmax_bwd, (y, grad, multiplier, None, 0, None, None, None, backend)))
    y, gate, _ = ops.entmax_fwd(x, mask, None, None, 1.5, None, None, None, backend)
    samples.append((ops.entmax_bwd, (y, grad, gate, 1.5, None, True, None, None, None, backend)))
    samples.append((ops.entmax_bwd, (y, grad, gate, 1.5, None, False, None, None, None, backend)))
    _, stats, _ = ops.self_adjusted_softmax_fwd(x, None, None, lengths, False, None, None, backend)
    samples.append((ops.self_adjusted_softmax_bwd, (x, None, None, lengths, grad, stats, False, None, None, backend)))
    return samples + sink_op_samples(backend)


def sink_op_samples(backend: str):
    """(op, args) pairs for every op with a sink per row (a column, one value per head here)."""
    x = scores(2, 2, 3, 5, dtype=torch.float64)
    mask = torch.rand(1, 1, 3, 5, generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.3
    sink = torch.tensor([0.3, -1.2], dtype=x.dtype, device=DEVICE).reshape(1, 2, 1, 1)
    grad = scores(2, 2, 3, 5, dtype=torch.float64, seed=2)
    samples = [
        (ops.softmax_fwd, (x, mask, None, None, 0.7, None, sink, None, backend)),
        (ops.scalable_softmax_fwd, (x, None, 0, None, 0.43, None, 0.1, None, sink, None, backend)),
        (ops.topk_softmax_fwd, (x, mask, None, None, 0.5, True, 1.0, None, sink, None, backend)),
        (ops.entmax_fwd, (x, mask, None, None, 1.5, None, sink, None, backend)),
        (ops.self_adjusted_softmax_fwd, (x, mask, None, None, True, sink, None, backend)),
    ]
    y, multiplier, _, weight = ops.scalable_softmax_fwd(x, None, 0, None, 0.43, None, 0.1, None, sink, None, backend)
    samples.append((ops.softmax_bwd, (y, grad, multiplier, x, 2, weight, sink, None, backend)))
    samples.append((ops.softmax_bwd, (y, grad, multiplier, None, 1, weight, None, None, backend)))
    y, gate, weight = ops.entmax_fwd(x, mask, None, None, 1.5, None, sink, None, backend)
    samples.append((ops.entmax_bwd, (y, grad, gate, 1.5, None, True, weight, None, None, backend)))
    _, stats, _ = ops.self_adjusted_softmax_fwd(x, mask, None, None, False, sink, None, backend)
    samples.append((ops.self_adjusted_softmax_bwd, (x, mask, None, None, grad, stats, False, sink, None, backend)))
    return samples + softcap_op_samples(x, mask, sink, grad, backend)


def softcap_op_samples(x, mask, sink, grad, backend: str):
    """(op, args) pairs for every op soft-capped at 2, with and without a sink."""
    samples = [
        (ops.softmax_fwd, (x, mask, None, None, 0.7, None, None, 2.0, backend)),
        (ops.scalable_softmax_fwd, (x, None, 0, None, 0.43, None, 0.1, None, sink, 2.0, backend)),
        (ops.topk_softmax_fwd, (x, mask, None, None, 2.0, False, 1.0, None, None, 2.0, backend)),
        (ops.entmax_fwd, (x, mask, None, None, 1.5, None, sink, 2.0, backend)),
        (ops.self_adjusted_softmax_fwd, (x, mask, None, None, True, None, 2.0, backend)),
    ]
    y, multiplier, _, weight = ops.scalable_softmax_fwd(x, None, 0, None, 0.43, None, 0.1, None, sink, 2.0, backend)
    samples.append((ops.softmax_bwd, (y, grad, multiplier, x, 2, weight, sink, 2.0, backend)))
    samples.append((ops.softmax_bwd, (y, grad, multiplier, x, 0, weight, None, 2.0, backend)))
    y, gate, _ = ops.entmax_fwd(x, mask, None, None, 1.5, None, None, 2.0, backend)
    samples.append((ops.entmax_bwd, (y, grad, gate, 1.5, None, True, None, x, 2.0, backend)))
    _, stats, _ = ops.self_adjusted_softmax_fwd(x, mask, None, None, False, sink, 2.0, backend)
    samples.append((ops.self_adjusted_softmax_bwd, (x, mask, None, None, grad, stats, False, sink, 2.0, backend)))
    return samples


OPCHECKS = {"schema-autograd-fake": ("test_schema", "test_autograd_registration", "test_faketensor"),
            "aot-dispatch": ("test_aot_dispatch_dynamic",)}
# Under the interpreter AOT dispatch of the Triton ops costs ~35 s: the default run checks it for
# the other backends (the same ops and fake kernels), -m slow for Triton too.
OPCHECK_CASES = [pytest.param(backend, checks, id=f"{backend}-{checks}",
                              marks=slow_under_interpreter((backend, checks) != ("triton", "aot-dispatch")))
                 for backend in OP_BACKENDS for checks in OPCHECKS]


@pytest.mark.parametrize(("backend", "checks"), OPCHECK_CASES)
def test_opcheck_every_op(backend, checks):
    for op, args in op_samples(backend):
        torch.library.opcheck(op, args, test_utils=OPCHECKS[checks])


# ---- torch.compile ----------------------------------------------------------------------------


@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("name", list(MODULES))
def test_compile_fullgraph_has_no_graph_break_and_matches_eager(name, mask_kind):
    torch._dynamo.reset()
    module = MODULES[name]().to(DEVICE)
    mask = MASKS[mask_kind]()
    x = scores(2, 2, 4, 6, requires_grad=True)
    upstream = scores(2, 2, 4, 6, seed=3)

    def run(t):
        return module(t, mask)

    assert torch._dynamo.explain(run)(x).graph_break_count == 0
    expected, expected_grads = grads_of(module, x, mask, upstream)
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    grads = torch.autograd.grad(out, [x, *module.parameters()], upstream, allow_unused=True)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["ssmax_learnable", "entmax_learnable", "topk0.4"])
def test_inductor_compiles_the_ops_and_matches_eager(name):
    torch._dynamo.reset()
    module = MODULES[name]().to(DEVICE)
    mask = attnorm.causal_mask()
    x = scores(2, 2, 4, 6, requires_grad=True)
    upstream = scores(2, 2, 4, 6, seed=3)
    expected, expected_grads = grads_of(module, x, mask, upstream)
    out = torch.compile(lambda t: module(t, mask), fullgraph=True)(x)
    grads = torch.autograd.grad(out, [x, *module.parameters()], upstream)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "call",
    [
        lambda x, t: attnorm.functional.softmax(x, temperature=t),
        lambda x, t: attnorm.functional.scalable_softmax(x, s=t, bias=0.2, mask=attnorm.causal_mask()),
        lambda x, t: attnorm.functional.entmax(x, alpha=t + 1),
        lambda x, t: attnorm.functional.topk_softmax(x, 3, temperature=t),
        lambda x, t: attnorm.functional.sparsemax(x / t),
        lambda x, t: attnorm.functional.self_adjusted_softmax(x * t, normalized=False),
    ],
    ids=["softmax", "ssmax", "entmax", "topk", "sparsemax", "sa"],
)
def test_compile_functional_with_tensor_parameters(call):
    torch._dynamo.reset()
    x = scores(2, 3, 5, requires_grad=True)
    t = torch.tensor([[[0.7]], [[1.4]]], device=DEVICE, requires_grad=True)
    assert torch._dynamo.explain(call)(x, t).graph_break_count == 0
    out = torch.compile(call, fullgraph=True, backend="aot_eager")(x, t)
    torch.testing.assert_close(out, call(x, t))
    got = torch.autograd.grad(out.square().sum(), [x, t])
    want = torch.autograd.grad(call(x, t).square().sum(), [x, t])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("normalizer", ["softmax", "ssmax", "sa_softmax", "sparsemax", "entmax", "topk:k=2"])
def test_compile_attention_has_no_graph_break(normalizer):
    torch._dynamo.reset()
    q, k, v = (scores(2, 2, 5, 4, seed=seed, requires_grad=True) for seed in range(3))

    def run(q, k, v):
        return attnorm.attention(q, k, v, normalizer, is_causal=True)

    assert torch._dynamo.explain(run)(q, k, v).graph_break_count == 0
    out = torch.compile(run, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(out, run(q, k, v))


@pytest.mark.skipif(not TRITON, reason="triton is not installed")
@pytest.mark.parametrize("normalizer", ["sparsemax", "sa_softmax", "topk:k=2"])
def test_compile_fused_self_attention_given_one_tensor_three_times(normalizer):
    """``attention(x, x, x)`` on the fused route: Dynamo breaks on an autograd.Function given one tensor twice."""
    torch._dynamo.reset()
    module = attnorm.make(normalizer, backend="triton")
    x = scores(1, 2, 20, 16, requires_grad=True)

    def run(t):
        return attnorm.attention(t, t, t, module, is_causal=True)

    assert torch._dynamo.explain(run)(x).graph_break_count == 0
    out = torch.compile(run, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, run(x))
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(run(x).sum(), x)[0])


# ---- torch.func --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODULES))
def test_vmap_matches_a_loop(name):
    module = MODULES[name]().to(DEVICE)
    x = scores(3, 2, 4, 6)
    batched = torch.func.vmap(module)(x)
    torch.testing.assert_close(batched, torch.stack([module(row) for row in x]))


@pytest.mark.parametrize("name", list(MODULES))
def test_vmap_then_backward_reaches_the_input(name):
    """``vmap(module)(x)`` then an ordinary backward: a vmap wrapper does not show that the tensor it batches
    needs a gradient, and the kernels' op alone left ``x.grad`` None with no error (fixed parameters)."""
    module = MODULES[name]().to(DEVICE).double()
    reference = MODULES[name](backend="reference").to(DEVICE).double()
    reference.load_state_dict(module.state_dict())
    weights = scores(3, 2, 4, 6, dtype=torch.float64, seed=5)
    x = scores(3, 2, 4, 6, dtype=torch.float64, requires_grad=True)
    (torch.func.vmap(module)(x) * weights).sum().backward()
    assert x.grad is not None
    expected = torch.autograd.grad((reference(x) * weights).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap_backward"])
@pytest.mark.parametrize("name", ["softmax_T0.7", "ssmax_learnable", "sa", "sparsemax", "entmax1.5", "entmax1.3",
                                  "entmax_learnable", "topk2"])
def test_compiled_torch_func_transforms_match_eager(name, transform):
    """``torch.compile`` of a torch.func transform of a module: the reference runs there (Dynamo traces the
    kernels' Function inside a transform without its gradient: compiled ``grad`` came out wrong, 0.97 off)."""
    module = MODULES[name]().to(DEVICE)
    weights = scores(3, 2, 4, 6, seed=5)
    functions = {
        "grad": torch.func.grad(lambda t: (module(t) * weights).sum()),
        "jacrev": torch.func.jacrev(module),
        "vmap_backward": torch.func.grad(lambda t: (torch.func.vmap(module)(t) * weights).sum()),
    }
    function = functions[transform]
    x = scores(3, 2, 4, 6)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(function, fullgraph=True, backend="aot_eager")(x), function(x),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["ssmax_learnable", "sparsemax", "entmax1.3", "entmax_learnable"])
def test_compiled_vmap_then_backward_reaches_input_and_parameters(name):
    """``torch.compile(vmap(module))`` then an ordinary backward: the input's and the parameters' gradients
    equal eager (a learnable entmax failed in Dynamo, the others left the input without a gradient)."""
    module = MODULES[name]().to(DEVICE)
    weights = scores(3, 2, 4, 6, seed=5)
    results = []
    for run in (torch.func.vmap(module), torch.compile(torch.func.vmap(module), fullgraph=True, backend="aot_eager")):
        torch._dynamo.reset()
        x = scores(3, 2, 4, 6, requires_grad=True)
        tensors = [x, *module.parameters()]
        results.append(torch.autograd.grad((run(x) * weights).sum(), tensors))
    for compiled, eager in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["sa", "sa_plain", "sparsemax", "entmax1.3", "entmax_learnable"])
def test_the_reference_compiles_whole_with_a_gradient(name):
    """The reference's entmax and Self-Adjusted Functions define a ``jvp`` (forward mode), which Dynamo does
    not trace: under ``torch.compile`` they run without it (3-5 graph breaks before)."""
    module = MODULES[name](backend="reference").to(DEVICE)
    x = scores(2, 2, 4, 6, requires_grad=True)

    def run(t):
        return module(t, attnorm.causal_mask())

    assert torch._dynamo.explain(run)(x).graph_break_count == 0
    out = torch.compile(run, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, run(x))
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(run(x).sum(), x)[0])


@pytest.mark.parametrize("name", ["ssmax_learnable", "entmax_learnable", "sparsemax"])
def test_attention_compiles_whole_under_dynamic_shapes(name):
    """A per-head normalizer's head check and a symbolic ``scale`` (``head_dim ** -0.5``, as transformers
    passes it) under ``dynamic=True``: both broke the graph before."""
    module = MODULES[name]().to(DEVICE)
    q = scores(2, 2, 5, 8, requires_grad=True)

    def run(t):
        return attnorm.attention(t, t, t, module, is_causal=True, scale=t.shape[-1] ** -0.5)

    torch._dynamo.reset()
    out = torch.compile(run, fullgraph=True, dynamic=True, backend="aot_eager")(q)
    torch.testing.assert_close(out, run(q))
    torch.testing.assert_close(torch.autograd.grad(out.sum(), q)[0], torch.autograd.grad(run(q).sum(), q)[0])


def test_a_multiplier_of_zero_keeps_its_parameter_gradients_under_torch_func():
    """A learnable Scalable-Softmax whose multiplier ``s log n + bias`` is exactly 0 (here s = bias = 0) still
    gets parameter gradients where autograd records the backward (``torch.func.grad``, ``create_graph``): a
    multiplier of 0 also marked the rows holding +inf, and those rows' gradients were zeroed (d bias 0.0
    instead of 0.57)."""
    module = attnorm.ScalableSoftmax(s=0.0, bias=0.0, learnable=True).to(DEVICE).double()
    x = scores(2, 5, dtype=torch.float64, seed=2)
    weights = scores(2, 5, dtype=torch.float64, seed=3)
    params = dict(module.named_parameters())

    def loss(parameters):
        return (torch.func.functional_call(module, parameters, (x,)) * weights).sum()

    got = torch.func.grad(loss)(params)
    s, bias = (torch.zeros((), dtype=torch.float64, requires_grad=True) for _ in range(2))
    expected = torch.autograd.grad((torch.softmax((s * math.log(5) + bias) * x, -1) * weights).sum(), (s, bias))
    torch.testing.assert_close(got["bias"].reshape(()), expected[1])
    torch.testing.assert_close(got["s"].reshape(()), expected[0])
    assert expected[1].abs() > 0.1


@pytest.mark.parametrize("name", list(MODULES))
def test_jacrev_and_grad_match_the_reference(name):
    module = MODULES[name]().to(DEVICE).double()
    reference = MODULES[name](backend="reference").to(DEVICE).double()
    reference.load_state_dict(module.state_dict())
    x = scores(2, 2, 6, dtype=torch.float64)
    jacobian = torch.func.jacrev(module)(x)
    torch.testing.assert_close(jacobian, torch.autograd.functional.jacobian(reference, x))
    weights = scores(2, 2, 6, dtype=torch.float64, seed=5)
    gradient = torch.func.grad(lambda t: (module(t) * weights).sum())(x)
    torch.testing.assert_close(gradient, torch.func.grad(lambda t: (reference(t) * weights).sum())(x))


@pytest.mark.parametrize("name", list(MODULES))
def test_double_backward(name):
    module = MODULES[name]().to(DEVICE).double()
    # Away from ties, from 0 (where SA clamps its min and max) and from support changes: the maps are smooth there.
    x = (torch.arange(12, dtype=torch.float64, device=DEVICE).reshape(2, 6) * 0.37 + 0.2).sin().reshape(1, 2, 1, 6)
    x.requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda t: module(t), (x,), atol=1e-6)


# ---- export and trace ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODULES))
def test_export_reproduces_eager(name):
    module = MODULES[name]().to(DEVICE)
    x = scores(2, 2, 4, 6)
    program = torch.export.export(module, (x,))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), module(x))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "error::torch.jit.TracerWarning")
@pytest.mark.parametrize("name", list(MODULES))
def test_jit_trace_reproduces_eager(name):
    """Tracing reproduces eager without a TracerWarning (a bool read of ``numel()`` gave one)."""
    module = MODULES[name]().to(DEVICE)
    x = scores(2, 2, 4, 6)
    with torch.no_grad():
        traced = torch.jit.trace(module, x, check_trace=False)
        torch.testing.assert_close(traced(scores(2, 2, 4, 6, seed=7)), module(scores(2, 2, 4, 6, seed=7)))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "error::torch.jit.TracerWarning")
@pytest.mark.parametrize("requires_grad", [False, True])
def test_jit_trace_of_functions_with_tensor_parameters_reads_no_values(requires_grad):
    """The functions' value checks of tensor parameters (T > 0, alpha >= 1, finite s) are skipped while tracing:
    a traced check gave a TracerWarning (and would keep its outcome); since parameters that require grad are
    checked too, every trainable temperature warned."""
    class Caller(torch.nn.Module):  # parameters that require grad, or buffers
        def __init__(self):
            super().__init__()
            for name, value in (("temperature", 0.7), ("s", 0.5), ("alpha", 1.5)):
                tensor = torch.tensor(value, device=DEVICE)
                if requires_grad:
                    self.register_parameter(name, torch.nn.Parameter(tensor))
                else:
                    self.register_buffer(name, tensor)

        def forward(self, x):
            return (attnorm.functional.softmax(x, temperature=self.temperature)
                    + attnorm.functional.scalable_softmax(x, s=self.s) + attnorm.functional.entmax(x, self.alpha))

    caller = Caller()
    traced = torch.jit.trace(caller, scores(2, 2, 4, 6), check_trace=False)
    torch.testing.assert_close(traced(scores(2, 2, 4, 6, seed=7)), caller(scores(2, 2, 4, 6, seed=7)))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_jit_trace_keeps_the_callers_own_tracer_warnings():
    """attnorm quiets only its own shape checks while tracing: a data-dependent branch of the
    traced caller still warns, from the caller's line, and a mask or an output normalizer adds none."""
    mask = (torch.rand(2, 1, 4, 6, generator=torch.Generator().manual_seed(3)) > 0.3).to(DEVICE)

    def caller(x):
        y = attnorm.Sparsemax()(x, mask=mask) + attnorm.SigmoidAttention()(x)
        return y * 2 if x.sum() > 0 else y  # a branch on a value: the trace must warn about it

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.jit.trace(caller, scores(2, 2, 4, 6), check_trace=False)
    tracer = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    assert len(tracer) == 1 and tracer[0].filename == __file__, [(w.filename, w.lineno) for w in tracer]


# ---- layout ------------------------------------------------------------------------------------


def module_imports(path: pathlib.Path, package_root: pathlib.Path) -> set[str]:
    """attnorm modules imported at module level (not inside functions) by ``path``."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attnorm"):
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("attnorm"))
    return names


def test_no_import_cycles_inside_attnorm():
    root = pathlib.Path(attnorm.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        # Importing a.b.c runs the __init__ of a and a.b first; the importer's own packages are
        # already being initialised (a package re-exporting its submodules is not a cycle).
        deps = set()
        for dep in module_imports(path, root):
            parts = dep.split(".")
            deps.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
        graph[name] = {dep for dep in deps if dep in modules and dep != name and not name.startswith(dep + ".")}
    state: dict[str, int] = {}

    def visit(name, stack):
        state[name] = 1
        for dep in graph[name]:
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack, name, dep]))
            if dep not in state:
                visit(dep, [*stack, name])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(MODULES))
def test_no_host_synchronisation_on_cuda(name):
    module = MODULES[name]().cuda()
    x = scores(2, 2, 64, 128, requires_grad=True)
    mask = attnorm.causal_mask() & attnorm.key_padding_mask(torch.tensor([128, 70], device="cuda"))
    module(x, mask)  # first call: compiles kernels, may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        module(x, mask).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- dtypes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_in_half_precision_out(backend, dtype):
    x = scores(2, 3, 40, dtype=dtype)
    s = torch.tensor(0.6, device=DEVICE)
    out = attnorm.functional.scalable_softmax(x, s=s, mask=attnorm.causal_mask(), backend=backend)
    assert out.dtype == dtype
    expected = attnorm.functional.scalable_softmax(
        x.double(), s=s.double(), mask=attnorm.causal_mask(), backend="reference"
    )
    torch.testing.assert_close(out.double(), expected, atol=4e-3, rtol=2e-2)


@pytest.mark.parametrize("backend", OP_BACKENDS)
def test_autocast_computes_forward_ops_in_float32(backend):
    x = scores(2, 3, 8, dtype=torch.bfloat16)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y, multiplier, _ = ops.softmax_fwd(x, None, None, None, 1.0, None, None, None, backend)
    assert y.dtype == torch.float32 and multiplier.dtype == torch.float32
    torch.testing.assert_close(y, torch.softmax(x.float(), -1))


@pytest.mark.skipif(DEVICE != "cpu", reason="the native kernels run on CPU")
def test_disabling_the_native_kernels_switches_auto_to_the_reference():
    from attnorm.kernels import backends
    from attnorm.kernels.cpu import build

    x = scores(2, 5)
    attnorm.Softmax()(x)  # loads the native kernels first
    assert backends.resolve(None, x.device) == "native"
    with build.disabled():
        assert backends.resolve(None, x.device) == "reference"
    assert backends.resolve(None, x.device) == "native"


# ---- eager calls: straight to the kernel, unless something watches ----------------------------


class _Names(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records the calls that skip the dispatcher: :func:`ops.call` straight to the forward and backward
    softmax kernels (by op name), and the weights-only shortcut of :mod:`attnorm.kernels.autograd` straight
    to a backend's forward with ``weights_only=True`` (``"direct:<backend>:<function>"``)."""
    calls = []
    for op in (ops.softmax_fwd, ops.softmax_bwd):
        kernel = ops._DEVICE_KERNELS[id(op)]

        def spy(*args, kernel=kernel, name=str(op)):
            calls.append(name)
            return kernel(*args)

        monkeypatch.setitem(ops._DEVICE_KERNELS, id(op), spy)
    def direct_spy(forward, name):
        def direct(*args, **kwargs):
            if kwargs.get("weights_only"):  # the op's own kernel calls it too, for every output
                calls.append(name)
            return forward(*args, **kwargs)

        return direct

    for backend in OP_BACKENDS:
        functions = ops.functions(backend)
        for forward in ("softmax_forward", "topk_forward", "entmax_forward", "self_adjusted_forward"):
            spy = direct_spy(getattr(functions, forward), f"direct:{backend}:{forward}")
            monkeypatch.setattr(functions, forward, spy)
    return calls


@pytest.mark.parametrize("backend", [b for b in OP_BACKENDS if b != "reference"])
def test_a_plain_eager_call_runs_the_kernels_without_the_dispatcher(kernel_calls, backend):
    x = scores(3, 7, requires_grad=True)
    y = attnorm.Softmax(temperature=0.5, backend=backend)(x)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y).cumsum(-1))
    assert kernel_calls == ["attnorm.softmax_fwd.default", "attnorm.softmax_bwd.default"]
    x64 = x.detach().double().requires_grad_()
    y64 = torch.softmax(x64 / 0.5, -1)
    (dx64,) = torch.autograd.grad(y64, x64, torch.ones_like(y64).cumsum(-1))
    torch.testing.assert_close(y, y64.float())
    torch.testing.assert_close(dx, dx64.float())


@pytest.mark.parametrize("backend", [b for b in OP_BACKENDS if b != "reference"])
def test_a_kernel_that_raises_in_a_plain_call_with_a_gradient_leaves_nothing_pending(monkeypatch, backend):
    """The plain lane hands the forward its kernel through :func:`shortcut.apply_with`: an error in
    the kernel must not leave it for the next Function's forward (a watched call would skip the op)."""
    from attnorm.kernels import shortcut

    def broken(*args):
        raise RuntimeError("kernel failed")

    monkeypatch.setitem(ops._DEVICE_KERNELS, id(ops.softmax_fwd), broken)
    with pytest.raises(RuntimeError, match="kernel failed"):
        attnorm.Softmax(temperature=0.5, backend=backend)(scores(3, 7, requires_grad=True))
    assert shortcut.take() is None


@pytest.mark.parametrize("backend", [b for b in OP_BACKENDS if b != "reference"])
def test_a_plain_call_that_needs_no_gradient_keeps_the_weights_alone(kernel_calls, backend):
    """No gradient wanted and nothing watching: the backend's forward runs directly with
    ``weights_only=True`` (no op, no statistics), inside ``no_grad`` or on inputs that need none."""
    x = scores(3, 7)
    y = attnorm.Softmax(temperature=0.5, backend=backend)(x)
    with torch.no_grad():
        y_no_grad = attnorm.Softmax(temperature=0.5, backend=backend)(x.clone().requires_grad_())
    assert kernel_calls == [f"direct:{backend}:softmax_forward"] * 2
    expected = torch.softmax(x.double() / 0.5, -1).float()
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(y_no_grad, expected)


@pytest.mark.parametrize("backend", [b for b in OP_BACKENDS if b != "reference"])
@pytest.mark.parametrize("name", MODULES)
def test_negative_views_are_read_as_their_values(name, backend):
    """A tensor with the negative bit (``torch._neg_view``: its memory holds the values negated) as the
    scores, the incoming gradient or the sink: the same weights and gradients as the resolved tensor, with
    a gradient and without (a data pointer handed straight to C or Triton read the memory as it is)."""
    module = MODULES[name](backend=backend).to(DEVICE)
    memory = scores(2, 2, 3, 6, seed=5)
    sink_memory = scores(2, 2, 3, 1, seed=6)
    upstream = scores(2, 2, 3, 6, seed=7)

    def run(x, sink, grad_out):
        x = x.detach().requires_grad_()
        y = module(x, sink=sink)
        (dx,) = torch.autograd.grad(y, x, grad_out)
        with torch.no_grad():
            return y, dx, module(x, sink=sink)

    viewed = run(torch._neg_view(memory), torch._neg_view(sink_memory), torch._neg_view(upstream))
    resolved = run(-memory, -sink_memory, -upstream)
    assert torch._neg_view(memory).is_neg()
    for got, expected in zip(viewed, resolved, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", [b for b in OP_BACKENDS if b != "reference"])
@pytest.mark.parametrize("name", MODULES)
def test_efficient_zero_tensors_are_zeros(name, backend):
    """An efficient zero tensor (no memory: a null data pointer) as the scores or the incoming gradient:
    the results of a real zero tensor, not a crash (C was handed the null pointer and segfaulted)."""
    module = MODULES[name](backend=backend).to(DEVICE)
    lazy = torch._efficientzerotensor((2, 2, 3, 6), device=DEVICE)
    assert lazy._is_zerotensor()
    with torch.no_grad():
        torch.testing.assert_close(module(lazy), module(torch.zeros(2, 2, 3, 6, device=DEVICE)), rtol=0, atol=0)
    x = scores(2, 2, 3, 6, seed=5, requires_grad=True)
    (dx,) = torch.autograd.grad(module(x), x, lazy)
    assert torch.equal(dx, torch.zeros_like(dx))


@pytest.mark.parametrize("backend", OP_BACKENDS)
@pytest.mark.parametrize("name", MODULES)
def test_autocast_computes_in_float32_forward_and_backward(name, backend):
    """Under autocast, half-precision scores give float32 weights on every backend (the ops' autocast
    rule, as ``torch.softmax``'s), and the backward runs, with the raw scores it reads for a cap or a
    learnable multiplier (the saved half-precision scores once reached the native kernel as they were):
    weights and gradients are those of the same module on the float32 scores."""
    module = MODULES[name](backend=backend).to(DEVICE)
    half = scores(2, 2, 3, 6, seed=8, dtype=torch.bfloat16) * 3
    upstream = scores(2, 2, 3, 6, seed=9)

    def run(x, autocast):
        x = x.detach().requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            y = module(x, softcap=4.0)
        grads = torch.autograd.grad(y, [x, *module.parameters()], upstream)
        return y, grads

    y, grads = run(half, True)
    expected, expected_grads = run(half.float(), False)
    assert y.dtype == torch.float32 and grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(y, expected)
    for got, want in zip(grads, expected_grads, strict=True):  # the scores' gradient rounded to bfloat16
        torch.testing.assert_close(got, want.to(got.dtype))


def _by_the_op(run):
    """``run()`` with the ops dispatched (a dispatch mode that only passes them on): the route with every output."""
    with _Names():
        return run()


SHORTCUT_CASES = {
    "plain": {},
    "bool mask": {"mask": lambda: torch.rand(2, 2, 5, 9, generator=torch.Generator().manual_seed(3)) > 0.3},
    "causal": {"mask": attnorm.causal_mask},
    "padding": {"mask": lambda: attnorm.key_padding_mask(torch.tensor([9, 4], device=DEVICE))},
    "sink and cap": {"sink": lambda: scores(2, 2, 1, 1, seed=4), "softcap": 2.5},
}


@pytest.mark.parametrize("case", SHORTCUT_CASES)
@pytest.mark.parametrize("name", MODULES)
def test_the_weights_only_shortcut_gives_the_ops_weights_bit_for_bit(kernel_calls, name, case):
    """The shortcut and the op run the same backend function: the weights match exactly, for every
    normalizer (learnable ones: parameters per head) with masks, a sink and a cap."""
    spec = SHORTCUT_CASES[case]
    module = MODULES[name]().to(DEVICE)
    x = scores(2, 2, 5, 9, seed=1) * 3
    mask = spec["mask"]() if "mask" in spec else None
    if isinstance(mask, torch.Tensor):
        mask = mask.to(DEVICE)
    keywords = {key: spec[key]() if callable(spec[key]) else spec[key] for key in ("sink", "softcap") if key in spec}
    if keywords.get("sink") is not None:
        keywords["sink"] = keywords["sink"].to(DEVICE)
    with torch.no_grad():
        shortcut = module(x, mask, **keywords)
        assert len(kernel_calls) == 1 and kernel_calls[0].startswith("direct:"), kernel_calls
        dispatched = _by_the_op(lambda: module(x, mask, **keywords))
        assert len(kernel_calls) == 1, kernel_calls
    assert torch.equal(shortcut, dispatched)


def _profiled(run):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        run()
    return [event.name for event in profiler.events()]


def _dispatched(run):
    with _Names() as mode:
        run()
    return mode.names


def _traced(run):
    x = scores(3, 7)
    # check_trace would rerun the function untraced (a plain eager call) to compare.
    return [str(torch.jit.trace(lambda t: attnorm.Softmax(temperature=0.5)(t), x, check_trace=False).graph)]


def _autocast(run):
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        run()
    return ["attnorm::softmax_fwd"]  # its autocast rule ran: see the dtype check below


def _vmapped(run):
    torch.func.vmap(lambda t: attnorm.Softmax(temperature=0.5)(t))(scores(2, 3, 7))
    return ["attnorm::softmax_fwd"]


WATCHERS = {"profiler": _profiled, "dispatch mode": _dispatched, "jit.trace": _traced, "autocast": _autocast,
            "vmap": _vmapped}


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no grad", "requires grad"])
@pytest.mark.parametrize("watcher", WATCHERS)
def test_whatever_watches_an_eager_call_sees_the_op_through_the_dispatcher(kernel_calls, watcher, requires_grad):
    """A profiler, a dispatch mode, jit.trace, autocast or a torch.func transform: the op goes
    through the dispatcher (the direct call is never taken, with a gradient or without) and shows
    where each looks."""
    x = scores(3, 7, dtype=torch.bfloat16 if watcher == "autocast" else torch.float32, requires_grad=requires_grad)
    results = []
    seen = WATCHERS[watcher](lambda: results.append(attnorm.Softmax(temperature=0.5)(x)))
    assert kernel_calls == []
    assert any("attnorm::softmax_fwd" in name or "attnorm.softmax_fwd" in name for name in seen), seen
    for y in results:
        expected = torch.softmax(x.double() / 0.5, -1)
        if watcher == "autocast":
            assert y.dtype == torch.float32  # the op's autocast rule: computed and returned in float32
        torch.testing.assert_close(y, expected.to(y.dtype))


def test_gradients_batched_by_the_legacy_vmap_go_through_the_dispatcher(kernel_calls):
    """``autograd.grad(..., is_grads_batched=True)`` (and ``jacobian(vectorize=True)``) hand the
    backward legacy-batched gradients, plain tensors to ``type``: the kernel must not get them."""
    x = scores(3, 7, dtype=torch.float64, requires_grad=True)
    y = attnorm.Softmax(temperature=0.5)(x)
    upstream = torch.randn(4, 3, 7, dtype=torch.float64).to(DEVICE)
    (batched,) = torch.autograd.grad(y, x, upstream, retain_graph=True, is_grads_batched=True)
    assert kernel_calls == ["attnorm.softmax_fwd.default"]
    for grad, g in zip(batched, upstream, strict=True):
        torch.testing.assert_close(grad, torch.autograd.grad(y, x, g, retain_graph=True)[0])


# ---- forward mode: on the reference, for every normalizer; never a dropped tangent -------------


def _dual_tangent(module, x, t):
    import torch.autograd.forward_ad as forward_ad

    with forward_ad.dual_level():
        return forward_ad.unpack_dual(module(forward_ad.make_dual(x, t), attnorm.causal_mask())).tangent


def _func_tangent(module, x, t):
    return torch.func.jvp(lambda s: module(s, attnorm.causal_mask()), (x,), (t,))[1]


TANGENTS = {"forward_ad": _dual_tangent, "func.jvp": _func_tangent}


@pytest.mark.parametrize("how", TANGENTS)
@pytest.mark.parametrize("name", MODULES)
def test_forward_mode_derivatives_equal_central_differences(name, how):
    """The kernels have no JVP: forward mode runs on the reference, whose entmax/sparsemax and
    Self-Adjusted Functions have closed-form ``jvp``s.  Before, forward_ad dropped the tangent
    (None), torch.func.jvp handed a kernel functorch's wrapper, and those three raised."""
    module = MODULES[name]().to(DEVICE, torch.float64)
    x, t = scores(2, 4, 6, dtype=torch.float64), scores(2, 4, 6, dtype=torch.float64, seed=1)
    tangent = TANGENTS[how](module, x, t)
    assert tangent is not None
    central = central_difference(lambda s: module(s, attnorm.causal_mask()), (x,), (t,))
    torch.testing.assert_close(tangent, central, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("name", MODULES)
def test_forward_mode_with_a_sink_and_a_cap_equals_central_differences(name):
    """Tangents of the scores and of a per-head sink together, through a soft cap."""
    module = MODULES[name]().to(DEVICE, torch.float64)
    x, t = scores(2, 2, 4, 7, dtype=torch.float64), scores(2, 2, 4, 7, dtype=torch.float64, seed=1)
    sink, sink_t = scores(2, 1, 1, dtype=torch.float64, seed=2), scores(2, 1, 1, dtype=torch.float64, seed=3)

    def f(s, k):
        return module(s, attnorm.causal_mask(), sink=k, softcap=3.0)

    tangent = torch.func.jvp(f, (x, sink), (t, sink_t))[1]
    central = central_difference(f, (x, sink), (t, sink_t))
    torch.testing.assert_close(tangent, central, atol=1e-8, rtol=1e-6)


def test_forward_mode_through_entmax_alpha_equals_central_differences():
    """A tangent of alpha (per row, 1.5 and 2 included) as well as of the scores."""
    x, t = scores(2, 4, 6, dtype=torch.float64), scores(2, 4, 6, dtype=torch.float64, seed=1)
    alpha = torch.tensor([1.2, 1.5, 1.7, 2.0], dtype=torch.float64, device=DEVICE).view(1, 4, 1).repeat(2, 1, 1)
    alpha_t = torch.linspace(-1, 1, 8, dtype=torch.float64, device=DEVICE).view(2, 4, 1)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]], dtype=torch.bool, device=DEVICE)

    def f(s, a):
        return attnorm.functional.entmax(s, alpha=a, mask=mask)

    tangent = torch.func.jvp(f, (x, alpha), (t, alpha_t))[1]
    central = central_difference(f, (x, alpha), (t, alpha_t))
    torch.testing.assert_close(tangent, central, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("name", ["sparsemax", "entmax1.5", "entmax1.3", "sa", "sa_plain"])
def test_hessian_forward_over_reverse_equals_reverse_over_reverse(name):
    """``torch.func.hessian`` (jacfwd of jacrev: the jvp of the forward and of the backward) against
    jacrev of jacrev (double backward, no jvp involved)."""
    module = MODULES[name]().to(DEVICE, torch.float64)
    x = scores(6, dtype=torch.float64)
    readout = torch.linspace(-1, 2, 6, dtype=torch.float64, device=DEVICE)

    def f(s):
        return (module(s) * readout).sum()

    forward_over_reverse = torch.func.hessian(f)(x)
    torch.testing.assert_close(forward_over_reverse, torch.func.jacrev(torch.func.jacrev(f))(x))
    assert forward_over_reverse.abs().sum() > 0 or name == "sparsemax"  # sparsemax's is 0 almost everywhere


def _edge_rows() -> torch.Tensor:
    inf, tiny = math.inf, 1e-300  # tiny: span squared underflows to 0
    return torch.tensor([
        [0.3, -1.2, 2.0, 0.7, -0.4, 1.1],
        [-inf] * 6,                           # fully masked
        [1.0, inf, 0.0, inf, -2.0, 3.0],      # +inf: uniform over the +inf positions
        [-1.0, -1.0, 2.0, 0.5, 3.0, 3.0],     # ties at the min and the max
        [0.0] * 6,                            # one value: Self-Adjusted's span is 0
        [tiny, -tiny, 0.0, 2 * tiny, -3 * tiny, tiny],  # a span of 5e-300
        [2.0, 1.0, -inf, 0.5, -inf, 1.5],
    ], dtype=torch.float64, device=DEVICE)


@pytest.mark.parametrize("name", ["softmax_T0.7", "sparsemax", "entmax1.5", "entmax1.3", "sa", "sa_plain", "topk2"])
def test_forward_mode_jacobian_is_the_kernels_reverse_mode_jacobian_on_edge_rows(name):
    """jacfwd (the reference's jvp) against jacrev (the default backend's backward kernel) on
    masked, +inf, tied, constant and denormal rows; a NaN row's tangent is NaN, as torch.softmax's."""
    module = MODULES[name]().to(DEVICE, torch.float64)
    x = _edge_rows()
    forward, reverse = torch.func.jacfwd(module)(x), torch.func.jacrev(module)(x)
    assert forward.isfinite().all()
    torch.testing.assert_close(forward, reverse, atol=1e-12, rtol=1e-9)
    with_nan = torch.cat([x[:1], torch.tensor([[0.1, math.nan, 0.2, 0.3, 0.4, 0.5]], dtype=x.dtype, device=DEVICE)])
    tangent = torch.func.jvp(module, (with_nan,), (torch.ones_like(with_nan),))[1]
    want = torch.func.jvp(lambda s: torch.softmax(s, -1), (with_nan,), (torch.ones_like(with_nan),))[1]
    assert tangent[1].isnan().all() and want[1].isnan().all()
    assert tangent[0].isfinite().all()


@pytest.mark.parametrize("backend", [b for b in OP_BACKENDS if b != "reference"])
def test_forward_mode_on_a_kernel_backend_asked_by_name_is_a_clear_error(backend):
    x = scores(3, 6, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=f"backend='{backend}'"):
        _func_tangent(attnorm.Softmax(backend=backend), x, x)
