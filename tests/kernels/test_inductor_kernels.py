"""The Inductor decomposition of the Triton-backed ops (``attnorm.kernels.inductor``), traced without a GPU.

``inductor_trace.py`` runs in a child process (Triton's JIT kernels, not the interpreter)
and compiles every row normalizer, every fused attention family and the decoding kernel
with the decomposition on.  With it on, each graph must hold only Triton kernel launches
(``triton_kernel_wrapper_functional``, their mutated arguments found by lowering the
kernels to TTIR for sm_90) and no opaque attnorm op; off, under symbolic sizes and in
``torch.export``, the op must stay whole.  Running the compiled kernels needs CUDA.

The trace takes ~45 s on 2 cores for an opt-in feature (``ATTNORM_INDUCTOR_KERNELS=1``), so its tests are
``slow`` (``bash scripts/test.sh -m slow``); the switch's own test runs by default.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from attnorm.kernels import inductor

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def traced() -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("inductor_trace.py"))],
                            capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


ROWS = ["softmax:temperature=0.5", "ssmax", "ssmax:learnable=true,num_heads=3", "sparsemax", "entmax",
        "entmax:alpha=1.3", "topk:k=3", "topk:k=0.25", "sa_softmax", "sa_softmax:normalized=false"]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ROWS)
def test_row_ops_decompose_into_one_kernel_forward_and_backward(traced, spec):
    assert traced[f"rows/{spec}"] == [{"kernels": 1, "ops": []}, {"kernels": 1, "ops": []}]


@pytest.mark.slow
@pytest.mark.parametrize("modifier", ["sink", "softcap"])
@pytest.mark.parametrize("spec", ROWS)
def test_row_ops_with_a_sink_or_a_cap_decompose_into_one_kernel_forward_and_backward(traced, spec, modifier):
    # The sink's gradient is summed over the rows a head's sink serves: a reduction, not an op.
    assert traced[f"{modifier}/{spec}"] == [{"kernels": 1, "ops": []}, {"kernels": 1, "ops": []}]


@pytest.mark.parametrize("case", ["sparsemax", "entmax", "sa_softmax", "sa_softmax:normalized=false", "topk:k=3",
                                  "ssmax", "topk:k=0.25", "gqa", "self"])
@pytest.mark.slow
def test_fused_attention_decomposes_forward_and_backward(traced, case):
    forward, backward = traced[f"attention/{case}"]
    assert forward == {"kernels": 1, "ops": []}
    assert backward["ops"] == [] and backward["kernels"] >= 2  # dq and dk/dv kernels (and a row dot product)


@pytest.mark.slow
def test_decoding_kernel_decomposes(traced):
    assert traced["decoding/sa_softmax"] == [{"kernels": 2, "ops": []}]  # split and combine


@pytest.mark.slow
@pytest.mark.parametrize("case", ["off", "dynamic", "export"])
def test_the_op_stays_whole_when_off_under_symbolic_sizes_and_in_export(traced, case):
    graphs = traced[f"{case}/sparsemax"]
    assert all(graph["kernels"] == 0 for graph in graphs)
    assert graphs[0]["ops"] == ["attnorm.entmax_fwd.default"]


def test_the_switch_is_off_by_default_and_checks_its_argument():
    if os.environ.get("ATTNORM_INDUCTOR_KERNELS") is None:
        assert not inductor.enabled()
    with pytest.raises(TypeError, match="value must be a bool"):
        inductor.set_enabled(1)
