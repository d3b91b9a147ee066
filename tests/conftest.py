"""Test-wide set-up.

Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter,
which must be switched on before ``triton`` is imported.  :data:`DEVICE` (and the
``device`` fixture) is where tests build the tensors they hand to the Triton
kernels: CUDA when there is a GPU, else the CPU.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def central_difference(f, primals: tuple, tangents: tuple, eps: float = 1e-6) -> torch.Tensor:
    """``(f(p + eps t) - f(p - eps t)) / (2 eps)``: the directional derivative forward-mode tests compare with."""
    with torch.no_grad():
        plus = f(*(p + eps * t for p, t in zip(primals, tangents, strict=True)))
        minus = f(*(p - eps * t for p, t in zip(primals, tangents, strict=True)))
    return (plus - minus) / (2 * eps)


def slow_under_interpreter(keep: bool):
    """Marks for a Triton case: none with CUDA or when ``keep``; else ``slow`` (the interpreter runs it)."""
    return () if keep or DEVICE == "cuda" else pytest.mark.slow


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items) -> None:
    """Under the interpreter, top-k's multi-pass select (a radix select over the key blocks) costs
    5-12 s a case: the default run keeps the first multi-pass top-k case of each test function,
    ``-m slow`` the others.  With a GPU every case runs."""
    if DEVICE == "cuda":
        return
    kept = set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or "multi-pass" not in callspec.id or "topk" not in item.name:
            continue
        if item.get_closest_marker("slow") is None:
            function = item.nodeid.split("[")[0]
            if function in kept:
                item.add_marker(pytest.mark.slow)
            kept.add(function)


@pytest.fixture
def device() -> str:
    """Where Triton test tensors live: "cuda" when available, else "cpu" (interpreter)."""
    return DEVICE


@pytest.fixture
def force_blocked(monkeypatch) -> None:
    """attention()'s blocked route takes every call it can, one query row per block."""
    import attnorm.routes.blocked as blocked

    monkeypatch.setattr(blocked, "MIN_BLOCK_BYTES", 1)
    monkeypatch.setattr(blocked, "BLOCKS_PER_INPUTS", 10**9)


def fused_blocks(monkeypatch, size: int) -> None:
    """Fused attention kernels take query and key blocks of ``size`` on every device (CUDA and interpreter)."""
    from attnorm.kernels.triton import attention_launch

    monkeypatch.setattr(attention_launch, "BLOCK_INTERPRETED", size)
    monkeypatch.setattr(attention_launch, "BLOCK_CUDA", size)


@pytest.fixture
def blocks_of_32(monkeypatch) -> None:
    """Blocks of 32 on every device (CUDA's 64 scaled down; several blocks per test)."""
    fused_blocks(monkeypatch, 32)


@pytest.fixture
def blocks_of_16(monkeypatch) -> None:
    """Blocks of 16 on every device (the interpreter's; CUDA's 64 shrunk), for tests whose shapes place
    key-block boundaries."""
    fused_blocks(monkeypatch, 16)


@pytest.fixture
def launched_kernels(monkeypatch) -> dict:
    """Every Triton launch through ``launch.launchable`` from now on: kernel name -> its keyword arguments."""
    from attnorm.kernels.triton import launch

    seen = {}
    plain = launch.launchable

    class Recorded:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen[self.kernel.__name__] = kwargs
                return plain(self.kernel)[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(launch, "launchable", Recorded)
    return seen


def poisoned_empty(shape, dtype, device) -> torch.Tensor:
    """``launch.empty`` for tests: outputs made NaN, so an element a kernel leaves unwritten shows.

    Made filled rather than filled in place (the version counter stays 0) and noted as an
    output of the call being recorded (:mod:`attnorm.kernels.triton.replay`), so replays run
    poisoned too.
    """
    from attnorm.kernels import fast_launch

    out = torch.full(shape, math.nan, dtype=dtype, device=device)
    fast_launch.note_output(out)
    return out


REPLAY_CHECK = os.environ.get("ATTNORM_TEST_REPLAY", "0") == "1"
"""Run the suite's Triton calls through the direct launch and its replays (CPU only; ``tests/kernels/standin.py``)."""


@pytest.fixture(autouse=True, scope="session")
def direct_launch_stand_in():
    """With ``ATTNORM_TEST_REPLAY=1`` and no CUDA: every launched kernel a JIT function whose compiled launcher
    runs the interpreter, and the direct launch on, so each Triton call is recorded and then replayed."""
    if not REPLAY_CHECK or torch.cuda.is_available():
        yield
        return
    from tests.kernels import standin

    with pytest.MonkeyPatch.context() as patch:
        standin.install(patch)
        yield
