"""Time and peak memory of attention with every attnorm normalizer against SDPA.

For each normalizer spec, each sequence length ``L`` (``batch = max(1, tokens // L)``, so
every length holds the same number of tokens), causal and not, and each mode — forward
(a training forward, saving for backward), backward (after an untimed forward) and
forward+backward — with ``q, k, v`` of shape ``(batch, heads, L, head_dim)``:

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (softmax; the baseline:
  every ratio is against it, measured in the same run);
* ``attnorm``: ``attnorm.attention(q, k, v, normalizer, is_causal=...)``, the route it
  picks (one SDPA call for temperature and Scalable-Softmax, the fused Triton kernels on
  CUDA, the blocked route elsewhere);
* ``materialised``: ``attnorm.attention(..., return_weights=True)``: the ``(L x L)``
  scores built and the normalizer applied to them (skipped, with an error row, where
  they would not fit in memory);
* ``adasplash``: AdaSplash's ``adasplash(q, k, v, alpha, is_causal)`` for sparsemax
  (alpha 2) and alpha-entmax, on CUDA when the package is installed (its own scaling);
* ``flex``: ``torch.nn.attention.flex_attention`` (compiled) with a ``score_mod`` for the
  logit scalings (softmax with temperature: ``score / T``; Scalable-Softmax:
  ``score * (s_h log n_i + b_h)`` with ``n_i`` the keys row ``i`` may attend) and a causal
  block mask.  On CUDA by default; on the CPU it has no backward and compiles for ~30 s
  per shape, so ask for it with ``--providers``;
* ``radix``: attnorm's fused top-k with the forward's radix select forced
  (``attention_topk.CANDIDATE_KEEP = 0``) where it takes candidate buffers: the two
  selections side by side, on CUDA.

Each provider is isolated: an exception (an out-of-memory error included) while
building or running it becomes an ``error`` row and the run goes on; memory is freed
between providers.

How it is measured:

* CUDA: ``triton.testing.do_bench`` (warm-up, CUDA events, L2 flushed before each call;
  the backward re-runs ``out.backward(grad, retain_graph=True)`` on one forward's graph);
  peak memory is ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
  minus what was allocated before the call (the inputs do not count).
* CPU: interleaved rounds of ``time.perf_counter`` (one call of each provider in turn,
  so load on a shared machine slows all alike); the ratio is the median of each round's
  ratio to SDPA.  Peak memory is the peak of torch's CPU allocator's running
  allocated-minus-freed bytes during the call, from ``torch.profiler`` memory events
  (:mod:`profiler_memory`).

Two more modes:

* ``--check-memory`` (CPU): forward+backward peak memory of each normalizer's route at
  ``L = 8192`` (batch 1, ``--heads`` 4, head dim 64, float32) over SDPA's; the goal is
  <= 1.1x for the logit scalings (temperature, Scalable-Softmax) and <= 2x for the rest.
  Exits 1 when one is over.
* ``--gpt2-step``: one training step (forward, loss, backward, AdamW) of a GPT-2-small
  shaped model with random weights (12 layers, 12 heads, 768 wide, dropout 0; bf16,
  8 x 1024 tokens on CUDA; 2 layers, 4 heads, 128 wide, float32, 2 x 256 tokens on the
  CPU) with ``attn_implementation="sdpa"`` and patched with each normalizer
  (``attnorm.integrations.transformers.patch``); step time and peak memory over SDPA's.

Usage::

    python benchmarks/bench_attention.py                        # CUDA: L 1k..32k, 16384 tokens, 16 heads, bf16
    python benchmarks/bench_attention.py --device cpu           # L 256..2048, 1024 tokens, 2 heads, float32
    python benchmarks/bench_attention.py --device cpu --quick   # seconds: L 64 and 128
    python benchmarks/bench_attention.py --check-memory         # CPU, L = 8192
    python benchmarks/bench_attention.py --device cpu --window 256   # a causal sliding window of 256 keys
    python benchmarks/bench_attention.py --gpt2-step [--device cpu]
    python benchmarks/bench_attention.py --lengths 4096 --specs ssmax sparsemax --providers sdpa attnorm

Writes ``bench_attention_<device>``, ``bench_attention_gpt2_<device>`` or
``bench_attention_check_memory_cpu`` ``.csv`` and ``.md`` (and for the first a ``.png``)
into ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import importlib.util
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from profiler_memory import peak_bytes
from reporting import error_text, markdown_table, percentiles, versions, write_csv

import attnorm

COLUMNS = (
    "normalizer", "provider", "mode", "metric", "unit", "L", "batch", "heads", "head_dim", "causal", "dtype",
    "device", "median", "p20", "p80", "error", "versions",
)
MODES = ("forward", "backward", "forward+backward")
CAUSAL = {"both": (True, False), "yes": (True,), "no": (False,)}
SHORT_MODE = {"forward": "fwd", "backward": "bwd", "forward+backward": "fwd+bwd"}
# {heads} becomes the number of heads of the run (per-head learnable parameters).
SPECS = (
    "softmax", "softmax:temperature=0.5", "ssmax", "ssmax:learnable=true,num_heads={heads}", "sparsemax",
    "entmax:alpha=1.5", "entmax:alpha=1.3", "entmax:alpha=1.5,learnable=true,num_heads={heads}", "topk:k=64",
    "topk:k=0.06", "sa_softmax", "sa_softmax:normalized=false",
)
BASELINE = ("softmax", "sdpa")
PROVIDERS = ("sdpa", "attnorm", "materialised", "adasplash", "flex", "radix")


@dataclass(frozen=True)
class Setting:
    """What one run measures: lengths, tokens per length, heads, head dim, dtype, device and timing effort."""

    lengths: tuple[int, ...]
    tokens: int
    heads: int
    head_dim: int
    dtype: str
    repeats: int


SETTINGS = {
    "cuda": Setting((1024, 2048, 4096, 8192, 16384, 32768), 16384, 16, 64, "bfloat16", 0),
    "cpu": Setting((256, 512, 1024, 2048), 1024, 2, 64, "float32", 3),
    "quick": Setting((64, 128), 128, 2, 16, "float32", 1),
}
CHECK_LENGTH, CHECK_HEADS, CHECK_LIMITS = 8192, 4, {"scaling": 1.1, "other": 2.0}
GPT2 = {
    "cuda": dict(n_layer=12, n_head=12, n_embd=768, batch=8, length=1024, dtype="bfloat16", repeats=0),
    "cpu": dict(n_layer=2, n_head=4, n_embd=128, batch=2, length=256, dtype="float32", repeats=5),
    "quick": dict(n_layer=1, n_head=2, n_embd=32, batch=1, length=32, dtype="float32", repeats=1),
}

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Provider:
    """One implementation: ``build(causal, length)`` gives ``attend(q, k, v)`` and its trainable parameters."""

    normalizer: str
    provider: str
    build: Callable[[bool, int], tuple[Attend, list[torch.Tensor]]]

    @property
    def key(self) -> tuple[str, str]:
        return self.normalizer, self.provider


def is_scaling(spec: str) -> bool:
    """Whether ``spec`` is a logit scaling (softmax with a temperature, Scalable-Softmax): one SDPA call."""
    return spec.split(":")[0] in ("softmax", "ssmax")


def make_normalizer(spec: str, device: str) -> attnorm.Normalizer:
    return attnorm.make(spec).to(device)


def providers(specs: Sequence[str], wanted: Sequence[str], device: str, shape: tuple[int, int, int],
              dtype: torch.dtype, window: int | None = None) -> list[Provider]:
    """SDPA, then for each spec every wanted provider that can express it.

    With a ``window``, SDPA gets the causal sliding window as a bool ``(L, L)`` mask and attnorm as
    ``attnorm.sliding_window_mask(window)``; AdaSplash, FlexAttention and the radix select are left out.
    """
    if window is None:
        sdpa = lambda causal, length: (functools.partial(F.scaled_dot_product_attention, is_causal=causal), [])
    else:
        sdpa = lambda causal, length: (functools.partial(F.scaled_dot_product_attention,
                                                         attn_mask=window_allowed(length, window, device)), [])
    found = [Provider(*BASELINE, sdpa)]
    windowed = {} if window is None else {"window": window}
    for spec in specs:
        if "attnorm" in wanted:
            found.append(Provider(spec, "attnorm", functools.partial(attnorm_attend, spec, device, False, **windowed)))
        if "materialised" in wanted:
            build = functools.partial(materialised_attend, spec, device, shape, dtype, **windowed)
            found.append(Provider(spec, "materialised", build))
        if window is not None:
            continue
        alpha = entmax_alpha(spec)
        if "adasplash" in wanted and device == "cuda" and alpha and importlib.util.find_spec("adasplash"):
            found.append(Provider(spec, "adasplash", functools.partial(adasplash_attend, alpha)))
        if "flex" in wanted and is_scaling(spec) and spec != "softmax":
            found.append(Provider(spec, "flex", functools.partial(flex_attend, spec, device)))
        if "radix" in wanted and spec.startswith("topk") and device == "cuda":
            found.append(Provider(spec, "radix", functools.partial(radix_attend, spec, device)))
    return found


def radix_attend(spec: str, device: str, causal: bool, length: int):
    """attnorm's fused top-k with its forward's radix select, where it would take candidate buffers (k <= 64).

    The switch is a module constant, which replayed calls do not read: the replay plans are
    forgotten as it flips (so these calls run as written, ~0.1 ms of host time against
    forwards of milliseconds).
    """
    from attnorm.kernels.triton import attention_topk, replay

    attend, parameters = attnorm_attend(spec, device, False, causal, length)

    def call(q, k, v):
        kept = attention_topk.CANDIDATE_KEEP
        attention_topk.CANDIDATE_KEEP = 0
        replay.clear()
        try:
            return attend(q, k, v)
        finally:
            attention_topk.CANDIDATE_KEEP = kept
            replay.clear()

    return call, parameters


def window_allowed(length: int, window: int, device: str) -> torch.Tensor:
    """The causal sliding window of ``window`` keys as a bool ``(L, L)`` mask (True = may attend)."""
    rows, keys = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)
    return (keys <= rows) & (keys > rows - window)


def attnorm_attend(spec: str, device: str, return_weights: bool, causal: bool, length: int,
                   window: int | None = None):
    normalizer = make_normalizer(spec, device)
    masking = dict(is_causal=causal) if window is None else dict(attn_mask=attnorm.sliding_window_mask(window))
    attend = functools.partial(attnorm.attention, normalizer=normalizer, return_weights=return_weights, **masking)
    if return_weights:
        return (lambda q, k, v: attend(q, k, v)[0]), list(normalizer.parameters())
    return attend, list(normalizer.parameters())


def materialised_attend(spec: str, device: str, shape: tuple[int, int, int], dtype: torch.dtype, causal: bool,
                        length: int, window: int | None = None):
    """The materialised route, refused up front when its float32 scores, weights and their
    gradients (about four ``(L x L)`` tensors per head) would not fit in free memory."""
    batch, heads, _ = shape
    needed = 4 * batch * heads * length * length * max(4, dtype.itemsize)
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else available_cpu_bytes()
    if needed > free // 2:
        raise MemoryError(f"skipped: the materialised route needs ~{needed / 2**30:.1f} GiB, "
                          f"{free / 2**30:.1f} GiB free")
    return attnorm_attend(spec, device, True, causal, length, window)


def available_cpu_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(fields["MemAvailable"].split()[0]) * 1024


def entmax_alpha(spec: str) -> float | None:
    """The alpha of a fixed-alpha sparsemax / entmax spec (AdaSplash's), else None."""
    if spec == "sparsemax":
        return 2.0
    name, _, arguments = spec.partition(":")
    fields = dict(item.split("=") for item in arguments.split(",") if item)
    if name == "entmax" and "learnable" not in fields:
        return float(fields.get("alpha", 1.5))
    return None


def adasplash_attend(alpha: float, causal: bool, length: int):
    adasplash = importlib.import_module("adasplash").adasplash
    return (lambda q, k, v: adasplash(q, k, v, alpha=alpha, is_causal=causal)), []


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attend(spec: str, device: str, causal: bool, length: int):
    """FlexAttention with the normalizer's logit scaling as a ``score_mod``."""
    from torch.nn.attention.flex_attention import create_block_mask

    normalizer = make_normalizer(spec, device)
    if isinstance(normalizer, attnorm.ScalableSoftmax):
        s, bias = (torch.as_tensor(value, device=device).reshape(-1) for value in (normalizer.s, normalizer.bias))
        per_head = s.numel() > 1

        def score_mod(score, b, h, q_idx, kv_idx):
            n = (q_idx + 1 if causal else torch.full_like(q_idx, length)).to(torch.float32)
            index = h if per_head else 0
            return score * (s[index] * torch.log(n) + bias[index])
    else:
        temperature = normalizer.temperature

        def score_mod(score, b, h, q_idx, kv_idx):
            return score / temperature

    block_mask = (create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, length, length,
                                    device=device) if causal else None)
    flex = compiled_flex_attention()
    return (lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)), list(normalizer.parameters())


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """Give back the memory a provider left (on the CPU, reference counting already has)."""
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def clear_grads(tensors: Sequence[torch.Tensor]) -> None:
    for tensor in tensors:
        tensor.grad = None


