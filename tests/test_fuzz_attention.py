"""Random differential test of ``attnorm.attention``'s kernel routes against float64 attention from the definitions.

Each seed draws one call: a normalizer (sparsemax, α-entmax fixed or learnable per head,
top-k by count or fraction, Self-Adjusted both ways, softmax with temperature,
Scalable-Softmax fixed or learnable), a dtype, GQA, head and value dims, ``Lq`` and ``Lk``,
a mask (none, ``is_causal``, causal at several diagonals, sliding window, key padding,
documents, their combinations, a dense bool mask with a fully masked row, an additive mask
with -inf), softcap, sinks, integer-valued inputs (exact ties), and a route: the fused
kernels (``DECODING_ROWS = 0``), or decoding with and without a gradient.  ``backend="triton"``
runs the Triton kernels (the interpreter without CUDA).

The reference is independent of attnorm: float64 scores ``(q k^T) scale``, the cap, the
mask built here from its parameters, weights from the ``entmax`` package (sparsemax,
``entmax15``, ``entmax_bisect``), a stable sort (top-k, ties to the lowest index), or the
formulas (softmax, Scalable-Softmax ``(s log n + b) x``, Self-Adjusted), a zero row where
nothing is allowed; gradients by autograd.  Outputs and the gradients of q, k, v, the sinks
and the module's parameters must agree within a tolerance per dtype, relative to the
largest reference value.  A run of about 2,200 draws found the bfloat16 top-k ``delta``
(``tests/kernels/test_attention_topk.py``) and a float32 Scalable-Softmax multiplier in float64 attention
(``tests/test_attention.py``); a cap of 1e4 (drawn since) and float64 modules found the fused kernels' cancelling
tanh and a float32 alpha gradient (``tests/kernels/test_attention_modifiers.py``).

Slow: ``pytest -m slow tests/test_fuzz_attention.py`` (about 2 s a seed on two cores).
"""

from __future__ import annotations

import importlib
import math
import random

import pytest
import torch

import attnorm

entmax = pytest.importorskip("entmax")
pytest.importorskip("triton")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

F64 = torch.float64
attention_module = importlib.import_module("attnorm.attention")
TOL_OUT = {F64: 1e-8, torch.float32: 2e-4, torch.float16: 6e-3, torch.bfloat16: 4e-2}
TOL_GRAD = {F64: 1e-7, torch.float32: 2e-3, torch.float16: 3e-2, torch.bfloat16: 8e-2}
KINDS = ("sparsemax", "entmax", "topk", "topk", "sa", "sa", "softmax", "ssmax", "entmax_learnable", "ssmax_learnable")
MASKS = ("none", "is_causal", "causal", "window", "padding", "documents", "causal+documents", "causal+padding",
         "bool", "additive", "window+padding")


def draw(seed: int) -> dict:
    """One call's configuration (deterministic in ``seed``)."""
    rng = random.Random(seed)
    case = {"kind": rng.choice(KINDS), "seed": rng.randint(0, 2**31)}
    kind, params = case["kind"], {}
    if kind == "softmax":
        params["temperature"] = rng.choice([1.0, 0.5, 2.0])
    elif kind == "ssmax":
        params.update(s=rng.choice([0.43, 1.0]), bias=rng.choice([0.0, 0.3]))
    elif kind == "entmax":
        params["alpha"] = rng.choice([1.5, 1.5, 1.25, 1.7, 1.0001, 2.0])
    elif kind == "topk":
        params.update(k=rng.choice([1, 2, 3, 5, 8, 64, 0.3, 0.06, 0.5]), temperature=rng.choice([1.0, 0.7]))
    elif kind == "sa":
        params["normalized"] = rng.random() < 0.5
    case["params"] = params
    case["dtype"] = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16, F64])
    case.update(batch=rng.choice([1, 2]), kv_heads=rng.choice([1, 2]), group=rng.choice([1, 1, 2, 3]),
                head_dim=rng.choice([16, 16, 32, 64]))
    case["value_dim"] = rng.choice([case["head_dim"], case["head_dim"], 16])
    case["route"] = rng.choice(["fused", "fused", "fused", "decoding", "decoding with grad"])
    case["lk"] = rng.randint(1, 48)
    case["lq"] = rng.randint(1, 40) if case["route"] == "fused" else rng.randint(1, 16)
    case["mask"] = rng.choice(MASKS)
    if "documents" in case["mask"]:
        case["lq"] = case["lk"]
    # a cap of 1e4 sits far above the scores: cap tanh(x / cap) = x must hold to the scores' own precision
    case.update(softcap=rng.choice([None, None, None, 5.0, 30.0, 1e4]), sinks=rng.random() < 0.2,
                integer=rng.random() < 0.15, scale=rng.choice([None, 0.35, 1.0]))
    return case


