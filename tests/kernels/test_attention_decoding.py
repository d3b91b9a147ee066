"""Split-K Self-Adjusted Softmax decoding against a float64 attention written from the definition.

The reference builds the ``(Lq, Lk)`` scores in float64, masks them and applies
``phi(x) softmax(x)`` over each row's allowed keys (``torch.softmax``; ``phi = x``, or
``(x - low) / (high - low)`` with ``low = min(min x, 0)``, ``high = max(max x, 0)``),
with the rules of :mod:`attnorm.kernels.rules`: zeros for a row with no allowed key,
the +inf limit (uniform over the +inf keys: ``v``'s mean normalized, ``inf`` weights
plain), NaN for a NaN score.  Every kernel output, the per-split partials included,
is poisoned with NaN before the kernels run (``launch.empty`` is patched).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import attnorm
from attnorm.kernels.rules import AttentionMask
from tests.kernels.test_attention_self_adjusted import (  # noqa: F401 (poisoned_outputs: an autouse fixture)
    MASKS,
    TOLERANCES,
    make_qkv,
    masked_scores,
    poisoned_outputs,
)

pytest.importorskip("triton")

from attnorm.kernels import decoding_ops  # noqa: E402
from attnorm.kernels.triton import attention_decoding as split_k  # noqa: E402
from attnorm.kernels.triton import launch  # noqa: E402
from attnorm.routes import blocked, decoding  # noqa: E402
from tests.conftest import poisoned_empty, slow_under_interpreter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's masked-off lanes

F64 = torch.float64
SCALE = 0.35
LK = 70  # not a multiple of the interpreter's 16-key block: 5 blocks, the last one partial
DECODING_MASKS = ("none", "bottom-right", "padding", "window", "dense", "additive")


def reference(q, k, v, mask: AttentionMask, scale, normalized):
    """``(phi(x) softmax(x)) v`` in float64, with the zero, +inf and NaN row rules."""
    q, k, v = (t.to(F64) for t in (q, k, v))
    x, allowed = masked_scores(q, k, mask, scale)
    v = v.repeat_interleave(q.shape[1] // k.shape[1], 1)
    finite = allowed & x.isfinite()
    any_finite = finite.any(-1, keepdim=True)
    weights = torch.softmax(torch.where(finite, x, -math.inf).masked_fill(~any_finite, 0.0), -1)
    weights = torch.where(finite, weights, 0.0)
    xs = torch.where(finite, x, 0.0)
    if normalized:
        low = torch.where(finite, x, math.inf).amin(-1, keepdim=True).clamp(max=0).masked_fill(~any_finite, 0.0)
        high = torch.where(finite, x, -math.inf).amax(-1, keepdim=True).clamp(min=0).masked_fill(~any_finite, 0.0)
        span = high - low
        phi = torch.where(span > 0, (xs - low) / torch.where(span > 0, span, 1.0), 0.0)
    else:
        phi = xs
    out = (phi * weights) @ v
    posinf = allowed & (x == math.inf)
    count = posinf.sum(-1, keepdim=True)
    mass = posinf.to(F64) if normalized else torch.where(posinf, math.inf, 0.0).to(F64)
    out = torch.where(count > 0, (mass @ v) / count.clamp(min=1), out)
    return torch.where((allowed & x.isnan()).any(-1, keepdim=True), math.nan, out)


def check(q, k, v, mask, normalized, splits=3, scale=SCALE):
    out = split_k.self_adjusted_decoding_forward(q, k, v, mask, scale, normalized, splits)
    expected = reference(q, k, v, mask, scale, normalized)
    assert out.shape == expected.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.to(F64), expected, equal_nan=True, **TOLERANCES[q.dtype])
    return out


# ---- the kernel ------------------------------------------------------------------------------


# One query and sixteen under every mask kind; three queries under two (all six with -m slow).
DECODING_CASES = [pytest.param(lq, kind, normalized, id=f"{lq}-{kind}-{('plain', 'normalized')[normalized]}",
                               marks=slow_under_interpreter(lq != 3 or kind in ("bottom-right", "padding")))
                  for lq in (1, 3, 16) for kind in DECODING_MASKS for normalized in (True, False)]


@pytest.mark.parametrize(("lq", "kind", "normalized"), DECODING_CASES)
def test_every_mask_kind_matches_reference(lq, kind, normalized, device):
    """Four query heads on two key/value heads, three key splits of two, two and one blocks."""
    q, k, v = make_qkv(2, 4, 2, lq, LK, 16, 16, torch.float32, device)
    check(q, k, v, MASKS[kind](2, lq, LK, device), normalized)


@pytest.mark.parametrize("lq", [1, 16])
def test_one_key_value_head_for_all_query_heads(lq, device):
    """Hkv = 1: the four query heads stack into one tile (64 rows at Lq = 16), K and V read once."""
    q, k, v = make_qkv(2, 4, 1, lq, LK, 16, 16, torch.float32, device)
    for normalized in (True, False):
        check(q, k, v, MASKS["bottom-right"](2, lq, LK, device), normalized)


def test_stacked_rows_past_one_row_block(monkeypatch, device):
    """16-row blocks: 4 query heads x 16 queries take four row blocks per key/value head."""
    monkeypatch.setattr(split_k, "MAX_STACKED_ROWS", 16)
    q, k, v = make_qkv(1, 4, 1, 16, LK, 16, 16, torch.float32, device)
    check(q, k, v, MASKS["dense"](1, 16, LK, device), True)


@pytest.mark.parametrize("splits", [1, 2, 5, 100, 0])
@pytest.mark.parametrize("lk", [5, 17, 80])
def test_any_split_count_gives_the_same_result(lk, splits, device):
    """One split, several, one per block, more than blocks (clamped) and automatic, at lengths off the block."""
    q, k, v = make_qkv(1, 2, 2, 3, lk, 16, 16, torch.float32, device)
    check(q, k, v, MASKS["bottom-right"](1, 3, lk, device), True, splits=splits)


def test_head_dims_padded_and_strided_inputs(device):
    """Head dim 20, value dim 24 (padded to 32); q, k, v as non-contiguous views."""
    q, k, v = make_qkv(2, 4, 2, 3, LK, 20, 24, torch.float32, device)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not k.is_contiguous()
    check(q, k, v, MASKS["padding"](2, 3, LK, device), False)


def test_fully_masked_rows_give_zeros(device):
    """Batch 1 has no key at all, and a dense mask empties one more row: zeros, never NaN."""
    q, k, v = make_qkv(2, 2, 2, 3, LK, 16, 16, torch.float32, device)
    start, stop = attnorm.key_padding_mask(torch.tensor([LK, 0])).key_range(2, 3, LK, device)
    dense = torch.ones(1, 1, 3, LK, dtype=torch.bool)
    dense[..., 1, :] = False
    mask = AttentionMask(start, stop, dense.to(device))
    for normalized in (True, False):
        out = check(q, k, v, mask, normalized)
        assert (out[1] == 0).all() and (out[0, :, 1] == 0).all()


def test_posinf_rows_follow_the_limit_across_splits(device):
    """+inf keys in two splits of row 1 and in one split of row 2, finite keys elsewhere; a NaN row."""
    q, k, v = make_qkv(1, 1, 1, 3, LK, 16, 16, torch.float64, device)
    additive = torch.zeros(3, LK, dtype=F64)
    additive[1, [2, 60]] = math.inf
    additive[2, 40] = math.inf
    additive[0, 33] = math.nan
    mask = AttentionMask(additive=additive.to(device))
    normalized = check(q, k, v, mask, True)
    torch.testing.assert_close(normalized[0, 0, 1], v[0, 0, [2, 60]].mean(0))
    torch.testing.assert_close(normalized[0, 0, 2], v[0, 0, 40])
    assert normalized[0, 0, 0].isnan().all()
    check(q, k, v, mask, False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_dtypes(dtype, device):
    q, k, v = make_qkv(2, 4, 2, 3, LK, 32, 32, dtype, device)
    for normalized in (True, False):
        check(q, k, v, MASKS["bottom-right"](2, 3, LK, device), normalized, scale=32**-0.5)


def test_split_count_fills_the_machine(monkeypatch):
    """Eight programs per SM on an H200's 132, at most one split per key block, at least one split."""
    monkeypatch.setattr(split_k, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert split_k.split_count(65536, 8 * 16, 64, cuda) == 9  # 128 programs x 9 splits >= 8 x 132
    assert split_k.split_count(4096, 1 * 8, 64, cuda) == 64  # one split per key block
    assert split_k.split_count(100, 1, 64, cuda) == 2
    assert split_k.split_count(0, 1, 64, cuda) == 1
    assert split_k.split_count(80, 2, 16, torch.device("cpu")) == split_k.PROGRAMS_PER_SM * split_k.INTERPRETED_SMS // 2


def test_negative_splits_are_rejected(device):
    q, k, v = make_qkv(1, 1, 1, 1, 16, 16, 16, torch.float32, device)
    with pytest.raises(ValueError, match="splits must be >= 0"):
        split_k.self_adjusted_decoding_forward(q, k, v, AttentionMask(), SCALE, True, -1)


# ---- the op and the route --------------------------------------------------------------------


def route_inputs(device, lq=2, seed=0):
    q, k, v = make_qkv(2, 4, 2, lq, 40, 16, 16, torch.float32, device, seed=seed)
    return q, k, v


def test_op_passes_opcheck_and_is_forward_only(device):
    q, k, v = route_inputs(device)
    start, stop = attnorm.causal_mask(40 - 2).key_range(2, 2, 40, device)
    torch.library.opcheck(torch.ops.attnorm.self_adjusted_decoding_fwd, (q, k, v, start, stop, None, None, 0.25,
                                                                         True, 0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    out = decoding_ops.self_adjusted_decoding(q.requires_grad_(), k, v, AttentionMask(start, stop), 0.25, True)
    with pytest.raises(RuntimeError, match="forward only"):
        out.sum().backward()


@pytest.mark.parametrize("mask", ["causal", "padding", "bool", "additive"])
def test_route_equals_the_rows_route(mask, device):
    """decoding.attention (split-K) and attention()'s scores-as-rows give the same output."""
    q, k, v = route_inputs(device)
    attn_mask = {
        "causal": attnorm.causal_mask(40 - 2),
        "padding": attnorm.key_padding_mask(torch.tensor([40, 9])) & attnorm.causal_mask(40 - 2),
        "bool": torch.rand(2, 1, 2, 40, generator=torch.Generator().manual_seed(1)).to(device) > 0.3,
        "additive": torch.randn(2, 40, generator=torch.Generator().manual_seed(2), dtype=torch.float32).to(device),
    }[mask]
    mask_part, additive = (None, attn_mask) if mask == "additive" else (attn_mask, None)
    for normalized in (True, False):
        normalizer = attnorm.SelfAdjustedSoftmax(normalized, backend="triton")
        assert decoding.supports(normalizer, q, k, v, mask_part, additive, 0.0)
        out = decoding.attention(normalizer, q, k, v, mask_part, additive, 16**-0.5)
        with decoding.use_route("rows"):
            rows = attnorm.attention(q, k, v, normalizer, attn_mask=attn_mask)
        torch.testing.assert_close(out, rows, atol=2e-5, rtol=1e-4)


def test_route_choice(device):
    q, k, v = route_inputs(device)
    sa = attnorm.SelfAdjustedSoftmax(backend="triton")
    assert decoding.supports(sa, q, k, v, None, None, 0.0)
    assert not decoding.supports(attnorm.SelfAdjustedSoftmax(), q.cpu(), k.cpu(), v.cpu(), None, None, 0.0)  # native
    assert not decoding.supports(sa, q, k, v, None, None, 0.1)  # dropout
    assert not decoding.supports(sa, q, k, v, None, None, 0.0, softcap=30.0)
    assert not decoding.supports(sa, q, k, v, None, None, 0.0, sinks=torch.zeros(4))
    assert not decoding.supports(sa, q[0], k[0], v[0], None, None, 0.0)  # (H, L, D)
    assert not decoding.supports(sa, q.requires_grad_(), k, v, None, None, 0.0)  # forward only
    with torch.no_grad():
        assert decoding.supports(sa, q, k, v, None, None, 0.0)
    q = q.detach()
    assert not decoding.supports(attnorm.Sparsemax(backend="triton"), q, k, v, None, None, 0.0)  # rows
    with decoding.use_route("rows"):
        assert not decoding.supports(sa, q, k, v, None, None, 0.0)
        assert decoding.route(sa) == "rows" and decoding.route(attnorm.Softmax()) == "sdpa"
    with decoding.use_route("split_k"):
        assert decoding.route(attnorm.Entmax(1.5)) == "rows"  # no split-K kernel: keeps its route
        assert decoding.route(sa) == "split_k"
    assert decoding.get_route() == "auto"
    with pytest.raises(ValueError, match="decoding route must be one of"), decoding.use_route("fastest"):
        pass
    assert set(decoding.DECODING_ROUTES.values()) == {"sdpa", "rows", "split_k"}


def test_environment_variable_sets_the_override(monkeypatch):
    try:
        monkeypatch.setenv("ATTNORM_DECODING_ROUTE", "rows")
        assert importlib.reload(decoding).get_route() == "rows"
        monkeypatch.setenv("ATTNORM_DECODING_ROUTE", "fastest")
        with pytest.raises(ValueError, match="ATTNORM_DECODING_ROUTE must be one of"):
            importlib.reload(decoding)
    finally:
        monkeypatch.delenv("ATTNORM_DECODING_ROUTE")
        importlib.reload(decoding)
    assert decoding.get_route() == "auto"


def test_route_compiles_without_graph_breaks(device):
    q, k, v = route_inputs(device)
    normalizer = attnorm.SelfAdjustedSoftmax(backend="triton")
    mask = attnorm.causal_mask(40 - 2)

    def run(q, k, v):
        assert decoding.supports(normalizer, q, k, v, mask, None, 0.0)
        return decoding.attention(normalizer, q, k, v, mask, None, 0.25)

    explanation = torch._dynamo.explain(run)(q, k, v)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), run(q, k, v))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", [*DECODING_MASKS, "causal"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 1), (8, 8)])
def test_larger_grid(heads, kv_heads, kind, dtype, device):
    for lq in (1, 5, 16):
        q, k, v = make_qkv(2, heads, kv_heads, lq, 150, 64, 64, dtype, device)
        for normalized in (True, False):
            check(q, k, v, MASKS[kind](2, lq, 150, device), normalized, splits=0, scale=64**-0.5)


def test_attention_takes_split_k_for_inference_and_rows_for_training(device, monkeypatch):
    """attention() on one query row: split-K without grad; with grad the rows route, gradients included."""
    q, k, v = route_inputs(device, lq=1)
    mask = attnorm.causal_mask(40 - 1)
    taken = []
    original = decoding.attention
    monkeypatch.setattr(decoding, "attention", lambda *args: taken.append(1) or original(*args))
    normalizer = attnorm.SelfAdjustedSoftmax(backend="triton")
    out = attnorm.attention(q, k, v, normalizer, attn_mask=mask)
    assert taken == [1]
    expected = reference(q.double(), k.double(), v.double(), AttentionMask(*mask.key_range(2, 1, 40, device)),
                         16**-0.5, True)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    trained = attnorm.attention(q64, k64, v64, normalizer, attn_mask=mask)
    assert taken == [1]  # a call that needs gradients stays on the rows route
    torch.testing.assert_close(trained, expected, atol=1e-10, rtol=1e-10)
    grads = torch.autograd.grad(trained.sum(), (q64, k64, v64))
    q_ref, k_ref, v_ref = (t.detach().clone().requires_grad_() for t in (q64, k64, v64))
    expected_out = reference(q_ref, k_ref, v_ref, AttentionMask(*mask.key_range(2, 1, 40, device)), 16**-0.5, True)
    for got, want in zip(grads, torch.autograd.grad(expected_out.sum(), (q_ref, k_ref, v_ref)), strict=True):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


# ---- the rows route's scores kernel ----------------------------------------------------------


def product_reference(q, k, scale):
    """``scale q k^T`` in float64, each key head repeated for its group of query heads."""
    k = k.to(F64).repeat_interleave(q.shape[1] // k.shape[1], 1)
    return scale * (q.to(F64) @ k.transpose(-1, -2))


SCORE_TOLERANCES = {torch.float64: {"atol": 1e-12, "rtol": 1e-12}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "lq", "lk", "head_dim"),
                         [(4, 2, 3, LK, 16), (4, 1, 16, 33, 20), (2, 2, 1, 5, 64), (1, 1, 1, 1, 16)])
def test_scores_kernel_matches_float64_products(dtype, heads, kv_heads, lq, lk, head_dim, device):
    """Float32 scores of half inputs (float64 of float64): the inputs' exact products, not rounded to q's dtype."""
    q, k, _ = make_qkv(2, heads, kv_heads, lq, lk, head_dim, 16, dtype, device)
    scores = split_k.decoding_scores_forward(q, k, 0.3)
    assert scores.shape == (2, heads, lq, lk)
    assert scores.dtype == (F64 if dtype == F64 else torch.float32)
    tolerance = SCORE_TOLERANCES[F64 if dtype == F64 else torch.float32]
    torch.testing.assert_close(scores.to(F64), product_reference(q, k, 0.3), **tolerance)


def test_scores_kernel_chunks_row_blocks_and_strides(monkeypatch, device):
    """One key block per program, 16-row blocks of 4 x 16 stacked rows, non-contiguous q and k."""
    monkeypatch.setattr(split_k, "SCORE_BLOCKS_PER_PROGRAM", 1)
    monkeypatch.setattr(split_k, "MAX_STACKED_ROWS", 16)
    q, k, _ = make_qkv(2, 8, 2, 16, LK, 24, 16, torch.bfloat16, device)
    q, k = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
    assert not k.is_contiguous()
    scores = split_k.decoding_scores_forward(q, k[:, :, 3:], 0.125)
    torch.testing.assert_close(scores.to(F64), product_reference(q, k[:, :, 3:], 0.125), atol=1e-5, rtol=1e-5)


def test_scores_kernel_keeps_extremes_and_empty_shapes(device):
    """inf and NaN products pass through as the float64 products give them; no key or no row: an empty result."""
    q, k, _ = make_qkv(1, 2, 1, 2, 20, 16, 16, torch.float16, device)
    k[0, 0, 3] = math.inf
    q[0, 1, 1, 0] = math.nan
    scores = split_k.decoding_scores_forward(q, k, 1.0)
    expected = product_reference(q, k, 1.0)
    torch.testing.assert_close(scores.to(F64), expected, equal_nan=True, atol=1e-5, rtol=1e-5)
    assert split_k.decoding_scores_forward(q, k[:, :, :0], 1.0).shape == (1, 2, 2, 0)
    assert split_k.decoding_scores_forward(q[:, :, :0], k, 1.0).shape == (1, 2, 0, 20)


def test_scores_op_passes_opcheck_and_is_forward_only(device):
    q, k, _ = make_qkv(2, 4, 2, 3, 40, 16, 16, torch.bfloat16, device)
    torch.library.opcheck(torch.ops.attnorm.decoding_scores_fwd, (q, k, 0.25),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    scores = decoding_ops.decoding_scores(q.requires_grad_(), k, 0.25)
    with pytest.raises(RuntimeError, match="forward only"):
        scores.sum().backward()


ROW_NORMALIZERS = {
    "sparsemax": lambda: attnorm.Sparsemax(backend="triton"),
    "entmax 1.5": lambda: attnorm.Entmax(1.5, backend="triton"),
    "top-5": lambda: attnorm.TopKSoftmax(5, backend="triton"),
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=slow_under_interpreter(name == "sparsemax"))
                                  for name in ROW_NORMALIZERS])
