"""Building normalizers by name (attnorm.make), their repr, and their state_dict."""

from __future__ import annotations

import pytest
import torch

import attnorm

SHORT_NAMES = ["softmax", "ssmax", "sa_softmax", "sparsemax", "entmax", "topk", "relu", "relu2", "softplus", "sigmoid",
               "softmax1", "taylor", "l2norm"]
ALIASES = {
    "scalable_softmax": attnorm.ScalableSoftmax,
    "scalable-softmax": attnorm.ScalableSoftmax,
    "self_adjusted_softmax": attnorm.SelfAdjustedSoftmax,
    "self-adjusted-softmax": attnorm.SelfAdjustedSoftmax,
    "alpha_entmax": attnorm.Entmax,
    "entmax15": attnorm.Entmax,
    "topk_softmax": attnorm.TopKSoftmax,
    "top-k": attnorm.TopKSoftmax,
    "softmax_1": attnorm.Softmax1,
    "taylor_softmax": attnorm.TaylorSoftmax,
    "l2_norm": attnorm.L2NormAttention,
}


def test_available_lists_short_names_then_aliases():
    names = attnorm.available()
    assert names[: len(SHORT_NAMES)] == SHORT_NAMES
    assert set(names[len(SHORT_NAMES) :]) == set(ALIASES)


@pytest.mark.parametrize(("name", "cls"), sorted(ALIASES.items()))
def test_aliases_build_their_normalizer(name, cls):
    spec = f"{name}:k=3" if cls is attnorm.TopKSoftmax else name
    assert type(attnorm.make(spec)) is cls


@pytest.mark.parametrize(
    ("spec", "cls", "attributes"),
    [
        ("softmax", attnorm.Softmax, {"temperature": 1.0}),
        ("softmax:temperature=2", attnorm.Softmax, {"temperature": 2}),
        ("entmax:alpha=1.3", attnorm.Entmax, {"alpha": 1.3, "learnable": False}),
        ("entmax15", attnorm.Entmax, {"alpha": 1.5}),
        ("topk:k=0.06", attnorm.TopKSoftmax, {"k": 0.06}),
        ("topk:k=5,temperature=0.5", attnorm.TopKSoftmax, {"k": 5, "temperature": 0.5}),
        ("ssmax:s=0.5,learnable=true", attnorm.ScalableSoftmax, {"learnable": True}),
        ("ssmax:s=0.5,bias=-0.25,num_heads=none", attnorm.ScalableSoftmax, {"s": 0.5, "bias": -0.25}),
        ("sa_softmax:normalized=False", attnorm.SelfAdjustedSoftmax, {"normalized": False}),
        ("sparsemax:dim=1", attnorm.Sparsemax, {"dim": 1}),
        ("  Entmax : alpha = 1.7 , dim = -2 ", attnorm.Entmax, {"alpha": 1.7, "dim": -2}),
        ("softmax:backend=torch", attnorm.Softmax, {"backend": "torch"}),
    ],
)
def test_make_parses_spec_strings(spec, cls, attributes):
    module = attnorm.make(spec)
    assert type(module) is cls
    for name, value in attributes.items():
        assert getattr(module, name) == value, name


def test_spec_values_keep_int_k_and_float_fraction_apart():
    assert attnorm.make("topk:k=6").k == 6 and isinstance(attnorm.make("topk:k=6").k, int)
    assert attnorm.make("topk:k=0.5").k == 0.5


def test_learnable_spec_gives_parameters():
    module = attnorm.make("ssmax:s=0.5,learnable=true,num_heads=4")
    assert {name for name, _ in module.named_parameters()} == {"s", "bias"}
    torch.testing.assert_close(module.s, torch.full((4, 1, 1), 0.5))


def test_overrides_take_precedence_over_the_spec():
    assert attnorm.make("entmax:alpha=1.3", alpha=1.7).alpha == 1.7
    assert attnorm.make("topk", k=4).k == 4
    assert attnorm.make("entmax15", alpha=1.2).alpha == 1.2


def test_made_modules_compute_the_same_as_their_classes():
    x = torch.randn(2, 3, 7)
    torch.testing.assert_close(attnorm.make("entmax:alpha=1.3")(x), attnorm.Entmax(alpha=1.3)(x))
    torch.testing.assert_close(attnorm.make("topk:k=0.5")(x), attnorm.TopKSoftmax(0.5)(x))
    assert attnorm.make("softmax") is not attnorm.make("softmax")


def test_every_available_name_builds_a_working_normalizer():
    x = torch.randn(2, 5)
    q = torch.randn(1, 2, 5, 4)
    for name in attnorm.available():
        module = attnorm.make(name, k=2) if "top" in name else attnorm.make(name)
        if isinstance(module, attnorm.OutputNormalizer):  # normalises attention outputs, not scores
            assert attnorm.attention(q, q, q, module).shape == q.shape
            continue
        assert isinstance(module, attnorm.Normalizer)
        assert module(x).shape == x.shape


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(ValueError, match="'attention_sink'") as raised:
        attnorm.make("attention_sink:alpha=1")
    assert all(name in str(raised.value) for name in attnorm.available())