def mode_call(attend: Attend, qkv, grad: torch.Tensor, mode: str) -> Callable[[], object]:
    """A call running ``mode`` once; for ``backward`` the forward runs now, outside the call."""
    if mode == "backward":
        out = attend(*qkv)
        return lambda: out.backward(grad, retain_graph=True)
    if mode == "forward":
        return lambda: attend(*qkv)
    return lambda: attend(*qkv).backward(grad)


def cpu_seconds(attend: Attend, qkv, grad, mode: str, leaves) -> float:
    clear_grads(leaves)
    call = mode_call(attend, qkv, grad, mode)
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def cpu_samples(built: dict, qkv, grad, mode: str, repeats: int, errors: dict) -> dict[tuple, list[float]]:
    """Seconds per round for each provider, one call of each in turn after a warm-up call."""
    samples = {}
    for key, (attend, params) in built.items():
        try:
            cpu_seconds(attend, qkv, grad, mode, [*qkv, *params])
            samples[key] = []
        except Exception as error:  # one provider failing must not end the run
            errors[key] = error_text(error)
    for _ in range(repeats):
        for key in list(samples):
            attend, params = built[key]
            try:
                samples[key].append(cpu_seconds(attend, qkv, grad, mode, [*qkv, *params]))
            except Exception as error:
                errors[key] = error_text(error)
                del samples[key]
    return samples


