"""Building, caching and loading the native kernels (attnorm.kernels.cpu.build), each case in
a fresh process with a fresh ``ATTNORM_CACHE_DIR``.

The first load builds the library and a later process reuses it; a truncated or empty
cached library is rebuilt (never mapped); ``CC`` may carry flags; without a compiler
``usable()`` is False with one warning; concurrent first calls build once.
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

# Prints build_info() as JSON, with usable(), the warnings loading raised and the
# result of a softmax call checked against torch.softmax when the kernels load.
PROBE = """
import json, warnings
import torch
from attnorm.kernels import rules
from attnorm.kernels.cpu import build, native

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    usable = build.usable()
    build.usable()
info = build.build_info()
if usable:
    x = torch.randn(4, 300, dtype=torch.float64)
    y, _, _ = native.softmax_forward(x, rules.RowMask(), 0, 0.7, 0.0)
    torch.testing.assert_close(y, torch.softmax(x / 0.7, -1))
info["usable"] = usable
info["warnings"] = [str(warning.message) for warning in caught]
print(json.dumps(info))
"""

# Eight threads make their first native call at once.
THREADS = """
import json, threading
import torch
from attnorm.kernels import rules
from attnorm.kernels.cpu import build, native

barrier, results = threading.Barrier(8), []
def call():
    barrier.wait()
    x = torch.randn(3, 50)
    results.append(bool(torch.allclose(native.entmax_forward(x, rules.RowMask(), 1.5)[0].sum(-1), torch.ones(3))))
workers = [threading.Thread(target=call) for _ in range(8)]
for worker in workers:
    worker.start()
for worker in workers:
    worker.join()
print(json.dumps({"results": results, **build.build_info()}))
"""


def run_fresh(cache: Path, script: str = PROBE, **environment: str) -> dict:
    """The JSON line ``script`` prints in a new Python process with ATTNORM_CACHE_DIR=cache;
    ``environment`` overrides variables (ATTNORM_NATIVE and CC are unset otherwise)."""
    env = {name: value for name, value in os.environ.items() if name not in ("ATTNORM_NATIVE", "CC")}
    env.update(ATTNORM_CACHE_DIR=str(cache), **environment)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    return json.loads(result.stdout.splitlines()[-1])


def libraries(cache: Path) -> list[Path]:
    return sorted(cache.glob("attnorm_rows_*.so"))


pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def test_first_load_builds_and_later_processes_reuse_it(tmp_path):
    first = run_fresh(tmp_path)
    assert first["usable"] and first["available"] and not first["cached"] and not first["warnings"]
    assert [path.name for path in libraries(tmp_path)] == [Path(first["path"]).name]
    assert (tmp_path / (Path(first["path"]).name + ".sha256")).is_file()
    assert not [path for path in tmp_path.iterdir() if path.is_dir()]  # no scratch directory left behind
    second = run_fresh(tmp_path)
    assert second["usable"] and second["cached"] and second["path"] == first["path"]


SLOW_DAMAGE = [pytest.param(damage, marks=pytest.mark.slow) for damage in ("empty", "garbage")]  # a rebuild each


@pytest.mark.parametrize("damage", ["truncated", *SLOW_DAMAGE])
def test_a_damaged_cached_library_is_rebuilt(tmp_path, damage):
    path = Path(run_fresh(tmp_path)["path"])
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 3], "empty": b"", "garbage": b"\x7fELF" + b"\0" * 100}[damage])
    again = run_fresh(tmp_path)  # would die with SIGBUS if the damaged file were mapped
    assert again["usable"] and not again["cached"] and not again["warnings"]
    assert path.read_bytes() == data or len(path.read_bytes()) > 0
    assert run_fresh(tmp_path)["cached"]


@pytest.mark.slow
def test_a_library_without_its_checksum_is_rebuilt(tmp_path):
    path = Path(run_fresh(tmp_path)["path"])
    path.with_name(path.name + ".sha256").unlink()
    again = run_fresh(tmp_path)
    assert again["usable"] and not again["cached"]


@pytest.mark.slow  # two builds, ~20 s
def test_compiler_with_flags(tmp_path):
    info = run_fresh(tmp_path, CC="cc -O0 -DATTNORM_TEST_FLAG=1")
    assert info["usable"] and info["compiler"] == "cc -O0 -DATTNORM_TEST_FLAG=1"
    plain = run_fresh(tmp_path)  # another compiler command, another library
    assert plain["usable"] and plain["path"] != info["path"]


def test_no_compiler_means_unusable_with_one_warning(tmp_path):
    info = run_fresh(tmp_path, CC="/nonexistent/cc")
    assert not info["usable"] and not info["available"]
    assert "no C compiler" in info["reason"]
    assert len(info["warnings"]) == 1 and "unavailable" in info["warnings"][0]
    assert not libraries(tmp_path)


@pytest.mark.slow
def test_a_failing_compiler_means_unusable_with_one_warning(tmp_path):
    info = run_fresh(tmp_path, CC="cc -DNOT_A_FLAG -fthis-flag-does-not-exist")
    assert not info["usable"] and len(info["warnings"]) == 1 and "failed" in info["reason"]


def test_disabled_by_environment_without_warning(tmp_path):
    info = run_fresh(tmp_path, ATTNORM_NATIVE="0")
    assert not info["usable"] and info["reason"] == "disabled by ATTNORM_NATIVE=0" and not info["warnings"]


def test_concurrent_first_calls_build_once(tmp_path):
    log = tmp_path / "compiler.log"
    wrapper = tmp_path / "counting-cc"
    wrapper.write_text(f'#!/bin/sh\necho run >> "{log}"\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    info = run_fresh(tmp_path / "cache", THREADS, CC=str(wrapper))
    assert info["results"] == [True] * 8 and info["available"]
    assert log.read_text().count("run") == 1



def test_a_packed_call_with_the_wrong_slot_count_is_refused(monkeypatch):
    """C checks the count Python packs before it reads a slot, and the caller names the kernel."""
    import ctypes
    import struct

    import torch

    from attnorm.kernels.cpu import native

    build = native.build  # the module native calls through (other tests may re-import attnorm)
    if not build.usable():
        pytest.skip("no native kernels on this machine")
    entry = build.library().attnorm_softmax_forward_packed_f32
    slots = len(build.SIGNATURES["attnorm_softmax_forward"])
    short = struct.pack("=q", slots - 1) + bytes(8 * (slots - 1))
    assert entry(ctypes.c_char_p(short)) == build.PACKED_MISMATCH
    # A caller that packs every argument but states one slot fewer: C must refuse it.
    layout = "=" + "".join(build._SLOTS[kind] for kind in build.SIGNATURES["attnorm_softmax_forward"])
    monkeypatch.setattr(build, "kernel", lambda name, dtype: lambda *arguments: entry(
        struct.pack("=q", slots - 1) + struct.pack(layout, *arguments)))
    x, y, multiplier = torch.zeros(1, 2), torch.full((1, 2), float("nan")), torch.full((1,), float("nan"))
    with pytest.raises(RuntimeError, match="attnorm_softmax_forward was built for other arguments"):
        native._launch("attnorm_softmax_forward", torch.float32, x.data_ptr(), y.data_ptr(), 1, 2, 0, 1.0, 0, 0.0, 0,
                       multiplier.data_ptr(), 0, float("-inf"), 0, 0, 0.0, 0, 0, 0)
    assert y.isnan().all() and multiplier.isnan().all()  # nothing was written


# The process's first attnorm call, which loads the library, comes inside a transform or mode.
FIRST_CALL_INSIDE = """
import json
import torch
import attnorm
from attnorm.kernels.cpu import build

