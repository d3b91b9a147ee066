"""The fused top-k forward's two selections: candidate buffers (k up to ``CANDIDATE_KEEP``) and the radix select.

Both must keep the very same keys: the float64 reference of ``test_attention_topk`` (a
stable descending sort: ties at the k-th score to the lowest key index) checks the
candidate path's values and gradients, and the radix select (``CANDIDATE_KEEP = 0``) must
give bit-identical outputs, gradients and stats but the threshold (any value between the
k-th score and the next will do) on the same calls.  The buffers are shrunk after every
tile here (``CANDIDATE_ROOM = 1``), read a few slots at a time, on rows of up to 150 keys,
so scores tied at the k-th value are dropped from a buffer and must still count as cut
ties.  Outputs are poisoned with NaN before the kernels run.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnorm.kernels.rules import AttentionMask
from tests.conftest import slow_under_interpreter
from tests.kernels.test_attention_self_adjusted import (  # noqa: F401 (poisoned_outputs: an autouse fixture)
    MASKS,
    make_qkv,
    poisoned_outputs,
)
from tests.kernels.test_attention_topk import SCALE, check

pytest.importorskip("triton")

from attnorm.kernels.triton import attention_topk as fused  # noqa: E402
from attnorm.kernels.triton import replay  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def switched(monkeypatch, name, value):
    """Set a launcher constant; replay plans recorded under the old value (``ATTNORM_TEST_REPLAY``) go."""
    monkeypatch.setattr(fused, name, value)
    replay.clear()


@pytest.fixture(autouse=True)
def shrunk_every_tile(monkeypatch):
    """Buffers shrunk after every tile, read in chunks of the kept keys' power of two, at least 4 (several a buffer)."""
    switched(monkeypatch, "CANDIDATE_ROOM", 1)
    switched(monkeypatch, "CANDIDATE_CHUNK", 4)
    yield
    monkeypatch.undo()
    replay.clear()


def both_selections(monkeypatch, q, k, v, mask, k_keep, is_fraction=False, temperature=1.0, sinks=None):
    """Through the candidate buffers, then the radix select: ``(out, stats but the threshold, dq, dk, dv)`` each.

    The threshold itself may differ (the radix select stops at any value that separates
    the k-th score from the next), not the keys it keeps: the backward, which finds them
    from it, must give the same gradients.
    """
    plans = []
    monkeypatch.setattr(fused, "_candidates", lambda *a, plan=fused._candidates: plans.append(plan(*a)) or plans[-1])
    args = (q, k, v, mask, SCALE, k_keep, is_fraction, temperature)
    grad_out = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(5)).to(q)
    results = []
    for keep in (fused.CANDIDATE_KEEP, 0):
        switched(monkeypatch, "CANDIDATE_KEEP", keep)
        out, stats, _ = fused.topk_attention_forward(*args, sinks=sinks)
        grads = fused.topk_attention_backward(q, k, v, out, grad_out, stats, mask, SCALE, k_keep, is_fraction,
                                              temperature, sinks=sinks)
        results.append((out, stats[..., [0, 1, 3, 4]], *grads[:3]))
    assert plans[0] is not None and plans[1] is None
    return results


