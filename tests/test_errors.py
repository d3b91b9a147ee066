"""Bad input raises ValueError/TypeError whose message names the argument and the value."""

from __future__ import annotations

import math

import pytest
import torch
from normalizers.references import CASES

import attnorm
from attnorm import functional as F

SCORES = torch.randn(2, 3, 4)

BAD_PARAMETERS = [
    # (id, call, exception, message pattern)
    ("Softmax T=0", lambda: attnorm.Softmax(temperature=0.0), ValueError, r"temperature.*0\.0"),
    ("Softmax T=-1", lambda: attnorm.Softmax(temperature=-1), ValueError, r"temperature.*-1"),
    ("Softmax T=inf", lambda: attnorm.Softmax(temperature=math.inf), ValueError, r"temperature.*inf"),
    ("Softmax T=str", lambda: attnorm.Softmax(temperature="1"), TypeError, r"temperature.*'1'"),
    ("softmax T=-0.5", lambda: F.softmax(SCORES, temperature=-0.5), ValueError, r"temperature.*-0\.5"),
    (
        "softmax T tensor",
        lambda: F.softmax(SCORES, temperature=torch.tensor([[[1.0]], [[0.0]]])),
        ValueError,
        r"temperature.*\[1\.0, 0\.0\]",
    ),
    ("TopK T=0", lambda: attnorm.TopKSoftmax(2, temperature=0.0), ValueError, r"temperature.*0\.0"),
    ("topk T=-2", lambda: F.topk_softmax(SCORES, 2, temperature=-2.0), ValueError, r"temperature.*-2\.0"),
    ("Entmax alpha=0.5", lambda: attnorm.Entmax(alpha=0.5), ValueError, r"alpha.*0\.5"),
    ("entmax alpha=0.99", lambda: F.entmax(SCORES, alpha=0.99), ValueError, r"alpha.*0\.99"),
    ("entmax alpha=nan", lambda: F.entmax(SCORES, alpha=math.nan), ValueError, r"alpha.*nan"),
    (
        "entmax alpha tensor",
        lambda: F.entmax(SCORES, alpha=torch.tensor([[[1.5]], [[0.5]]])),
        ValueError,
        r"alpha.*\[1\.5, 0\.5\]",
    ),
    ("Entmax learnable alpha=2.5", lambda: attnorm.Entmax(alpha=2.5, learnable=True), ValueError, r"alpha.*2\.5"),
    ("TopK k=0", lambda: attnorm.TopKSoftmax(0), ValueError, r"k must be >= 1, got 0"),
    ("TopK k=-3", lambda: attnorm.TopKSoftmax(-3), ValueError, r"\bk\b.*-3"),
    ("TopK k=1.5", lambda: attnorm.TopKSoftmax(1.5), ValueError, r"\bk\b.*1\.5"),
    ("TopK k=1.0", lambda: attnorm.TopKSoftmax(1.0), ValueError, r"\bk\b.*1\.0"),
    ("TopK k=0.0", lambda: attnorm.TopKSoftmax(0.0), ValueError, r"\bk\b.*0\.0"),
    ("TopK k=str", lambda: attnorm.TopKSoftmax("3"), TypeError, r"\bk\b.*'3'"),
    ("TopK k=True", lambda: attnorm.TopKSoftmax(True), TypeError, r"\bk\b.*True"),
    ("topk k=0", lambda: F.topk_softmax(SCORES, 0), ValueError, r"\bk\b.*0"),
    ("SSMax s=inf", lambda: attnorm.ScalableSoftmax(s=math.inf), ValueError, r"\bs\b.*inf"),
    ("SSMax s=nan", lambda: attnorm.ScalableSoftmax(s=math.nan), ValueError, r"\bs\b.*nan"),
    ("SSMax bias=-inf", lambda: attnorm.ScalableSoftmax(bias=-math.inf), ValueError, r"bias.*-inf"),
    ("ssmax s=inf", lambda: F.scalable_softmax(SCORES, s=math.inf), ValueError, r"\bs\b.*inf"),
    (
        "ssmax s tensor",
        lambda: F.scalable_softmax(SCORES, s=torch.tensor([[[0.5]], [[math.inf]]])),
        ValueError,
        r"\bs\b.*\[0\.5, inf\]",
    ),
    ("SSMax num_heads=0", lambda: attnorm.ScalableSoftmax(num_heads=0), ValueError, r"num_heads.*0"),
    ("SA normalized=1", lambda: attnorm.SelfAdjustedSoftmax(normalized=1), TypeError, r"normalized.*1"),
    ("dim=1.0", lambda: attnorm.Softmax(dim=1.0), TypeError, r"dim.*1\.0"),
    ("backend=cuda", lambda: attnorm.Sparsemax(backend="cuda"), ValueError, r"backend.*'cuda'"),
    (
        "per-head s, wrong head count",
        lambda: attnorm.ScalableSoftmax(num_heads=3)(torch.randn(2, 4, 5, 5)),
        ValueError,
        r"\bs\b of shape \(3, 1, 1\).*\(2, 4, 5, 5\)",
    ),
    (
        "temperature varying along dim",
        lambda: F.softmax(SCORES, temperature=torch.ones(4) * 2),
        ValueError,
        r"temperature must be constant along dim",
    ),
    # Tensors that require grad are read too (on the CPU): T = 0 gave NaN, T = -1 softmax(-x), with no error.
    ("softmax T=0 with grad", lambda: F.softmax(SCORES, temperature=torch.tensor(0.0, requires_grad=True)),
     ValueError, r"temperature.*\[0\.0\]"),
    ("softmax T=-1 with grad", lambda: F.softmax(SCORES, temperature=torch.tensor(-1.0, requires_grad=True)),
     ValueError, r"temperature.*\[-1\.0\]"),
    ("topk T=-1 with grad", lambda: F.topk_softmax(SCORES, 2, temperature=-torch.ones(2, 1, 1, requires_grad=True)),
     ValueError, r"temperature.*-1\.0"),
    ("entmax alpha=0.5 with grad", lambda: F.entmax(SCORES, alpha=torch.tensor(0.5, requires_grad=True)),
     ValueError, r"alpha.*\[0\.5\]"),
    ("ssmax s=inf with grad", lambda: F.scalable_softmax(SCORES, s=torch.tensor(math.inf, requires_grad=True)),
     ValueError, r"\bs\b.*\[inf\]"),
    ("ssmax bias=nan with grad", lambda: F.scalable_softmax(SCORES, bias=torch.tensor(math.nan, requires_grad=True)),
     ValueError, r"bias.*\[nan\]"),
    # A parameter on another device than the scores: the kernels' internal names reached the message.
    ("temperature on meta", lambda: F.softmax(SCORES, temperature=torch.ones(2, 1, 1, device="meta")),
     ValueError, r"temperature is on meta but scores are on cpu"),
    ("alpha on meta", lambda: F.entmax(SCORES, alpha=torch.full((2, 1, 1), 1.5, device="meta")),
     ValueError, r"alpha is on meta but scores are on cpu"),
    ("s on meta", lambda: F.scalable_softmax(SCORES, s=torch.full((2, 1, 1), 0.5, device="meta")),
     ValueError, r"\bs is on meta but scores are on cpu"),
]