x = torch.randn(3, 5, dtype=torch.float64)
case = {case!r}
if case == "func.grad":
    got = torch.func.grad(lambda s: attnorm.Softmax(0.7)(s)[0, 1])(x)
    want = torch.func.grad(lambda s: torch.softmax(s / 0.7, -1)[0, 1])(x)
elif case == "func.jvp":
    got = torch.func.jvp(attnorm.Softmax(0.7), (x,), (x.cos(),))[1]
    want = torch.func.jvp(lambda s: torch.softmax(s / 0.7, -1), (x,), (x.cos(),))[1]
elif case == "jit.trace":
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(attnorm.Softmax(0.7), x, check_trace=False)
    assert not [w for w in caught if w.filename == build.__file__], [str(w.message) for w in caught]
    got, want = traced(x.flip(0)), torch.softmax(x.flip(0) / 0.7, -1)
else:
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.randn(3, 5)
        assert attnorm.Sparsemax()(fake).shape == (3, 5)
    got, want = attnorm.Sparsemax()(x), attnorm.Sparsemax(backend="reference")(x)
torch.testing.assert_close(got, want)
print(json.dumps(build.build_info()))
"""


# func.jvp shares func.grad's cause (functorch's wrappers); each case is a new process (~9 s).
@pytest.mark.parametrize("case", ["func.grad",
                                  *(pytest.param(c, marks=pytest.mark.slow)
                                    for c in ("FakeTensorMode", "func.jvp", "jit.trace"))])
def test_the_first_call_of_a_process_may_come_inside_a_transform_or_mode(case, tmp_path):
    """Loading probes the library with a known call; inside ``torch.func.grad``/``jvp`` its new
    buffers were functorch wrappers (no data pointer: a RuntimeError), under a fake mode fake,
    and ``torch.jit.trace`` recorded the probe and warned about its checks.

    The library is built first into a cache of the test's own: the shared one may be rebuilt by
    another test process meanwhile (seen with 15 workers on a fresh machine), which is not this case."""
    from attnorm.kernels.cpu import native

    if not native.build.usable():
        pytest.skip("no native kernels on this machine")
    assert run_fresh(tmp_path)["available"]
    info = run_fresh(tmp_path, FIRST_CALL_INSIDE.format(case=case))
    assert info["available"] and info["cached"]
