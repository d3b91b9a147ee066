"""Building and loading the native kernels (attnorm.kernels.native), each case in a fresh
process with a fresh ``ATTNORM_CACHE_DIR``.

The first load builds the library and a later process reuses it; with the kernels
turned off, or without a working compiler, loading reports why, and the public
functions run the torch-only path and still match the float64 reference.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]

# Prints build_info() as JSON, with the implementation cpu._kernels picks and the
# warnings loading raised, once the public functions have matched the reference.
PROBE = """
import json, math, warnings
import torch
from attnorm import functional as F
from attnorm.kernels import fast_cpu as cpu, old_reference as reference
from attnorm.kernels.cpu import native

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    info = native.build_info()
x = torch.randn(3, 4, 300, generator=torch.Generator().manual_seed(0)) * 2
x[0, 1, ::3] = -math.inf
x64 = x.double()
checks = {
    "softmax": (F.softmax(x, temperature=0.7), reference.softmax_rows(x64, None, temperature=0.7)),
    "sparsemax": (F.sparsemax(x), reference.sparsemax_row_op(x64, None)),
    "entmax": (F.entmax(x, alpha=1.3), reference.entmax_row_op(x64, None, alpha=1.3)),
    "topk": (F.topk_softmax(x, 5), reference.topk_softmax_rows(x64, None, k=5)),
}
for name, (got, expected) in checks.items():
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0, msg=name)
info["kernels"] = "native" if cpu._kernels(x) is cpu._NATIVE else "torch-only"
info["warnings"] = [str(warning.message) for warning in caught]
print(json.dumps(info))
"""


def load_in_fresh_process(cache: Path, **environment: str) -> dict:
    """build_info() of a new Python process with ATTNORM_CACHE_DIR=cache; ``environment``
    overrides the variables (ATTNORM_NATIVE and CC are unset otherwise)."""
    env = {name: value for name, value in os.environ.items() if name not in ("ATTNORM_NATIVE", "CC")}
    env.update(ATTNORM_CACHE_DIR=str(cache), **environment)
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_first_process_builds_and_the_next_reuses_the_build(tmp_path):
    first = load_in_fresh_process(tmp_path / "cache")
    assert first["available"] and not first["cached"]
    assert Path(first["path"]).parent == tmp_path / "cache"
    assert first["kernels"] == "native"
    assert first["warnings"] == []
    second = load_in_fresh_process(tmp_path / "cache")
    assert second["available"] and second["cached"]
    assert second["path"] == first["path"]
    assert second["kernels"] == "native"


def test_disabled_by_attnorm_native_0(tmp_path):
    info = load_in_fresh_process(tmp_path / "cache", ATTNORM_NATIVE="0")
    assert not info["available"]
    assert "ATTNORM_NATIVE=0" in info["reason"]
    assert info["kernels"] == "torch-only"
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_a_missing_compiler_falls_back_to_torch(tmp_path):
    info = load_in_fresh_process(tmp_path / "cache", CC="/nonexistent/cc")
    assert not info["available"]
    assert "/nonexistent/cc" in info["reason"]
    assert info["kernels"] == "torch-only"


@pytest.mark.skipif(shutil.which("false") is None, reason="no `false` command to act as a failing compiler")
def test_a_failing_build_warns_and_falls_back_to_torch(tmp_path):
    info = load_in_fresh_process(tmp_path / "cache", CC="false")
    assert not info["available"]
    assert "failed" in info["reason"]
    assert info["kernels"] == "torch-only"
    assert len(info["warnings"]) == 1 and "torch-only" in info["warnings"][0]
    assert list((tmp_path / "cache").glob("*.so")) == []  # no partial library left behind


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize(
    "rejected, openmp",
    [("-fopenmp", False), ("-march=native", False)],
    ids=["no-openmp", "no-native-arch"],
)
def test_a_compiler_rejecting_flags_gets_a_simpler_build(tmp_path, rejected, openmp):
    # A compiler like Apple clang: it fails on `rejected` and builds without it.
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nfor arg; do [ "$arg" = "{rejected}" ] && exit 1; done\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    info = load_in_fresh_process(tmp_path / "cache", CC=str(wrapper))
    assert info["available"] and not info["cached"]
    assert info["openmp"] is openmp
    assert info["kernels"] == "native"
    assert info["warnings"] == []


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_build_info_says_what_the_build_uses(tmp_path):
    info = load_in_fresh_process(tmp_path / "cache")
    assert all(isinstance(info[feature], bool) for feature in ("openmp", "avx512", "avx2"))
