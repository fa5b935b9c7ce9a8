"""``lut_b_moe_gemm``: grouped GEMM of MXFP8 activations with LUT-B v1 weight tiles (Triton).

The op consumes the block-aligned routing of :func:`lutb_kernels.routing.moe_align_block_size`:
row ``p`` of ``sorted_token_ids`` is a flat route index ``route = token * top_k + slot``; it
reads A row ``route // top_k`` and writes out row ``route``. The sentinel ``M * top_k`` (padding)
is skipped and blocks whose expert id is -1 (past ``num_tokens_post_padded``) write nothing.
Rows of routes that have no row in ``sorted_token_ids`` (experts not held) are not touched:
the caller zeroes or excludes them.

Arithmetic. Each weight is decoded in registers to bfloat16 ``lut[code] * 2**(s-127)``, each
activation to ``e4m3 * 2**(s_a-127)`` in bfloat16; both are exact in bfloat16 unless the
product falls below the smallest normal bfloat16 (``2**-126``; weights that small decode with
one rounding, activations lose bits below ``2**-133``), far outside realistic scales. The tensor
cores multiply them exactly and accumulate in float32, then the routed weight (float32) is
applied and the result rounded to ``out.dtype``. Only the order of the float32 sum differs from
:func:`lut_b_moe_gemm_reference`.

Configs (:class:`LutBGemmConfig`, :func:`default_config`): decoder ``prmt`` (inline PTX, NVIDIA
sm80+), ``prmt2`` (the same values bit for bit, fewer instructions per weight: unscaled LUT split
once per tile, scale applied after the lookup, cheaper selectors) or ``triton`` (pure Triton: the
CPU interpreter and other GPUs), rows per program, output
columns per program (a divisor of 128: a program stays inside one tile row), split-K (one float32
slice per split, summed in order by a second launch), stream-K (a persistent grid splitting all K tiles evenly,
the default for short decode grids), swap-AB (weights as the MMA's M side for small batches), warps and
pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from lutb_kernels._grouped_gemm_details.launch import (
    cdiv,
    check_out_and_weights,
    check_routing,
    interpreting,
    is_nvidia,
    next_pow2,
    pdl_launch,
    sm_count,
)
from lutb_kernels.mxfp8 import BLOCK, mxfp8_dequantize
from lutb_kernels.mxfp8_triton import decoder_column_order
from lutb_kernels.tiles import TILE, TILE_BYTES, tiles_to_dense, to_kernel_layout

Decoder = Literal["prmt", "prmt2", "triton"]
# the kernel's constexpr DECODER for each decoder name
DECODER_IDS: dict[str, int] = {"triton": 0, "prmt": 1, "prmt2": 2}


@dataclass(frozen=True)
class LutBGemmConfig:
    """Launch parameters of :func:`lut_b_moe_gemm`.

    ``block_m``: rows per program (divides the routing block); ``block_n``: output columns per
    program (16..128, divides 128); ``split_k``: programs sharing one output tile along K;
    ``swap_ab``: compute ``W @ A^T`` so the weights fill the MMA's M side; ``decoder``: "prmt",
    "prmt2" (NVIDIA sm80+, identical results) or "triton"; ``groups_per_step``: 32-column groups
    decoded per K step (4 = a whole tile; 2 or 1 hold fewer decoded weights in registers, for
    large ``block_m``).
    """

    block_m: int
    block_n: int = 128
    split_k: int = 1
    swap_ab: bool = False
    decoder: Decoder = "prmt2"
    num_warps: int = 4
    num_stages: int = 3
    groups_per_step: int = 4
    tile_loop: bool = False
    """One K-loop iteration per tile (``groups_per_step`` must be 1): a thread loads its rows'
    12 plane words with 16-byte loads and their 4 scale bytes in one word, then decodes the 4
    groups in the MMA's register layout (offline sm90 SASS: ~5 instead of ~8 instructions per
    weight at decode, ``docs/kernels.md``)."""
    prefetch: bool = False
    """``tile_loop``: load tile t+1 into registers while decoding tile t (Triton's own cp.async
    pipelining with ``num_stages`` already does this; kept for the tuning sweep)."""
    unroll: int = 1
    """``tile_loop``: K tiles per loop iteration after unrolling (Triton's ``loop_unroll_factor``;
    1: none). The per-iteration work (pipeline indexes, barriers, address arithmetic) is then
    shared by that many tiles: offline sm90 SASS of the decode config, 924 instead of 2 x 498 loop
    instructions per 2 tiles (``bench/sass_offline.py``), yet slower on the H200 at decode sizes
    (``TILE_UNROLL``)."""
    stream_k: int = 0
    """Programs per SM of a stream-K launch, or 0 for one program per (routing sub-block, column
    block, split). Stream-K (``swap_ab`` decode sizes): a grid of ``stream_k`` x SMs programs
    splits the sequence of every unit's K tiles into equal contiguous runs of at least
    ``ceil(K tiles / split_k)`` tiles, so every program does the same work whatever the routing
    and however few routing blocks are in use (the plain grid's last wave runs part-full); a unit
    split between programs gets one partial per program (at most ``split_k + 1``), summed in slice
    order by the unit's last program to finish, in the same launch (an int32 counter per unit,
    ``lut_b_moe_gemm``'s ``split_k_counters``)."""
    maxnreg: int | None = None
    """Registers per thread the compiler may use (PTX ``.maxnreg``; NVIDIA only), or None for its
    own choice. At decode configs the kernel takes 127, which holds an SM to 4 blocks of 4 warps
    (Nsight Compute: bench/results/2026-12-02-ncu-gemm-h200.md); a cap trades spills for warps."""


def default_decoder(device: torch.device) -> Decoder:
    """``prmt2`` on NVIDIA GPUs of compute capability 8.0 or newer, else ``triton``."""
    if is_nvidia(device) and torch.cuda.get_device_capability(device) >= (8, 0):
        return "prmt2"
    return "triton"


# The default launch table, keyed by the routing block (moe_align_block_size's block_m, chosen
# from the average rows per expert): (block_m, block_n, num_warps, num_stages, waves, maxnreg).
# Split-K doubles while the grid holds fewer than ``waves`` programs per SM and every split keeps
# at least MIN_TILES_PER_SPLIT K tiles. Update from ``bench/kernels.py --tune`` (tune.json's
# "table_suggestion"); TUNED overrides one (route_block, N, K) exactly (split_k included).
# maxnreg None everywhere: at decode the compiler takes 127 registers (4 blocks per SM; Nsight
# Compute, bench/results/2026-12-02-ncu-gemm-h200.md). A cap of 96 compiles to the same loop with
# no spills and fits 5 blocks, but on the H200 it made deepseek's decode ~5% faster and mixtral's
# ~3-5% slower (its w2 GEMM up to 25%), bench/results/2026-12-02-kernels-maxnreg-h200.md.
DEFAULT_TABLE: dict[int, tuple[int, int, int, int, int, int | None]] = {
    16: (16, 128, 4, 3, 4, None),
    32: (32, 128, 4, 3, 4, None),
    64: (64, 128, 4, 3, 2, None),
    128: (128, 128, 8, 3, 1, None),
    256: (128, 128, 8, 3, 1, None),
}
MIN_TILES_PER_SPLIT = 4
# K tiles per unrolled loop iteration in the default configs (LutBGemmConfig.unroll); a module
# constant so that bench/kernels.py --ab unroll can time the same forward both ways. 1: unrolling
# by 2 cuts the decode loop from 498 to 462 instructions per tile but made the H200 slower at
# decode (mixtral T=1/8/32 +10/+8/+9%, deepseek T=8 +7%) and faster only at deepseek T=128/512
# (-2/-3%), bench/results/2026-12-03-unroll-h200.md.
TILE_UNROLL = 1
# Decode (16-row routing blocks, at most 256 routes): split K at least in two. On the H200 every
# GEMM whose heuristic split was 1 ran faster at 2: mixtral T=8/32 w13 -12%/-8%, deepseek T=8/32
# w13 -10%/-5% and w2 -2%/-4%, in two runs (bench/results/2026-12-02-kernels-maxnreg-h200.md, run B;
# 2026-12-02-kernels-prmt2-h200.md's breakdown). Larger batches were not measured with it.
# (:func:`expected_blocks` in place of min(E, routes) takes mixtral T=8 w2 from 2 to 4 splits:
# -22% in the same runs.)
DECODE_MIN_SPLIT_ROUTES = 256
# ... unless the plain grid already holds this many programs per SM (6 waves of 4): with the kernel
# layout (2026-12-04) deepseek-v3's w2 (~26 programs per SM at T=8) ran faster unsplit (190.4 -> 184.5
# us; T=32: 491.9 -> 472.7 us) and its w13 at T=32 (43 per SM) the same, while grids of 5-15 programs
# per SM still gained from two splits (deepseek w13 T=8: 351.6 -> 344.8 us; qwen3 w13 T=8, ~5 per SM:
# a forward 8.6 us slower unsplit), bench/results/2026-12-04-min-split-h200.md. Stream-K is decided
# before this.
DECODE_MIN_SPLIT_BELOW_PROGRAMS_PER_SM = 24
# Decode (16-row routing blocks) plain grids of at least this many programs per SM run under a
# DECODE_WIDE_GRID_MAXNREG register cap: 5 blocks of 4 warps per SM instead of the compiler's 4 (the
# same tile loop; split-K kernels spill a few registers outside it). It pays where the grid is many
# waves deep and costs where one wave more or less is a large share (mixtral w2 at ~6 programs per
# SM: 104.0 -> 126.3 us at T=32); bench/results/2026-12-04-min-split-h200.md.
DECODE_WIDE_GRID_PROGRAMS_PER_SM = 12
DECODE_WIDE_GRID_MAXNREG = 96
# Decode (16-row routing blocks) whose plain grid would be under STREAM_K_BELOW_WAVES waves of
# STREAM_K_PER_SM programs per SM, of fewer than STREAM_K_BELOW_TILES K tiles each, over at most
# STREAM_K_MAX_BLOCKS routing blocks (expected), launches stream-K instead (LutBGemmConfig.stream_k;
# 0: never), capped at STREAM_K_MAXNREG registers (uncapped the stream-K loop takes 161: 3 blocks
# of 4 warps per SM; 128 keeps 4 with no spills, offline sm90 SASS). On the H200 stream-K made such
# GEMMs (2-8 blocks) 7-17% faster (deepseek-v3 T=1 forward 146 -> 126 us, qwen3-30b-a3b T=1
# 49 -> 45) and grids of longer programs 2-6% slower (mixtral-8x7b T=1 w13, 16 tiles per program;
# T=8/32 w2), as was qwen3 T=8 w2 (~50 blocks of 6-tile programs: forward 97.6 -> 100.9 us),
# bench/results/2026-12-04-stream-k-h200.md.
STREAM_K_PER_SM = 4
STREAM_K_BELOW_WAVES = 2
STREAM_K_BELOW_TILES = 16
STREAM_K_MAX_BLOCKS = 16
STREAM_K_MAXNREG = 128
# Routing blocks from which the defaults keep the prmt decoder: on the H200 prmt2 made every
# decode-sized forward faster (mixtral T=1 209 -> 120 us) but prefill ones slower (qwen3 T=2048
# 933 -> 1025 us, T=8192 2598 -> 2917 us), bench/results/2026-12-02-kernels-prmt2-h200.md.
PRMT2_MAX_ROUTE_BLOCK = 128
TUNED: dict[tuple[int, int, int], dict] = {
    # (route_block, n, k): {"block_n": 64, "split_k": 8, "num_warps": 4, "num_stages": 3}
}


def expected_blocks(num_routes: int, num_experts: int, route_block: int) -> float:
    """Routing blocks in use, expected for ``num_routes`` routes spread uniformly over ``num_experts``.

    ``E * (1 - (1 - 1/E)**R)`` experts receive a route (skewed routing touches fewer), plus one
    more block per ``route_block`` routes. A function of sizes only, so a CUDA graph captured for
    a batch size keeps its config.
    """
    if num_experts <= 0 or num_routes <= 0:
        return 0.0
    touched = num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** num_routes)
    return touched + num_routes // route_block