def cuda_quantiles(attend: Attend, qkv, grad, mode: str, params) -> tuple[float, float, float]:
    """(median, p20, p80) seconds from ``triton.testing.do_bench`` (L2 flushed before each call)."""
    from triton.testing import do_bench

    clear_grads([*qkv, *params])
    milliseconds = do_bench(mode_call(attend, qkv, grad, mode), grad_to_none=[*qkv, *params],
                            quantiles=[0.5, 0.2, 0.8])
    return tuple(value / 1e3 for value in milliseconds)


def inputs(batch: int, heads: int, length: int, head_dim: int, dtype, device: str):
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (batch, heads, length, head_dim)
    qkv = [torch.randn(shape, device=device, dtype=dtype, generator=generator).requires_grad_() for _ in range(3)]
    return qkv, torch.randn(shape, device=device, dtype=dtype, generator=generator)


def measure_config(cases: list[Provider], setting: Setting, length: int, causal: bool, device: str,
                   progress, modes: Sequence[str] = MODES) -> list[dict]:
    """Time and peak memory of every provider in every mode at one length, causal or not."""
    batch, dtype = max(1, setting.tokens // length), getattr(torch, setting.dtype)
    qkv, grad = inputs(batch, setting.heads, length, setting.head_dim, dtype, device)
    common = dict(L=length, batch=batch, heads=setting.heads, head_dim=setting.head_dim, causal=causal,
                  dtype=setting.dtype, device=device)
    built, build_errors = {}, {}
    for case in cases:
        try:
            built[case.key] = case.build(causal, length)
        except Exception as error:  # one provider failing must not end the run
            build_errors[case.key] = error_text(error)
    results = []
    for mode in modes:
        errors, times, memory = dict(build_errors), {}, {}
        if device == "cpu":
            samples = cpu_samples(built, qkv, grad, mode, setting.repeats, errors)
            times = {key: percentiles(values) for key, values in samples.items()}
            base = samples.get(BASELINE)
            ratios = {key: percentiles([t / b for t, b in zip(values, base, strict=True)])
                      for key, values in samples.items()} if base else {}
        for key, (attend, params) in built.items():
            if key in errors:
                continue
            try:
                if device == "cuda":
                    times[key] = cuda_quantiles(attend, qkv, grad, mode, params)
                clear_grads([*qkv, *params])
                memory[key] = peak_bytes(mode_call(attend, qkv, grad, mode), device) / 2**20
            except Exception as error:  # an OOM here too: the row says so and the run goes on
                errors[key] = error_text(error)
                times.pop(key, None)
            clear_grads([*qkv, *params])
            release(device)
        if device == "cuda":
            base = times.get(BASELINE, (math.nan,))[0]
            ratios = {key: tuple(value / base for value in quantiles) for key, quantiles in times.items()}
        for case in cases:
            row = dict(normalizer=case.normalizer, provider=case.provider, mode=mode, **common)
            results += case_rows(case.key, row, times, ratios, memory, errors)
            progress(1)
    return results


def case_rows(key, row: dict, times: dict, ratios: dict, memory: dict, errors: dict) -> list[dict]:
    """The CSV rows of one provider in one configuration: time, ratios, peak memory; or one error row."""
    if key in errors or key not in times:
        return [{**row, "metric": "error", "unit": "-", "error": errors.get(key, "not measured")}]
    spread = lambda values, scale=1.0: dict(zip(("median", "p20", "p80"), (v * scale for v in values), strict=True))
    out = [{**row, "metric": "time", "unit": "ms", **spread(times[key], 1e3)}]
    if key in ratios:
        out.append({**row, "metric": "time_ratio_vs_sdpa", "unit": "x", **spread(ratios[key])})
    if key in memory:
        out.append({**row, "metric": "peak_memory", "unit": "MiB", **spread((memory[key],) * 3)})
        if memory.get(BASELINE):
            out.append({**row, "metric": "memory_ratio_vs_sdpa", "unit": "x",
                        **spread((memory[key] / memory[BASELINE],) * 3)})
    return out


def report(results: list[dict], lengths: Sequence[int], causals: Sequence[bool] = (True, False),
           modes: Sequence[str] = MODES) -> str:
    """Markdown, per causal flag and mode: ``time x / memory x`` against SDPA, SDPA's own ms / MiB."""
    found = {(r["normalizer"], r["provider"], r["causal"], r["L"], r["mode"], r["metric"]): r for r in results}
    keys = dict.fromkeys((r["normalizer"], r["provider"]) for r in results)
    batches = {r["L"]: r["batch"] for r in results}

    def cell(key, causal, length, mode) -> str:
        get = lambda metric: found.get((*key, causal, length, mode, metric))
        if get("time") is None:
            return "error" if get("error") else "-"
        memory = get("peak_memory")
        if key == BASELINE:
            return f"{get('time')['median']:.3g} ms" + (f" / {memory['median']:.3g} MiB" if memory else "")
        time_ratio, memory_ratio = get("time_ratio_vs_sdpa"), get("memory_ratio_vs_sdpa")
        return (f"{time_ratio['median']:.2f}x" if time_ratio else "-") + (
            f" / {memory_ratio['median']:.2f}x" if memory_ratio else "")

    sections = []
    for causal in causals:
        for mode in modes:
            header = ["normalizer", "provider", *(f"L={length} (B={batches.get(length, '-')})" for length in lengths)]
            rows = [[*key, *(cell(key, causal, length, mode) for length in lengths)] for key in keys]
            title = f"### {'causal' if causal else 'not causal'}, {mode}: time / SDPA time, peak memory / SDPA's"
            sections.append(f"{title}\n\n{markdown_table(header, rows)}")
    return "\n\n".join(sections)


def error_lines(results: list[dict]) -> list[str]:
    where: dict[tuple, list[str]] = {}
    for r in results:
        if r["metric"] == "error":
            key = (r["normalizer"], r["provider"], r["error"])
            where.setdefault(key, []).append(f"L={r['L']}{' causal' if r['causal'] else ''} {SHORT_MODE[r['mode']]}")
    return [f"{normalizer} / {provider} ({', '.join(places)}): {error}"
            for (normalizer, provider, error), places in where.items()]


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(mode, "time_ratio_vs_sdpa") for mode in MODES] + [("forward+backward", "memory_ratio_vs_sdpa")]
    figure, axes = plt.subplots(2, len(panels), figsize=(5.5 * len(panels), 9), sharey="col", squeeze=False)
    keys = dict.fromkeys((r["normalizer"], r["provider"]) for r in results)
    styles = {"sdpa": "k-", "attnorm": "-o", "materialised": ":x", "adasplash": "--s", "flex": "-.^"}
    for axes_row, causal in zip(axes, (True, False), strict=True):
        for axis, (mode, metric) in zip(axes_row, panels, strict=True):
            for key in keys:
                points = sorted((r["L"], r["median"]) for r in results if (r["normalizer"], r["provider"]) == key
                                and r["causal"] == causal and r["mode"] == mode and r["metric"] == metric)
                if points:
                    axis.plot(*zip(*points, strict=True), styles[key[1]], label=" / ".join(key), markersize=4)
            axis.set(xscale="log", yscale="log", xlabel="L (batch x L fixed)",
                     title=f"{'causal' if causal else 'not causal'}, {SHORT_MODE[mode]}: "
                           f"{'time' if metric.startswith('time') else 'peak memory'} / SDPA")
            axis.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run_grid(args, setting: Setting, specs: list[str], stamp: str) -> int:
    """The attention benchmark over lengths, causal and not; writes CSV, markdown and PNG."""
    dtype = getattr(torch, setting.dtype)
    cases = providers(specs, args.providers, args.device, (1, setting.heads, setting.head_dim), dtype, args.window)
    causals, modes = (CAUSAL["yes"] if args.window else CAUSAL[args.causal]), args.modes
    total = len(cases) * len(setting.lengths) * len(causals) * len(modes)
    done = [0]

    def progress(count: int) -> None:
        done[0] += count
        print(f"\r{done[0]}/{total} provider-modes measured", end="", file=sys.stderr, flush=True)

    results = []
    for length in setting.lengths:
        for causal in causals:
            results += measure_config(cases, setting, length, causal, args.device, progress, modes)
    print(file=sys.stderr)
    for row in results:
        row["versions"] = stamp
    stem = args.out / f"bench_attention_{args.device}{f'_window{args.window}' if args.window else ''}"
    write_csv(stem.with_suffix(".csv"), results, COLUMNS)
    method = ("triton.testing.do_bench (L2 flushed per call); ratio of medians" if args.device == "cuda" else
              f"{setting.repeats} interleaved rounds after a warm-up; ratio = median of within-round ratios")
    note = (f"q, k, v ({args.tokens_note}, {setting.heads}, L, {setting.head_dim}) {setting.dtype} on {args.device}. "
            f"Cells: median time / SDPA's, peak memory / SDPA's; the SDPA row holds its own. Timing: {method}. "
            f"Versions: {stamp.replace(';', ', ')}.")
    if args.window:
        note += (f" Causal sliding window of {args.window} keys: attnorm takes `attnorm.sliding_window_mask"
                 f"({args.window})`, SDPA the same mask as a bool (L, L) tensor.")
    errors = error_lines(results)
    if errors:
        note += "\n\nErrors (the run went on without these):\n\n" + "\n".join(f"- {line}" for line in errors)
    text = f"{report(results, setting.lengths, causals, modes)}\n\n{note}\n"
    stem.with_suffix(".md").write_text(text)
    print(text)
    plot(results, stem.with_suffix(".png"), f"attention, {setting.heads} heads, head dim {setting.head_dim}, "
                                            f"{setting.dtype}, {args.device}")
    print(f"wrote {stem}.csv, .md, .png")
    return 0