def allowed_keys(spec: dict, batch: int, lq: int, lk: int) -> torch.Tensor:
    """``(B, 1, Lq, Lk)``: which keys each query may attend under the structured mask ``spec``."""
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    allowed = torch.ones(batch, 1, lq, lk, dtype=torch.bool)
    if "causal" in spec:
        allowed &= j - i <= spec["causal"]
    if "window" in spec:
        window, diagonal = spec["window"]
        allowed &= (j - i <= diagonal) & (j - i > diagonal - window)
    if "lengths" in spec:
        allowed &= (j < spec["lengths"][:, None, None]).unsqueeze(1)
    if "documents" in spec:
        document = torch.searchsorted(spec["documents"][1:].contiguous(), torch.arange(lq), right=True)
        allowed &= document[:, None] == document[None, :]
    return allowed


def structured_mask(spec: dict) -> attnorm.StructuredMask:
    parts = []
    if "causal" in spec:
        parts.append(attnorm.causal_mask(spec["causal"]))
    if "window" in spec:
        parts.append(attnorm.sliding_window_mask(*spec["window"]))
    if "lengths" in spec:
        parts.append(attnorm.key_padding_mask(spec["lengths"]))
    if "documents" in spec:
        parts.append(attnorm.document_mask(spec["documents"]))
    mask = parts[0]
    for part in parts[1:]:
        mask = mask & part
    return mask


def reference_weights(kind: str, params: dict, x: torch.Tensor, allowed: torch.Tensor,
                      sink: torch.Tensor | None) -> torch.Tensor:
    """Float64 weights of the real keys; ``x`` holds -inf where not allowed; ``sink (..., 1)`` one more key."""
    n = allowed.sum(-1, keepdim=True)  # the real allowed keys (Scalable-Softmax's n, a fraction's n)
    if sink is not None:
        x = torch.cat([x, sink.expand(*x.shape[:-1], 1)], -1)
        allowed = torch.cat([allowed, torch.ones_like(allowed[..., :1])], -1)
    empty = ~allowed.any(-1, keepdim=True)
    safe = torch.where(allowed, x, 0.0)
    if kind == "softmax":
        weights = torch.softmax(torch.where(allowed, safe / params["temperature"], -math.inf), -1)
    elif kind in ("ssmax", "ssmax_learnable"):
        multiplier = params["s"] * torch.log(n.clamp_min(1).to(F64)) + params["bias"]
        weights = torch.softmax(torch.where(allowed, safe * multiplier, -math.inf), -1)
    elif kind == "sparsemax":
        weights = entmax.sparsemax(torch.where(empty, 0.0, x), -1)
    elif kind == "entmax" and params["alpha"] == 1.5:
        weights = entmax.entmax15(torch.where(empty, 0.0, x), -1)
    elif kind in ("entmax", "entmax_learnable"):
        weights = entmax.entmax_bisect(torch.where(empty, 0.0, x), params["alpha"], -1, n_iter=200)
    elif kind == "topk":
        keep = params["k"]
        count = (torch.ceil(n.to(F64) * keep - 1e-9).long().clamp_min(1) if isinstance(keep, float)
                 else torch.full_like(n, keep))
        count = torch.minimum(count, allowed.sum(-1, keepdim=True))
        ranked = torch.where(allowed, x.detach(), -math.inf)
        rank = ranked.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        kept = allowed & (rank < count)
        weights = torch.softmax(torch.where(kept, safe / params["temperature"], -math.inf), -1)
    else:  # Self-Adjusted: phi(x) softmax(x)
        softmax = torch.softmax(torch.where(allowed, safe, -math.inf), -1)
        phi = safe
        if params["normalized"]:
            low = torch.where(allowed, safe, math.inf).amin(-1, keepdim=True).clamp_max(0)
            high = torch.where(allowed, safe, -math.inf).amax(-1, keepdim=True).clamp_min(0)
            span = high - low
            phi = torch.where(span > 0, (safe - low) / torch.where(span > 0, span, 1.0), 0.0)
        weights = phi * softmax
    weights = torch.where(empty | ~allowed, 0.0, weights)
    return weights[..., : x.shape[-1] - (sink is not None)]