def test_rows_route_takes_the_scores_kernel_for_half_inference(name, monkeypatch, device):
    """Half-precision decoding on Triton: the scores kernel, the output of float32 copies' products; not with grad."""
    q, k, v = make_qkv(2, 4, 2, 2, 40, 16, 16, torch.bfloat16, device)
    normalizer = ROW_NORMALIZERS[name]()
    mask = attnorm.causal_mask(40 - 2)
    taken = []
    original = decoding_ops.decoding_scores
    monkeypatch.setattr(blocked, "decoding_scores", lambda *args: taken.append(1) or original(*args))
    out = attnorm.attention(q, k, v, normalizer, attn_mask=mask)
    assert taken == [1]
    monkeypatch.setattr(decoding, "scores_kernel_applies", lambda *args: False)
    torch.testing.assert_close(out, attnorm.attention(q, k, v, normalizer, attn_mask=mask), atol=1e-2, rtol=1e-2)
    monkeypatch.undo()
    monkeypatch.setattr(launch, "empty", poisoned_empty)
    taken.clear()
    monkeypatch.setattr(blocked, "decoding_scores", lambda *args: taken.append(1) or original(*args))
    attnorm.attention(q.requires_grad_(), k, v, normalizer, attn_mask=mask).float().sum().backward()
    assert taken == [] and q.grad.isfinite().all()


