"""What every benchmark script reports beside its timings (versions, percentiles, CSV and markdown), and the
interleaved-rounds timing two of them share.

Imported by the scripts in this folder as ``from reporting import ...``; run nothing here.
"""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

OPTIONAL_PACKAGES = ("attnorm", "entmax", "triton", "liger_kernel", "adasplash")


def versions(device: str) -> str:
    """``name=version;...`` for python, torch, the installed optional packages, threads and GPU."""
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for package in OPTIONAL_PACKAGES:
        try:
            found[package] = importlib.metadata.version(package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            continue
    if commit := attnorm_commit():
        found["attnorm_commit"] = commit
    found["threads"] = str(torch.get_num_threads())
    if device == "cuda":
        found["gpu"] = torch.cuda.get_device_name()
    return ";".join(f"{name}={value}" for name, value in found.items())


def attnorm_commit() -> str | None:
    """The git commit of the attnorm checkout in use (``+dirty`` when attnorm/ has changes), if any."""
    spec = importlib.util.find_spec("attnorm")
    if spec is None or spec.origin is None:
        return None
    package = Path(spec.origin).parent
    git = ["git", "-C", str(package)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        changes = subprocess.run([*git, "status", "--porcelain", "--", "."], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit.stdout.strip() + ("+dirty" if changes.stdout.strip() else "")


def percentiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, p20, p80) of ``samples``."""
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    cuts = statistics.quantiles(samples, n=10, method="inclusive")
    return statistics.median(samples), cuts[1], cuts[7]


def write_csv(path: Path, rows: Iterable[dict], columns: Sequence[str]) -> None:
    """Rows as CSV with fixed ``columns`` (missing cells empty), floats to 4 decimals."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows({key: round(value, 4) if isinstance(value, float) else value for key, value in row.items()}
                         for row in rows)


def error_text(error: BaseException) -> str:
    """One line naming an exception, fit for a CSV cell or a markdown table."""
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0] if message else ''}".replace("|", "/")[:300]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table from a header and rows of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def timed(run: Callable[[], object], device: str) -> float:
    """Seconds one call of ``run`` takes (CUDA: synchronised before and after)."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def interleaved(providers: dict, device: str, rounds: int) -> tuple[dict, dict]:
    """``(times, errors)``: each provider called once (warm-up; one that raises becomes an error, its
    text by key, and is left out), then ``rounds`` rounds that call every provider once in turn."""
    providers, errors = dict(providers), {}
    for key, run in list(providers.items()):
        try:
            run()  # warm-up (and compilation on CUDA)
        except Exception as error:  # noqa: BLE001 - a failing provider becomes an error row
            errors[key] = error_text(error)
            del providers[key]
    times = {key: [] for key in providers}
    for _ in range(rounds):
        for key, run in providers.items():
            times[key].append(timed(run, device))
    return times, errors
