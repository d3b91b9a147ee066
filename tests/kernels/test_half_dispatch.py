"""normalize() hands fp16/bf16 scores straight to kernels that read half precision."""

import pytest
import torch

import attnorm
from attnorm.kernels import dispatch


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_kernels_receive_half_scores_and_fp32_params(monkeypatch, dtype):
    kernel = dispatch.resolve("scalable_softmax", torch.zeros(1), "triton")
    assert kernel.reads_half_precision
    seen = {}

    def spy(x, mask, **params):
        seen["x"], seen["s"] = x.dtype, params["s"].dtype
        return kernel(x, mask, **params)

    spy.reads_half_precision = True
    monkeypatch.setitem(dispatch._REGISTRY["triton"], "scalable_softmax", spy)
    scores = torch.randn(2, 3, 40).to(dtype)
    s = torch.tensor(0.6)
    out = attnorm.functional.scalable_softmax(scores, s=s, backend="triton")
    assert seen == {"x": dtype, "s": torch.float32}
    assert out.dtype == dtype
    expected = attnorm.functional.scalable_softmax(scores.double(), s=s.double(), backend="torch")
    torch.testing.assert_close(out.double(), expected, atol=4e-3, rtol=2e-2)


def test_torch_backend_still_computes_half_in_fp32(monkeypatch):
    kernel = dispatch.resolve("softmax", torch.zeros(1), "torch")
    seen = {}

    def spy(x, mask, **params):
        seen["x"] = x.dtype
        return kernel(x, mask, **params)

    monkeypatch.setitem(dispatch._REGISTRY["torch"], "softmax", spy)
    out = attnorm.functional.softmax(torch.randn(3, 5).half(), backend="torch")
    assert seen == {"x": torch.float32} and out.dtype == torch.float16