def test_scores_kernel_applies_only_where_it_can(device):
    sparsemax = attnorm.Sparsemax(backend="triton")
    q = torch.zeros(1, 4, 1, 16, dtype=torch.bfloat16, device=device)
    k = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16, device=device)
    assert decoding.scores_kernel_applies(sparsemax, q, k)
    assert not decoding.scores_kernel_applies(sparsemax, q.float(), k.float())  # float32: torch.matmul already is
    assert not decoding.scores_kernel_applies(attnorm.Sparsemax(backend="native"), q, k)
    assert not decoding.scores_kernel_applies(sparsemax, q[0], k[0])  # (H, L, D)
    assert not decoding.scores_kernel_applies(sparsemax, q[:, :3], k)  # 3 query heads on 2 key heads
    assert not decoding.scores_kernel_applies(sparsemax, q.requires_grad_(), k)
    with torch.no_grad():
        assert decoding.scores_kernel_applies(sparsemax, q, k)


ONE_CALL_NORMALIZERS = {
    "sparsemax": lambda: attnorm.Sparsemax(backend="triton"),
    "entmax 1.5": lambda: attnorm.Entmax(1.5, backend="triton"),
    "top-5": lambda: attnorm.TopKSoftmax(5, backend="triton"),
    "top-20%": lambda: attnorm.TopKSoftmax(0.2, backend="triton"),
    "sa": lambda: attnorm.SelfAdjustedSoftmax(backend="triton"),
    "sa plain": lambda: attnorm.SelfAdjustedSoftmax(normalized=False, backend="triton"),
    "softmax T": lambda: attnorm.Softmax(temperature=0.5, backend="triton"),
    "ssmax": lambda: attnorm.ScalableSoftmax(s=0.7, bias=0.1, backend="triton"),
}


