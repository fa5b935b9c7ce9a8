#!/usr/bin/env python3
"""The eager batch sizes the server's warm-up runs, per shape and shard, with the H200's config rules (CPU, no GPU).

Builds packed experts on the CPU (random tiles) for each shape, whole and as shards of the first
experts, evaluates ``launch_key`` for every eager size with the GEMM, grouped-GEMM and MXFP8 rules
of a 132-SM GPU (as ``tests/kernels/test_launch_key.py`` does), and prints, per case, the sizes
``warm_up_sizes`` picks, the launch keys powers of two alone would miss, and the time the choice took::

    PYTHONPATH=kernels:client:server:tests/kernels python3 bench/warm_up_sizes.py
"""

from __future__ import annotations

import argparse
import time

from lutb_gpu_testdata import make_layer, use_h200_rules
from lutb_kernels.checkpoint import CheckpointConfig
from lutb_kernels.experts.graphs import CHUNK_FACTOR
from lutb_kernels.experts.packed import LutBPackedExperts
from lutb_kernels.hf_import import compact_ids
from lutb_server.worker import _powers_of_two_upto, warm_up_sizes

# name: (experts, hidden, intermediate, top_k); shards hold the first E / n experts
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2), "deepseek-v3": (256, 7168, 2048, 8)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", type=int, default=512,
                   help="largest CUDA-graph bucket (batches up to CHUNK_FACTOR times it run as chunks; eager sizes start above)")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--shards", default="1,2,4,8", help="comma list: the layer split in n shards (skipped when E < n)")
    args = p.parse_args()
    use_h200_rules()
    eager_above = CHUNK_FACTOR * args.graphs  # CudaGraphExperts.eager_above at the default chunk limit
    print("| shape | experts held | warm-up sizes | sizes whose key powers of two miss | choice s |")
    print("|---|---|---|---|---|")
    for name, (experts, hidden, inter, top_k) in SHAPES.items():
        cfg = CheckpointConfig(hidden_size=hidden, intermediate_size=inter, num_experts=experts, activation="silu", dtype="bfloat16")
        for n in (int(s) for s in args.shards.split(",")):
            if experts < n or (name == "deepseek-v3" and n == 1):  # a whole deepseek layer is 4.6 GB of tiles
                continue
            held = experts // n
            key = LutBPackedExperts(cfg, make_layer(cfg, list(range(held))), "cpu").launch_key
            start = time.perf_counter()
            sizes = warm_up_sizes(eager_above, args.max_tokens, key, top_k)
            seconds = time.perf_counter() - start
            powers = {key(t, top_k) for t in _powers_of_two_upto(args.max_tokens) if t > eager_above}
            missed = [t for t in range(eager_above + 1, args.max_tokens + 1) if key(t, top_k) not in powers]
            print(f"| {name} | {held} of {experts} | {', '.join(map(str, sizes))} | {compact_ids(missed) or '-'} | {seconds:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
