"""Where decoding time goes: the host against the GPU, and the split-K kernel's split count (CUDA only).

For each KV length and normalizer this times one decoding call, ``attnorm.attention`` on
``(B, H, 1, D)`` queries against ``(B, H, Lk, D)`` keys and values, two ways:

* eager (``triton.testing.do_bench``): what a Python decoding loop pays, host included;
* replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``): the GPU's time alone,
  what ``torch.compile(mode="reduce-overhead")`` or a hand-made graph would pay.

Where eager is far above the graph, the call is host-bound and kernels cannot help; where both
are close, the kernels are the cost.  Then the Self-Adjusted split-K kernel
(:func:`attnorm.kernels.triton.attention_decoding.self_adjusted_decoding_forward`) is replayed
at several split counts, 0 being :func:`~attnorm.kernels.triton.attention_decoding.split_count`'s.

Usage::

    python scripts/decoding_probe.py                        # bf16, batch 8, 16 heads, head dim 64
    python scripts/decoding_probe.py --lengths 4096 65536 --splits 0 16 64
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import attnorm
from attnorm.kernels.rules import AttentionMask
from attnorm.kernels.triton.attention_decoding import self_adjusted_decoding_forward


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--specs", nargs="+", default=["sparsemax", "entmax:alpha=1.5", "topk:k=64", "sa_softmax"])
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 8, 16, 32, 64, 128])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA: it times the GPU against the host")
    import triton.testing as tt

    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; bf16, B={args.batch}, H={args.heads}, D=64, one query row; "
          "ms per call: eager (host included) / CUDA graph replay (GPU alone)")
    print("| call | " + " | ".join(f"KV {n}" for n in args.lengths) + " |")
    print("|---|" + "---|" * len(args.lengths))
    inputs = {}
    for lk in args.lengths:
        q = torch.randn(args.batch, args.heads, 1, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(args.batch, args.heads, lk, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        inputs[lk] = (q, k, v)

    def row(name, make):
        cells = []
        for lk in args.lengths:
            try:
                call = make(*inputs[lk])
                with torch.no_grad():
                    call()
                    eager = tt.do_bench(call)
                    graph = tt.do_bench_cudagraph(call)
                cells.append(f"{eager:.3f} / {graph:.3f}")
            except Exception as error:  # noqa: BLE001 (a probe: report and go on)
                cells.append(f"error: {type(error).__name__}: {str(error)[:60]}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)

    row("sdpa", lambda q, k, v: lambda: F.scaled_dot_product_attention(q, k, v))
    for spec in args.specs:
        normalizer = attnorm.make(spec).cuda()
        row(spec, lambda q, k, v, n=normalizer: lambda: attnorm.attention(q, k, v, n, attn_mask=attnorm.causal_mask(
            k.shape[-2] - 1)))
    for splits in args.splits:
        row(f"SA split-K kernel, splits={splits or 'auto'}",
            lambda q, k, v, s=splits: lambda: self_adjusted_decoding_forward(q, k, v, AttentionMask(), 0.125, True,
                                                                             splits=s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