@pytest.mark.parametrize(("name", "dtype"), [
    pytest.param(name, dtype, id=f"{str(dtype).removeprefix('torch.')}-{name}",
                 marks=slow_under_interpreter(dtype == torch.float16 or name == "sparsemax"))
    for dtype in (torch.float16, torch.bfloat16) for name in ONE_CALL_NORMALIZERS])
def test_one_call_weights_equal_the_scores_op_then_the_module(name, dtype, device):
    """``row_weights``: bit for bit the scores op followed by the module and ``.to(q.dtype)``, the row kernel
    rounding as it stores (GQA, 3 rows, a partial key block)."""
    q, k, _ = make_qkv(2, 4, 2, 3, 37, 16, 16, dtype, device, seed=1)
    normalizer = ONE_CALL_NORMALIZERS[name]()
    with torch.no_grad():
        got = decoding.row_weights(normalizer, q, k, SCALE)
        wide = normalizer(decoding_ops.decoding_scores(q, k, SCALE))
    assert got is not None and got.shape == (2, 4, 3, 37) and got.dtype == dtype
    assert wide.dtype == torch.float32 and not torch.equal(wide, wide.to(dtype).float())  # the rounding shows
    torch.testing.assert_close(got, wide.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left-padded"])
def test_decoding_step_takes_the_one_call_weights_and_equals_the_long_way(padded, monkeypatch, device):
    """A decoding step, under its causal mask (every key allowed) or a left-padded batch's ``(B, 1, 1, Lk)``
    bool mask (what Hugging Face passes), takes the one-call weights: the long way's output bit for bit, and
    float64's within half precision."""
    q, k, v = make_qkv(2, 4, 2, 1, 40, 16, 16, torch.float16 if padded else torch.bfloat16, device, seed=4 * padded)
    spec = "topk:k=5" if padded else "entmax:alpha=1.5"
    normalizer = attnorm.make(spec)
    normalizer.backend = "triton"
    mask = left_padding([40, 13], 40, device) if padded else attnorm.causal_mask(40 - 1)
    taken = []
    original = decoding.row_weights
    monkeypatch.setattr(decoding, "row_weights", lambda *args: taken.append(original(*args)) or taken[-1])
    out = attnorm.attention(q, k, v, normalizer, attn_mask=mask)
    assert len(taken) == 1 and taken[0] is not None
    monkeypatch.setattr(decoding, "row_weights", lambda *args: None)
    torch.testing.assert_close(out, attnorm.attention(q, k, v, normalizer, attn_mask=mask), rtol=0, atol=0)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    reference = attnorm.make(spec)
    reference.backend = "reference"
    weights = reference(q64 @ k64.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.25, mask if padded else None)
    torch.testing.assert_close(out.double(), weights @ v64.repeat_interleave(2, dim=1), atol=2e-2, rtol=2e-2)


def left_padding(lengths, lk, device):
    """A left-padded batch's decoding mask ``(B, 1, 1, Lk)``: each sequence's last ``length`` keys."""
    return (torch.arange(lk) >= lk - torch.tensor(lengths)[:, None]).reshape(len(lengths), 1, 1, lk).to(device)


PADDED_MASKS = {  # shapes a decoding step's bool mask comes in, against scores (2, 4, 3, 37)
    "left padding (B,1,1,Lk)": lambda device: left_padding([37, 20], 37, device),
    "per query (B,1,Lq,Lk)": lambda device: torch.rand(2, 1, 3, 37, generator=torch.Generator().manual_seed(3)).to(
        device) > 0.3,
    "one row (Lk,)": lambda device: (torch.arange(37) % 3 != 1).to(device),
    "a sequence with one key (B,1,1,Lk)": lambda device: left_padding([37, 1], 37, device),
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=slow_under_interpreter(name == "sparsemax"))
                                  for name in ["sparsemax", "entmax 1.5", "top-5", "sa"]])
