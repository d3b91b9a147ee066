"""Test-wide set-up.

Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter,
which must be switched on before ``triton`` is imported.  :data:`DEVICE` (and the
``device`` fixture) is where tests build the tensors they hand to the Triton
kernels: CUDA when there is a GPU, else the CPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    """Where Triton test tensors live: "cuda" when available, else "cpu" (interpreter)."""
    return DEVICE