def make_module(kind: str, params: dict, heads: int, generator: torch.Generator) -> torch.nn.Module:
    if kind == "entmax_learnable":
        module = attnorm.Entmax(1.5, learnable=True, num_heads=heads, backend="triton")
        with torch.no_grad():
            module.alpha_logit.copy_(torch.randn(module.alpha_logit.shape, generator=generator))
        return module
    if kind == "ssmax_learnable":
        module = attnorm.ScalableSoftmax(learnable=True, num_heads=heads, backend="triton")
        with torch.no_grad():
            module.s.copy_(torch.rand(module.s.shape, generator=generator) + 0.2)
            module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.3)
        return module
    make = {"softmax": attnorm.Softmax, "ssmax": attnorm.ScalableSoftmax, "sparsemax": attnorm.Sparsemax,
            "entmax": attnorm.Entmax, "topk": attnorm.TopKSoftmax, "sa": attnorm.SelfAdjustedSoftmax}[kind]
    return make(**params, backend="triton")


def inputs(case: dict, generator: torch.Generator, rng: random.Random):
    """q, k, v, sinks; the attn_mask / is_causal arguments; the additive mask and allowed keys for the reference."""
    batch, heads, lq, lk = case["batch"], case["kv_heads"] * case["group"], case["lq"], case["lk"]

    def sample(*shape):
        if case["integer"]:  # exact scores, many of them tied
            return torch.randint(-2, 3, shape, generator=generator).to(F64)
        return torch.randn(*shape, generator=generator, dtype=F64)

    q, k = sample(batch, heads, lq, case["head_dim"]), sample(batch, case["kv_heads"], lk, case["head_dim"])
    v = torch.randn(batch, case["kv_heads"], lk, case["value_dim"], generator=generator, dtype=F64)
    q, k, v = (t.to(case["dtype"]) for t in (q, k, v))
    sinks = torch.randn(heads, generator=generator, dtype=F64).to(case["dtype"]) if case["sinks"] else None
    kind, spec = case["mask"], {}
    attn_mask, is_causal, additive = None, kind == "is_causal", None
    allowed = torch.ones(batch, 1, lq, lk, dtype=torch.bool)
    if is_causal:
        spec["causal"] = 0
    if "causal" in kind and not is_causal:
        spec["causal"] = rng.choice([0, lk - lq, rng.randint(-3, 3)])
    if "window" in kind:
        spec["window"] = (rng.randint(1, 8), rng.choice([0, lk - lq]))
    if "padding" in kind:
        spec["lengths"] = torch.tensor([rng.randint(0, lk) for _ in range(batch)])
    if "documents" in kind:
        spec["documents"] = torch.tensor([0, *sorted(rng.sample(range(1, lk + 1), min(lk, rng.randint(1, 4))))])
    if spec:
        allowed = allowed_keys(spec, batch, lq, lk)
        attn_mask = None if is_causal else structured_mask(spec)
    if kind == "bool":
        allowed = torch.rand(batch, rng.choice([1, heads]), lq, lk, generator=generator) < 0.7
        if lq > 1:
            allowed[..., 0, :] = False  # a fully masked row
        attn_mask = allowed
    if kind == "additive":
        additive = torch.randn(batch, 1, lq, lk, generator=generator, dtype=F64)
        additive = torch.where(torch.rand(batch, 1, lq, lk, generator=generator) < 0.2, -math.inf, additive)
        attn_mask = additive.to(case["dtype"])
        additive, allowed = attn_mask.to(F64), attn_mask > -math.inf
    return (q, k, v, sinks), (attn_mask, is_causal), additive, allowed


