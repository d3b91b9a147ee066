"""Decoding: a few queries against a long KV cache, every attnorm normalizer against SDPA.

Generation runs attention with ``Lq`` = 1 (or a few, with speculative decoding) query
rows against the whole cache, bottom-right causal (``attnorm.causal_mask(Lk - Lq)``).
For each KV length and normalizer this times ``attnorm.attention`` (its decoding route:
the scaled SDPA call for temperature and Scalable-Softmax; for the others the route
:data:`attnorm.routes.decoding.DECODING_ROUTES` gives their family) and
``scaled_dot_product_attention`` on the same ``(B, H, Lq, D)`` / ``(B, H, Lk, D)``
tensors, forward only (inference), as a ratio measured in the same run.

**Route choice.**  Every normalizer whose family has a split-K kernel (Self-Adjusted,
both variants) gets two more providers, each timing one route function alone (no
``attention()`` argument handling, so neither pays for it):

* ``<spec>[rows]``: scores as rows, ``attnorm.routes.blocked.materialised_attention``;
* ``<spec>[split_k]``: the split-K kernel, ``attnorm.routes.decoding.attention``.

With ``--copies`` every family on the rows route gets one more provider,
``<spec>[f32 copies]``: ``attention()`` with half-precision scores from float32 copies
of q and k (``torch.matmul``), the route before the scores kernel
(:func:`attnorm.routes.decoding.scores_kernel_applies`), so one run shows what the
kernel saves.

With ``--growing`` the KV cache grows by one key per call, as in generation: each call of
every provider attends to the first ``n`` keys of a longer cache, ``n`` one more than the
call before (from the KV length up, wrapping after :data:`GROW_SPAN` steps), with the mask
made per call.  A fixed length repeats one shape, which attnorm's replay of Triton calls
(``attnorm/kernels/triton/replay.py``) serves from a recorded plan; a growing cache has a
new shape every step and runs the Python launchers as written, so this is the host time a
generation loop sees.  No route providers in this mode.  SDPA is timed twice here: with its
default backend choice (``sdpa``) and restricted to FlashAttention (``sdpa[flash]``).  On an
H200 (torch 2.11, 2026-11-27, ``benchmarks/results/bench_decoding_growing_h200_c71da1d.md``) the
default took 36 ms a step at 4k keys and 16 ms at 64k against 0.05 and 0.55 ms at a fixed
length, and attnorm's ScalableSoftmax (an SDPA call) 6.7 and 42 ms: a per-shape cost inside SDPA's
backend choice (a cuDNN plan built per new shape would explain it; not established), so the
ratios against ``sdpa`` said nothing of attnorm's kernels (sparsemax 0.21 / 1.11 ms).

With ``--padded`` the batch is left-padded, as a batch of prompts of different lengths is
in generation: sequence ``b`` of ``B`` starts ``b Lk / (2 B)`` keys into the cache, so
every provider (SDPA too) gets a bool mask ``(B, 1, Lq, Lk)``, the padding and the
bottom-right causal mask in one: the mask Hugging Face passes.  No route providers in
this mode.

The second table gives ``split_k / rows`` per KV length: below 1 split-K is faster,
and the family's entry in ``DECODING_ROUTES`` should be ``"split_k"``.  On CPU the
split-K kernel runs only under Triton's interpreter (``TRITON_INTERPRET=1``, the
normalizer on ``backend="triton"``; its timings then say nothing about a GPU):
without it the route providers are left out, with a note saying why.

Goals (H100, bf16, batch 8, 16 heads, head dim 64, KV 4k-64k): every normalizer <= 2x
SDPA's decoding time, the logit scalings <= 1.1x.

How it is measured: interleaved rounds, every provider once per round, the ratio the
median of the rounds' ratios; a CUDA sample is ``triton.testing.do_bench``'s median over
a short run (warm-up, L2 flushed), a CPU sample one call's ``time.perf_counter``.  Each
provider is isolated: one that fails becomes an error row.

Usage::

    python benchmarks/bench_decoding.py                         # CUDA: KV 4k..64k, batch 8, bf16
    python benchmarks/bench_decoding.py --device cpu            # KV 1k..8k, batch 2, float32
    python benchmarks/bench_decoding.py --device cpu --quick    # seconds
    python benchmarks/bench_decoding.py --specs sa_softmax sa_softmax:normalized=false   # the route choice
    python benchmarks/bench_decoding.py --copies --specs sparsemax topk:k=64    # the scores kernel's saving
    python benchmarks/bench_decoding.py --growing               # a new KV length every call, as in generation
    python benchmarks/bench_decoding.py --padded                # a left-padded batch (a bool mask per sequence)

Writes ``bench_decoding_<device>.csv`` and ``.md`` into ``--out`` (default ``benchmarks/results/``),
``bench_decoding_<device>_growing`` with ``--growing``, ``_padded`` with ``--padded``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from reporting import error_text, markdown_table, percentiles, versions, write_csv
from torch.nn.attention.bias import causal_lower_right

import attnorm
from attnorm.routes import decoding
from attnorm.routes.blocked import materialised_attention

SPECS = ("softmax", "softmax:temperature=0.5", "ssmax", "ssmax:learnable=true,num_heads={heads}", "sparsemax",
         "entmax:alpha=1.5", "entmax:alpha=1.3", "topk:k=64", "topk:k=0.06", "sa_softmax",
         "sa_softmax:normalized=false")
ROUTES = ("rows", "split_k")
"""The decoding routes timed head to head for families that have both (``<spec>[route]`` providers)."""
COLUMNS = ("normalizer", "kv_length", "queries", "batch", "heads", "head_dim", "dtype", "device", "median_ms",
           "p20_ms", "p80_ms", "ratio_vs_sdpa", "goal", "error", "versions")
SETTINGS = {  # device: (kv lengths, batch, heads, head dim, dtype, rounds)
    "cuda": ((4096, 8192, 16384, 32768, 65536), 8, 16, 64, torch.bfloat16, 7),
    "cpu": ((1024, 2048, 4096, 8192), 2, 8, 64, torch.float32, 15),
}


CUDA_REP_MS = 20
"""``do_bench``'s ``rep`` per CUDA sample (milliseconds)."""


