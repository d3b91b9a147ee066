"""Experiment plumbing on synthetic attention (a stand-in for capture), the gradient command, token windows."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from torch import nn

from attnorm.diagnostics import experiments, selection_distance
from attnorm.diagnostics.__main__ import main
from attnorm.diagnostics.capture import AttentionRecord
from attnorm.diagnostics.models import default_model_path, is_causal_model, load_model, max_length, token_windows

LAYERS, HEADS, DIM = 2, 3, 4


class FakeModel(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.is_causal = causal


def synthetic_records(input_ids: torch.Tensor) -> list[AttentionRecord]:
    """Attention a model could produce, seeded by the window's first token id."""
    generator = torch.Generator().manual_seed(int(input_ids[0, 0]))
    length = input_ids.shape[-1]
    records = []
    for layer in range(LAYERS):
        weights = torch.softmax(3 * torch.randn(1, HEADS, length, length, generator=generator), dim=-1)
        vectors = torch.randn(1, HEADS, length, DIM, generator=generator)
        records.append(AttentionRecord(layer, vectors, vectors, vectors, weights))
    return records


@pytest.fixture(scope="module")
def tokenizer():
    return load_model()[1]


@pytest.fixture
def fake_run(monkeypatch, tokenizer):
    monkeypatch.setattr(experiments, "capture", lambda model, inputs, normalizer: synthetic_records(inputs))
    text = " ".join(f"word{i}" for i in range(400))
    return experiments.ModelRun(FakeModel(causal=False), tokenizer, text, windows=2, queries=None, progress=False)


def test_head_measures_average_over_windows_and_queries(fake_run):
    measures = {"distance": lambda w, v: selection_distance(w, v, 2)}
    got = experiments.head_measures(fake_run, "softmax", 16, measures)["distance"]
    expected = np.zeros((LAYERS, HEADS))
    windows = token_windows(fake_run.tokenizer, fake_run.text, 16, 2)
    for window in windows:
        for record in synthetic_records(window[None]):
            for head in range(HEADS):
                for query in range(16):
                    row = selection_distance(record.weights[0, head, query][None], record.value[0, head], 2)
                    expected[record.layer, head] += row.item() / 16 / len(windows)
    assert got.shape == (LAYERS, HEADS)
    assert np.allclose(got, expected)


def test_causal_models_use_the_last_query(fake_run):
    fake_run.model = FakeModel(causal=True)
    got = experiments.head_measures(fake_run, "softmax", 16, {"max": lambda w, v: w.amax(-1)})["max"]
    windows = token_windows(fake_run.tokenizer, fake_run.text, 16, 2)
    expected = sum(
        np.stack([record.weights[0, :, -1].amax(-1).numpy() for record in synthetic_records(window[None])])
        for window in windows
    ) / len(windows)
    assert np.allclose(got, expected)


def test_model_experiments_rows(fake_run):
    summary = experiments.summary_experiment(fake_run, ["softmax"], [16, 32], top_n=2)
    assert len(summary) == 2 * LAYERS * HEADS
    assert all(0 <= row["normalized_entropy"] <= 1 for row in summary)
    rows, critical = experiments.distance_experiment(
        fake_run, ["softmax"], [16, 32], [1, 2, 4, 64], fixed_n=2, samples=2
    )
    assert [(row["sweep"], row["length"], row["top_n"]) for row in rows] == [
        ("length", 16, 2), ("length", 32, 2), ("top_n", 32, 1), ("top_n", 32, 2), ("top_n", 32, 4)
    ]
    assert critical[0]["length"] == 32
    separable = experiments.separability_experiment(fake_run, ["softmax"], [16], [1, 4])
    assert [row["top_n"] for row in separable] == [1, 4]
    assert all(0 <= row["separable_fraction"] <= 1 for row in separable)


def test_gradient_command_writes_csv_and_png(tmp_path, capsys):
    arguments = ["gradient", "--quick", "--trials", "8", "--out", str(tmp_path), "--no-progress",
                 "--normalizer", "softmax", "sparsemax"]
    assert main(arguments) == 0
    with (tmp_path / "gradient.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 * 9 * 3
    assert {"temperature", "eps", "g_mean", "jacobian_spectral_max"} <= set(rows[0])
    assert (tmp_path / "gradient.png").stat().st_size > 1000
    assert (tmp_path / "gradient_slopes.csv").exists()
    assert "Lemma 2" in capsys.readouterr().out


def test_gradient_rows_follow_one_over_temperature_for_tied_logits():
    rows = experiments.gradient_experiment(["softmax"], [1e-3, 1e-2], [1e-6], length=8, trials=4, logit_std=0.0,
                                           progress=False)
    # Equal logits: J = (I/L - 1/L^2) / T, so g = ||v - mean(v)|| / (L T) and ||J||_2 = 1 / (L T).
    assert rows[0]["jacobian_spectral_max"] == pytest.approx(1 / (8 * 1e-3))
    assert rows[0]["g_mean"] / rows[1]["g_mean"] == pytest.approx(10, rel=1e-3)
    slope = experiments.gradient_slopes(rows)[0]["slope_g_mean"]
    assert slope == pytest.approx(-1, abs=1e-3)


def test_token_windows_and_model_facts(tokenizer):
    windows = token_windows(tokenizer, "the light turns " * 50, 16, 3)
    assert windows.shape == (3, 16)
    assert (windows[:, 0] == tokenizer.cls_token_id).all() and (windows[:, -1] == tokenizer.sep_token_id).all()
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(tokenizer, "too short", 64, 1)
    assert default_model_path().joinpath("config.json").exists()


def test_causality_and_max_length_from_configs():
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    gpt2 = GPT2Model(GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=64, vocab_size=50))
    bert = BertModel(BertConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=8, intermediate_size=16,
                                max_position_embeddings=32, vocab_size=50))
    assert is_causal_model(gpt2) and not is_causal_model(bert)
    assert (max_length(gpt2), max_length(bert)) == (64, 32)


@pytest.mark.parametrize("experiment", ["summary", "distance", "separability", "gradient"])
def test_quick_command_under_a_minute(tmp_path, experiment):
    import time

    pytest.importorskip("attnorm.integrations.transformers")
    started = time.perf_counter()
    assert main([experiment, "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    assert time.perf_counter() - started < 60
    with (tmp_path / f"{experiment}.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) > 0
    assert (tmp_path / f"{experiment}.png").read_bytes().startswith(b"\x89PNG")
