#!/usr/bin/env python3
"""GPU memory needed for LUT-B expert weights, and how many expert-parallel shards that takes.

    python deploy/sizing.py                 # the tables in docs/deploy.md (markdown)
    python deploy/sizing.py --json          # the same numbers as JSON
    python deploy/sizing.py --model deepseek-v3 --gpu-gb 80 --headroom 0.15

A LUT-B matrix is stored as 128x128 tiles of 6672 bytes each (3.2578 bits per weight). One
routed expert is a gated W13 [2I, H] plus a W2 [H, I]. Only routed experts are counted:
attention, embeddings, dense layers and shared experts stay with the attention tier.

CUDA graphs (``--cuda-graph-max-tokens N``) add static buffers, which the layers of a server share
(their graphs replay one at a time): for every token bucket B (powers of two up to N, and N), the
input rows ``x [B, H]`` (model dtype), ``topk_ids [B, k]`` (int32) and ``topk_weights [B, k]``
(float32), the rows MXFP8 input lands in (codes ``[B, H]``, one byte each, and scales ``[B, H/32]``),
and the combined output ``[B, H]`` (model dtype), for the variants the server captures at start-up
(combined output, its top-k) and MXFP8 input's rows. A route-major variant, captured on first use, keeps its
own outputs per layer; the graphs' shared pool of intermediate activations comes on top.

Shards follow `lutb shard`: each shard holds a subset of the experts, for every MoE layer, so
a shard of k experts needs k x layers x (bytes per expert). The number of shards is the
smallest S for which the largest shard, ceil(E / S) experts, fits the GPU's weight budget:
(1 - headroom) x GPU memory, the rest left for the CUDA context, activations, routing
buffers and allocator fragmentation. GPU memory is taken as the marketed size in GB
(10^9 bytes), which is below what the devices report, so the estimate errs on the safe side.

Standard library only: runs without the project installed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

TILE = 128
TILE_BYTES = 6672  # lutb_kernels.tiles.TILE_BYTES; tests/deploy checks they agree
BITS_PER_WEIGHT = TILE_BYTES * 8 / (TILE * TILE)
BF16_BYTES = 2

GIB = 1024**3
MIB = 1024**2
GB = 10**9

DEFAULT_HEADROOM = 0.15
DEFAULT_GPUS_GB = (80, 141)  # H100/A100 80 GB, H200 141 GB
GRAPH_MAX_TOKENS = (512, 2048)  # the server's default --cuda-graph-max-tokens, and a larger choice


def graph_buckets(max_tokens: int) -> list[int]:
    """The CUDA-graph token buckets up to ``max_tokens``: powers of two and ``max_tokens`` itself
    (``lutb_kernels.experts.graphs.token_buckets``; tests/deploy checks they agree)."""
    buckets, b = [], 1
    while b <= max_tokens:
        buckets.append(b)
        b *= 2
    if max_tokens and buckets[-1] != max_tokens:
        buckets.append(max_tokens)
    return buckets


@dataclass(frozen=True)
class MoEShape:
    """Routed-expert geometry of one model: E experts per layer, hidden H, expert intermediate I."""

    name: str
    experts: int
    hidden: int
    intermediate: int
    moe_layers: int
    top_k: int

    def __post_init__(self) -> None:
        for field, value in (("hidden", self.hidden), ("intermediate", self.intermediate)):
            if value <= 0 or value % TILE:
                raise ValueError(f"{self.name}: {field}={value} must be a positive multiple of {TILE}")
        if self.experts <= 0 or self.moe_layers <= 0 or not 0 < self.top_k <= self.experts:
            raise ValueError(f"{self.name}: experts and moe_layers must be positive, top_k in [1, experts]")

    @property
    def weights_per_expert(self) -> int:
        return 2 * self.intermediate * self.hidden + self.hidden * self.intermediate

    @property
    def tiles_per_expert(self) -> int:
        w13 = (2 * self.intermediate // TILE) * (self.hidden // TILE)
        w2 = (self.hidden // TILE) * (self.intermediate // TILE)
        return w13 + w2

    def expert_bytes(self, fmt: str) -> int:
        if fmt == "lutb":
            return self.tiles_per_expert * TILE_BYTES
        if fmt == "bf16":
            return self.weights_per_expert * BF16_BYTES
        raise ValueError(f"unknown format {fmt!r} (lutb or bf16)")

    def layer_bytes(self, fmt: str) -> int:
        return self.experts * self.expert_bytes(fmt)

    def model_bytes(self, fmt: str) -> int:
        return self.moe_layers * self.layer_bytes(fmt)

    def graph_bytes(self, max_tokens: int, dtype_bytes: int = BF16_BYTES) -> int:
        """The start-up CUDA graphs' static buffers, shared by every layer (see the module docstring): per bucket
        row, x and the combined output in the model dtype, MXFP8 input's codes (a byte each) and scales (a byte per
        32), top-k ids (int32) and weights (float32)."""
        mxfp8_row = self.hidden + self.hidden // 32
        return sum(graph_buckets(max_tokens)) * (2 * self.hidden * dtype_bytes + mxfp8_row + self.top_k * (4 + 4))


REFERENCE_SHAPES = (
    MoEShape("qwen3-30b-a3b", experts=128, hidden=2048, intermediate=768, moe_layers=48, top_k=8),
    MoEShape("mixtral-8x7b", experts=8, hidden=4096, intermediate=14336, moe_layers=32, top_k=2),
    MoEShape("deepseek-v3", experts=256, hidden=7168, intermediate=2048, moe_layers=58, top_k=8),
)
SHAPES_BY_NAME = {s.name: s for s in REFERENCE_SHAPES}


@dataclass(frozen=True)
class ShardPlan:
    shards: int
    experts_per_shard: int  # the largest shard
    shard_bytes: int  # the largest shard's expert weights
    budget_bytes: int


def shards_needed(shape: MoEShape, gpu_gb: float, fmt: str = "lutb", headroom: float = DEFAULT_HEADROOM) -> ShardPlan:
    """Fewest one-GPU shards whose largest shard fits (1 - headroom) x gpu_gb x 10^9 bytes.

    Raises ValueError when even a single expert (all layers) does not fit.
    """
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    budget = int(gpu_gb * GB * (1 - headroom))
    per_expert_all_layers = shape.expert_bytes(fmt) * shape.moe_layers
    fits = budget // per_expert_all_layers
    if fits < 1:
        raise ValueError(f"{shape.name} ({fmt}): one expert across {shape.moe_layers} layers needs "
                         f"{per_expert_all_layers / GIB:.1f} GiB, more than the {budget / GIB:.1f} GiB budget")
    shards = math.ceil(shape.experts / min(fits, shape.experts))
    largest = math.ceil(shape.experts / shards)
    return ShardPlan(shards, largest, largest * per_expert_all_layers, budget)


def _fmt_bytes(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / MIB:,.2f} MiB"


def memory_table() -> str:
    rows = [
        "| model | E | H | I | MoE layers | per expert, LUT-B | per expert, bf16 | per layer, LUT-B | per layer, bf16 | all layers, LUT-B | all layers, bf16 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in REFERENCE_SHAPES:
        rows.append(
            f"| {s.name} | {s.experts} | {s.hidden} | {s.intermediate} | {s.moe_layers} "
            f"| {_fmt_bytes(s.expert_bytes('lutb'))} | {_fmt_bytes(s.expert_bytes('bf16'))} "
            f"| {_fmt_bytes(s.layer_bytes('lutb'))} | {_fmt_bytes(s.layer_bytes('bf16'))} "
            f"| {_fmt_bytes(s.model_bytes('lutb'))} | {_fmt_bytes(s.model_bytes('bf16'))} |"
        )
    return "\n".join(rows)


def shard_table(gpus_gb: tuple[float, ...] = DEFAULT_GPUS_GB, headroom: float = DEFAULT_HEADROOM) -> str:
    rows = [
        "| model | GPU | weight budget | shards, LUT-B | largest shard, LUT-B | shards, bf16 | largest shard, bf16 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in REFERENCE_SHAPES:
        for gb in gpus_gb:
            lutb = shards_needed(s, gb, "lutb", headroom)
            bf16 = shards_needed(s, gb, "bf16", headroom)
            rows.append(
                f"| {s.name} | {gb:g} GB | {_fmt_bytes(lutb.budget_bytes)} "
                f"| {lutb.shards} | {lutb.experts_per_shard} experts, {_fmt_bytes(lutb.shard_bytes)} "
                f"| {bf16.shards} | {bf16.experts_per_shard} experts, {_fmt_bytes(bf16.shard_bytes)} |"
            )
    return "\n".join(rows)


def graph_table(max_tokens: tuple[int, ...] = GRAPH_MAX_TOKENS) -> str:
    head = " | ".join(f"N = {n}" for n in max_tokens)
    rows = [f"| model | H | top-k | {head} |", "| --- | ---: | ---: |" + " ---: |" * len(max_tokens)]
    for s in REFERENCE_SHAPES:
        cells = " | ".join(_fmt_bytes(s.graph_bytes(n)) for n in max_tokens)
        rows.append(f"| {s.name} | {s.hidden} | {s.top_k} | {cells} |")
    return "\n".join(rows)


def as_dict(gpus_gb: tuple[float, ...] = DEFAULT_GPUS_GB, headroom: float = DEFAULT_HEADROOM) -> dict:
    out: dict = {"tile_bytes": TILE_BYTES, "bits_per_weight": BITS_PER_WEIGHT, "headroom": headroom, "models": {}}
    for s in REFERENCE_SHAPES:
        entry = {
            "experts": s.experts, "hidden": s.hidden, "intermediate": s.intermediate, "moe_layers": s.moe_layers,
            "top_k": s.top_k, "tiles_per_expert": s.tiles_per_expert, "weights_per_expert": s.weights_per_expert,
            "graph_bytes": {str(n): s.graph_bytes(n) for n in GRAPH_MAX_TOKENS},
        }
        for fmt in ("lutb", "bf16"):
            entry[fmt] = {
                "expert_bytes": s.expert_bytes(fmt),
                "layer_bytes": s.layer_bytes(fmt),
                "model_bytes": s.model_bytes(fmt),
                "shards": {f"{gb:g}": vars(shards_needed(s, gb, fmt, headroom)) for gb in gpus_gb},
            }
        out["models"][s.name] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown tables")
    parser.add_argument("--model", choices=sorted(SHAPES_BY_NAME), help="print one model's shard plan")
    parser.add_argument("--gpu-gb", type=float, action="append", help="GPU memory in GB (repeatable; default 80 and 141)")
    parser.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                        help=f"fraction of GPU memory kept free of weights (default {DEFAULT_HEADROOM})")
    args = parser.parse_args(argv)
    gpus = tuple(args.gpu_gb) if args.gpu_gb else DEFAULT_GPUS_GB
    if args.model:
        shape = SHAPES_BY_NAME[args.model]
        for gb in gpus:
            for fmt in ("lutb", "bf16"):
                plan = shards_needed(shape, gb, fmt, args.headroom)
                print(f"{shape.name} {fmt} on {gb:g} GB: {plan.shards} shards, largest "
                      f"{plan.experts_per_shard} experts = {_fmt_bytes(plan.shard_bytes)} "
                      f"(budget {_fmt_bytes(plan.budget_bytes)})")
        return 0
    if args.json:
        print(json.dumps(as_dict(gpus, args.headroom), indent=2))
        return 0
    print(memory_table())
    print()
    print(shard_table(gpus, args.headroom))
    print()
    print(graph_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
