"""The paper's lemmas (Mudarisov et al., arXiv 2508.17821) as properties of the normalizers.

Lemma 1 (vanishing attention): softmax with temperature T over logits in [a, b] gives
every weight in [e^{-(b-a)/T} / L, e^{(b-a)/T} / L], so the largest weight decays like 1/L.
Scalable-Softmax, top-k, sparsemax and entmax escape it (bounds derived below).

Lemma 2 (gradient sensitivity): for a = F(x) / sum F(x) with F elementwise,
J = (diag(F'(x)) - a F'(x)^T) / sum F(x).  For softmax(x / T) every entry of J is at most
1/(4T) and its spectral norm at most 1/(2T) (the paper writes 1/(4T) for "the norm"; that
holds entrywise, the spectral norm reaches 1/(2T) at two equal dominant logits).  Sparsemax's
Jacobian is the projection diag(s) - s s^T / |S| (s the support indicator).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnorm

SETTINGS = settings(max_examples=40, deadline=None)

lengths = st.integers(1, 4000)
seeds = st.integers(0, 2**31 - 1)


def uniform(low: float, high: float, size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand(size, generator=generator, dtype=torch.float64)


def jacobian(module: attnorm.Normalizer, x: torch.Tensor) -> torch.Tensor:
    """Autograd Jacobian of one row, J[i, j] = d out_i / d x_j."""
    return torch.autograd.functional.jacobian(module, x, vectorize=True)


def spectral_norm(matrix: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(matrix, ord=2))


# ---------------------------------------------------------------- Lemma 1


@SETTINGS
@given(
    length=lengths,
    low=st.floats(-30, 30),
    width=st.floats(0, 8),
    temperature=st.floats(0.25, 10),
    seed=seeds,
)
def test_lemma1_softmax_weights_lie_within_exp_spread_over_length(length, low, width, temperature, seed):
    x = uniform(low, low + width, length, seed)
    x[0], x[-1] = low, low + width  # the interval's ends are attained
    out = attnorm.Softmax(temperature)(x)
    spread = math.exp(width / temperature)
    assert float(out.min()) >= (1 - 1e-12) / (spread * length)
    assert float(out.max()) <= (1 + 1e-12) * spread / length


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_lemma1_bounds_are_approached_by_a_lone_extreme_logit(temperature):
    length, width = 100_000, 3.0
    spread = math.exp(width / temperature)
    top = torch.zeros(length, dtype=torch.float64)
    top[0] = width  # one logit at b, the rest at a: its weight -> e^{(b-a)/T} / L as L grows
    assert float(attnorm.Softmax(temperature)(top)[0]) >= 0.99 * spread / length
    bottom = torch.full((length,), width, dtype=torch.float64)
    bottom[0] = 0.0  # one logit at a, the rest at b: its weight -> e^{-(b-a)/T} / L
    assert float(attnorm.Softmax(temperature)(bottom)[0]) >= 0.99 / (spread * length)


def test_lemma1_max_weight_vanishes_like_one_over_length():
    max_weights = []
    for length in (10, 100, 1000, 10_000):
        x = uniform(0.0, 2.0, length, seed=length)
        max_weights.append(float(attnorm.Softmax()(x).max()))
        assert max_weights[-1] <= math.exp(2.0) / length
    assert max_weights[-1] < 1e-3 < max_weights[0] / 100


def needle_row(length: int, gap: float, spread: float, seed: int) -> torch.Tensor:
    """Key 0 holds ``gap`` above the largest other logit; the others lie in [-spread, 0]."""
    x = uniform(-spread, 0.0, length, seed)
    x[0] = gap
    return x


def ssmax_needle_bound(length: int, s: float, gap: float) -> float:
    """Scalable-Softmax's needle weight (bias 0) is at least 1 / (1 + (n - 1) n^{-s gap}).

    With c = s log n the needle's weight is 1 / (1 + sum_j e^{-c (x_0 - x_j)}) and every
    x_0 - x_j >= gap, so the sum is at most (n - 1) e^{-c gap} = (n - 1) n^{-s gap}.  When
    s gap >= 1 this is < 1, so the weight stays above 1/2 for every n; equality holds when
    all the other logits sit exactly ``gap`` below the needle.
    """
    return 1 / (1 + (length - 1) * length ** (-s * gap))


@SETTINGS
@given(length=st.integers(2, 4000), s=st.floats(0.1, 2.0), excess=st.floats(0, 2), spread=st.floats(0, 5), seed=seeds)
def test_ssmax_keeps_a_needle_above_one_half_when_s_gap_at_least_one(length, s, excess, spread, seed):
    gap = (1 + excess) / s
    x = needle_row(length, gap, spread, seed)
    weight = float(attnorm.ScalableSoftmax(s=s)(x)[0])
    bound = ssmax_needle_bound(length, s, gap)
    assert weight >= bound * (1 - 1e-12)
    assert bound >= 0.5


@pytest.mark.parametrize(("s", "gap"), [(0.43, 1 / 0.43), (0.5, 1.0), (1.0, 1.5)])
@pytest.mark.parametrize("length", [2, 50, 4000])
def test_ssmax_needle_bound_is_exact_when_the_others_tie(s, gap, length):
    x = torch.zeros(length, dtype=torch.float64)
    x[0] = gap
    weight = float(attnorm.ScalableSoftmax(s=s)(x)[0])
    assert weight == pytest.approx(ssmax_needle_bound(length, s, gap), rel=1e-12)


def test_ssmax_needle_survives_where_softmax_fades_under_a_causal_mask():
    # Key 0 is the needle; query i sees n = i + 1 keys, so SSMax's multiplier is s log(i + 1).
    length, s, gap = 3000, 0.5, 2.0
    x = needle_row(length, gap, spread=1.0, seed=0).expand(length, length)
    ssmax = attnorm.ScalableSoftmax(s=s)(x, mask=attnorm.causal_mask())[:, 0]
    softmax = attnorm.Softmax()(x, mask=attnorm.causal_mask())[:, 0]
    assert float(ssmax.min()) >= 0.5
    assert float(softmax[-1]) <= math.exp(gap + 1.0) / length  # Lemma 1 with b - a = gap + spread


@SETTINGS
@given(length=lengths, k=st.integers(1, 16), seed=seeds)
def test_topk_max_weight_at_least_one_over_k_for_any_length(length, k, seed):
    x = uniform(-3, 3, length, seed)
    assert float(attnorm.TopKSoftmax(k)(x).max()) >= (1 - 1e-12) / min(k, length)


@SETTINGS
@given(length=lengths, alpha=st.sampled_from([1.25, 1.5, 2.0]), spread=st.floats(0.1, 10), seed=seeds)
def test_sparse_maps_max_weight_at_least_one_over_support_size(length, alpha, spread, seed):
    x = uniform(-spread, spread, length, seed)
    out = attnorm.Entmax(alpha)(x)
    assert float(out.max()) * int((out > 0).sum()) >= 1 - 1e-9


@SETTINGS
@given(length=lengths, alpha=st.sampled_from([1.25, 1.5, 2.0]), spread=st.floats(0, 10), seed=seeds)
def test_entmax_needle_gets_all_the_weight_for_any_length(length, alpha, spread, seed):
    # p_i = [(alpha - 1) x_i - tau]_+^{1/(alpha-1)} is one-hot exactly when (alpha - 1)(x_0 - x_j) >= 1.
    x = needle_row(length, 1 / (alpha - 1), spread, seed)
    module = attnorm.Sparsemax() if alpha == 2.0 else attnorm.Entmax(alpha)
    out = module(x)
    assert float(out[0]) == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------- Lemma 2


def general_jacobian(values: torch.Tensor, derivative: torch.Tensor) -> torch.Tensor:
    """The paper's J = (diag(F'(x)) - a F'(x)^T) / sum F(x), a = F(x) / sum F(x)."""
    total = values.sum()
    weights = values / total
    return (torch.diag(derivative) - torch.outer(weights, derivative)) / total