@pytest.mark.parametrize("shape", list(PADDED_MASKS))
def test_one_call_weights_take_a_padded_batch_mask(name, shape, device):
    """A bool mask (a left-padded batch's) rides along: bit for bit the scores op, then the module with the mask,
    then ``.to(q.dtype)``; and against float64 (masked keys weigh exactly 0)."""
    q, k, _ = make_qkv(2, 4, 2, 3, 37, 16, 16, torch.float16, device, seed=2)
    mask = PADDED_MASKS[shape](device)
    normalizer = ONE_CALL_NORMALIZERS[name]()
    with torch.no_grad():
        got = decoding.row_weights(normalizer, q, k, SCALE, mask)
        want = normalizer(decoding_ops.decoding_scores(q, k, SCALE), mask).to(q.dtype)
    assert got is not None and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got[~mask.expand(got.shape)] == 0).all()
    if name == "sparsemax":
        scores = q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2) * SCALE
        reference = attnorm.Sparsemax(backend="reference")(scores, mask)
        torch.testing.assert_close(got.double(), reference, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", [pytest.param(name, marks=slow_under_interpreter(name == "sparsemax"))
                                  for name in ["sparsemax", "top-5"]])
def test_one_call_weights_take_a_cap_and_a_capped_step_takes_them(name, monkeypatch, device):
    """Gemma 2's soft cap is applied by the row kernel in the one call: bit for bit the module given the cap,
    and ``attention(..., softcap=)``'s decoding step takes the one call and equals the long way."""
    q, k, v = make_qkv(2, 4, 2, 1, 37, 16, 16, torch.float16, device, seed=7)
    q = q * 4  # scores beyond the cap's linear range
    normalizer = ONE_CALL_NORMALIZERS[name]()
    with torch.no_grad():
        got = decoding.row_weights(normalizer, q, k, SCALE, None, 2.0)
        want = normalizer(decoding_ops.decoding_scores(q, k, SCALE), softcap=2.0).to(q.dtype)
        uncapped = decoding.row_weights(normalizer, q, k, SCALE)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, uncapped)
    taken = []
    original = decoding.row_weights
    monkeypatch.setattr(decoding, "row_weights", lambda *args: taken.append(original(*args)) or taken[-1])
    out = attnorm.attention(q, k, v, normalizer, scale=SCALE, softcap=2.0)
    assert len(taken) == 1 and taken[0] is not None
    monkeypatch.setattr(decoding, "row_weights", lambda *args: None)
    torch.testing.assert_close(out, attnorm.attention(q, k, v, normalizer, scale=SCALE, softcap=2.0), rtol=0, atol=0)