def default_config(num_routes: int, n: int, k: int, num_experts: int, route_block: int, device: torch.device) -> LutBGemmConfig:
    """A config keyed on the routing block (the batch) and the matrix shape (``DEFAULT_TABLE``).

    Every size uses swap-AB (decoded weights in registers as the MMA's M side) and the per-tile
    K loop (``tile_loop``); small batches (decode) split K until the grid holds ``waves``
    programs per SM (:func:`expected_blocks` estimates the grid), and in at least two at decode
    sizes (``DECODE_MIN_SPLIT_ROUTES``) unless the grid is already deep
    (``DECODE_MIN_SPLIT_BELOW_PROGRAMS_PER_SM``); deep decode grids run under a register cap
    (``DECODE_WIDE_GRID_PROGRAMS_PER_SM``); a decode grid still under two waves of short programs
    over few routing blocks runs stream-K (``STREAM_K_PER_SM``). ``TUNED`` entries replace the
    table for one exact shape.
    """
    decoder = default_decoder(device)
    if interpreting():
        return LutBGemmConfig(block_m=min(route_block, 16), block_n=min(64, n), split_k=1, swap_ab=False,
                              decoder=decoder, num_warps=4, num_stages=1, groups_per_step=4)
    if decoder == "prmt2" and route_block >= PRMT2_MAX_ROUTE_BLOCK:
        decoder = "prmt"
    k_tiles = k // TILE
    block_m, block_n, warps, stages, waves, maxnreg = DEFAULT_TABLE.get(route_block, DEFAULT_TABLE[128])
    block_m = min(block_m, route_block)
    tuned = TUNED.get((route_block, n, k))
    if tuned is not None:
        return LutBGemmConfig(block_m=tuned.get("block_m", block_m), block_n=tuned.get("block_n", block_n),
                              split_k=tuned.get("split_k", 1), swap_ab=True, decoder=decoder,
                              num_warps=tuned.get("num_warps", warps), num_stages=tuned.get("num_stages", stages),
                              groups_per_step=1, tile_loop=tuned.get("tile_loop", True), prefetch=tuned.get("prefetch", False),
                              unroll=tuned.get("unroll", TILE_UNROLL), maxnreg=tuned.get("maxnreg", maxnreg))
    blocks = expected_blocks(num_routes, num_experts, route_block)
    programs = blocks * (route_block // block_m) * (n // block_n)
    target = waves * sm_count(device)
    split_k = 1
    while programs * split_k < target and k_tiles // (split_k * 2) >= MIN_TILES_PER_SPLIT:
        split_k *= 2
    min_split = (split_k == 1 and route_block == 16 and num_routes <= DECODE_MIN_SPLIT_ROUTES
                 and k_tiles // 2 >= MIN_TILES_PER_SPLIT)
    if min_split:
        split_k = 2
    if (route_block == 16 and STREAM_K_PER_SM and programs * split_k < STREAM_K_BELOW_WAVES * STREAM_K_PER_SM * sm_count(device)
            and cdiv(k_tiles, split_k) < STREAM_K_BELOW_TILES and blocks <= STREAM_K_MAX_BLOCKS):
        # runs of at least MIN_TILES_PER_SPLIT tiles and half the expected share of a program
        # (bounds the workspace: a unit meets at most k_tiles / run + 1 programs)
        share = programs * k_tiles / (STREAM_K_PER_SM * sm_count(device))
        run = max(MIN_TILES_PER_SPLIT, int(share // 2))
        return LutBGemmConfig(block_m=block_m, block_n=block_n, split_k=max(1, k_tiles // run), swap_ab=True,
                              decoder=decoder, num_warps=warps, num_stages=stages, groups_per_step=1, tile_loop=True,
                              unroll=TILE_UNROLL, stream_k=STREAM_K_PER_SM, maxnreg=STREAM_K_MAXNREG)
    if min_split and programs >= DECODE_MIN_SPLIT_BELOW_PROGRAMS_PER_SM * sm_count(device):
        split_k = 1
    if route_block == 16 and maxnreg is None and programs * split_k >= DECODE_WIDE_GRID_PROGRAMS_PER_SM * sm_count(device):
        maxnreg = DECODE_WIDE_GRID_MAXNREG
    return LutBGemmConfig(block_m=block_m, block_n=block_n, split_k=split_k, swap_ab=True, decoder=decoder,
                          num_warps=warps, num_stages=stages, groups_per_step=1, tile_loop=True, unroll=TILE_UNROLL,
                          maxnreg=maxnreg)


def _check_args(
    a_mxfp8: torch.Tensor,
    a_scales: torch.Tensor | None,
    w_packed: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    top_k: int,
    block_m: int,
    a_k_order: str,
) -> tuple[int, int, int]:
    device = a_mxfp8.device
    want = (torch.float8_e4m3fn,) if a_scales is not None else (torch.bfloat16, torch.float16, torch.float32)
    if a_mxfp8.dtype not in want or a_mxfp8.dim() != 2 or a_mxfp8.stride(1) != 1:
        raise ValueError(f"a_mxfp8 must be {' or '.join(map(str, want))} [M, K] with unit column stride "
                         f"(a float dtype when a_scales is None), got {a_mxfp8.dtype} {tuple(a_mxfp8.shape)}")
    m, k = a_mxfp8.shape
    if k % TILE or k == 0:
        raise ValueError(f"K must be a positive multiple of {TILE}, got {k}")
    if a_scales is None:
        pass
    elif a_scales.dtype != torch.uint8 or tuple(a_scales.shape) != (m, k // BLOCK) or a_scales.stride(1) != 1 or a_scales.device != device:
        raise ValueError(f"a_scales must be uint8 [{m}, {k // BLOCK}] on {device}, got {a_scales.dtype} {tuple(a_scales.shape)}")
    if w_packed.dtype != torch.uint8 or w_packed.dim() != 4 or w_packed.shape[2] * TILE != k or w_packed.shape[3] != TILE_BYTES:
        raise ValueError(f"w_packed must be uint8 [E, N/128, {k // TILE}, {TILE_BYTES}], got {w_packed.dtype} {tuple(w_packed.shape)}")
    if not w_packed.is_contiguous() or w_packed.device != device:
        raise ValueError(f"w_packed must be contiguous on {device}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if a_k_order not in ("natural", "decoder"):
        raise ValueError(f"a_k_order must be 'natural' or 'decoder', got {a_k_order!r}")
    n = w_packed.shape[1] * TILE
    check_out_and_weights(out, topk_weights, m * top_k, n, device)
    check_routing(sorted_token_ids, expert_ids, num_tokens_post_padded, block_m, device)
    return m, n, k


def lut_b_moe_gemm(
    a_mxfp8: torch.Tensor,
    a_scales: torch.Tensor | None,
    w_packed: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    top_k: int,
    *,
    block_m: int = 128,
    a_k_order: Literal["natural", "decoder"] = "natural",
    config: LutBGemmConfig | None = None,
    held_routes: int | None = None,
    kernel_layout: bool = False,
    split_k_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[route] = (A[route // top_k] @ W[expert]^T) * topk_weights[route]`` over the routed rows.

    Args:
        a_mxfp8: float8_e4m3fn ``[M, K]``, ``K % 128 == 0``; or, with ``a_scales=None``, the
            MXFP8 values already dequantized (bfloat16 holds them exactly; see
            :func:`lutb_kernels.mxfp8_triton.mxfp8_qdq` ``out_dtype``), which spares the kernel
            the per-element conversion at large batches.
        a_scales: uint8 ``[M, K/32]``, E8M0 per 32-block, or None (see above).
        w_packed: uint8 ``[E, N/128, K/128, 6672]`` LUT-B v1 tiles (E local experts).
        out: ``[M * top_k, N]`` bfloat16/float16/float32 (``[M, N]`` when ``top_k == 1``); only
            rows of routed, held routes are written.
        topk_weights: float32 with ``M * top_k`` elements (``[M, top_k]``, flat route index), or None.
        sorted_token_ids, expert_ids, num_tokens_post_padded: int32, from
            ``moe_align_block_size(topk_ids, block_m, ...)``; expert ids are local: -1 or in ``[0, E)``
            with ``E = w_packed.shape[0]``, which the device reads without a check (a host check would
            need a sync): an id ``>= E`` reads past the weights. The routing ops give such ids only
            for an ``expert_map`` (or ``num_experts``) that names more experts than ``w_packed`` holds.
        top_k: routes per A row.
        block_m: the routing's block size (16, 32, 64, 128 or 256).
        a_k_order: ``"decoder"`` when ``a_mxfp8`` was quantized with ``k_order="decoder"``
            (contiguous loads); ``"natural"`` reads it in decoder order by address.
        config: launch parameters; default :func:`default_config`.
        held_routes: routes expected to land on ``w_packed``'s experts, when it holds a shard of
            the experts the routing chose from (uniform share: ``M * top_k * E / E_layer``); None:
            all ``M * top_k``. Sizes the default launch only; the result does not depend on it.
        kernel_layout: ``w_packed`` is in the kernel layout (:func:`lutb_kernels.tiles.to_kernel_layout`,
            how the packed experts keep it: planes rotated, rows chunk-major): the ``prmt2``
            selector takes 4 integer instructions instead of 6 and each 16-byte plane load reads
            whole sectors; same result. False: the checkpoint layout.
        split_k_counters: int32 on the device, all zero, one element per unit of the launch
            (``expert_ids.numel() * (block_m / config.block_m) * (N / config.block_n)``): the
            counters a stream-K launch uses to find each unit's last partial (it leaves them zero
            again; plain split-K grids sum their slices in a second launch and use none). None, or
            too small: the call allocates a zeroed one (one memset more).
            Callers that run many GEMMs (the packed experts) keep one buffer for all of them; two
            launches must not use one buffer at the same time (one stream).

    Returns:
        ``out``.
    """
    m, n, k = _check_args(a_mxfp8, a_scales, w_packed, out, topk_weights, sorted_token_ids, expert_ids,
                          num_tokens_post_padded, top_k, block_m, a_k_order)
    num_valid = m * top_k
    if num_valid == 0 or n == 0 or expert_ids.numel() == 0:
        return out
    from lutb_kernels._lut_b_gemm_details.kernels import lut_b_moe_gemm_kernel, split_k_reduce_kernel

    device = a_mxfp8.device
    if config is None:
        config = default_config(num_valid if held_routes is None else held_routes, n, k, w_packed.shape[0], block_m, device)
    bm = min(config.block_m, block_m)
    if (block_m % bm or config.block_n not in (16, 32, 64, 128) or config.split_k < 1 or config.groups_per_step not in (1, 2, 4)
            or (config.tile_loop and config.groups_per_step != 1) or config.decoder not in DECODER_IDS
            or (config.maxnreg is not None and not 32 <= config.maxnreg <= 255) or config.unroll not in (1, 2, 4)
            or config.stream_k < 0 or (config.stream_k and not config.swap_ab)):
        raise ValueError(f"bad config {config} for block_m={block_m}")
    k_tiles = k // TILE
    split_k = min(config.split_k, k_tiles)
    tiles_per_split = cdiv(k_tiles, split_k)
    split_k = cdiv(k_tiles, tiles_per_split)
    blocks = expert_ids.numel()
    programs = config.stream_k * sm_count(device)
    if config.stream_k:
        # runs of >= tiles_per_split tiles: a unit's K tiles meet at most this many programs
        split_k = cdiv(k_tiles, tiles_per_split) + 1
        grid: tuple[int, ...] = (programs,)
    else:
        grid = (blocks * (block_m // bm), n // config.block_n, split_k)
    # split-K: one float32 slice per partial, written with plain stores (no zeroing, no float
    # atomics), summed in slice order by the unit's last program (stream-K: an int32 counter per
    # unit) or by a second launch (plain grids of many waves, where that measured faster)
    ws = torch.empty((split_k, num_valid, n), dtype=torch.float32, device=device) if split_k > 1 else out
    counters = ws
    if config.stream_k:
        units = blocks * (block_m // bm) * (n // config.block_n)
        counters = split_k_counters
        if counters is not None and (counters.dtype != torch.int32 or counters.device != device or not counters.is_contiguous()):
            raise ValueError(f"split_k_counters must be a contiguous int32 tensor on {device}, got {counters.dtype} on {counters.device}")
        if counters is None or counters.numel() < units:
            counters = torch.zeros(units, dtype=torch.int32, device=device)
    lut_b_moe_gemm_kernel[grid](
        a_mxfp8.view(torch.uint8) if a_scales is not None else a_mxfp8,
        a_scales if a_scales is not None else a_mxfp8, w_packed, w_packed.view(torch.int32), out, ws, counters,
        topk_weights if topk_weights is not None else ws,
        sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, num_valid, tiles_per_split, programs, blocks,
        a_mxfp8.stride(0), a_scales.stride(0) if a_scales is not None else 0, out.stride(0),
        TOP_K=top_k, ROUTE_BLOCK=block_m, BLOCK_M=bm, BLOCK_N=config.block_n, SPLIT_K=split_k,
        MUL_WEIGHT=topk_weights is not None,
        DECODER=DECODER_IDS[config.decoder],
        A_PERMUTED=a_k_order == "decoder",
        A_DEQUANTIZED=a_scales is None,
        SWAP_AB=config.swap_ab,
        DOT_BF16=not interpreting(),
        G=config.groups_per_step,
        TILE_LOOP=config.tile_loop,
        PREFETCH=config.prefetch,
        UNROLL=config.unroll,
        STREAM_K=config.stream_k > 0,
        KERNEL_LAYOUT=kernel_layout,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **({"maxnreg": config.maxnreg} if config.maxnreg is not None and not interpreting() else {}),
        **pdl_launch(device),
    )
    if split_k > 1 and not config.stream_k:
        fin_r, fin_n = min(block_m, 16), min(256, next_pow2(n))
        split_k_reduce_kernel[(blocks * (block_m // fin_r), cdiv(n, fin_n))](
            ws, out, topk_weights if topk_weights is not None else ws,
            sorted_token_ids, expert_ids, num_tokens_post_padded, n, num_valid, out.stride(0),
            ROUTE_BLOCK=block_m, BLOCK_R=fin_r, BLOCK_N=fin_n, SPLIT_K=split_k,
            MUL_WEIGHT=topk_weights is not None, num_warps=4, **pdl_launch(device),
        )
    return out


def lut_b_moe_gemm_reference(
    a_mxfp8: torch.Tensor,
    a_scales: torch.Tensor | None,
    w_packed: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    top_k: int,
    *,
    block_m: int = 128,
    a_k_order: Literal["natural", "decoder"] = "natural",
    config: LutBGemmConfig | None = None,
    held_routes: int | None = None,
    kernel_layout: bool = False,
    split_k_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch twin of :func:`lut_b_moe_gemm`, with its signature.

    ``config``, ``held_routes`` and ``split_k_counters`` are accepted and ignored (they shape the
    launch, not the result; the counters are neither checked nor touched).

    Dequantizes A with :func:`~lutb_kernels.mxfp8.mxfp8_dequantize` and each expert's tiles
    with :func:`~lutb_kernels.tiles.tiles_to_dense`, then walks the routing blocks; float32
    throughout, rounded to ``out.dtype`` at the end.
    """
    m, n, k = _check_args(a_mxfp8, a_scales, w_packed, out, topk_weights, sorted_token_ids, expert_ids,
                          num_tokens_post_padded, top_k, block_m, a_k_order)
    num_valid = m * top_k
    q = a_mxfp8
    if a_k_order == "decoder":  # undo the permutation: natural column c sits at position inv[c]
        order = decoder_column_order(k, q.device)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(k, device=q.device)
        q = q.view(torch.uint8)[:, inv].view(torch.float8_e4m3fn) if a_scales is not None else q[:, inv]
    a = mxfp8_dequantize(q, a_scales, torch.float32) if a_scales is not None else q.float()
    used = int(num_tokens_post_padded.item())
    blocks = min(expert_ids.numel(), cdiv(used, block_m))
    dense: dict[int, torch.Tensor] = {}
    flat_w = topk_weights.reshape(-1) if topk_weights is not None else None
    for b in range(blocks):
        e = int(expert_ids[b])
        if e < 0:
            continue
        routes = sorted_token_ids[b * block_m:(b + 1) * block_m].long()
        routes = routes[routes < num_valid]
        if routes.numel() == 0:
            continue
        if e not in dense:
            tiles = to_kernel_layout(w_packed[e], inverse=True) if kernel_layout else w_packed[e]
            dense[e] = tiles_to_dense(tiles, torch.float32)
        y = a[routes // top_k] @ dense[e].T
        if flat_w is not None:
            y = y * flat_w[routes][:, None]
        out[routes] = y.to(out.dtype)
    return out


def with_config(config: LutBGemmConfig, **changes: object) -> LutBGemmConfig:
    """A copy of ``config`` with fields replaced (for tuning scripts)."""
    return replace(config, **changes)  # type: ignore[arg-type]


def random_tiles(
    shape: tuple[int, ...],
    *,
    k: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    scale_jitter: int = 1,
) -> torch.Tensor:
    """Random valid LUT-B v1 tiles ``uint8 [*shape, 6672]`` made directly as bytes (tests, benchmarks).

    Planes are random bits (codes uniform over 0..7), each tile's LUT is 8 sorted standard
    normals in bfloat16, and each (row, group) scale is ``2**-round(log2(sqrt(k)))`` times
    ``2**U{-scale_jitter..scale_jitter}``, so a matrix with ``k`` columns has weights of about
    ``1/sqrt(k)`` and keeps standard-normal activations at unit scale. Fast on any device:
    no quantizer, no per-field packing.
    """
    device = torch.device(device)
    n_tiles = 1
    for s in shape:
        n_tiles *= s
    tiles = torch.empty((n_tiles, TILE_BYTES), dtype=torch.uint8, device=device)
    tiles[:, 528:] = torch.randint(0, 256, (n_tiles, TILE_BYTES - 528), dtype=torch.uint8, device=device, generator=generator)
    base = 127 - round(0.5 * float(torch.tensor(float(k)).log2()))
    tiles[:, 16:528] = torch.randint(base - scale_jitter, base + scale_jitter + 1, (n_tiles, 512), dtype=torch.uint8,
                                     device=device, generator=generator)
    lut = torch.randn((n_tiles, 8), device=device, generator=generator).sort(dim=-1).values.to(torch.bfloat16)
    tiles[:, :16] = lut.view(torch.uint8)
    return tiles.reshape(*shape, TILE_BYTES)