@SETTINGS
@given(length=st.integers(1, 48), temperature=st.floats(0.05, 20), scale=st.floats(0.1, 10), seed=seeds)
def test_lemma2_general_jacobian_matches_autograd_for_softmax(length, temperature, scale, seed):
    x = uniform(-scale, scale, length, seed)
    exponential = torch.exp((x - x.max()) / temperature)  # F(x) = e^{x/T}, up to a common factor
    expected = general_jacobian(exponential, exponential / temperature)
    torch.testing.assert_close(jacobian(attnorm.Softmax(temperature), x), expected, rtol=1e-9, atol=1e-12)


@SETTINGS
@given(length=st.integers(1, 48), s=st.floats(-1, 2), bias=st.floats(-1, 1), seed=seeds)
def test_lemma2_general_jacobian_matches_autograd_for_ssmax_at_fixed_n(length, s, bias, seed):
    x = uniform(-3, 3, length, seed)
    multiplier = s * math.log(length) + bias  # F(x) = e^{c x}, F'(x) = c e^{c x}
    exponential = torch.exp(multiplier * (x - x.max()))
    expected = general_jacobian(exponential, multiplier * exponential)
    torch.testing.assert_close(jacobian(attnorm.ScalableSoftmax(s=s, bias=bias), x), expected, rtol=1e-9, atol=1e-12)


