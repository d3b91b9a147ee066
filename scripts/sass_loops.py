"""Static instruction counts of the Triton kernels' innermost loops, from their sm_90 SASS, without a GPU.

A fused attention kernel spends its time in loops over key (or query) blocks; each trip
handles one ``BLOCK_M x BLOCK_N`` score tile.  This script disassembles cubins written by
``scripts/compile_check.py --dump DIR`` with the Triton wheel's ``cuobjdump``, finds the
innermost loops (a backward branch and the instructions it jumps over), and counts their
instructions by class: tensor-core products, float arithmetic, special functions (``MUFU``:
exp2, log2, reciprocal, sqrt), integer and address arithmetic, global and shared memory,
shuffles, barriers.  ``per score`` divides a loop's count by the score elements one thread
holds per tile (``BLOCK_M * BLOCK_N / (32 * num_warps)``), the number to compare between
kernels.  ``--baseline`` compiles a plain causal flash-attention forward (softmax, online,
the FlashAttention-2 loop, written here) with the same tile and options, as the yardstick.

What it shows is a static count: not the time (no latency, no issue rate, branches taken or
not), but a kernel doing three times the baseline's work per score cannot be as fast.

Usage::

    PYTHONPATH=. python scripts/compile_check.py -k "attention SA plain bfloat16 D64 causal" --blocks cuda --dump /tmp/d
    PYTHONPATH=. python scripts/sass_loops.py /tmp/d --baseline
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

CLASSES = (
    ("tensor", ("HGMMA", "HMMA", "IMMA", "DMMA", "WARPGROUP")),
    ("mufu", ("MUFU",)),
    ("float", ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FRND", "F2F", "HADD2", "HMUL2",
               "HFMA2", "DADD", "DMUL", "DFMA", "DSETP", "F2FP")),
    ("convert", ("I2F", "F2I", "I2I", "F2IP", "I2FP")),
    ("global", ("LDG", "STG", "LDGSTS", "LDGDEPBAR", "UTMALDG", "UBLKCP", "RED", "ATOM")),
    ("shared", ("LDS", "STS", "LDSM", "STSM", "ATOMS")),
    ("shuffle", ("SHFL",)),
    ("sync", ("BAR", "DEPBAR", "SYNCS", "WARPSYNC", "MEMBAR", "ARRIVES")),
    ("control", ("BRA", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "WARPGROUP.ARRIVE", "YIELD", "NOP")),
    ("int", ("IMAD", "IADD3", "LOP3", "SHF", "ISETP", "SEL", "IMNMX", "LEA", "POPC", "FLO", "PRMT", "SGXT", "IABS",
             "MOV", "IADD", "ULEA", "UIADD3", "UIMAD", "ULOP3", "USHF", "UISETP", "USEL", "UMOV", "S2R", "S2UR",
             "CS2R", "R2UR", "PLOP3", "P2R", "R2P", "VOTE", "UPLOP3", "VIADD", "VIMNMX", "ISCADD", "LOP", "USGXT",
             "UPRMT", "UFLO", "UPOPC", "VOTEU", "REDUX", "ELECT")),
)


def classify(opcode: str) -> str:
    base = opcode.split(".")[0]
    for name, prefixes in CLASSES:
        if base in prefixes or opcode.startswith(prefixes):
            return name
    return "other"


LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
TARGET = re.compile(r"\s*(0x[0-9a-f]+)")


def disassemble(cubin: Path) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


def innermost_loops(sass: str) -> list[list[str]]:
    """The opcode lists of the innermost loops: a backward branch and the instructions back to its target."""
    instructions, at = [], {}
    for line in sass.splitlines():
        match = LINE.search(line)
        if match:
            at[int(match.group(1), 16)] = len(instructions)
            instructions.append((match.group(3), match.group(4)))
    loops = []
    for index, (opcode, operands) in enumerate(instructions):
        target = TARGET.match(operands)
        if opcode.startswith("BRA") and target and at.get(int(target.group(1), 16), index + 1) <= index:
            loops.append((at[int(target.group(1), 16)], index))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [[op for op, _ in instructions[a:b + 1]] for a, b in sorted(inner)]


def describe(name: str, sass: str, elements: float, top: int) -> list[str]:
    lines = [f"## {name}"]
    for number, loop in enumerate(innermost_loops(sass), 1):
        classes = Counter(classify(op) for op in loop)
        opcodes = Counter(op for op in loop)
        per_score = ", ".join(f"{kind} {count / elements:.2f}" for kind, count in classes.most_common())
        lines.append(f"- loop {number}: {len(loop)} instructions, {len(loop) / elements:.2f} per score "
                     f"({elements:g} scores per thread per tile): {per_score}")
        lines.append("  top opcodes: " + ", ".join(f"{op} {count}" for op, count in opcodes.most_common(top)))
    return lines


def tile_elements(label: str) -> float | None:
    """Score elements per thread per tile from a dump's label (``BLOCK_M``, ``BLOCK_N``, ``num_warps``); None
    for a kernel without score tiles."""
    sizes = [re.search(pattern, label) for pattern in (r"BLOCK_M=(\d+)", r"BLOCK_N=(\d+)", r"'num_warps': (\d+)")]
    if not all(sizes):
        return None
    block_m, block_n, warps = (int(size.group(1)) for size in sizes)
    return block_m * block_n / (32 * warps)


BASELINE = '''
import triton
import triton.language as tl


@triton.jit
def flash_forward(Q, K, V, OUT, lq, lk, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + bh * lq * D + offs_m[:, None] * D + offs_d[None, :], mask=(offs_m < lq)[:, None], other=0.0)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for start in range(0, tl.minimum(start_m + BLOCK_M, lk), BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + bh * lk * D + offs_n[None, :] * D + offs_d[:, None], mask=(offs_n < lk)[None, :], other=0.0)
        s = tl.dot(q, k) * scale
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        new_m = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2((s - new_m[:, None]) * 1.4426950408889634)
        rescale = tl.exp2((m - new_m) * 1.4426950408889634)
        total = total * rescale + tl.sum(p, 1)
        v = tl.load(V + bh * lk * D + offs_n[:, None] * D + offs_d[None, :], mask=(offs_n < lk)[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        m = new_m
    acc = acc / total[:, None]
    tl.store(OUT + bh * lq * D + offs_m[:, None] * D + offs_d[None, :], acc.to(OUT.dtype.element_ty),
             mask=(offs_m < lq)[:, None])
'''


def baseline_sass(block: int, warps: int, stages: int, dtype: str) -> str:
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "baseline_flash.py"
        path.write_text(BASELINE)
        spec = importlib.util.spec_from_file_location("baseline_flash", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        pointer = f"*{dtype}"
        signature = {"Q": pointer, "K": pointer, "V": pointer, "OUT": pointer, "lq": "i32", "lk": "i32",
                     "scale": "fp32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "D": "constexpr"}
        constexprs = {"BLOCK_M": block, "BLOCK_N": block, "D": 64}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
        source = ASTSource(module.flash_forward, signature, constexprs, attrs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps, "num_stages": stages})
        cubin = Path(folder) / "baseline.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return disassemble(cubin)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a compile_check.py --dump folder")
    parser.add_argument("-k", "--select", default="", help="regular expression on the dumped names")
    parser.add_argument("--baseline", action="store_true", help="also a plain flash-attention forward (bf16, D 64)")
    parser.add_argument("--baseline-options", default="64x4x3", help="BLOCKxWARPSxSTAGES of the baseline")
    parser.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    lines = []
    if args.baseline:
        block, warps, stages = (int(part) for part in args.baseline_options.split("x"))
        lines += describe(f"baseline flash forward (bf16, D64, {args.baseline_options})",
                          baseline_sass(block, warps, stages, "bf16"), block * block / (32 * warps), args.top)
    for cubin in sorted(Path(args.folder).glob("*.cubin")):
        if not re.search(args.select, cubin.stem):
            continue
        label = cubin.with_suffix(".txt").read_text()
        if tile_elements(label) is None:
            continue
        lines += describe(f"{cubin.stem}: {label.splitlines()[0]}", disassemble(cubin), tile_elements(label), args.top)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
