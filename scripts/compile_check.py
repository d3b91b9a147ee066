"""Ahead-of-time compile check of every attnorm Triton kernel for an NVIDIA sm_90 GPU (H100), without a GPU.

Run from the repository root: ``PYTHONPATH=. python scripts/compile_check.py`` (``--help``;
``-k REGEX`` runs only the calls whose label matches, ``--blocks cuda`` skips the
interpreter's choices, ``--options 4x3,8x2`` compiles every variant at each
``num_warps x num_stages`` instead of its launcher's and prints a summary per setting:
how ``attention_launch.CUDA_OPTIONS`` was chosen).  A first run takes about 30 minutes on two cores (recording
under the interpreter ~10, compiling ~630 variants ~20); with Triton's cache a rerun
takes ~10, mostly recording.  Run it on a tree nobody is editing: the interpreter re-reads the
kernels' source from disk.

1. **Record.**  A child process runs a representative set of attnorm calls on small CPU
   tensors under ``TRITON_INTERPRET=1`` and records every kernel launch (wrapping
   ``InterpretedFunction.run``): the kernel, the grid, the arguments, and the signature,
   constexprs and attributes Triton's own launcher derives from them for sm_90 (its
   binder: pointer dtypes, 16-byte alignment, ints equal to 1 specialised), with the
   launch's ``num_warps``/``num_stages``.  The calls: every row normalizer forward and
   backward (short rows, one 8192-wide block, multi-pass rows; no mask, bool mask,
   causal + key lengths; and the forward alone, without a gradient), every fused
   attention kernel forward and backward through ``attnorm.attention`` (masks, GQA,
   softcap, sinks, head dims 64 and 128) and the split-K Self-Adjusted decoding kernel
   (``Lq`` 1 and 4).  Dtypes float32, bfloat16, float16; a few float64 calls, reported
   apart (not the GPU path).
   The attention launches are recorded with the CUDA choices of the launchers: each
   ``x.device.type == "cuda"`` test of :data:`CUDA_CHOICES` is rewritten to its CUDA
   branch (blocks of 64, bfloat16 operands, the fused kernels' warps and stages, an
   H100's 132 SMs for the decoding split count), and again, for the dtype x head dim
   calls, with the choices they make off CUDA (blocks of 16, bfloat16 q/k/v read as
   float32: what the test suite's interpreter runs).  The row kernels choose their
   blocks the same way on both devices and are recorded once.
2. **Compile.**  This process, interpreter off, compiles each distinct (kernel,
   signature, constexprs, attributes, options) with
   ``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
   options={"num_warps": ..., "num_stages": ...})`` down to a cubin (ptxas ships in the
   triton wheel) and reads its resources: Triton's shared memory (``metadata.shared``),
   and registers and stack bytes per thread (spilled registers live there) from the
   wheel's ``cuobjdump``.
3. **Report.**  One line per variant (``-q``: failures only), a summary per kernel; exit
   status 1 when a compile failed, a kernel needs more shared memory than an sm_90 block
   may have (227 KiB: it would raise OutOfResources at launch), or a call failed under
   the interpreter.

What it proves: these launches type-check, lower and assemble for sm_90 with the
installed Triton and fit an H100 block's shared memory.  What it does not: compiling is
not running (no numerics, races, out-of-bounds accesses or launch-time driver checks
besides shared memory), there is no timing, and launches these calls do not reach
(other head dims, row lengths, shapes specialised differently) are not compiled.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import pickle
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import warnings
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

SHARED_LIMITS = {80: 166912, 90: 232448}
"""Bytes of shared memory one block may opt in to, per compute capability (sm_90: 227 KiB); others: not checked."""

H100_SMS = 132
"""Streaming multiprocessors of an H100 SXM (the decoding split count's CUDA branch asks the device)."""

CUDA_TEST = re.compile(r'\b[\w.]*device\.type (==|!=) "cuda"')
"""A launcher's device test; :func:`cuda_branch` replaces it by its CUDA value."""

CUDA_CHOICES = (
    ("attnorm.kernels.triton.attention_launch", "block_size"),
    ("attnorm.kernels.triton.attention_launch", "dot_operands"),
    ("attnorm.kernels.triton.attention_launch", "launch_options"),
    ("attnorm.kernels.triton.attention_launch", "narrow_cuda"),
    ("attnorm.kernels.triton.attention_decoding", "split_count"),
    ("attnorm.kernels.triton.attention_decoding", "decoding_scores_forward"),
)
"""Launcher functions whose device tests are rewritten to their CUDA branch while recording."""

BATCH, HEADS, KV_HEADS, QUERIES = 2, 4, 2, 48
ROW_HEADS, ROW_QUERIES = 2, 3
ROW_LENGTHS = {"short": 37, "one block": 8192, "multi-pass": 8200}
DECODING_KEYS = 512


@dataclass
class Launch:
    """One recorded kernel launch, as Triton's launcher would compile it for sm_90."""

    module: str
    name: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    declared: tuple
    grid: tuple
    arguments: dict
    case: str
    blocks: str

    def key(self) -> tuple:
        return (self.module, self.name, tuple(self.signature.items()), repr(sorted(self.constexprs.items())),
                repr(sorted(self.attrs.items())), tuple(sorted(self.options.items())))


@dataclass
class Variant:
    """A distinct compile: the first launch that needs it, and every case and block choice that does."""

    launch: Launch
    cases: list = field(default_factory=list)
    blocks: set = field(default_factory=set)
    status: str = "?"
    error: str = ""
    shared: int | None = None
    resources: dict = field(default_factory=dict)
    warps_stages: tuple = ("-", "-")
    seconds: float = 0.0


# ---- recording (child process, TRITON_INTERPRET=1) --------------------------------------------


def describe(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return repr(value)


def install_recorder(launches: list, state: dict) -> None:
    """Wrap ``InterpretedFunction.run``: record what sm_90's launcher would compile, then interpret."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", state["arch"], 32))
    binders = {}
    interpret = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if self.fn not in binders:
            jit = JITFunction(self.fn)  # a compilable twin of the interpreted kernel, for its binder
            binders[self.fn] = jit, create_function_from_signature(jit.signature, jit.params, backend)
        jit, binder = binders[self.fn]
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
        launches.append(Launch(
            module=self.fn.__module__, name=self.fn.__name__, signature=signature,
            constexprs={jit.arg_names[path[0]]: value for path, value in constexprs.items()}, attrs=attrs,
            options={k: kwargs[k] for k in ("num_warps", "num_stages", "num_ctas", "maxnreg") if k in kwargs},
            declared=tuple(p.name for p in jit.params if p.is_constexpr), grid=tuple(grid),
            arguments={name: describe(value) for name, value in bound.items()}, case=state["case"],
            blocks=state["blocks"],
        ))
        return interpret(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def cuda_branch(function):
    """``function`` recompiled from its source with each ``x.device.type ==/!= "cuda"`` test set to a CUDA device.

    A decorated function (``@replay.replayable``) is recompiled from its own source, decorator included, in its
    own module's globals.
    """
    function = inspect.unwrap(function)
    source = textwrap.dedent(inspect.getsource(function))
    source, count = CUDA_TEST.subn(lambda match: str(match[1] == "=="), source)
    if not count:
        raise RuntimeError(f"{function.__qualname__} no longer tests the device: update CUDA_CHOICES")
    namespace = {}
    source = "from __future__ import annotations\n" + source  # as in the launchers' modules
    exec(compile(source, inspect.getsourcefile(function), "exec"), function.__globals__, namespace)
    return namespace[function.__name__]


def apply_cuda_choices() -> list[str]:
    """Rewrite :data:`CUDA_CHOICES` to their CUDA branch; return the device tests left at their CPU branch."""
    patched = []
    for module_name, path in CUDA_CHOICES:
        *owners, name = path.split(".")
        owner = importlib.import_module(module_name)
        for part in owners:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        replacement = cuda_branch(original)
        setattr(owner, name, replacement)
        for module in list(sys.modules.values()):  # the modules that imported the helper by name
            if module.__name__.startswith("attnorm") and module.__dict__.get(name) is original:
                setattr(module, name, replacement)
        lines, first = inspect.getsourcelines(original)
        patched.append((inspect.getsourcefile(original), range(first, first + len(lines))))
    decoding = importlib.import_module("attnorm.kernels.triton.attention_decoding")
    decoding._multiprocessors = lambda device: H100_SMS
    return device_tests_left(patched)


def device_tests_left(patched: list) -> list[str]:
    """``file:line`` of each launcher device test outside the rewritten functions."""
    import attnorm.kernels.triton as package

    left = []
    for path in sorted(os.listdir(os.path.dirname(package.__file__))):
        path = os.path.join(os.path.dirname(package.__file__), path)
        if not path.endswith(".py"):
            continue
        with open(path) as source:
            for number, line in enumerate(source, 1):
                inside = any(os.path.samefile(path, file) and number in lines for file, lines in patched)
                if CUDA_TEST.search(line) and not inside:
                    left.append(f"{os.path.relpath(path)}:{number}: {line.strip()}")
    return left


def row_normalizers() -> dict:
    import attnorm

    triton = dict(backend="triton")
    return {
        "softmax/T": lambda: attnorm.Softmax(temperature=0.7, **triton),
        "ssmax": lambda: attnorm.ScalableSoftmax(s=0.43, bias=0.1, **triton),
        "ssmax learnable": lambda: attnorm.ScalableSoftmax(learnable=True, num_heads=ROW_HEADS, **triton),
        "top-k 3": lambda: attnorm.TopKSoftmax(3, temperature=0.7, **triton),
        "top-k 0.25": lambda: attnorm.TopKSoftmax(0.25, **triton),
        "sparsemax": lambda: attnorm.Sparsemax(**triton),
        "entmax 1.5": lambda: attnorm.Entmax(1.5, **triton),
        "entmax 1.3": lambda: attnorm.Entmax(1.3, **triton),
        "entmax 1.05": lambda: attnorm.Entmax(1.05, **triton),  # near softmax: float64 compute (rules.NEAR_SOFTMAX)
        "entmax 3": lambda: attnorm.Entmax(3.0, **triton),
        "entmax learnable": lambda: attnorm.Entmax(1.5, learnable=True, num_heads=ROW_HEADS, **triton),
        "SA plain": lambda: attnorm.SelfAdjustedSoftmax(normalized=False, **triton),
        "SA normalized": lambda: attnorm.SelfAdjustedSoftmax(**triton),
    }


def row_mask(kind: str, length: int):
    import torch

    import attnorm

    if kind == "bool":
        allowed = torch.rand(BATCH, 1, ROW_QUERIES, length) > 0.3
        allowed[..., 0] = True
        return allowed
    if kind == "causal+lengths":
        lengths = torch.tensor([length, length - 5])
        return attnorm.causal_mask(length - ROW_QUERIES) & attnorm.key_padding_mask(lengths)
    return None


def row_call(make, dtype, length: int, mask: str, sink: bool = False, softcap: float | None = None,
             grad: bool = True):
    import torch

    def call():
        x = torch.randn(BATCH, ROW_HEADS, ROW_QUERIES, length).to(dtype).requires_grad_(grad)
        sinks = torch.randn(1, ROW_HEADS, 1, 1).requires_grad_(grad) if sink else None
        with torch.set_grad_enabled(grad):
            y = make()(x, row_mask(mask, length), sink=sinks, softcap=softcap)
        if grad:
            y.backward(torch.randn_like(y))

    return call


def row_cases():
    """Each normalizer: every row path x mask in bfloat16, the other dtypes on short rows, float64 apart."""
    import torch

    for family, make in row_normalizers().items():
        for path, length in ROW_LENGTHS.items():
            for mask in ("none", "bool", "causal+lengths"):
                yield f"rows {family} bf16 {path} {mask}", row_call(make, torch.bfloat16, length, mask)
        for dtype in (torch.float32, torch.float16, torch.float64):
            for path in ("short", "multi-pass") if dtype == torch.float64 else ("short",):
                name = str(dtype).removeprefix("torch.")
                yield (f"rows {family} {name} {path} causal+lengths",
                       row_call(make, dtype, ROW_LENGTHS[path], "causal+lengths"))
        # No gradient wanted: the forwards' WEIGHTS_ONLY variants (no per-row statistics), every row path.
        for path, length in ROW_LENGTHS.items():
            yield f"rows {family} bf16 {path} none no-grad", row_call(make, torch.bfloat16, length, "none", grad=False)
        # The modifiers' variants (HAS_SINK, SOFTCAP): every row path in bfloat16 under a bool mask.
        for sink, softcap in ((True, None), (False, 30.0), (True, 30.0)):
            label = " + ".join(["sink"] * sink + ["softcap"] * (softcap is not None))
            for path, length in ROW_LENGTHS.items():
                yield (f"rows {family} bf16 {path} bool {label}",
                       row_call(make, torch.bfloat16, length, "bool", sink, softcap))


def attention_normalizers() -> dict:
    """Each fused family: a normalizer, and the mask it takes the fused route with unmodified."""
    import attnorm

    triton = dict(backend="triton")
    return {
        "sparsemax": (lambda: attnorm.Sparsemax(**triton), "causal"),
        "entmax 1.5": (lambda: attnorm.Entmax(1.5, **triton), "causal"),
        "entmax learnable": (lambda: attnorm.Entmax(1.5, learnable=True, num_heads=HEADS, **triton), "causal"),
        "softmax/T": (lambda: attnorm.Softmax(temperature=0.7, **triton), "window"),
        "ssmax": (lambda: attnorm.ScalableSoftmax(s=0.43, bias=0.1, **triton), "documents"),
        "ssmax learnable": (lambda: attnorm.ScalableSoftmax(learnable=True, num_heads=HEADS, **triton), "documents"),
        "SA plain": (lambda: attnorm.SelfAdjustedSoftmax(normalized=False, **triton), "causal"),
        "SA normalized": (lambda: attnorm.SelfAdjustedSoftmax(**triton), "causal"),
        "top-k 5": (lambda: attnorm.TopKSoftmax(5, temperature=0.7, **triton), "causal"),
        "top-k 0.3": (lambda: attnorm.TopKSoftmax(0.3, **triton), "causal"),
        "top-k radix": (lambda: _radix_topk(**triton), "causal"),  # the last family: it switches the buffers off
    }


def _radix_topk(**options):
    """Top-k 5 through the radix select: the candidate buffers are switched off for the rest of the recording."""
    import attnorm
    from attnorm.kernels.triton import attention_topk

    attention_topk.CANDIDATE_KEEP = 0
    return attnorm.TopKSoftmax(5, temperature=0.7, **options)


def attention_mask(kind: str, lq: int, lk: int, dtype) -> dict:
    """``attnorm.attention`` keywords for mask ``kind`` (an additive mask in the inputs' ``dtype``)."""
    import torch

    import attnorm

    if kind == "bool":
        allowed = torch.rand(BATCH, 1, lq, lk) > 0.3
        allowed[..., -1] = True
        return dict(attn_mask=allowed)
    if kind == "additive":
        return dict(attn_mask=torch.randn(lq, lk).masked_fill(torch.rand(lq, lk) > 0.7, float("-inf")).to(dtype))
    masks = {
        "causal": lambda: attnorm.causal_mask(),
        "key padding": lambda: attnorm.key_padding_mask(torch.tensor([lk, lk - 11])),
        "window": lambda: attnorm.sliding_window_mask(16),
        "documents": lambda: attnorm.document_mask(torch.tensor([0, lk // 3, lk])),
    }
    return dict(attn_mask=masks[kind]()) if kind in masks else {}


def attention_call(make, dtype, head_dim: int, mask: str, kv_heads: int = KV_HEADS, softcap=None, sinks=False,
                   lq: int = QUERIES, lk: int = QUERIES, grad: bool = True):
    import torch

    import attnorm

    def call():
        q = torch.randn(BATCH, HEADS, lq, head_dim).to(dtype)
        k, v = (torch.randn(BATCH, kv_heads, lk, head_dim).to(dtype) for _ in range(2))
        sink = torch.randn(HEADS).to(dtype) if sinks else None
        with torch.set_grad_enabled(grad):
            for t in (q, k, v):
                t.requires_grad_(grad)
            out = attnorm.attention(q, k, v, make(), softcap=softcap, sinks=sink, **attention_mask(mask, lq, lk, dtype))
            if grad:
                out.backward(torch.randn_like(out))

    return call


def attention_cases(full: bool = True):
    """Each family: dtype x head dim at its own mask; ``full``: every mask, softcap, sinks, MHA (bf16 D64), float64."""
    import torch

    for family, (make, own) in attention_normalizers().items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for head_dim in (64, 128):
                name = str(dtype).removeprefix("torch.")
                yield f"attention {family} {name} D{head_dim} {own}", attention_call(make, dtype, head_dim, own)
        if not full:
            continue
        bf16 = torch.bfloat16
        # Unmodified, the logit scalings take SDPA under these masks: with softcap they take the fused kernel.
        cap = 30.0 if own != "causal" else None
        for mask in ("none", "causal", "key padding", "bool", "additive"):
            if mask != own:
                yield (f"attention {family} bf16 D64 {mask}{' softcap' * bool(cap)}",
                       attention_call(make, bf16, 64, mask, softcap=cap))
        for softcap, sinks in ((30.0, False), (None, True), (30.0, True)):
            label = " + ".join(["softcap"] * (softcap is not None) + ["sinks"] * sinks)
            yield (f"attention {family} bf16 D64 {own} {label}",
                   attention_call(make, bf16, 64, own, softcap=softcap, sinks=sinks))
        yield f"attention {family} bf16 D64 {own} MHA", attention_call(make, bf16, 64, own, kv_heads=HEADS)
        yield f"attention {family} float64 D64 {own}", attention_call(make, torch.float64, 64, own)
        yield f"attention {family} float64 D64 additive", attention_call(make, torch.float64, 64, "additive")


def decoding_cases(full: bool = True):
    """The split-K Self-Adjusted kernel (inference, Lq <= 16): both variants, dtypes, head dims; ``full``: masks.

    Then the rows route's scores kernel (half precision, sparsemax's row kernels after it).
    """
    import torch

    import attnorm

    for normalized in (False, True):
        make = lambda normalized=normalized: attnorm.SelfAdjustedSoftmax(normalized=normalized, backend="triton")
        family = "SA normalized" if normalized else "SA plain"
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for head_dim in (64, 128):
                name = str(dtype).removeprefix("torch.")
                yield (f"decoding {family} {name} D{head_dim} Lq1",
                       attention_call(make, dtype, head_dim, "none", lq=1, lk=DECODING_KEYS, grad=False))
        if not full:
            continue
        for mask, lq in (("key padding", 1), ("bool", 1), ("causal", 4), ("none", 4)):
            yield (f"decoding {family} bf16 D64 Lq{lq} {mask}",
                   attention_call(make, torch.bfloat16, 64, mask, lq=lq, lk=DECODING_KEYS, grad=False))
        yield (f"decoding {family} float64 D64 Lq1",
               attention_call(make, torch.float64, 64, "none", lq=1, lk=DECODING_KEYS, grad=False))
    # The rows route's scores kernel (half precision only), with the row kernels after it.
    sparsemax = lambda: attnorm.Sparsemax(backend="triton")
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 128):
            name = str(dtype).removeprefix("torch.")
            yield (f"decoding scores sparsemax {name} D{head_dim} Lq1",
                   attention_call(sparsemax, dtype, head_dim, "none", lq=1, lk=DECODING_KEYS, grad=False))
    # gpt-oss's sinks: a bfloat16 parameter per head, read in place by the row kernels (a bfloat16 sink pointer)
    for family, make in (("sparsemax", sparsemax), ("top-4", lambda: attnorm.TopKSoftmax(4, backend="triton")),
                         ("SA", lambda: attnorm.SelfAdjustedSoftmax(backend="triton"))):
        yield (f"decoding scores {family} bf16 D64 Lq1 sinks",
               attention_call(make, torch.bfloat16, 64, "none", lq=1, lk=DECODING_KEYS, grad=False, sinks=True))
    if full:
        yield ("decoding scores sparsemax bf16 D64 Lq16 MHA",
               attention_call(sparsemax, torch.bfloat16, 64, "causal", lq=16, lk=DECODING_KEYS, grad=False,
                              kv_heads=HEADS))


def record(blocks: str, arch: int, selection: str, output: str) -> None:
    """Child process: run the cases with ``blocks`` choices, pickle ``(launches, case outcomes, notes)``."""
    import torch

    warnings.filterwarnings("ignore")  # the interpreter evaluates masked-off lanes (exp(-inf - -inf) ...)
    torch.manual_seed(0)
    launches, state = [], {"arch": arch, "blocks": blocks, "case": ""}
    install_recorder(launches, state)
    notes = [f"device test left at its CPU branch: {line}" for line in apply_cuda_choices()] if blocks == "cuda" else []
    full = blocks == "cuda"  # the interpreter's choices: the dtype x head dim calls only (no rows: same choices)
    groups = [attention_cases(full), decoding_cases(full)] + ([row_cases()] if full else [])
    outcomes = []
    for cases in groups:
        for label, call in cases:
            if not re.search(selection, label):
                continue
            state["case"], before, start = label, len(launches), time.perf_counter()
            try:
                call()
                error = ""
            except Exception as exc:  # a call the interpreter rejects: reported, the others go on
                error = f"{type(exc).__name__}: {first_line(exc)}"
                print(f"call failed under the interpreter: {label}", file=sys.stderr)
                traceback.print_exc()
            outcomes.append((label, len(launches) - before, error, time.perf_counter() - start))
    with open(output, "wb") as file:
        pickle.dump((launches, outcomes, notes), file)


# ---- compiling (this process, interpreter off) -------------------------------------------------


def first_line(exc: BaseException, module: str | None = None) -> str:
    """The line of an error that says what went wrong (a compile error's message, and where in ``module``'s code)."""
    while exc.__cause__ is not None and type(exc.__cause__).__name__ == type(exc).__name__:
        exc = exc.__cause__  # a device function's error re-raised by its caller: the innermost says where
    message = getattr(exc, "error_message", None)
    if message:
        return message.strip().splitlines()[0] + (error_location(exc, module) if module else "")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def error_location(exc: BaseException, module: str) -> str:
    """`` (file:line, in function)`` of a compile error raised in a function ``module`` can see."""
    name, node = re.search(r"def\s+(\w+)", getattr(exc, "src", None) or ""), getattr(exc, "node", None)
    if name is None or not hasattr(node, "lineno"):
        return ""
    function = getattr(importlib.import_module(module), name[1], None)
    try:
        lines, start = inspect.getsourcelines(getattr(function, "fn", function))
    except TypeError:
        return f" (line {node.lineno} of {name[1]})"
    definition = start + next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
    return f" ({os.path.relpath(inspect.getsourcefile(function.fn))}:{definition + node.lineno - 1}, in {name[1]})"


def resource_usage(cubin: bytes) -> dict:
    """Registers and stack bytes per thread (where ptxas spills registers), read by the wheel's cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        result = subprocess.run([tool, "--dump-resource-usage", file.name], capture_output=True, text=True)
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", result.stdout)}


def compile_variant(variant: Variant, arch: int, dump: str | None = None) -> Variant:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch = variant.launch
    fn = getattr(importlib.import_module(launch.module), launch.name)
    start = time.perf_counter()
    try:
        source = ASTSource(fn, launch.signature, launch.constexprs, launch.attrs)
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
    except Exception as exc:
        variant.status, variant.error = "error", f"{type(exc).__name__}: {first_line(exc, launch.module)}"
    else:
        variant.shared = kernel.metadata.shared
        if dump:
            stem = Path(dump) / f"{launch.name}_{data_dtype(launch)}_{constexpr_digest(launch)}"
            stem.with_suffix(".cubin").write_bytes(kernel.asm["cubin"])
            stem.with_suffix(".ptx").write_text(kernel.asm["ptx"])
            stem.with_suffix(".txt").write_text(f"{variant.cases[0]}\n{constexpr_summary(launch)}\n{launch.options}\n")
        variant.resources = resource_usage(kernel.asm["cubin"])
        variant.warps_stages = (kernel.metadata.num_warps, kernel.metadata.num_stages)
        variant.status = "ok"
        limit = SHARED_LIMITS.get(arch, variant.shared)
        if variant.shared > limit:
            variant.status, variant.error = "error", f"needs {variant.shared} B of shared memory > {limit} (sm_{arch})"
    variant.seconds = time.perf_counter() - start
    return variant


def distinct(launches: list[Launch]) -> list[Variant]:
    variants = {}
    for launch in launches:
        variant = variants.setdefault(launch.key(), Variant(launch))
        variant.blocks.add(launch.blocks)
        if launch.case not in variant.cases:
            variant.cases.append(launch.case)
    return list(variants.values())


# ---- report ------------------------------------------------------------------------------------


SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int32": "i32",
         "int64": "i64", "uint32": "u32", "uint64": "u64"}


def data_dtype(launch: Launch) -> str:
    """The dtype of the kernel's data: its first pointer argument's."""
    first = next((kind for kind in launch.signature.values() if kind.startswith("*")), "*?")
    return first[1:]


def constexpr_digest(launch: Launch) -> str:
    """A short stable name for a variant's specialisation (its constexprs, signature and options)."""
    import hashlib

    return hashlib.sha1(repr(launch.key()).encode()).hexdigest()[:8]


def constexpr_summary(launch: Launch) -> str:
    """Declared constexprs: True flags by name, False ones left out, others as name=value."""
    parts = []
    for name in launch.declared:
        value = launch.constexprs.get(name)
        if value is True:
            parts.append(name)
        elif value is not False and value is not None:
            text = SHORT.get(getattr(value, "name", ""), getattr(value, "name", value))
            parts.append(f"{name}={text}")
    return " ".join(parts)


def programs_per_sm(regs: int, shared: int, warps: int) -> int:
    """Resident programs per SM of an H100 (sm_90) the registers and shared memory allow.

    64K registers, allocated per warp in units of 256 (8 per thread); 228 KiB of shared
    memory, of which each program also reserves 1 KiB; at most 64 warps and 32 programs.
    Two programs of 4 warps per SM, the usual case at 255 registers, leave 8 warps to hide
    latency; a FlashAttention-2 forward at 128 registers runs four.
    """
    by_regs = 65536 // (max(-(-regs // 8) * 8, 8) * 32 * warps)
    by_shared = 233472 // (shared + 1024)
    return max(min(by_regs, by_shared, 64 // warps, 32), 0)


def variant_line(number: int, variant: Variant) -> str:
    launch, usage = variant.launch, variant.resources
    warps, stages = variant.warps_stages
    shared = "-" if variant.shared is None else str(variant.shared)
    regs = usage.get("REG", "-")
    stack = usage.get("STACK", "-")
    blocks = "+".join(sorted(variant.blocks))
    status = "ok" if variant.status == "ok" else f"ERROR {variant.error}"
    compiled = variant.shared is not None and isinstance(regs, int) and isinstance(warps, int)
    per_sm = programs_per_sm(regs, variant.shared, warps) if compiled else "-"
    return (f"{number:4d} {launch.name:34s} {data_dtype(launch):5s} w{warps}/s{stages} {blocks:16s} smem={shared:>6s} "
            f"regs={regs!s:>3s} stack={stack!s:>4s} per-SM={per_sm!s:>2s} {variant.seconds:5.1f}s {status}\n"
            f"       {constexpr_summary(launch)}  [{variant.cases[0]}{' ...' if len(variant.cases) > 1 else ''}]")


def kernel_summary(variants: list[Variant]) -> list[str]:
    by_kernel = defaultdict(list)
    for variant in variants:
        by_kernel[(variant.launch.module.rsplit(".", 1)[-1], variant.launch.name)].append(variant)
    lines = [f"{'module':24s} {'kernel':34s} variants failed  max smem  max regs  max stack  stack>0  min per SM"]
    for (module, name), group in sorted(by_kernel.items()):
        failed = sum(variant.status != "ok" for variant in group)
        shared = max((variant.shared or 0 for variant in group), default=0)
        regs = max((variant.resources.get("REG", 0) for variant in group), default=0)
        stack = [variant.resources.get("STACK", 0) for variant in group]
        per_sm = min((programs_per_sm(variant.resources.get("REG", 0), variant.shared or 0, variant.warps_stages[0])
                      for variant in group if isinstance(variant.warps_stages[0], int)), default=0)
        lines.append(f"{module:24s} {name:34s} {len(group):8d} {failed:6d} {shared:9d} {regs:9d} {max(stack):10d} "
                     f"{sum(map(bool, stack)):8d} {per_sm:11d}")
    return lines


def report(variants: list[Variant], outcomes: list, notes: list[str], arch: int, quiet: bool) -> int:
    import triton

    gpu = [variant for variant in variants if data_dtype(variant.launch) != "fp64"]
    wide = [variant for variant in variants if data_dtype(variant.launch) == "fp64"]
    for title, group in (("float32 / bfloat16 / float16 (the GPU path)", gpu), ("float64 (reported apart)", wide)):
        print(f"\n== {title}: {len(group)} variants ==")
        for number, variant in enumerate(group, 1):
            if not quiet or variant.status != "ok":
                print(variant_line(number, variant))
        print("\n".join(kernel_summary(group)))
    failed_cases = [outcome for outcome in outcomes if outcome[2]]
    silent = [outcome[0] for outcome in outcomes if not outcome[1] and not outcome[2]]
    print(f"\n{len(outcomes)} calls recorded, {sum(outcome[1] for outcome in outcomes)} launches; "
          f"{len(failed_cases)} calls failed under the interpreter, {len(silent)} launched no Triton kernel")
    for label, _, error, _ in failed_cases:
        print(f"  interpreter error: {label}: {error}")
    for label in silent:
        print(f"  no Triton launch (another route): {label}")
    slowest = sorted(outcomes, key=lambda outcome: -outcome[3])[:5]
    print("  slowest calls: " + ", ".join(f"{label} ({seconds:.0f}s)" for label, _, _, seconds in slowest))
    for note in notes:
        print(f"  note: {note}")
    errors = [variant for variant in variants if variant.status != "ok"]
    print(f"\ntriton {triton.__version__}, sm_{arch}: {len(variants)} variants of "
          f"{len({(v.launch.module, v.launch.name) for v in variants})} kernels compiled, {len(errors)} failed "
          f"({sum(v.status != 'ok' for v in wide)} of them float64)")
    return 1 if errors or failed_cases else 0


# ---- main ------------------------------------------------------------------------------------------


def _warps_stages(text: str) -> list[dict[str, int]]:
    """``4x3,8x2,4x3r168`` -> launch options (:func:`tune_attention.launch_options` for each)."""
    from tune_attention import launch_options  # this folder is on sys.path when a script of it runs

    try:
        return [launch_options(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected num_warps x num_stages pairs like 4x3,8x2 (optionally rREGS: "
                                         f"4x3r168), got {text!r}") from None


def sweep(launches: list[Launch], options: list[dict[str, int]], arch: int) -> None:
    """Compile every distinct variant once per option set and print each one's kernel summary."""
    for chosen_options in options:
        chosen = [replace(launch, options={**launch.options, **chosen_options}) for launch in launches]
        variants = [compile_variant(variant, arch) for variant in distinct(chosen)]
        failed = sum(variant.status != "ok" for variant in variants)
        described = " ".join(f"{key}={value}" for key, value in chosen_options.items())
        print(f"\n== {described}: {len(variants)} variants, {failed} failed ==")
        print("\n".join(kernel_summary(variants)), flush=True)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90)")
    parser.add_argument("--blocks", choices=("cuda", "interpreted", "both"), default="both",
                        help="launch choices to record: CUDA's, the interpreter's, or both (default)")
    parser.add_argument("-k", "--select", default="", help="regular expression: run only the calls it matches")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only the failed variants and the summary")
    parser.add_argument("--launches", help="also write every recorded launch to this file (one per line)")
    parser.add_argument("--dump", help="write each variant's cubin, PTX and a label into this folder "
                                       "(for scripts/sass_loops.py)")
    parser.add_argument("--options", type=_warps_stages, default=[],
                        help="comma-separated num_warps x num_stages[rREGS], e.g. 4x3,8x2,4x3r168: compile every "
                             "variant with each instead of its launcher's choice and print the per-kernel summary of "
                             "each (a sweep)")
    parser.add_argument("--record", help=argparse.SUPPRESS)
    return parser.parse_args()


def record_in_child(args: argparse.Namespace, blocks: str) -> tuple[list, list, list]:
    """Run this script with ``--record`` under the interpreter; return what it recorded."""
    with tempfile.TemporaryDirectory() as directory:
        output = os.path.join(directory, "launches.pickle")
        env = dict(os.environ, TRITON_INTERPRET="1")
        command = [sys.executable, __file__, "--record", output, "--blocks", blocks, "--arch", str(args.arch),
                   "-k", args.select]
        subprocess.run(command, env=env, check=True)
        with open(output, "rb") as file:
            return pickle.load(file)


def main() -> int:
    args = parse_arguments()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns unless set; 1 is every version's default
    if args.record:
        record(args.blocks, args.arch, args.select, args.record)
        return 0
    os.environ.pop("TRITON_INTERPRET", None)  # compile real JITFunctions
    launches, outcomes, notes = [], [], []
    for blocks in ("cuda", "interpreted") if args.blocks == "both" else (args.blocks,):
        start = time.perf_counter()
        recorded = record_in_child(args, blocks)
        for total, part in zip((launches, outcomes, notes), recorded, strict=True):
            total.extend(part)
        print(f"recorded {len(recorded[0])} launches with {blocks} choices in {time.perf_counter() - start:.0f}s",
              flush=True)
    if args.launches:
        with open(args.launches, "w") as file:
            for launch in launches:
                print(launch, file=file)
    if args.options:
        sweep(launches, args.options, args.arch)
        return 0
    variants = distinct(launches)
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
    print(f"compiling {len(variants)} distinct variants for sm_{args.arch}", flush=True)
    for number, variant in enumerate(variants, 1):
        compile_variant(variant, args.arch, args.dump)
        if variant.status != "ok":
            print(variant_line(number, variant), flush=True)
        if number % 100 == 0:
            print(f"... {number} compiled", flush=True)
    return report(variants, outcomes, notes, args.arch, args.quiet)


if __name__ == "__main__":
    sys.exit(main())