def run_check_memory(args, specs: list[str], stamp: str) -> int:
    """Forward+backward peak memory of each normalizer's attnorm route over SDPA's (CPU, float32)."""
    heads, length = args.heads or CHECK_HEADS, args.check_length
    qkv, grad = inputs(1, heads, length, 64, torch.float32, "cpu")
    small_qkv, small_grad = inputs(1, heads, 256, 64, torch.float32, "cpu")
    cases = providers(specs, ("attnorm",), "cpu", (1, heads, 64), torch.float32)
    rows, table, failed, base = [], [], [], None
    for case in cases:
        row = dict(normalizer=case.normalizer, provider=case.provider, mode="forward+backward", L=length, batch=1,
                   heads=heads, head_dim=64, causal=True, dtype="float32", device="cpu", versions=stamp)
        try:
            attend, params = case.build(True, length)
            mode_call(attend, small_qkv, small_grad, "forward+backward")()  # loads kernels, warms caches
            clear_grads([*qkv, *params])
            start = time.perf_counter()
            peak = peak_bytes(mode_call(attend, qkv, grad, "forward+backward"), "cpu") / 2**20
            seconds = time.perf_counter() - start
        except Exception as error:  # one normalizer failing must not end the run
            rows.append({**row, "metric": "error", "unit": "-", "error": error_text(error)})
            table.append([case.normalizer, case.provider, "error", error_text(error), "-", "over"])
            failed.append(case.normalizer)
            continue
        finally:
            clear_grads(qkv)
        base = peak if case.key == BASELINE else base
        limit = CHECK_LIMITS["scaling" if is_scaling(case.normalizer) else "other"]
        verdict = "ok" if peak / base <= limit else "over"
        failed += [case.normalizer] if verdict == "over" else []
        rows += [{**row, "metric": "peak_memory", "unit": "MiB", "median": peak},
                 {**row, "metric": "memory_ratio_vs_sdpa", "unit": "x", "median": peak / base},
                 {**row, "metric": "seconds_with_profiler", "unit": "s", "median": seconds}]
        table.append([case.normalizer, case.provider, f"{peak:.1f}", f"{peak / base:.2f}x", f"{limit}x", verdict])
        print(" | ".join(table[-1]) + f" | {seconds:.1f} s", flush=True)
    stem = args.out / "bench_attention_check_memory_cpu"
    write_csv(stem.with_suffix(".csv"), rows, COLUMNS)
    text = (f"### CPU peak memory, causal attention forward+backward, q, k, v (1, {heads}, {length}, 64) float32\n\n"
            + markdown_table(["normalizer", "provider", "peak MiB", "x SDPA", "limit", "verdict"], table)
            + f"\n\nPeak: torch CPU allocator bytes above those held before the call (torch.profiler memory events). "
              f"Versions: {stamp.replace(';', ', ')}.\n")
    stem.with_suffix(".md").write_text(text)
    print(text)
    print("PASS" if not failed else f"over the limit: {', '.join(failed)}")
    return 0 if not failed else 1