@pytest.mark.parametrize("name", [pytest.param(name, marks=slow_under_interpreter(name != "top-5"))
                                  for name in ["top-5", "sa", "entmax 1.5"]])
def test_one_call_weights_take_sinks_and_a_sink_step_takes_them(name, monkeypatch, device):
    """gpt-oss's sinks (a bfloat16 parameter per query head) are read in place by the row kernel in the one call:
    bit for bit the module given the per-head sink, and ``attention(..., sinks=)``'s decoding step takes the one
    call (a batch of 2, GQA) and equals the long way; a sink that records a gradient goes the long way."""
    q, k, v = make_qkv(2, 4, 2, 1, 37, 16, 16, torch.bfloat16, device, seed=8)
    sinks = torch.nn.Parameter(torch.tensor([2.0, -1.0, 0.5, 8.0], dtype=torch.bfloat16, device=device))
    normalizer = ONE_CALL_NORMALIZERS[name]()
    with torch.no_grad():
        got = decoding.row_weights(normalizer, q, k, SCALE, None, None, sinks)
        want = normalizer(decoding_ops.decoding_scores(q, k, SCALE), sink=sinks.reshape(-1, 1, 1)).to(q.dtype)
        without = decoding.row_weights(normalizer, q, k, SCALE)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, without) and got[:, 3].float().sum() < got[:, 1].float().sum()  # head 3's sink wins
    assert decoding.row_weights(normalizer, q, k, SCALE, None, None, sinks) is None  # grad mode: sinks learn
    taken = []
    original = decoding.row_weights
    monkeypatch.setattr(decoding, "row_weights", lambda *args: taken.append(original(*args)) or taken[-1])
    with torch.no_grad():
        out = attnorm.attention(q, k, v, normalizer, scale=SCALE, sinks=sinks)
        assert len(taken) == 1 and taken[0] is not None
        monkeypatch.setattr(decoding, "row_weights", lambda *args: None)
        torch.testing.assert_close(out, attnorm.attention(q, k, v, normalizer, scale=SCALE, sinks=sinks), rtol=0,
                                   atol=0)