@SETTINGS
@given(length=st.integers(2, 48), temperature=st.floats(0.05, 20), scale=st.floats(0.01, 50), seed=seeds)
def test_lemma2_softmax_jacobian_entries_and_spectral_norm_are_bounded(length, temperature, scale, seed):
    x = uniform(-scale, scale, length, seed)
    matrix = jacobian(attnorm.Softmax(temperature), x)
    assert float(matrix.abs().max()) <= (1 + 1e-9) / (4 * temperature)
    assert spectral_norm(matrix) <= (1 + 1e-9) / (2 * temperature)


@pytest.mark.parametrize("temperature", [0.1, 1.0, 7.0])
@pytest.mark.parametrize("length", [2, 16, 300])
def test_lemma2_bounds_are_reached_at_two_equal_dominant_logits(temperature, length):
    x = torch.zeros(length, dtype=torch.float64)
    x[:2] = 25 * temperature  # the other logits carry ~e^{-25} of the mass
    matrix = jacobian(attnorm.Softmax(temperature), x)
    entry_bound, spectral_bound = 1 / (4 * temperature), 1 / (2 * temperature)
    assert 0.99 * entry_bound <= float(matrix.abs().max()) <= entry_bound * (1 + 1e-9)
    assert 0.99 * spectral_bound <= spectral_norm(matrix) <= spectral_bound * (1 + 1e-9)
    assert spectral_norm(matrix) > 1.9 / (4 * temperature)  # 1/(4T) does not bound the spectral norm


def test_sparsemax_jacobian_is_the_support_projection():
    generator = torch.Generator().manual_seed(1)
    for length in (2, 5, 40):
        x = torch.randn(length, dtype=torch.float64, generator=generator)
        support = (attnorm.Sparsemax()(x) > 0).double()
        size = int(support.sum())
        matrix = jacobian(attnorm.Sparsemax(), x)
        expected = torch.diag(support) - torch.outer(support, support) / size
        torch.testing.assert_close(matrix, expected, rtol=0, atol=1e-12)
        eigenvalues = torch.linalg.eigvalsh(matrix)  # ascending: 0 (length - size + 1 times), then 1
        projection_spectrum = torch.cat([torch.zeros(length - size + 1), torch.ones(size - 1)]).double()
        torch.testing.assert_close(eigenvalues, projection_spectrum, rtol=0, atol=1e-12)


@SETTINGS
@given(length=st.integers(2, 48), scale=st.floats(0.01, 20), seed=seeds)
def test_sparsemax_spectral_norm_is_one_with_two_or_more_in_support(length, scale, seed):
    x = uniform(-scale, scale, length, seed)
    size = int((attnorm.Sparsemax()(x) > 0).sum())
    norm = spectral_norm(jacobian(attnorm.Sparsemax(), x))
    assert norm == pytest.approx(1.0 if size >= 2 else 0.0, abs=1e-12)
