#!/usr/bin/env python3
"""The one-program routing kernel alone, under placement chunk sizes and warp counts (GPU).

For each size: the torch ``moe_align_block_size`` (the judge), then
``moe_align_block_size_triton`` with ``routing_triton.PAIRWISE_RANK_CHUNK`` (routes per placement
step; the one-hot mode's chunk does not depend on it) and ``ROUTING_WARPS`` set to each candidate;
every result is checked equal to the torch one. Microseconds per call: median over rounds of a CUDA
graph holding 20 calls.

    PYTHONPATH=kernels python3 bench/routing_chunks.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import lutb_kernels.routing_triton as rt
import torch
from lutb_kernels.routing import moe_align_block_size

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import time_graph

# (tokens, experts, top_k, routing block): deepseek-v3-like decode and prefill sizes, and one qwen3-like
SIZES = ((1, 256, 8, 16), (8, 256, 8, 16), (32, 256, 8, 16), (128, 256, 8, 16), (512, 256, 8, 16),
         (2048, 256, 8, 64), (32, 128, 8, 16))
CHUNKS = (16, 32, 64, 128, 256)
WARPS = (4, 8, 16)


def graph_us(fn: Callable[[], object], calls: int = 20, rounds: int = 9) -> float:
    """Median microseconds per call of ``fn``: a CUDA graph holding ``calls`` calls, replayed (``kernels.time_graph``)."""
    us, _ = time_graph(lambda: [fn() for _ in range(calls)], replays=1, rounds=rounds)
    return us / calls


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    saved = rt.PAIRWISE_RANK_CHUNK, rt.ROUTING_WARPS
    print(f"{'T':>6s} {'R':>6s} {'E':>4s} {'BM':>4s} {'chunk':>6s} {'warps':>5s} {'us':>8s} equal")
    try:
        for tokens, experts, top_k, block in SIZES:
            ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
            ref = moe_align_block_size(ids, block, experts)
            torch_us = graph_us(lambda ids=ids, block=block, experts=experts: moe_align_block_size(ids, block, experts),
                                calls=5, rounds=5)
            print(f"{tokens:6d} {tokens * top_k:6d} {experts:4d} {block:4d} {'torch':>6s} {'':>5s} {torch_us:8.1f}")
            for chunk in CHUNKS:
                if chunk > 2 * max(16, tokens * top_k):  # the launch clamps the chunk to the routes
                    continue
                for warps in WARPS:
                    rt.PAIRWISE_RANK_CHUNK, rt.ROUTING_WARPS = chunk, warps
                    out = rt.moe_align_block_size_triton(ids, block, experts)
                    equal = all(torch.equal(a, b) for a, b in zip(out, ref))
                    us = graph_us(lambda ids=ids, block=block, experts=experts: rt.moe_align_block_size_triton(ids, block, experts))
                    print(f"{tokens:6d} {tokens * top_k:6d} {experts:4d} {block:4d} {chunk:6d} {warps:5d} {us:8.1f} {equal}",
                          flush=True)
    finally:
        rt.PAIRWISE_RANK_CHUNK, rt.ROUTING_WARPS = saved


if __name__ == "__main__":
    main()