def run_gpt2_step(args, specs: list[str], stamp: str) -> int:
    """A GPT-2-shaped training step with SDPA and patched with each normalizer; step time and peak memory."""
    import transformers

    from attnorm.integrations.transformers import patch

    transformers.logging.set_verbosity_error()
    shape = dict(GPT2["quick" if args.quick else args.device])
    batch, length, dtype, repeats = (shape.pop(name) for name in ("batch", "length", "dtype", "repeats"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(**shape, n_positions=length, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     vocab_size=50257 if args.device == "cuda" else 1024)
    model = transformers.GPT2LMHeadModel(config).to(args.device, getattr(torch, dtype)).train()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, config.vocab_size, (batch, length), device=args.device)
    common = dict(mode="train step", L=length, batch=batch, heads=config.n_head,
                  head_dim=config.n_embd // config.n_head, causal=True, dtype=dtype, device=args.device, versions=stamp)

    def measure() -> tuple[tuple[float, float, float], float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # optimizer state, kernels, caches
        if args.device == "cuda":
            from triton.testing import do_bench

            seconds = tuple(value / 1e3 for value in do_bench(step, quantiles=[0.5, 0.2, 0.8]))
        else:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            seconds = percentiles(times)
        return seconds, peak_bytes(step, args.device) / 2**20

    rows, table, base = [], [], None
    for spec in [None, *specs]:
        row = dict(normalizer=spec or "softmax", provider="attnorm patch" if spec else "sdpa", **common)
        try:
            if spec is None:
                seconds, memory = measure()
            else:
                with patch(model, spec):
                    seconds, memory = measure()
        except Exception as error:  # one normalizer failing must not end the run
            rows.append({**row, "metric": "error", "unit": "-", "error": error_text(error)})
            table.append([row["normalizer"], row["provider"], "error", error_text(error), "-"])
            continue
        finally:
            release(args.device)
        base = (seconds[0], memory) if spec is None else base
        rows += [{**row, "metric": "time", "unit": "ms", **dict(zip(("median", "p20", "p80"),
                                                                    (1e3 * s for s in seconds), strict=True))},
                 {**row, "metric": "time_ratio_vs_sdpa", "unit": "x", "median": seconds[0] / base[0]},
                 {**row, "metric": "peak_memory", "unit": "MiB", "median": memory},
                 {**row, "metric": "memory_ratio_vs_sdpa", "unit": "x", "median": memory / base[1]}]
        table.append([row["normalizer"], row["provider"], f"{1e3 * seconds[0]:.1f}", f"{seconds[0] / base[0]:.2f}x",
                      f"{memory:.0f} ({memory / base[1]:.2f}x)"])
        print(" | ".join(table[-1]), flush=True)
    stem = args.out / f"bench_attention_gpt2_{args.device}"
    write_csv(stem.with_suffix(".csv"), rows, COLUMNS)
    method = "triton.testing.do_bench" if args.device == "cuda" else f"median of {repeats} steps after a warm-up"
    text = (f"### GPT-2 training step ({config.n_layer} layers, {config.n_head} heads, {config.n_embd} wide, "
            f"random weights, dropout 0), {batch} x {length} tokens, {dtype}, {args.device}\n\n"
            + markdown_table(["normalizer", "attention", "step ms", "x SDPA", "peak MiB (x SDPA)"], table)
            + f"\n\nStep: forward, loss, backward, AdamW.  Timing: {method}.  Versions: {stamp.replace(';', ', ')}.\n")
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one round (seconds; for tests)")
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths L")
    parser.add_argument("--tokens", type=int, help="batch x L (batch = max(1, tokens // L))")
    parser.add_argument("--heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--repeats", type=int, help="CPU: timed rounds")
    parser.add_argument("--specs", nargs="+", help="normalizer specs ({heads} = the run's heads)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS,
                        help="default: all but flex on CPU; sdpa always runs")
    parser.add_argument("--causal", choices=tuple(CAUSAL), default="both", help="causal masks to run (default both)")
    parser.add_argument("--window", type=int, help="a causal sliding window of this many keys (implies --causal yes)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="default: all three")
    parser.add_argument("--check-memory", action="store_true", help="CPU forward+backward peak memory at L=8192")
    parser.add_argument("--check-length", type=int, default=CHECK_LENGTH, help=argparse.SUPPRESS)
    parser.add_argument("--gpt2-step", action="store_true", help="GPT-2-shaped training step, SDPA vs attnorm")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.check_memory:
        args.device = "cpu"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.providers is None:
        args.providers = [p for p in PROVIDERS if p != "flex" or args.device == "cuda"]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = SETTINGS["quick" if args.quick else args.device]
    setting = Setting(tuple(args.lengths or base.lengths), args.tokens or base.tokens, args.heads or base.heads,
                      args.head_dim or base.head_dim, args.dtype or base.dtype,
                      base.repeats if args.repeats is None else args.repeats)
    if args.check_memory:
        heads = args.heads or CHECK_HEADS
    elif args.gpt2_step:
        heads = GPT2["quick" if args.quick else args.device]["n_head"]
    else:
        heads = setting.heads
    specs = [spec.format(heads=heads) for spec in (args.specs or SPECS)]
    stamp = versions(args.device)
    print(f"versions: {stamp}; attnorm from {Path(attnorm.__file__).parent}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.check_memory:
        return run_check_memory(args, specs, stamp)
    if args.gpt2_step:
        return run_gpt2_step(args, specs, stamp)
    args.tokens_note = f"batch = {setting.tokens} // L"
    print(f"L {', '.join(map(str, setting.lengths))}; {args.tokens_note}; {setting.heads} heads, head dim "
          f"{setting.head_dim}, {setting.dtype}, {args.device}; providers {', '.join(args.providers)}")
    return run_grid(args, setting, specs, stamp)


if __name__ == "__main__":
    sys.exit(main())
