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


# ---------------------------------------------------------------- every F / sum F normalizer
#
# For a = F(x) / sum F(x) with F > 0 on [a, b], Lemma 1 reads
#     min F / (L max F) <= a_i <= max F / (L min F)          (min, max of F over [a, b]),
# tight as L grows (one logit at F's argmax, the rest at its argmin, or the reverse).
# Lemma 2's J = (diag(F') - a F'^T) / sum F equals (diag(a) - a a^T) diag(r) with
# r = F' / F = (log F)', and diag(a) - a a^T has spectral norm <= 1/2 and entries <= 1/4, so
#     ||J||_2 <= max_j |r(x_j)| / 2,   |J_ij| <= max_j |r(x_j)| / 4       (j over a_j > 0),
# softmax's 1/(2T) and 1/(4T) when r = 1/T; equality at two equal dominant logits where |r| peaks.


def _softplus(x):
    return torch.log1p(torch.exp(x))


# name: (module, F, F', the x where |F'/F| peaks, that peak, the region F > 0)
FAMILIES = {
    "softmax_T0.5": (lambda: attnorm.Softmax(0.5), lambda x: torch.exp(2 * x), lambda x: 2 * torch.exp(2 * x),
                     0.0, 2.0, None),
    "relu": (lambda: attnorm.make("relu"), lambda x: x.clamp_min(0), lambda x: (x > 0).double(), 0.5, 2.0, 0.0),
    "relu2": (lambda: attnorm.make("relu2"), lambda x: x.clamp_min(0) ** 2, lambda x: 2 * x.clamp_min(0),
              0.5, 4.0, 0.0),
    "softplus": (lambda: attnorm.make("softplus"), _softplus, torch.sigmoid, -40.0, 1.0, None),
    "taylor2": (lambda: attnorm.make("taylor"), lambda x: 1 + x + x * x / 2, lambda x: 1 + x, 0.0, 1.0, None),
    "taylor4": (lambda: attnorm.make("taylor:n=4"), lambda x: 1 + x + x**2 / 2 + x**3 / 6 + x**4 / 24,
                lambda x: 1 + x + x**2 / 2 + x**3 / 6, 0.0, 1.0, None),
    "normalized_x2+1": (lambda: attnorm.Normalized(lambda x: x * x + 1), lambda x: x * x + 1, lambda x: 2 * x,
                        1.0, 1.0, None),
}


def f_range(f, low: float, high: float) -> tuple[float, float]:
    """min and max of F over [low, high] (a fine grid holding the ends and F's critical points -1, 0, 1)."""
    grid = torch.cat([torch.linspace(low, high, 20001, dtype=torch.float64),
                      torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64).clamp(low, high)])
    values = f(grid)
    return float(values.min()), float(values.max())


@SETTINGS
@given(family=st.sampled_from(sorted(FAMILIES)), length=lengths, low=st.floats(-20, 20), width=st.floats(0, 8),
       seed=seeds)
def test_lemma1_every_ratio_of_f_lies_within_its_f_range_over_length(family, length, low, width, seed):
    build, f, _, _, _, positive_above = FAMILIES[family]
    if positive_above is not None:
        low = abs(low) + 0.1  # F > 0 on [a, b] only for a > 0
    x = uniform(low, low + width, length, seed)
    x[0], x[-1] = low, low + width
    f_min, f_max = f_range(f, low, low + width)
    out = build()(x)
    assert float(out.min()) >= (1 - 1e-9) * f_min / (length * f_max)
    assert float(out.max()) <= (1 + 1e-9) * f_max / (length * f_min)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lemma1_ratio_bounds_are_approached_by_a_lone_extreme_logit(family):
    build, f, _, _, _, positive_above = FAMILIES[family]
    length, low, high = 100_000, (0.5 if positive_above is not None else -1.5), 1.5
    grid = torch.linspace(low, high, 3001, dtype=torch.float64)
    values = f(grid)
    arg_min, arg_max = float(grid[values.argmin()]), float(grid[values.argmax()])
    f_min, f_max = float(values.min()), float(values.max())
    top = torch.full((length,), arg_min, dtype=torch.float64)
    top[0] = arg_max
    assert float(build()(top)[0]) >= 0.99 * f_max / (length * f_min)
    bottom = torch.full((length,), arg_max, dtype=torch.float64)
    bottom[0] = arg_min
    assert float(build()(bottom)[0]) >= 0.99 * f_min / (length * f_max)


