"""Structured masks (attnorm.masks): causal and key-padding masks, their combination and validation."""

from __future__ import annotations

import pytest
import torch

import attnorm
from attnorm.masks import StructuredMask


@pytest.mark.parametrize("diagonal", [-2, 0, 1, 3])
def test_causal_mask_lets_query_i_attend_keys_up_to_i_plus_diagonal(diagonal):
    queries, keys = 4, 6
    allowed = attnorm.causal_mask(diagonal).materialize(torch.Size([2, queries, keys]))
    expected = torch.tensor([[key - query <= diagonal for key in range(keys)] for query in range(queries)])
    assert torch.equal(allowed.expand(2, queries, keys), expected.expand(2, queries, keys))


def test_key_padding_mask_keeps_the_first_lengths_keys_of_each_batch_row():
    lengths = torch.tensor([0, 2, 5])
    allowed = attnorm.key_padding_mask(lengths).materialize(torch.Size([3, 2, 4, 5]))
    for batch, length in enumerate(lengths.tolist()):
        expected = torch.tensor([key < length for key in range(5)])
        assert torch.equal(allowed[batch].expand(2, 4, 5), expected.expand(2, 4, 5))


def test_key_padding_mask_built_inside_vmap_takes_per_example_lengths():
    """Lengths batched by ``torch.func.vmap``: the eager value check (a Python bool of the lengths)
    was data-dependent control flow there; each example equals its own eager call."""
    x = torch.randn(2, 3, 4, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([[1, 2], [3, 7], [0, 5]])

    def weights(length):
        return attnorm.Softmax()(x, mask=attnorm.key_padding_mask(length))

    batched = torch.func.vmap(weights)(lengths)
    for got, length in zip(batched, lengths, strict=True):
        assert torch.equal(got, weights(length))
    with pytest.raises(ValueError, match="lengths must be >= 0"):  # eager calls still check the values
        attnorm.key_padding_mask(torch.tensor([-1, 2]))


def test_key_padding_mask_traces_without_warnings():
    """``jit.trace`` of a function building the mask from a lengths input: no TracerWarning (the value
    check and ``as_tensor`` of a tensor both warned), and the trace follows new lengths."""
    import warnings

    x = torch.randn(2, 3, 4, 7, generator=torch.Generator().manual_seed(1))

    def weights(scores, length):
        return attnorm.Softmax()(scores, mask=attnorm.key_padding_mask(length))

    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(weights, (x, torch.tensor([1, 2])), check_trace=False)
    assert torch.equal(traced(x, torch.tensor([3, 7])), weights(x, torch.tensor([3, 7])))


def test_combined_masks_intersect():
    lengths_a, lengths_b = torch.tensor([3, 5]), torch.tensor([4, 2])
    shape = torch.Size([2, 3, 5, 5])
    combined = attnorm.causal_mask(1) & attnorm.key_padding_mask(lengths_a) & attnorm.key_padding_mask(lengths_b)
    combined = combined & attnorm.causal_mask(0)
    expected = (
        attnorm.causal_mask(0).materialize(shape)
        & attnorm.key_padding_mask(lengths_a).materialize(shape)
        & attnorm.key_padding_mask(lengths_b).materialize(shape)
    )
    assert torch.equal(combined.materialize(shape), expected)


def test_zero_length_rows_and_rows_before_the_diagonal_give_zeros():
    x = torch.randn(2, 3, 4, requires_grad=True)
    mask = attnorm.causal_mask(-1) & attnorm.key_padding_mask(torch.tensor([0, 4]))
    out = attnorm.Softmax()(x, mask=mask)
    assert (out[0] == 0).all() and (out[1, 0] == 0).all()
    torch.testing.assert_close(out[1, 1:].sum(-1), torch.ones(2))
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.isfinite(grad).all()


def test_single_length_broadcasts_over_the_batch():
    x = torch.randn(3, 2, 6)
    out = attnorm.Sparsemax()(x, mask=attnorm.key_padding_mask(torch.tensor([4])))
    assert (out[..., 4:] == 0).all()
    torch.testing.assert_close(out[..., :4], attnorm.Sparsemax()(x[..., :4]))


@pytest.mark.parametrize(
    ("call", "exception", "pattern"),
    [
        (lambda: attnorm.causal_mask(1.0), TypeError, r"diagonal.*1\.0"),
        (lambda: attnorm.causal_mask(True), TypeError, r"diagonal.*True"),
        (lambda: attnorm.key_padding_mask(torch.tensor([1.5, 2.0])), TypeError, r"lengths.*float"),
        (lambda: attnorm.key_padding_mask(torch.tensor([[1, 2]])), TypeError, r"lengths.*\(1, 2\)"),
        (lambda: attnorm.key_padding_mask(torch.tensor([3, -1])), ValueError, r"lengths.*\[3, -1\]"),
        (
            lambda: attnorm.Softmax()(torch.randn(3, 2, 4), mask=attnorm.key_padding_mask(torch.tensor([2, 3]))),
            ValueError,
            r"key_lengths.*\(2,\)",
        ),
        (lambda: attnorm.Softmax()(torch.randn(4), mask=attnorm.causal_mask()), ValueError, r"at least 2 dims.*\(4,\)"),
    ],
)
def test_bad_structured_masks_raise(call, exception, pattern):
    with pytest.raises(exception, match=pattern):
        call()


def test_and_with_a_bool_tensor_is_not_supported():
    with pytest.raises(TypeError):
        StructuredMask(causal_diagonal=0) & torch.ones(2, 2, dtype=torch.bool)


def test_key_padding_needs_a_batch_axis():
    # On (Lq, Lk) scores axis 0 holds queries, not batch rows: refuse rather than pad per query.
    with pytest.raises(ValueError, match=r"key_lengths needs scores shaped \(B, \.\.\., Lq, Lk\).*\(2, 4\)"):
        attnorm.Softmax()(torch.randn(2, 4), mask=attnorm.key_padding_mask(torch.tensor([2, 3])))


@pytest.mark.parametrize("window,diagonal", [(1, 0), (3, 0), (4, 2), (10, 0)])
def test_sliding_window_keeps_the_window_keys_up_to_the_diagonal(window, diagonal):
    queries, keys = 5, 7
    allowed = attnorm.sliding_window_mask(window, diagonal).materialize(torch.Size([queries, keys]))
    expected = torch.tensor(
        [[query + diagonal - window < key <= query + diagonal for key in range(keys)] for query in range(queries)]
    )
    assert torch.equal(allowed, expected)


def test_document_mask_keeps_keys_of_the_same_document_and_counts_the_trailing_positions_as_one():
    bounds = [0, 2, 2, 5]  # documents [0, 2), [] and [2, 5); positions 5.. form one more
    length = 7
    allowed = attnorm.document_mask(torch.tensor(bounds)).materialize(torch.Size([length, length]))
    document = [0, 0, 2, 2, 2, 3, 3]
    expected = torch.tensor([[document[i] == document[j] for j in range(length)] for i in range(length)])
    assert torch.equal(allowed, expected)


def test_two_document_masks_intersect_into_the_common_refinement():
    a, b = attnorm.document_mask(torch.tensor([0, 4, 8])), attnorm.document_mask(torch.tensor([0, 2, 8]))
    shape = torch.Size([8, 8])
    assert torch.equal((a & b).materialize(shape), a.materialize(shape) & b.materialize(shape))


def test_document_mask_combines_with_causal_and_padding():
    shape = torch.Size([2, 1, 6, 6])
    parts = [
        attnorm.document_mask(torch.tensor([0, 3, 6])),
        attnorm.causal_mask(),
        attnorm.key_padding_mask(torch.tensor([6, 4])),
    ]
    combined = parts[0] & parts[1] & parts[2]
    expected = parts[0].materialize(shape) & parts[1].materialize(shape) & parts[2].materialize(shape)
    assert torch.equal(combined.materialize(shape), expected)


@pytest.mark.parametrize(
    "bad,error",
    [(torch.tensor([1, 3]), ValueError), (torch.tensor([0, 3, 2]), ValueError), (torch.tensor([0.0, 2.0]), TypeError)],
)
def test_document_mask_rejects_bad_boundaries(bad, error):
    with pytest.raises(error, match="cu_seqlens"):
        attnorm.document_mask(bad)


def test_sliding_window_rejects_a_window_below_one():
    with pytest.raises(ValueError, match="window"):
        attnorm.sliding_window_mask(0)


def test_document_mask_needs_square_scores():
    with pytest.raises(ValueError, match="square"):
        attnorm.document_mask(torch.tensor([0, 2])).materialize(torch.Size([2, 3]))


def test_document_mask_with_one_packing_per_batch_row():
    bounds = torch.tensor([[0, 2, 5], [0, 4, 4]])
    allowed = attnorm.document_mask(bounds).materialize(torch.Size([2, 3, 5, 5]))
    assert allowed.shape == (2, 1, 5, 5)
    for row in range(2):
        single = attnorm.document_mask(bounds[row]).materialize(torch.Size([5, 5]))
        assert torch.equal(allowed[row, 0], single)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attnorm.document_mask(torch.tensor([[0, 2], [1, 3]]))


def test_document_mask_built_inside_vmap_takes_per_example_boundaries():
    """Boundaries batched by ``torch.func.vmap`` (the eager check read their values with ``tolist``:
    a RuntimeError there); each example equals its own eager call, and eager calls still check."""
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    bounds = torch.tensor([[0, 2, 6], [0, 3, 6], [0, 6, 6]])

    def weights(cu_seqlens):
        return attnorm.Softmax()(x, mask=attnorm.document_mask(cu_seqlens))

    batched = torch.func.vmap(weights)(bounds)
    for got, cu_seqlens in zip(batched, bounds, strict=True):
        assert torch.equal(got, weights(cu_seqlens))
    assert not torch.equal(batched[0], batched[1])  # the examples really differ
    with pytest.raises(ValueError, match="never decrease"):
        attnorm.document_mask(torch.tensor([0, 4, 2]))


def test_document_mask_traces_without_warnings():
    """``jit.trace`` of a function building the mask from a boundaries input (it raised a SystemError):
    no TracerWarning, and the trace follows new boundaries."""
    import warnings

    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(3))

    def weights(scores, cu_seqlens):
        return attnorm.Softmax()(scores, mask=attnorm.document_mask(cu_seqlens))

    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(weights, (x, torch.tensor([0, 2, 6])), check_trace=False)
    other = torch.tensor([0, 3, 6])
    assert torch.equal(traced(x, other), weights(x, other))
    assert not torch.equal(traced(x, other), weights(x, torch.tensor([0, 2, 6])))
