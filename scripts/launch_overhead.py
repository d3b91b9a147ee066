"""Host time of attnorm's eager Triton calls without a GPU: Triton's launch against the direct launch.

An eager call on CUDA costs host time in three places: attnorm's Python (checks, the op,
the launcher arguments), Triton's ``JITFunction.run`` (binding and specialising the
arguments, the cache key, the launch metadata) and the driver's launch itself.  The
first two are Python and can be timed on any machine: this script installs a stand-in
Triton driver (device 0, stream 0, sm_90 as the target, a launcher that launches
nothing), so Triton compiles each kernel for sm_90 offline and then runs its whole
launch path except the driver call, on CPU tensors.  Each call is timed with
:mod:`attnorm.kernels.fast_launch` off (Triton's path) and on (the direct launch, and
the replay of :mod:`attnorm.kernels.triton.replay`), interleaved, best of several rounds.

What it leaves out: the driver's launch (a few microseconds on a GPU machine), CUDA's
own allocator and stream queries (CPU tensors here), and the CPU's speed (the ratio
carries over better than the microseconds).  ``benchmarks/bench_overhead.py --device
cuda --triton-launch`` measures the real thing on a GPU.

Usage::

    PYTHONPATH=. python scripts/launch_overhead.py                # every module, no grad and requires grad
    PYTHONPATH=. python scripts/launch_overhead.py --out benchmarks/results
    PYTHONPATH=. python scripts/launch_overhead.py --modules Sparsemax --no-decoding --calls 5 --rounds 1

Writes ``launch_overhead_cpu.md`` into ``--out`` when given.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JITFunction objects, not the interpreter's

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

MODULES: dict[str, Callable[[], torch.nn.Module]] = {}
GROWTH = 4096
"""KV lengths a growing-cache case steps through before it wraps (more than the replay remembers)."""
DECODING: dict[str, torch.nn.Module] = {}


class _Utils:
    """What Triton asks of the driver when it loads a compiled kernel."""

    def load_binary(self, name, kernel, shared, device):
        return (1, 2, 32, 0, 1024)  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}


class _Launcher:
    """A compiled kernel's launcher that launches nothing."""

    def __init__(self, src, metadata):
        pass

    def __call__(self, *args):
        pass


class StandInDriver:
    """Device 0, stream 0, an sm_90 target; kernels compile for real and are never launched."""

    def __init__(self):
        self.launcher_cls = _Launcher
        self.utils = _Utils()

    def is_active(self):
        return True

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_device_capability(self, device=0):
        return (9, 0)


def install() -> None:
    """The stand-in driver, Triton on CPU tensors, and the direct launch's device and stream."""
    import attnorm
    from attnorm.kernels import backends, fast_launch, shortcut

    driver.set_active(StandInDriver())
    backends._triton_interpreted = lambda: True  # backend="triton" takes CPU tensors (no kernel runs)
    fast_launch._device_and_stream = lambda: (0, 0)
    shortcut.DEVICE_TYPES = frozenset({"cuda", "cpu"})  # CPU tensors stand for CUDA ones here
    MODULES.update({
        "Softmax": lambda: attnorm.Softmax(backend="triton"),
        "Sparsemax": lambda: attnorm.Sparsemax(backend="triton"),
        "Entmax(1.5)": lambda: attnorm.Entmax(1.5, backend="triton"),
        "TopKSoftmax(k=4)": lambda: attnorm.TopKSoftmax(4, backend="triton"),
        "SelfAdjustedSoftmax": lambda: attnorm.SelfAdjustedSoftmax(backend="triton"),
        "ScalableSoftmax": lambda: attnorm.ScalableSoftmax(backend="triton"),
    })
    DECODING.update({  # the rows route (scores, row kernel, w v) and, for Self-Adjusted, the split-K kernel
        "Sparsemax": attnorm.Sparsemax(backend="triton"),
        "Entmax(1.5)": attnorm.Entmax(1.5, backend="triton"),
        "TopKSoftmax(k=4)": attnorm.TopKSoftmax(4, backend="triton"),
        "SelfAdjustedSoftmax": attnorm.SelfAdjustedSoftmax(backend="triton"),
        "ScalableSoftmax": attnorm.ScalableSoftmax(backend="triton"),  # SDPA; a bool mask: the count kernel first
    })


LAYERS = 12
"""Attention layers per generation step in the many-layer growing-cache case."""


def _growing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, normalizer: torch.nn.Module,
             layers: int = 1) -> Callable[[], object]:
    """A decoding step whose KV cache is one key longer than the step before (from 64, wrapping after GROWTH).

    With ``layers > 1`` the step runs that many attention layers, each on a cache of its own
    of the step's length (as a model's layers are): the step's shapes repeat once per layer.
    """
    import attnorm

    lengths = itertools.count()
    caches = [(k, v)] + [(k.clone(), v.clone()) for _ in range(layers - 1)]

    def step():
        n = 64 + next(lengths) % GROWTH
        for k_layer, v_layer in caches:
            out = attnorm.attention(q, k_layer[:, :, :n], v_layer[:, :, :n], normalizer)
        return out

    return step