def test_relu_escapes_lemma1_when_scores_reach_zero():
    # With a <= 0 the lower bound is 0 and only the positive scores share the mass: a needle keeps it all.
    for length in (10, 1000, 100_000):
        x = -torch.rand(length, dtype=torch.float64)
        x[0] = 0.1
        assert float(attnorm.make("relu")(x)[0]) == 1.0


@SETTINGS
@given(family=st.sampled_from(sorted(FAMILIES)), length=st.integers(1, 48), scale=st.floats(0.1, 6), seed=seeds)
def test_lemma2_every_ratio_of_f_has_the_papers_jacobian_and_half_max_log_derivative_bound(family, length, scale,
                                                                                           seed):
    build, f, derivative, _, _, _ = FAMILIES[family]
    x = uniform(-scale, scale, length, seed)
    x[0] = scale + 0.5  # at least one positive score (relu)
    matrix = jacobian(build(), x)
    values = f(x)
    torch.testing.assert_close(matrix, general_jacobian(values, derivative(x)), rtol=1e-9, atol=1e-12)
    on = values > 0
    peak = float((derivative(x)[on] / values[on]).abs().max())
    assert spectral_norm(matrix) <= (1 + 1e-9) * peak / 2
    assert float(matrix.abs().max()) <= (1 + 1e-9) * peak / 4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lemma2_ratio_bound_is_reached_at_two_equal_dominant_logits_where_log_f_is_steepest(family):
    build, f, _, peak_at, peak, _ = FAMILIES[family]
    x = torch.tensor([peak_at, peak_at], dtype=torch.float64)
    if family.startswith("relu"):
        x = torch.tensor([peak_at, peak_at, -1.0, -2.0], dtype=torch.float64)  # F = 0: no share, no effect
    norm = spectral_norm(jacobian(build(), x))
    assert norm == pytest.approx(peak / 2, rel=1e-6)


def test_softmax1_keeps_softmax_bounds_from_above_but_not_from_below():
    # a_i = e^{x_i} / (1 + sum e^x) <= softmax_i, so Lemma 1's upper bound and Lemma 2's 1/2, 1/4 hold;
    # the lower bound becomes e^a / (1 + L e^b): a row may put almost no weight anywhere.
    generator = torch.Generator().manual_seed(0)
    for length, low, width in ((10, -30.0, 2.0), (1000, 0.0, 3.0), (20, 5.0, 1.0)):
        x = low + width * torch.rand(length, dtype=torch.float64, generator=generator)
        x[0], x[-1] = low, low + width
        out = attnorm.make("softmax1")(x)
        assert float(out.max()) <= math.exp(width) / length
        assert float(out.min()) >= (1 - 1e-12) * math.exp(low) / (1 + length * math.exp(low + width))
        matrix = jacobian(attnorm.make("softmax1"), x[:40])
        assert spectral_norm(matrix) <= 0.5 + 1e-12 and float(matrix.abs().max()) <= 0.25 + 1e-12
    assert spectral_norm(jacobian(attnorm.make("softmax1"), torch.tensor([30.0, 30.0], dtype=torch.float64))) \
        == pytest.approx(0.5, rel=1e-9)


def test_sigmoid_attention_vanishes_like_one_over_n_with_a_diagonal_jacobian():
    # a_i = sigmoid(x_i - log n) <= e^{x_i} / n: Lemma 1's 1/n decay holds for its upper bound; J is
    # diag(a_i (1 - a_i)) at fixed n, so ||J||_2 = max a_i (1 - a_i) <= 1/4 (no 1/T growth at T = 1).
    for length in (10, 1000, 100_000):
        x = uniform(0.0, 2.0, length, seed=length)
        assert float(attnorm.make("sigmoid")(x).max()) <= math.exp(2.0) / length
    x = uniform(-3, 3, 12, seed=1)
    matrix = jacobian(attnorm.make("sigmoid"), x)
    weights = 1 / (1 + torch.exp(-(x - math.log(12))))
    torch.testing.assert_close(matrix, torch.diag(weights * (1 - weights)), rtol=1e-12, atol=1e-15)