@pytest.mark.parametrize("seed", range(64))
def test_attention_matches_float64_definitions(seed, monkeypatch):
    case = draw(seed)
    generator, rng = torch.Generator().manual_seed(case["seed"]), random.Random(case["seed"])
    (q, k, v, sinks), (attn_mask, is_causal), additive, allowed = inputs(case, generator, rng)
    heads, dtype = q.shape[1], case["dtype"]
    scale = q.shape[-1] ** -0.5 if case["scale"] is None else case["scale"]
    grad = case["route"] != "decoding"
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v) + ((sinks,) if sinks is not None else ())]
    module = make_module(case["kind"], case["params"], heads, generator)
    if dtype == F64:  # a float64 model's parameters (and their gradients) are float64
        module = module.double()
    params = list(module.parameters())
    weights_params = case["params"]
    if params:  # the module's own per-head values (its parametrisation), as float64 leaves of its graph
        weights_params = {name: value.double().reshape(1, heads, 1, 1)
                          for name, value in module.kernel_params().items()}
    if case["route"] == "fused":
        monkeypatch.setattr(attention_module, "DECODING_ROWS", 0)
    with torch.set_grad_enabled(grad):
        out = attnorm.attention(*leaves[:3], module, attn_mask=attn_mask, is_causal=is_causal, scale=case["scale"],
                                softcap=case["softcap"], sinks=leaves[3] if sinks is not None else None)
    reference_leaves = [t.detach().to(F64).requires_grad_(grad) for t in leaves]
    with torch.set_grad_enabled(grad):
        rq, rk, rv = reference_leaves[:3]
        rk, rv = rk.repeat_interleave(case["group"], 1), rv.repeat_interleave(case["group"], 1)
        x = (rq @ rk.transpose(-2, -1)) * scale
        if case["softcap"] is not None:
            x = case["softcap"] * torch.tanh(x / case["softcap"])
        if additive is not None:
            x = x + additive
        keep = allowed.expand(x.shape) & (x > -math.inf)
        sink = None if sinks is None else reference_leaves[3].reshape(1, heads, 1, 1).expand(*x.shape[:3], 1)
        expected = reference_weights(case["kind"], weights_params, torch.where(keep, x, -math.inf), keep, sink) @ rv

    def relative(got: torch.Tensor, want: torch.Tensor) -> float:
        if not got.numel():
            return 0.0
        return (got.detach().to(F64) - want.detach()).abs().max().item() / max(1.0, want.abs().max().item())

    described = {key: value for key, value in case.items() if key != "seed"}
    assert out.dtype == dtype and not out.isnan().any(), described
    assert relative(out, expected) <= TOL_OUT[dtype], described
    if grad and out.numel():
        grad_out = torch.randn(out.shape, generator=generator, dtype=F64)
        names = ["dq", "dk", "dv"] + (["dsinks"] if sinks is not None else []) + [f"d{name}" for name, _ in
                                                                                  module.named_parameters()]
        grads = torch.autograd.grad(out, leaves + params, grad_out.to(dtype), allow_unused=True)
        expected_grads = torch.autograd.grad(expected, reference_leaves + params, grad_out, allow_unused=True)
        for name, got, want in zip(names, grads, expected_grads, strict=True):
            want = torch.zeros_like(got, dtype=F64) if want is None else want
            got = torch.zeros_like(want) if got is None else got
            assert not got.isnan().any(), (name, described)
            assert relative(got, want) <= TOL_GRAD[dtype], (name, relative(got, want), described)