def best_us(call: Callable[[], object], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def measure(calls: int, rounds: int, names: list[str] | None = None,
            decoding: bool = True) -> list[tuple[str, str, float, float]]:
    """``(call, input, Triton's launch us, direct launch us)`` per module and input, interleaved."""
    import attnorm
    from attnorm.kernels import fast_launch

    cases = {}
    for name, make in MODULES.items():
        if names and name not in names:
            continue
        module = make()
        for grad in (False, True):
            x = torch.randn(4, 16, requires_grad=grad)
            cases[(name, "requires grad" if grad else "no grad")] = lambda module=module, x=x: module(x)
    if decoding:
        # float16, not bfloat16: off CUDA the kernels read bfloat16 as float32 copies (a torch operation per
        # call, which no replay repeats), so a bfloat16 step here would time copies a GPU never makes.
        q = torch.randn(2, 4, 1, 64, dtype=torch.float16)
        k, v = (torch.randn(2, 4, 64, 64, dtype=torch.float16) for _ in range(2))
        mask = attnorm.causal_mask(63)  # a decoding step's: every key allowed
        # a left-padded batch's step: the (B, 1, 1, Lk) bool mask Hugging Face passes
        padded = (torch.arange(64) >= torch.tensor([0, 40])[:, None]).reshape(2, 1, 1, 64)
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.bfloat16)  # gpt-oss's: one per query head
        for name, normalizer in DECODING.items():
            if names and name not in names:
                continue
            cases[(f"attention({name}) decoding", "no grad")] = (
                lambda normalizer=normalizer: attnorm.attention(q, k, v, normalizer, attn_mask=mask))
            if name != "SelfAdjustedSoftmax":
                cases[(f"attention({name}) decoding, padded batch", "no grad")] = (
                    lambda normalizer=normalizer: attnorm.attention(q, k, v, normalizer, attn_mask=padded))
                cases[(f"attention({name}) decoding, sinks per head", "no grad")] = (
                    lambda normalizer=normalizer: attnorm.attention(q, k, v, normalizer, attn_mask=mask, sinks=sinks))
        # generation: the KV cache one key longer every call, a new shape each time (never replayed)
        # (one head of width 16: the CPU's own products stay small beside the host time at any length)
        qg = torch.randn(1, 1, 1, 16, dtype=torch.float16)
        kc, vc = (torch.randn(1, 1, 64 + GROWTH, 16, dtype=torch.float16) for _ in range(2))
        for name, normalizer in DECODING.items():
            if names and name not in names or name == "SelfAdjustedSoftmax":
                continue
            cases[(f"attention({name}) decoding, growing KV", "no grad")] = _growing(qg, kc, vc, normalizer)
            cases[(f"attention({name}) decoding, growing KV, {LAYERS} layers (per layer)", "no grad")] = _growing(
                qg, kc, vc, normalizer, LAYERS)
    per_call = {case: LAYERS if "layers" in case[0] else 1 for case in cases}
    results = {case: [float("inf"), float("inf")] for case in cases}
    initial = fast_launch.enabled()
    for switch in (False, True):  # compile every variant and keep it before timing
        fast_launch.set_enabled(switch)
        for call in cases.values():
            call()
            call()
    for _ in range(rounds):
        for switch in (False, True):
            fast_launch.set_enabled(switch)
            for case, call in cases.items():
                results[case][switch] = min(results[case][switch],
                                            best_us(call, max(1, calls // per_call[case]), 1) / per_call[case])
    fast_launch.set_enabled(initial)
    return [(*case, *results[case]) for case in cases]


def report(rows: list[tuple[str, str, float, float]]) -> str:
    lines = ["| call | input | Triton's launch (us) | direct launch + replay (us) | saved (us) |",
             "|---|---|---|---|---|"]
    for name, kind, slow, fast in rows:
        lines.append(f"| {name} | {kind} | {slow:.1f} | {fast:.1f} | {slow - fast:.1f} |")
    stamp = f"triton {triton.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, CPU tensors"
    return "\n".join(lines) + f"\n\n{stamp}; stand-in driver (no launch), best of rounds.\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per timed block")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the best block counts)")
    parser.add_argument("--modules", nargs="+", help="module names (default: all)")
    parser.add_argument("--no-decoding", action="store_true", help="leave out the decoding attention calls")
    parser.add_argument("--out", type=Path, help="write launch_overhead_cpu.md here")
    args = parser.parse_args(argv)
    install()
    table = report(measure(args.calls, args.rounds, args.modules, not args.no_decoding))
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "launch_overhead_cpu.md").write_text(
            "Host time per eager call on a 4x16 tensor (and decoding attention calls), Triton's launch path "
            "against attnorm's direct launch, without a GPU (`scripts/launch_overhead.py`).\n\n" + table
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
