"""Trace attnorm's Triton-backed ops through ``torch.compile`` with the Inductor decomposition on, without a GPU.

Run by ``tests/kernels/test_inductor_kernels.py`` in a child process with
``TRITON_INTERPRET`` unset, so ``@triton.jit`` gives the real ``JITFunction`` kernels
that :func:`torch.library.wrap_triton` accepts (under the interpreter it would hand back
the interpreted function and nothing would be traced).  Then:

* :data:`attnorm.kernels.inductor.DEVICES` takes CPU tensors, and ``TRITON_INTERPRET=1``
  is set after the import only so that ``backend="triton"`` accepts CPU tensors;
* Triton's active driver reports an sm_90 target: Inductor's mutation analysis lowers
  every traced kernel to TTIR for it and reads which arguments the kernel stores to;
* the AOTAutograd backend records the forward and backward graphs and raises instead of
  running them (there is no GPU to run them on).

Prints one JSON object: case name -> list of graphs, each ``{"kernels": n, "ops": [...]}``
(the number of ``triton_kernel_wrapper_*`` nodes and the attnorm ops left opaque).
"""

from __future__ import annotations

import importlib
import json
import os

import torch
import triton
from torch._dynamo.backends.common import aot_autograd
from triton.backends.compiler import GPUTarget

import attnorm
from attnorm.kernels import inductor

for family in ("", ".attention_entmax", ".attention_self_adjusted", ".attention_topk", ".attention_decoding"):
    importlib.import_module(f"attnorm.kernels.triton{family}")  # JIT kernels, imported before the switch below
os.environ["TRITON_INTERPRET"] = "1"
inductor.DEVICES = ("cpu",)
torch._functorch.config.force_non_lazy_backward_lowering = True  # the backward graph is traced up front


class _SM90:
    """What the mutation analysis asks of Triton's driver."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(_SM90())


class _Traced(Exception):
    pass


def graphs_of(fn, *inputs, dynamic: bool = False) -> list[dict]:
    recorded = []

    def compiler(gm, example_inputs):
        targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
        recorded.append({"kernels": sum("triton_kernel_wrapper" in t for t in targets),
                         "ops": [t for t in targets if t.startswith("attnorm.")]})

        def run(*args):
            raise _Traced

        return run

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler), fullgraph=True,
                             dynamic=dynamic)
    try:
        compiled(*inputs)
    except _Traced:
        pass
    return recorded


def exported_ops(module: torch.nn.Module, x: torch.Tensor) -> list[str]:
    program = torch.export.export(module, (x,))
    return [str(node.target) for node in program.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("attnorm.")]


def main() -> None:
    inductor.set_enabled(True)
    results = {}
    x = torch.randn(2, 3, 4, 10, requires_grad=True)  # (B, H, rows, L)
    sink = torch.randn(1, 3, 1, 1, requires_grad=True)  # one per head
    rows = ["softmax:temperature=0.5", "ssmax", "ssmax:learnable=true,num_heads=3", "sparsemax", "entmax",
            "entmax:alpha=1.3", "topk:k=3", "topk:k=0.25", "sa_softmax", "sa_softmax:normalized=false"]
    for spec in rows:
        module = attnorm.make(spec, backend="triton")
        results[f"rows/{spec}"] = graphs_of(lambda t, m=module: m(t).square().sum(), x)
        results[f"sink/{spec}"] = graphs_of(lambda t, s, m=module: m(t, sink=s).square().sum(), x, sink)
        results[f"softcap/{spec}"] = graphs_of(lambda t, m=module: m(t, softcap=5.0).square().sum(), x)
    q, k, v = (torch.randn(1, 4, 40, 16, requires_grad=True) for _ in range(3))
    kv = torch.randn(1, 2, 40, 16, requires_grad=True)
    fused = {
        "sparsemax": {}, "entmax": {"is_causal": True}, "sa_softmax": {"is_causal": True},
        "sa_softmax:normalized=false": {}, "topk:k=3": {"is_causal": True}, "ssmax": {"softcap": 5.0},
        "topk:k=0.25": {"sinks": torch.zeros(4)},
    }
    for spec, kwargs in fused.items():
        module = attnorm.make(spec, backend="triton")
        results[f"attention/{spec}"] = graphs_of(
            lambda a, b, c, m=module, kw=kwargs: attnorm.attention(a, b, c, m, **kw).square().sum(), q, k, v)
    module = attnorm.make("sparsemax", backend="triton")
    results["attention/gqa"] = graphs_of(lambda a, b: attnorm.attention(a, b, b, module).sum(), q, kv)
    results["attention/self"] = graphs_of(lambda a: attnorm.attention(a, a, a, module, is_causal=True).sum(), q)
    module = attnorm.make("sa_softmax", backend="triton")
    results["decoding/sa_softmax"] = graphs_of(lambda a, b: attnorm.attention(a, b, b, module),
                                               torch.randn(1, 2, 1, 16), kv.detach())
    module = attnorm.make("sparsemax", backend="triton")
    results["dynamic/sparsemax"] = graphs_of(lambda t: module(t).sum(), x, dynamic=True)
    results["export/sparsemax"] = [{"kernels": 0, "ops": exported_ops(module, x.detach())}]
    inductor.set_enabled(False)
    results["off/sparsemax"] = graphs_of(lambda t: module(t).sum(), x)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
