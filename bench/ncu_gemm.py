#!/usr/bin/env python3
"""Run the packed experts' forward a few times so Nsight Compute can profile ``lut_b_moe_gemm_kernel``.

Eager launches (no CUDA graph), fresh uniform random routing per call; with the defaults, the
first ``--warmup`` forwards compile and warm the caches, then ``--calls`` more run. Meant to be
started under ``ncu``, e.g. (the 2 GEMM launches of the 4th forward of each shape)::

    ncu --clock-control none --kernel-name regex:lut_b_moe_gemm_kernel --launch-skip 6 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python3 bench/ncu_gemm.py --shape mixtral-8x7b --tokens 1

Weights are random tiles (``bench/kernels.py``'s ``_packed_only``), so what ncu reads is the
kernel's own behaviour at the benchmark's shapes, not a model's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import SHAPES, _packed_only  # noqa: E402  (bench/kernels.py)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="mixtral-8x7b", choices=list(SHAPES))
    p.add_argument("--tokens", type=int, default=1, help="tokens per forward (default 1)")
    p.add_argument("--warmup", type=int, default=3, help="forwards before the measured ones (default 3)")
    p.add_argument("--calls", type=int, default=2, help="forwards after the warm-up (default 2)")
    args = p.parse_args()
    experts, hidden, _, top_k = SHAPES[args.shape]
    packed = _packed_only(args.shape)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(args.warmup + args.calls):
        x = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids = torch.rand(args.tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
        w = torch.rand(args.tokens, top_k, device="cuda", generator=gen)
        packed.forward_unchecked(x, ids, w)
    torch.cuda.synchronize()
    print(f"ncu_gemm: {args.shape} T={args.tokens}: {args.warmup + args.calls} forwards done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
