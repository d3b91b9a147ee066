"""benchmarks/traffic.py: the bytes a row normalizer must move (needs neither triton nor attnorm)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from traffic import MODES, OPS, bytes_moved  # noqa: E402


def test_softmax_forward_reads_and_writes_each_element_once():
    # 4096 rows of 1000 float16 scores: x read, y written, one float32 scalar per row saved.
    assert bytes_moved("softmax", 4096, 1000, torch.float16, "forward") == 4096 * (1000 * 2 * 2 + 4)


def test_backward_reads_output_and_gradient_and_writes_input_gradient():
    assert bytes_moved("entmax", 10, 100, torch.float32, "backward") == 10 * (100 * 4 * 3 + 4)
    assert bytes_moved("self_adjusted_softmax", 10, 100, torch.float64, "backward") == 10 * (100 * 8 * 3 + 8 * 4)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_forward_and_backward_add_up_and_scale_with_the_problem(op, dtype):
    both = bytes_moved(op, 8, 333, dtype, "forward+backward")
    assert both == bytes_moved(op, 8, 333, dtype, "forward") + bytes_moved(op, 8, 333, dtype, "backward")
    assert bytes_moved(op, 16, 333, dtype, "forward") == 2 * bytes_moved(op, 8, 333, dtype, "forward")
    assert bytes_moved(op, 8, 0, dtype, "forward") < bytes_moved(op, 8, 1, dtype, "forward")


def test_every_normalizer_has_a_traffic_entry():
    import attnorm

    normalizers = [value for value in vars(attnorm).values()
                   if isinstance(value, type) and issubclass(value, attnorm.Normalizer) and value.kernel]
    assert normalizers
    for normalizer in normalizers:
        assert normalizer.kernel in OPS, normalizer.__name__
        assert all(bytes_moved(normalizer.kernel, 1, 1, torch.float32, mode) > 0 for mode in MODES)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("softmax2", 1, 1, torch.float32, "forward"), "op must be one of"),
        (("softmax", 1, 1, torch.float32, "both"), "mode must be one of"),
        (("softmax", -1, 1, torch.float32, "forward"), "rows and length must be >= 0"),
        (("softmax", 1, 1, torch.int32, "forward"), "floating-point"),
    ],
)
def test_bad_arguments_are_named(arguments, message):
    with pytest.raises(ValueError, match=message):
        bytes_moved(*arguments)


def test_imports_without_triton_or_attnorm():
    program = "import sys; sys.modules['triton'] = sys.modules['attnorm'] = None; import traffic"
    subprocess.run([sys.executable, "-c", program], check=True, cwd=BENCHMARKS)