def test_one_call_weights_leave_other_masks_to_the_module(device):
    """A mask of another dtype, shape or device: None (the module's route says what is wrong)."""
    q, k, _ = make_qkv(2, 2, 2, 1, 24, 16, 16, torch.float16, device)
    sparsemax = attnorm.Sparsemax(backend="triton")
    assert decoding.row_weights(sparsemax, q, k, SCALE, left_padding([24, 3], 24, device)) is not None
    assert decoding.row_weights(sparsemax, q, k, SCALE, left_padding([24, 3], 24, device).float()) is None
    assert decoding.row_weights(sparsemax, q, k, SCALE, torch.ones(3, 1, 1, 24, dtype=torch.bool,
                                                                   device=device)) is None
    assert decoding.row_weights(sparsemax, q, k, SCALE, torch.ones(1, 2, 2, 1, 24, dtype=torch.bool,
                                                                   device=device)) is None
    if device == "cuda":
        assert decoding.row_weights(sparsemax, q, k, SCALE, torch.ones(24, dtype=torch.bool)) is None


class _Counted(attnorm.Sparsemax):
    def forward(self, scores, mask=None, **modifiers):
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(scores, mask, **modifiers)


def test_one_call_weights_leave_what_a_module_call_would_show(device):
    """Hooks, an overridden forward, learnable parameters, a watching mode, a gradient: the module's own route."""
    q, k, v = make_qkv(1, 2, 2, 1, 24, 16, 16, torch.float16, device)
    assert decoding.row_weights(attnorm.Sparsemax(backend="triton"), q, k, SCALE) is not None
    hooked, seen = attnorm.Sparsemax(backend="triton"), []
    hooked.register_forward_hook(lambda module, inputs, output: seen.append(output))
    assert decoding.row_weights(hooked, q, k, SCALE) is None
    attnorm.attention(q, k, v, hooked)
    assert len(seen) == 1 and seen[0].shape == (1, 2, 1, 24)
    counted = _Counted(backend="triton")
    attnorm.attention(q, k, v, counted)
    assert counted.calls == 1
    learnable = attnorm.Entmax(1.5, learnable=True, backend="triton")
    assert decoding.row_weights(learnable, q, k, SCALE) is None
    with torch.no_grad():
        assert decoding.row_weights(learnable, q, k, SCALE) is None  # a tensor alpha: the module broadcasts it

    class Watching(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watching():
        assert decoding.row_weights(attnorm.Sparsemax(backend="triton"), q, k, SCALE) is None
    assert not decoding.scores_kernel_applies(attnorm.Sparsemax(backend="triton"), q.requires_grad_(), k)


@pytest.mark.parametrize("name", [pytest.param(name, marks=slow_under_interpreter(name == "sparsemax"))
                                  for name in ["sparsemax", "entmax:alpha=1.5", "topk:k=5", "sa_softmax", "ssmax"]])
def test_inference_mode_runs_every_route_twice_and_again(name, device):
    """Under ``torch.inference_mode`` (inference tensors: no version counter) a module call, a decoding step, a
    fused call and their repeats (recorded, replayed on CUDA) equal the same calls under ``no_grad``."""
    normalizer = attnorm.make(name)
    normalizer.backend = "triton"
    q, k, v = make_qkv(1, 2, 2, 17, 20, 16, 16, torch.float16, device)
    calls = [lambda: normalizer(q.float() @ k.float().transpose(-1, -2)),
             lambda: attnorm.attention(q[:, :, -1:], k, v, normalizer, attn_mask=attnorm.causal_mask(19)),
             lambda: attnorm.attention(q, k, v, normalizer, attn_mask=attnorm.causal_mask(4))]
    with torch.no_grad():
        wants = [call() for call in calls]
    with torch.inference_mode():
        for _ in range(3 if device == "cuda" else 1):  # on CUDA: run as written, recorded, replayed
            for call, want in zip(calls, wants, strict=True):
                torch.testing.assert_close(call(), want, rtol=0, atol=0)