@pytest.mark.parametrize(
    ("spec", "overrides", "valid"),
    [
        ("entmax:beta=2", {}, ["alpha", "learnable", "num_heads", "dim", "backend"]),
        ("topk", {}, ["k", "temperature", "dim", "backend"]),
        ("softmax", {"alpha": 1.5}, ["temperature", "dim", "backend"]),
    ],
)
def test_bad_keys_list_the_valid_keys(spec, overrides, valid):
    with pytest.raises(ValueError) as raised:
        attnorm.make(spec, **overrides)
    message = str(raised.value)
    assert all(key in message for key in valid), message


@pytest.mark.parametrize("spec", ["entmax:alpha", "entmax:=1.3", "topk:k=3,,temperature"])
def test_malformed_spec_raises(spec):
    with pytest.raises(ValueError, match="spec"):
        attnorm.make(spec)


def test_invalid_values_in_a_spec_name_argument_and_value():
    with pytest.raises(ValueError, match=r"alpha.*0\.5"):
        attnorm.make("entmax:alpha=0.5")
    with pytest.raises(ValueError, match=r"\bk\b.*1\.5"):
        attnorm.make("topk:k=1.5")


def test_make_passes_instances_through_and_rejects_other_types():
    module = attnorm.Sparsemax()
    assert attnorm.make(module) is module
    with pytest.raises(ValueError, match="overrides"):
        attnorm.make(module, dim=0)
    with pytest.raises(TypeError, match="int"):
        attnorm.make(3)


@pytest.mark.parametrize(
    ("module", "shown"),
    [
        (attnorm.Softmax(temperature=0.5), ["temperature=0.5", "dim=-1"]),
        (attnorm.ScalableSoftmax(s=0.3, bias=0.1, dim=2), ["s=0.3", "bias=0.1", "learnable=False", "dim=2"]),
        (
            attnorm.ScalableSoftmax(s=0.3, learnable=True, num_heads=2),
            ["s=[0.3, 0.3]", "bias=[0.0, 0.0]", "num_heads=2"],
        ),
        (attnorm.SelfAdjustedSoftmax(normalized=False), ["normalized=False"]),
        (attnorm.Sparsemax(backend="torch"), ["dim=-1", "backend='torch'"]),
        (attnorm.Entmax(alpha=1.3), ["alpha=1.3", "learnable=False"]),
        (attnorm.Entmax(alpha=1.25, learnable=True), ["alpha=1.25", "learnable=True"]),
        (attnorm.TopKSoftmax(k=0.06, temperature=2.0), ["k=0.06", "temperature=2.0"]),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, attnorm.Normalizer) else None,
)
def test_extra_repr_shows_the_parameters(module, shown):
    text = repr(module)
    assert text.startswith(type(module).__name__ + "(")
    assert all(item in text for item in shown), text


# ---------------------------------------------------------------- state_dict


@pytest.mark.parametrize(
    ("build", "keys", "learnable"),
    [
        (lambda: attnorm.ScalableSoftmax(learnable=True, num_heads=3), {"s", "bias"}, True),
        (lambda: attnorm.ScalableSoftmax(learnable=True), {"s", "bias"}, True),
        (lambda: attnorm.ScalableSoftmax(num_heads=3), {"s", "bias"}, False),
        (lambda: attnorm.Entmax(alpha=1.4, learnable=True, num_heads=3), {"alpha_logit"}, True),
        (lambda: attnorm.Entmax(alpha=1.4, num_heads=3), {"fixed_alpha"}, False),
        (lambda: attnorm.Softmax(), set(), False),
        (lambda: attnorm.TopKSoftmax(3), set(), False),
    ],
)
def test_state_dict_round_trip(build, keys, learnable):
    source, target = build(), build()
    assert set(source.state_dict()) == keys
    assert {name for name, _ in source.named_parameters()} == (keys if learnable else set())
    with torch.no_grad():
        for tensor in source.state_dict().values():
            tensor.copy_(torch.linspace(1.1, 1.7, tensor.numel()).reshape(tensor.shape))
    target.load_state_dict(source.state_dict())
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor)
    x = torch.randn(2, 3, 4, 6)
    torch.testing.assert_close(target(x), source(x))


def test_load_state_dict_is_strict_about_missing_parameters():
    with pytest.raises(RuntimeError, match="alpha_logit"):
        attnorm.Entmax(alpha=1.4, learnable=True).load_state_dict({})


def test_parameters_follow_dtype_and_are_saved_through_torch_save(tmp_path):
    module = attnorm.Entmax(alpha=1.6, learnable=True, num_heads=2).double()
    assert module.alpha_logit.dtype == torch.float64
    torch.save(module.state_dict(), tmp_path / "entmax.pt")
    restored = attnorm.Entmax(alpha=1.2, learnable=True, num_heads=2).double()
    restored.load_state_dict(torch.load(tmp_path / "entmax.pt"))
    torch.testing.assert_close(restored.alpha, torch.full((2, 1, 1), 1.6, dtype=torch.float64))