def assert_identical(buffered, radix):
    for a, b in zip(buffered, radix, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_plan_sizes_and_fallbacks(monkeypatch):
    q, k, v = make_qkv(1, 1, 1, 4, 100, 16, 16, torch.float32, "cpu")
    shape = fused.problem(q, k, v)
    block = shape.block
    assert fused._candidates(shape, q, 5, False) == (5, 8, fused.launch.next_power_of_2(8 + block))
    monkeypatch.setattr(fused, "CANDIDATE_CHUNK", 32)
    assert fused._candidates(shape, q, 5, False).kp == min(32, fused.launch.next_power_of_2(8 + block))
    assert fused._candidates(shape, q, 0.05, True).keep_bound == 5  # ceil(0.05 * 100)
    assert fused._candidates(shape, q, 64, False).kp == 64
    assert fused._candidates(shape, q, 65, False) is None  # past CANDIDATE_KEEP
    assert fused._candidates(shape, q, 0.7, True) is None
    assert fused._candidates(shape, q.double(), 5, False) is None  # float64 keys: the radix select
    short = fused.problem(*make_qkv(1, 1, 1, 4, 30, 16, 16, torch.float32, "cpu"))
    assert fused._candidates(short, q, 1000, False).keep_bound == 31  # every key and a sink


DEFAULT_LONG_ROWS = {("none", 6), ("dense", 1), ("additive", 0.05)}
LONG_ROWS = [pytest.param(kind, k_keep, is_fraction, id=f"{kind}-{k_keep}",
                          marks=slow_under_interpreter((kind, k_keep) in DEFAULT_LONG_ROWS))
             for kind in ("none", "bottom-right", "window", "padding", "dense", "additive")
             for k_keep, is_fraction in ((1, False), (6, False), (0.05, True))]


@pytest.mark.parametrize(("kind", "k_keep", "is_fraction"), LONG_ROWS)
def test_long_rows_with_ties_match_the_reference(kind, k_keep, is_fraction, monkeypatch, device):
    """Integer q, k: many scores tie at the k-th value, across shrinks; values and gradients against float64."""
    q, k, v = make_qkv(1, 2, 1, 16, 120, 16, 16, torch.float32, device, integer=True)
    mask = MASKS[kind](1, 16, 120, device)
    check(q, k, v, mask, k_keep, is_fraction, temperature=0.8)
    assert_identical(*both_selections(monkeypatch, q, k, v, mask, k_keep, is_fraction, 0.8))


@pytest.mark.parametrize(("dtype", "k_keep"), [
    pytest.param(dtype, k_keep, id=f"{k_keep}-{dtype}",
                 marks=slow_under_interpreter(k_keep == 3 and dtype == torch.float32))
    for dtype in (torch.float32, torch.bfloat16, torch.float16) for k_keep in (3, 64)])
def test_selections_agree_bit_for_bit(dtype, k_keep, monkeypatch, device):
    q, k, v = make_qkv(2, 2, 1, 20, 130, 16, 16, dtype, device, seed=4)
    assert_identical(*both_selections(monkeypatch, q, k, v, MASKS["bottom-right"](2, 20, 130, device), k_keep))


def test_posinf_scores_beyond_k_keep_the_first(monkeypatch, device):
    """Rows with more +inf scores than k (some dropped from the buffer) and with fewer; NaN rows stay NaN."""
    q, k, v = make_qkv(1, 1, 1, 4, 120, 16, 16, torch.float32, device)
    additive = torch.zeros(4, 120)
    additive[0, 5::4] = math.inf  # 29 of them, k = 3: uniform over the first three
    additive[1, [40, 90]] = math.inf  # two: uniform over both
    additive[2, 70] = math.nan
    mask = AttentionMask(additive=additive.to(device))
    buffered, radix = both_selections(monkeypatch, q, k, v, mask, 3)
    assert_identical(buffered, radix)
    out = buffered[0]
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, [5, 9, 13]].mean(0))
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, [40, 90]].mean(0))
    assert out[0, 0, 2].isnan().all() and out[0, 0, 3].isfinite().all()


@pytest.mark.parametrize("where", [pytest.param(where, marks=slow_under_interpreter(where in ("tied", "masked")))
                                   for where in ("above", "tied", "below", "masked")])
def test_sinks_compete_for_slots(where, monkeypatch, device):
    """A sink (key Lk, losing ties) above every score, tied at the k-th, below it, or -inf."""
    q, k, v = make_qkv(1, 2, 1, 6, 100, 16, 16, torch.float32, device, integer=True)
    x = SCALE * q.double() @ k.double().transpose(-1, -2)
    kth = x.topk(4, -1).values[..., -1]
    sinks = {"above": x.amax(-1) + 1, "tied": kth, "below": kth - 0.25, "masked": torch.full_like(kth, -math.inf)}
    assert_identical(*both_selections(monkeypatch, q, k, v, AttentionMask(), 4, sinks=sinks[where].float()))


def test_launches_split_by_buffer_bytes(monkeypatch, device):
    """A forward whose buffers exceed ``CANDIDATE_BYTES`` runs in launches of (batch, head) pairs: same results."""
    q, k, v = make_qkv(2, 2, 1, 18, 70, 16, 16, torch.float32, device, seed=2)
    mask = MASKS["causal"](2, 18, 70, device)
    whole = fused.topk_attention_forward(q, k, v, mask, SCALE, 5, False, 1.0)[:2]
    switched(monkeypatch, "CANDIDATE_BYTES", 1)
    launches = []
    original = fused.launch.launchable

    def counted(kernel):
        launches.append(kernel)
        return original(kernel)

    monkeypatch.setattr(fused.launch, "launchable", counted)
    split = fused.topk_attention_forward(q, k, v, mask, SCALE, 5, False, 1.0)[:2]
    assert len(launches) == 4
    assert_identical(split, whole)
