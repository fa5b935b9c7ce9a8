"""``moe_align_block_size`` in one Triton launch; same results as :mod:`lutb_kernels.routing`.

:func:`moe_align_block_size_triton` returns exactly what
:func:`lutb_kernels.routing.moe_align_block_size` (the judge, plain torch) returns: the same
shapes, dtypes, sentinel ``T*k``, -1 blocks and int32 ``[1]`` total, with the routes of each
expert in ascending route order (stable). Sizes come from shapes only and nothing is read back
to the host, so it can be captured in a CUDA graph. The torch version costs ~25 small kernels
(60 us of a 209 us mixtral T=1 forward on the H200); this is one.

One program does everything (phases in :mod:`lutb_kernels._routing_details.kernels`), so it is
built for decode sizes; it stays correct up to the int32 limit (padded length < 2**31). At
prefill sizes the placement loop, not the launch, dominates, and the torch version can be faster
(below).

Where it wins (H200): 2.5-3.8 us against the torch version's 60-66 us at T=1 and T=8 (mixtral,
deepseek; bench/results/2026-12-02-routing-ep-h200.md), 40 us against 102 us at mixtral T=2048
(one-hot mode), even at mixtral T=8192. The pairwise mode (more than 64 experts) places 32 routes
per step (``PAIRWISE_RANK_CHUNK``): over 256 experts 3.0 / 5.1 / 12.5 / 44.1 us at 64 / 256 /
1024 / 4096 routes against the torch version's 63-103 us, but 164 against 146 us at 16384 routes
(bench/results/2026-12-04-routing-chunk-h200.md). :func:`triton_routing_wins` encodes that, and
the experts backends call this kernel where it says so and the torch version elsewhere. Those timings
replayed CUDA graphs, so they leave out launch costs: the torch version takes ~0.9 ms of CPU to launch,
which an eager call pays in full. An eager qwen3 experts call (128 experts, top-8) took 1588 us to launch
at 528 tokens (4224 routes, torch routing) against 408 us at 512 (4096 routes, this kernel) on the H200
(bench/results/2026-12-05-compute-pipeline-h200.md). So the pairwise limit is 16384 routes, where the
graph timings above tie within 18 us: on an H100 host, eager calls at 528, 1024 and 2048 tokens launched in
974 / 933 / 852 us with it against 1607 / 1762 / 1700 us with the limit at 4096 (wall, launch to GPU
done: 1011 / 970 / 1218 against 1642 / 1801 / 2069 us; bench/results/2026-12-05-routing-limit-h100.md).

Triton is optional: importing this module never imports triton.
"""

from __future__ import annotations

import torch

from lutb_kernels._grouped_gemm_details.launch import pdl_launch
from lutb_kernels.routing import check_held_out, check_routing_out, max_padded_routes
from lutb_kernels.routing import moe_align_block_size as moe_align_block_size_reference

__all__ = [
    "RoutingLaunch", "moe_align_block_size_reference", "moe_align_block_size_triton", "routing_launch", "triton_routing_wins",
]

# Phase 3 keeps per-expert counters in registers (one-hot [C, E_PAD] block) up to this many
# (padded) experts, and compares routes pairwise ([C, C]) with counters in memory above it.
ONEHOT_MAX_EXPERTS = 64
_INT32_LIMIT = 2**31
# Most routes for which one launch beats the torch version, per phase-3 mode (measurements in the
# module docstring): the one-hot mode walks 8192 / e_pad routes per step and ties at 16384 routes
# over 8 experts; the pairwise mode costs ~11 us per 1024 routes, 18 us more than the torch version's
# kernels at 16384 routes, but saves its ~0.9 ms of launches on every eager call up to there.
ONEHOT_MAX_ROUTES = 8192
PAIRWISE_MAX_ROUTES = 16384
# Routes per placement step in the pairwise mode ([C, C] comparisons). On the H200 (128 and 256
# experts, 64-16384 routes) 32 was the fastest of 16-256 at every warp count tried (4, 8, 16): 3-5x
# faster than 128 (whose [128, 128] block takes 254 registers), bench/results/2026-12-04-routing-chunk-h200.md.
PAIRWISE_RANK_CHUNK = 32
# The kernel's warps, either mode (a module constant so that bench/routing_chunks.py can sweep it:
# with 32-route chunks 4 was the fastest, tied by 8 at 256 routes over 256 experts).
ROUTING_WARPS = 4


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _clamp_pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, _pow2(n)))


class RoutingLaunch:
    """The kernel's compile-time shape for one problem size (see :func:`routing_launch`)."""

    __slots__ = ("e_pad", "fill_chunk", "hist_chunk", "num_warps", "onehot", "rank_chunk")

    def __init__(self, e_pad: int, onehot: bool, rank_chunk: int, hist_chunk: int, fill_chunk: int, num_warps: int):
        self.e_pad, self.onehot = e_pad, onehot
        self.rank_chunk, self.hist_chunk, self.fill_chunk = rank_chunk, hist_chunk, fill_chunk
        self.num_warps = num_warps

    def __repr__(self) -> str:
        return ("RoutingLaunch(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")")


