"""``python -m attnorm.diagnostics`` without the diagnostics extra: --help works, a run names the extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BLOCK_EXTRAS = """
import runpy, sys
for name in ('numpy', 'scipy', 'tqdm', 'transformers', 'matplotlib'):
    sys.modules[name] = None  # as if not installed: importing it raises ModuleNotFoundError
sys.argv = ['attnorm.diagnostics', *sys.argv[1:]]
runpy.run_module('attnorm.diagnostics', run_name='__main__', alter_sys=True)
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", BLOCK_EXTRAS, *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_help_and_missing_extra_message():
    shown = _run("--help")
    assert shown.returncode == 0, shown.stderr
    assert "gradient" in shown.stdout
    failed = _run("gradient", "--quick")
    assert failed.returncode == 1
    # torch itself warns once that it found no NumPy; attnorm's message is the last line, on its own.
    message = "attnorm.diagnostics needs 'numpy': pip install 'attnorm[diagnostics]'"
    assert failed.stderr.strip().splitlines()[-1] == message
    assert "Traceback" not in failed.stderr