GROW_SPAN = 2048
"""Steps a ``--growing`` provider takes before its KV length wraps around (more than the replay's memory of keys)."""


def growing(call: Callable[..., torch.Tensor], lk: int) -> Callable[..., torch.Tensor]:
    """``call`` on the first ``n`` keys of the cache, ``n = lk, lk + 1, ...`` call after call (``--growing``)."""
    step = itertools.count()

    def grown(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = lk + next(step) % GROW_SPAN
        return call(q, k[:, :, :n], v[:, :, :n])

    return grown


FLASH = "sdpa[flash]"
"""The ``--growing`` run's second SDPA provider: SDPA restricted to its FlashAttention backend."""


def flash_only(call: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``call`` with SDPA restricted to FlashAttention (``torch.nn.attention.sdpa_kernel``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return call(q, k, v)

    return flash


def padded_mask(batch: int, lq: int, lk: int, device: str) -> torch.Tensor:
    """A left-padded batch's bool mask ``(B, 1, Lq, Lk)``: sequence ``b`` starts at key ``b Lk / (2 B)``, bottom-right
    causal (``--padded``)."""
    keys, queries = torch.arange(lk, device=device), torch.arange(lq, device=device)
    starts = torch.arange(batch, device=device) * lk // (2 * batch)
    allowed = (keys >= starts[:, None, None]) & (keys <= lk - lq + queries[:, None])  # (B, Lq, Lk)
    return allowed[:, None]


def goal(spec: str) -> float:
    return 1.1 if spec.startswith(("softmax", "ssmax")) else 2.0


def attend_with(spec: str, device: str, lq: int, lk: int | None) -> Callable[..., torch.Tensor]:
    """``attnorm.attention`` under the bottom-right causal mask; ``lk`` None: the mask made per call (``--growing``)."""
    normalizer = attnorm.make(spec).to(device)
    if lk is None:
        return lambda q, k, v: attnorm.attention(q, k, v, normalizer, attn_mask=attnorm.causal_mask(k.shape[-2] - lq))
    mask = attnorm.causal_mask(lk - lq)
    return lambda q, k, v: attnorm.attention(q, k, v, normalizer, attn_mask=mask)


def route_with(spec: str, route: str, device: str, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> Callable[..., torch.Tensor]:
    """One decoding route's function alone (module docstring), under the same mask as :func:`attend_with`.

    Raises:
        RuntimeError: ``route`` is ``"split_k"`` and the split-K kernel cannot run these tensors.
    """
    normalizer = attnorm.make(spec).to(device)
    lq, lk = q.shape[-2], k.shape[-2]
    mask, scale, groups = attnorm.causal_mask(lk - lq), q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
    if route == "rows":
        return lambda q, k, v: materialised_attention(normalizer, q, k, v, mask, None, scale, 0.0, groups)[0]
    if device == "cpu":
        normalizer.backend = "triton"  # the interpreter: the only way Triton runs CPU tensors
    with decoding.use_route("split_k"):
        if not decoding.supports(normalizer, q, k, v, mask, None, 0.0):
            raise RuntimeError(f"the split-K route does not take {spec} on {device}")
    return lambda q, k, v: decoding.attention(normalizer, q, k, v, mask, None, scale)


COPIES = "[f32 copies]"
"""Suffix of the providers that score through float32 copies of q and k (``--copies``)."""


def with_copies(call: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``call`` with the rows route's scores kernel switched off: scores from float32 copies of q and k."""

    def copies(*inputs: torch.Tensor) -> torch.Tensor:
        kernel_applies = decoding.scores_kernel_applies
        decoding.scores_kernel_applies = lambda *args: False
        try:
            return call(*inputs)
        finally:
            decoding.scores_kernel_applies = kernel_applies

    return copies


def on_rows_route(spec: str) -> bool:
    """True when ``spec``'s family decodes by scores as rows (a spec that does not build: False)."""
    try:
        return decoding.route(attnorm.make(spec)) == "rows"
    except Exception:  # its own provider reports the error
        return False


def has_split_k(spec: str) -> bool:
    """True when ``spec``'s family has a split-K decoding kernel (a spec that does not build: False)."""
    try:
        kernel = getattr(attnorm.make(spec), "kernel", None)
    except Exception:  # its own provider reports the error
        return False
    return kernel in decoding.SPLIT_K_KERNELS


def split_k_unavailable(device: str) -> str | None:
    """Why the split-K kernel cannot run on ``device`` (None when it can)."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "split-K runs CPU tensors only under TRITON_INTERPRET=1 (Triton's interpreter)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "split-K needs triton (pip install triton)"
    return None


def sdpa_with(lq: int, lk: int) -> Callable[..., torch.Tensor]:
    """SDPA under the same bottom-right causal mask (a single query row sees every key)."""
    mask = causal_lower_right(lq, lk) if lq > 1 else None
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def time_providers(calls: dict[str, Callable], inputs, device: str, rounds: int, errors: dict) -> dict[str, list]:
    """Seconds per call of each provider, one sample per round, the providers interleaved in each round.

    CUDA: a sample is ``do_bench``'s median over a short run.  Timed one provider after another, the
    host-bound calls (4k keys) came out faster in whichever run went second (an H200, 2026-11-27: sparsemax
    12.9x then 2.4x SDPA), so every provider is now timed once per round and the ratio is the median of
    the rounds' ratios, as on CPU.  CPU: a sample is one call's wall time.
    """
    timer = _cuda_sample if device == "cuda" else _cpu_sample
    samples = {}
    with torch.no_grad():
        for name, call in calls.items():
            try:
                call(*inputs)  # warm-up (builds kernels, records replays)
                samples[name] = []
            except Exception as error:  # one provider failing must not end the run
                errors[name] = error_text(error)
        for _ in range(rounds):
            for name in list(samples):
                try:
                    samples[name].append(timer(calls[name], inputs))
                except Exception as error:
                    errors[name] = error_text(error)
                    del samples[name]
    return samples


def _cuda_sample(call: Callable, inputs) -> float:
    from triton.testing import do_bench

    return do_bench(lambda: call(*inputs), warmup=5, rep=CUDA_REP_MS) / 1e3


def _cpu_sample(call: Callable, inputs) -> float:
    start = time.perf_counter()
    call(*inputs)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> list[dict]:
    lengths, batch, heads, head_dim, dtype, rounds = SETTINGS[args.device]
    lengths = args.lengths or ((256, 512) if args.quick else lengths)
    rounds = 2 if args.quick else rounds
    specs = [spec.format(heads=heads) for spec in args.specs or SPECS]
    routed = [] if args.growing or args.padded else [spec for spec in specs if has_split_k(spec)]
    if routed and (reason := split_k_unavailable(args.device)):
        print(f"route providers left out: {reason}")
        routed = []
    stamp = versions(args.device)
    rows = []
    for lk in lengths:
        generator = torch.Generator(device=args.device).manual_seed(0)
        cache = lk + GROW_SPAN if args.growing else lk
        q, k, v = (torch.randn(batch, heads, length, head_dim, device=args.device, dtype=dtype, generator=generator)
                   for length in (args.queries, cache, cache))
        calls, errors = {"sdpa": sdpa_with(args.queries, lk)}, {}
        for spec in specs:
            try:
                calls[spec] = attend_with(spec, args.device, args.queries, None if args.growing else lk)
            except Exception as error:
                errors[spec] = error_text(error)
            if args.copies and spec in calls and on_rows_route(spec):
                calls[spec + COPIES] = with_copies(calls[spec])
        if args.padded:
            mask = padded_mask(batch, args.queries, lk, args.device)
            calls = {"sdpa": lambda q, k, v, mask=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)}
            for spec in specs:
                if spec in errors:
                    continue
                normalizer = attnorm.make(spec).to(args.device)
                calls[spec] = lambda q, k, v, normalizer=normalizer, mask=mask: attnorm.attention(
                    q, k, v, normalizer, attn_mask=mask)
        if args.growing:
            if args.queries > 1:
                calls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]))
            if args.device == "cuda":
                calls = {"sdpa": calls["sdpa"], FLASH: flash_only(calls["sdpa"]), **calls}
            calls = {name: growing(call, lk) for name, call in calls.items()}
        for spec in routed:
            for route in ROUTES:
                try:
                    calls[f"{spec}[{route}]"] = route_with(spec, route, args.device, q, k, v)
                except Exception as error:
                    errors[f"{spec}[{route}]"] = error_text(error)
        samples = time_providers(calls, (q, k, v), args.device, rounds, errors)
        base = samples.get("sdpa")
        for name in [*calls, *[spec for spec in errors if spec not in calls]]:
            row = {"normalizer": name, "kv_length": lk, "queries": args.queries, "batch": batch, "heads": heads,
                   "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."), "device": args.device,
                   "goal": "" if name.startswith("sdpa") else goal(name), "versions": stamp,
                   "error": errors.get(name, "")}
            if name in samples:
                median, p20, p80 = percentiles(samples[name])
                row.update(median_ms=median * 1e3, p20_ms=p20 * 1e3, p80_ms=p80 * 1e3)
                if base:
                    pairs = list(zip(samples[name], base, strict=False))
                    row["ratio_vs_sdpa"] = statistics.median(a / b for a, b in pairs)
            rows.append(row)
    return rows


def report(rows: list[dict]) -> str:
    lengths = sorted({row["kv_length"] for row in rows})
    names = list(dict.fromkeys(row["normalizer"] for row in rows))
    cell = {(row["normalizer"], row["kv_length"]): row for row in rows}
    body = []
    for name in names:
        entries = []
        for length in lengths:
            row = cell.get((name, length), {})
            if row.get("error"):
                entries.append("error")
            elif name == "sdpa":
                entries.append(f"{row['median_ms']:.3f} ms")
            else:
                entries.append(f"{row['ratio_vs_sdpa']:.2f}x")
        body.append([name, *entries])
    return markdown_table(["normalizer", *[f"KV {length}" for length in lengths]], body)


def route_report(rows: list[dict]) -> str | None:
    """``split_k / rows`` median time per routed spec and KV length (below 1: split-K is faster); None without any."""
    cell = {(row["normalizer"], row["kv_length"]): row for row in rows if "median_ms" in row}
    lengths = sorted({row["kv_length"] for row in rows})
    specs = list(dict.fromkeys(row["normalizer"].removesuffix("[split_k]") for row in rows
                               if row["normalizer"].endswith("[split_k]")))
    if not specs:
        return None
    body = []
    for spec in specs:
        entries = []
        for length in lengths:
            split, whole = cell.get((f"{spec}[split_k]", length)), cell.get((f"{spec}[rows]", length))
            entries.append(f"{split['median_ms'] / whole['median_ms']:.2f}" if split and whole else "error")
        body.append([spec, *entries])
    return markdown_table(["split_k / rows", *[f"KV {length}" for length in lengths]], body)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, two rounds (seconds; for tests)")
    parser.add_argument("--lengths", type=int, nargs="+", help="KV lengths")
    parser.add_argument("--queries", type=int, default=1, help="query rows per step (default 1)")
    parser.add_argument("--specs", nargs="+", help="normalizer specs ({heads} = the run's heads)")
    parser.add_argument("--copies", action="store_true",
                        help=f"also time rows-route families with scores from float32 copies ('<spec>{COPIES}')")
    parser.add_argument("--growing", action="store_true",
                        help="a KV cache one key longer every call, as in generation (no replayed shape)")
    parser.add_argument("--padded", action="store_true",
                        help="a left-padded batch: every provider gets a bool mask (B, 1, Lq, Lk)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.padded and args.growing:
        parser.error("--padded and --growing are separate runs")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"bench_decoding_{args.device}" + ("_growing" if args.growing else "") + ("_padded" if args.padded else "")
    write_csv(args.out / f"{name}.csv", rows, COLUMNS)
    table = report(rows)
    routes = route_report(rows)
    if routes:
        table += f"\n\nRoute choice: split-K time over scores-as-rows time (below 1: split-K is faster).\n\n{routes}"
    (args.out / f"{name}.md").write_text(
        f"Decoding, {args.queries} query row(s), forward only"
        f"{', the KV cache one key longer every call' if args.growing else ''}"
        f"{', a left-padded batch (bool mask)' if args.padded else ''}; SDPA in ms, the rest as a ratio "
        f"to it.\n\n"
        f"{table}\n\n{rows[0]['versions'] if rows else ''}\n"
    )
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