def routing_launch(num_routes: int, num_experts: int, max_padded: int, num_blocks: int) -> RoutingLaunch:
    """Chunk sizes (powers of two, >= 16) from the sizes alone, so a shape maps to few compiled variants.

    - ``e_pad``: experts padded to a power of two (the histogram's bins);
    - ``onehot``: phase-3 mode, ``e_pad <= ONEHOT_MAX_EXPERTS``;
    - ``rank_chunk``: routes per placement step, ``<= 8192 / e_pad`` (one-hot) or
      ``PAIRWISE_RANK_CHUNK`` ([C, C]);
    - ``hist_chunk``: routes per counting step, <= 1024;
    - ``fill_chunk``: positions per fill step, <= 1024;
    """
    e_pad = max(16, _pow2(num_experts))
    onehot = e_pad <= ONEHOT_MAX_EXPERTS
    rank_cap = max(16, 8192 // e_pad) if onehot else PAIRWISE_RANK_CHUNK
    return RoutingLaunch(
        e_pad=e_pad,
        onehot=onehot,
        rank_chunk=_clamp_pow2(num_routes, 16, rank_cap),
        hist_chunk=_clamp_pow2(num_routes, 16, 1024),
        fill_chunk=_clamp_pow2(max(max_padded, num_blocks), 16, 1024),
        num_warps=ROUTING_WARPS,
    )


def triton_routing_wins(num_routes: int, num_experts: int) -> bool:
    """Whether :func:`moe_align_block_size_triton` is the faster choice for this size (shapes only).

    ``num_routes`` is ``T*k``; ``num_experts`` the global expert count. Depends on sizes alone,
    so a CUDA graph captured for a batch size keeps its choice.
    """
    onehot = max(16, _pow2(num_experts)) <= ONEHOT_MAX_EXPERTS
    return num_routes <= (ONEHOT_MAX_ROUTES if onehot else PAIRWISE_MAX_ROUTES)


def moe_align_block_size_triton(
    topk_ids: torch.Tensor,
    block_m: int,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    held_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort routes by expert and pad each expert's run to a multiple of ``block_m`` (one Triton launch).

    Args:
        topk_ids: int32/int64 ``[T, k]`` global expert ids in ``[0, num_experts)``, on a Triton
            device. Ids outside that range (and local ids outside it) get no rows instead of
            faulting.
        block_m: rows per block of the grouped GEMM (>= 1).
        num_experts: the global expert count (>= 0).
        expert_map: optional int32/int64 ``[num_experts]`` global -> local expert, -1 when not
            held; routes to experts not held get no rows.
        out: optional preallocated ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``
            with the shapes below (every element is written).
        held_out: optional contiguous bool tensor of ``T*k`` elements, filled with whether each
            route's expert is held (in range and, with a map, mapped): the same launch writes the
            mask a shard's combine needs (one byte per route), instead of three torch launches.

    Returns:
        ``(sorted_token_ids, expert_ids, num_tokens_post_padded)`` as
        :func:`lutb_kernels.routing.moe_align_block_size`:

        - ``sorted_token_ids``: int32 ``[T*k + E*(block_m-1)]``, flat route indices grouped by
          local expert, ascending within an expert, each group padded to a multiple of
          ``block_m`` with the sentinel ``T*k``; positions past the total hold the sentinel.
        - ``expert_ids``: int32 ``[ceil(len(sorted_token_ids) / block_m)]``, the local expert of
          each block; -1 past the total.
        - ``num_tokens_post_padded``: int32 ``[1]``, rows in use.
    """
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if int(block_m) < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    if int(num_experts) < 0:
        raise ValueError(f"num_experts must be >= 0, got {num_experts}")
    block_m, num_experts = int(block_m), int(num_experts)
    device = topk_ids.device
    if expert_map is not None:
        if expert_map.dtype not in (torch.int32, torch.int64) or expert_map.numel() != num_experts \
                or expert_map.device != device:
            raise ValueError(f"expert_map must be int32/int64 with {num_experts} elements on {device}, "
                             f"got {expert_map.dtype} {tuple(expert_map.shape)} on {expert_map.device}")
        expert_map = expert_map.reshape(-1).contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    num_routes = ids.numel()
    if held_out is not None:
        check_held_out(held_out, num_routes, device)
    max_padded = max_padded_routes(num_routes, block_m, num_experts)
    num_blocks = -(-max_padded // block_m)
    launch = routing_launch(num_routes, num_experts, max_padded, num_blocks)
    if max_padded + block_m + max(launch.fill_chunk, launch.hist_chunk) >= _INT32_LIMIT:
        raise ValueError(f"routing too large for int32 indices: {num_routes} routes, {num_experts} experts, block_m {block_m}")

    if out is None:
        sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
        expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
        total = torch.empty(1, dtype=torch.int32, device=device)
    else:
        check_routing_out(out, max_padded, num_blocks, device)
        sorted_ids, expert_ids, total = out
    run = total if launch.onehot else torch.empty(launch.e_pad, dtype=torch.int32, device=device)

    from lutb_kernels._routing_details.kernels import moe_align_block_size_kernel

    moe_align_block_size_kernel[(1,)](
        ids, expert_map if expert_map is not None else ids, sorted_ids, expert_ids, total, run,
        held_out.view(torch.int8) if held_out is not None else run,
        num_routes, num_experts, block_m, max_padded, num_blocks,
        HAS_MAP=expert_map is not None,
        HAS_HELD=held_out is not None,
        ONEHOT=launch.onehot,
        E_PAD=launch.e_pad,
        RANK_C=launch.rank_chunk,
        HIST_C=launch.hist_chunk,
        FILL_C=launch.fill_chunk,
        num_warps=launch.num_warps,
        **pdl_launch(device),
    )
    return sorted_ids, expert_ids, total