@pytest.mark.parametrize(
    ("call", "exception", "pattern"),
    [entry[1:] for entry in BAD_PARAMETERS],
    ids=[entry[0] for entry in BAD_PARAMETERS],
)
def test_bad_parameter_raises_naming_argument_and_value(call, exception, pattern):
    with pytest.raises(exception, match=pattern):
        call()


BAD_INPUTS = [
    (
        "non-broadcasting mask",
        SCORES,
        torch.ones(5, dtype=torch.bool),
        ValueError,
        r"mask of shape \(5,\).*\(2, 3, 4\)",
    ),
    (
        "mask with an extra dim",
        SCORES,
        torch.ones(2, 2, 3, 4, dtype=torch.bool),
        ValueError,
        r"mask of shape \(2, 2, 3, 4\)",
    ),
    ("float mask", SCORES, torch.ones(3, 4), TypeError, r"mask.*torch\.float32"),
    ("int mask", SCORES, torch.ones(3, 4, dtype=torch.int64), TypeError, r"mask.*torch\.int64"),
    ("list mask", SCORES, [[True] * 4] * 3, TypeError, r"mask.*list"),
    ("integer scores", torch.ones(3, 4, dtype=torch.int64), None, TypeError, r"scores.*torch\.int64"),
    ("bool scores", torch.ones(3, 4, dtype=torch.bool), None, TypeError, r"scores.*torch\.bool"),
    ("list scores", [[1.0, 2.0]], None, TypeError, r"scores.*list"),
    ("sparse scores", SCORES.to_sparse(), None, TypeError, r"scores must be a dense.*sparse_coo"),
    ("sparse scores, masked", SCORES.to_sparse(), torch.ones(4, dtype=torch.bool), TypeError,
     r"scores must be a dense"),
    ("nested scores", torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(2, 4)]), None, TypeError,
     r"scores must be a dense.*nested"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize(
    ("scores", "mask", "exception", "pattern"),
    [entry[1:] for entry in BAD_INPUTS],
    ids=[entry[0] for entry in BAD_INPUTS],
)
def test_bad_scores_or_mask_raise_for_every_normalizer(case, scores, mask, exception, pattern):
    with pytest.raises(exception, match=pattern):
        case.build()(scores, mask=mask)
    with pytest.raises(exception, match=pattern):
        case.functional(scores, mask=mask)


@pytest.mark.parametrize(
    "module, name, value, pattern",
    [
        (lambda: attnorm.ScalableSoftmax(learnable=True), "s", math.nan, "s must be finite"),
        (lambda: attnorm.ScalableSoftmax(num_heads=2), "bias", math.inf, "bias must be finite"),
        (lambda: attnorm.Entmax(1.5, num_heads=3), "fixed_alpha", 0.5, "alpha must be >= 1"),
        (lambda: attnorm.Entmax(1.5, learnable=True), "alpha_logit", math.inf, "alpha_logit must be finite"),
    ],
    ids=["ssmax-s", "ssmax-bias", "entmax-alpha", "entmax-alpha-logit"],
)
def test_load_state_dict_rejects_invalid_parameters(module, name, value, pattern):
    # Nested in a model, as checkpoints are loaded: the normalizer's hook still runs.
    model = torch.nn.Sequential(torch.nn.Identity(), module())
    state = model.state_dict()
    model.load_state_dict(state)  # valid values load
    state[f"1.{name}"] = torch.full_like(state[f"1.{name}"], value)
    with pytest.raises(ValueError, match=pattern):
        model.load_state_dict(state)


@pytest.mark.parametrize("name,value", [("is_causal", "yes"), ("is_causal", 1), ("return_weights", "no"),
                                        ("return_weights", None)])
def test_attention_flags_must_be_bools(name, value):
    """A string was read as True (``return_weights="no"`` returned the weights); SDPA raises a TypeError too."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=rf"{name} must be a bool, got {value!r}"):
        attnorm.attention(q, q, q, "softmax", **{name: value})
