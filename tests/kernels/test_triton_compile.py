"""Every Triton kernel compiles for NVIDIA GPUs, checked offline (no GPU needed).

Triton's interpreter runs kernels through numpy and accepts code the GPU compiler
rejects (device functions whose returns differ in type, for one).  Here each of the
seven backend functions, forward and backward, single-block and multi-pass,
float32/float64/bfloat16, with a structured mask and a structured and bool mask together,
launches its kernels into Triton's compiler down to a cubin (ptxas ships with triton) for
sm_90; with ``-m slow`` also float16 and a bool mask alone, for sm_80 and sm_90.  It runs in a subprocess with the
interpreter off and
a stand-in driver that only names the target; ``JITFunction.run`` is patched to compile
(``warmup=True``) without launching.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

PROGRAM = r"""
import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class TargetOnlyDriver:
    backend = "cuda"

    def __init__(self, arch):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


driver.set_active(TargetOnlyDriver(int(sys.argv[1])))
compiled = set()


original_run = JITFunction.run


def compile_instead_of_launching(self, *args, grid, warmup=False, **kwargs):
    kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
    assert kernel.asm["cubin"], self.__name__
    compiled.add(self.__name__)
    return kernel


JITFunction.run = compile_instead_of_launching

from attnorm.kernels import triton as kernels
from attnorm.kernels.rules import RowMask
from attnorm.kernels.triton import launch as launcher


def every_function(x, mask):
    # Each of the seven functions, forward and backward, with per-row tensor parameters and gradients.
    rows = torch.ones(*x.shape[:-1], 1)
    g = torch.ones_like(x)
    for variant in (0, 1):
        y, multiplier, _ = kernels.softmax_forward(x, mask, variant, rows, 0.0)
        for param_grad in (0, 1, 2):
            kernels.softmax_backward(y, g, multiplier, x, param_grad)
    kernels.topk_forward(x, mask, 0.25, True, rows)
    kernels.topk_forward(x, mask, 3, False, 1.0)
    y, gate = kernels.entmax_forward(x, mask, rows * 1.5)
    kernels.entmax_backward(y, g, gate, rows * 1.5, True)
    for normalized in (True, False):
        y, stats = kernels.self_adjusted_forward(x, mask, normalized)
        kernels.self_adjusted_backward(x, mask, g, stats, normalized)


structured = RowMask(diagonal=1, key_lengths=torch.tensor([5, 6]))
every_mask = RowMask(torch.ones(1, 1, 3, 37, dtype=torch.bool), 1, torch.tensor([5, 6]))
for single_block_max in (8192, 16):
    launcher.SINGLE_BLOCK_MAX = launcher.MULTI_PASS_BLOCK = single_block_max
    combinations = [
        (torch.float32, structured),
        (torch.float32, every_mask),
        (torch.float64, RowMask()),
        (torch.bfloat16, RowMask()),
    ]
    if sys.argv[2] == "full":  # a bool mask alone, and float16 (the kernels' other 2-byte dtype)
        combinations += [(torch.float32, RowMask(torch.ones(1, 1, 3, 37, dtype=torch.bool))),
                         (torch.float16, structured)]
    for dtype, mask in combinations:
        every_function(torch.randn(2, 2, 3, 37).to(dtype), mask)
assert len(compiled) == 7, sorted(compiled)
"""


@pytest.mark.parametrize(("arch", "variants"), [pytest.param(80, "full", marks=pytest.mark.slow, id="80-full"),
                                               pytest.param(90, "full", marks=pytest.mark.slow, id="90-full"),
                                               pytest.param(90, "quick", id="90")])
def test_every_kernel_compiles_for_nvidia_gpus(arch, variants, tmp_path):
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton's NVIDIA backend (ptxas) is not installed")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["ATTNORM_FAST_LAUNCH"] = "0"  # Triton's own launch, the JITFunction.run patched above (no CUDA to ask)
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(arch), variants], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
