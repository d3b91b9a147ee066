"""The kernel speed tools in scripts/: SASS loop counting, launch-setting patches, the overhead profile (CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import compile_check  # noqa: E402
import profile_overhead  # noqa: E402
import sass_loops  # noqa: E402
import tune_attention  # noqa: E402

# A hand-written cuobjdump listing: an outer loop (0x0010-0x0080) around an inner one (0x0030-0x0060),
# a forward branch that is no loop, and a second, separate loop (0x0090-0x00a0).
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/               @P0 BRA 0x0070 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0040*/                   FFMA R5, R6, R7, R8 ;
        /*0050*/                   MUFU.EX2 R9, R10 ;
        /*0060*/              @!P1 BRA 0x0030 ;
        /*0070*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;
        /*0080*/              @!P2 BRA 0x0010 ;
        /*0090*/                   IMAD R3, R3, R4, RZ ;
        /*00a0*/              @!P3 BRA 0x0090 ;
        /*00b0*/                   EXIT ;
"""


def test_innermost_loops_are_the_backward_branches_that_hold_no_other_loop():
    loops = sass_loops.innermost_loops(SASS)
    assert loops == [["HGMMA.64x64x16.F32.BF16", "FFMA", "MUFU.EX2", "BRA"], ["IMAD", "BRA"]]


@pytest.mark.parametrize(("opcode", "kind"), [
    ("HGMMA.64x64x16.F32.BF16", "tensor"), ("MUFU.EX2", "mufu"), ("FFMA.FTZ", "float"),
    ("LDGSTS.E.BYPASS.128", "global"), ("SHFL.BFLY", "shuffle"), ("LOP3.LUT", "int"),
    ("BAR.SYNC.DEFER_BLOCKING", "sync"), ("STL", "other"),
])
def test_opcodes_fall_in_their_class(opcode, kind):
    assert sass_loops.classify(opcode) == kind


def test_scores_per_thread_come_from_the_dump_label():
    label = "attention x\nHAS_RANGE BLOCK_M=64 BLOCK_N=32 BLOCK_D=64\n{'num_warps': 4, 'num_stages': 3}\n"
    assert sass_loops.tile_elements(label) == 64 * 32 / 128
    assert sass_loops.tile_elements("rows\nBLOCK_M=64 BLOCK_DV=64\n{'num_warps': 4}\n") is None
    lines = sass_loops.describe("k", SASS, 2.0, 3)
    assert lines[1].startswith("- loop 1: 4 instructions, 2.00 per score")


def test_tune_settings_patch_the_fused_kernels_block_and_options(monkeypatch):
    from attnorm.kernels.triton import attention_entmax, attention_launch

    monkeypatch.setattr(attention_launch, "BLOCK_CUDA", attention_launch.BLOCK_CUDA)
    monkeypatch.setattr(attention_launch, "CUDA_OPTIONS", attention_launch.CUDA_OPTIONS)
    monkeypatch.setattr(attention_launch, "SKIP_EMPTY_TILES", attention_launch.SKIP_EMPTY_TILES)
    monkeypatch.setattr(attention_entmax, "HISTOGRAM_FLOOR", attention_entmax.HISTOGRAM_FLOOR)
    tune_attention.apply("128x8x2")
    assert attention_launch.BLOCK_CUDA == 128
    assert attention_launch.CUDA_OPTIONS == {"num_warps": 8, "num_stages": 2}
    assert attention_launch.SKIP_EMPTY_TILES is False
    assert attention_entmax.HISTOGRAM_FLOOR is False
    tune_attention.apply("64x4x3r168+skip+hist")
    assert attention_launch.BLOCK_CUDA == 64
    assert attention_launch.CUDA_OPTIONS == {"num_warps": 4, "num_stages": 3, "maxnreg": 168}
    assert attention_launch.SKIP_EMPTY_TILES is True
    assert attention_entmax.HISTOGRAM_FLOOR is True
    with pytest.raises(ValueError, match="only \\+skip, \\+hist"):
        tune_attention.apply("64x4x3+fast")


def test_programs_per_sm_follow_registers_and_shared_memory():
    assert compile_check.programs_per_sm(128, 0, 4) == 4  # a FlashAttention-2 forward: 16K registers a program
    assert compile_check.programs_per_sm(255, 57344, 4) == 2  # 255 rounds up to 256: 32K registers a program
    assert compile_check.programs_per_sm(168, 90112, 4) == 2  # registers allow 3, shared memory 2
    assert compile_check.programs_per_sm(168, 163840, 4) == 1
    assert compile_check.programs_per_sm(32, 0, 4) == 16  # then warps: 64 a SM


def test_compile_check_options_take_a_register_cap():
    assert compile_check._warps_stages("4x3,8x2r128") == [{"num_warps": 4, "num_stages": 3},
                                                          {"num_warps": 8, "num_stages": 2, "maxnreg": 128}]
    with pytest.raises(compile_check.argparse.ArgumentTypeError, match="4x3r168"):
        compile_check._warps_stages("4x3,8")


def test_overhead_profile_names_the_layers_of_a_call():
    text = profile_overhead.profile_module("Sparsemax", "cpu", calls=20, requires_grad=False, top=10)
    assert "Sparsemax on cpu" in text and "by tottime" in text and "by cumulative" in text
    assert "forward" in text  # the module's own layer is among the cumulative top


@pytest.mark.slow
def test_launch_overhead_times_both_launch_paths_without_a_gpu():
    """scripts/launch_overhead.py: Triton compiles for sm_90 offline, the stand-in driver launches nothing."""
    import os
    import subprocess

    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS.parent)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(SCRIPTS / "launch_overhead.py"), "--modules", "Sparsemax",
                           "--no-decoding", "--calls", "3", "--rounds", "1"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| Sparsemax |")]
    assert len(rows) == 2 and all(float(cell) > 0 for row in rows for cell in row.split("|")[3:5])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA gets")
def test_decoding_probe_refuses_to_run_without_cuda(capsys):
    """scripts/decoding_probe.py times the GPU against the host: without CUDA it stops with a usage error, at once."""
    import decoding_probe

    with pytest.raises(SystemExit) as stop:
        decoding_probe.main(["--lengths", "64"])
    assert stop.value.code == 2 and "needs CUDA" in capsys.readouterr().err
