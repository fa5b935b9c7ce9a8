"""Dense grouped GEMM over block-aligned routing (Triton), and the per-token route sum.

``grouped_gemm`` is the emulated path's GEMM (the seed's emulation: weights dequantized to
the model dtype once at load, activations MXFP8-QDQ'd before each GEMM) and, fed unquantized
weights, one of the bf16 peers of ``bench/kernels.py``. It takes the same routing arguments as
:func:`lutb_kernels.lut_b_gemm.lut_b_moe_gemm`: row ``p`` of ``sorted_token_ids`` is a route
``token * top_k + slot``, A row ``route // top_k``, out row ``route``; the sentinel
``M * top_k`` is skipped, blocks with expert id -1 write nothing, rows of routes without a row
(experts not held) are not touched. float32 accumulation; float32 inputs use TF32 only when
``allow_tf32`` (exact for MXFP8-QDQ'd activations times LUT-B weights: both fit TF32's mantissa).

``moe_combine`` is spec section 4 step 7: the float32 sum over a token's held routes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lutb_kernels._grouped_gemm_details.launch import (
    cdiv,
    check_out_and_weights,
    check_routing,
    interpreting,
    next_pow2,
    pdl_launch,
    shared_memory_per_block,
    sm_count,
)


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Launch parameters of :func:`grouped_gemm` (``block_k`` a power of two >= 16)."""

    block_m: int
    block_n: int = 128
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# The 128 x 256 tile of large batches: 4 stages of A (128 x 64) and W (64 x 256) bf16 take 192 KiB
# of shared memory. On the H200 it ran 11-25% faster than 128 x 128 (3 stages) on every large-T
# GEMM swept (mixtral T=2048/8192, qwen3 T=8192; bench/results/2026-12-02-kernels-prefill-h200.md).
WIDE_TILE_SMEM = 4 * (128 * 64 + 64 * 256) * 2


def default_config(num_routes: int, n: int, k: int, num_experts: int, route_block: int, device: torch.device, elem_size: int = 2) -> GroupedGemmConfig:
    """A config keyed on the routing block; split-K fills the GPU at small batches.

    From 128-row routing blocks, 16-bit inputs use a 128 x 256 tile with 4 stages where the GPU
    has the shared memory for it (Hopper, datacenter Blackwell), else 128 x 128 with 3.
    """
    if interpreting():
        return GroupedGemmConfig(block_m=min(route_block, 16), block_n=min(32, next_pow2(n)), block_k=32, num_stages=1)
    block_k = 64 if elem_size <= 2 else 32
    if route_block <= 32:
        block_m, block_n, warps, stages = route_block, 64, 4, 4
    elif route_block == 64:
        block_m, block_n, warps, stages = 64, 128, 4, 3
    elif elem_size <= 2 and n >= 256 and shared_memory_per_block(device) >= WIDE_TILE_SMEM:
        block_m, block_n, warps, stages = 128, 256, 8, 4
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    active_blocks = min(num_experts, num_routes) + num_routes // route_block
    programs = active_blocks * (route_block // block_m) * cdiv(n, block_n)
    split_k = 1
    while programs * split_k < 4 * sm_count(device) and k // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return GroupedGemmConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                             num_warps=warps, num_stages=stages)


def _check_args(a, w, out, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_m):
    device = a.device
    if a.dim() != 2 or a.dtype not in (torch.bfloat16, torch.float16, torch.float32) or a.stride(1) != 1:
        raise ValueError(f"a must be [M, K] bfloat16/float16/float32 with unit column stride, got {a.dtype} {tuple(a.shape)}")
    if w.dim() != 3 or w.dtype != a.dtype or w.shape[2] != a.shape[1] or w.stride(2) != 1 or w.device != device:
        raise ValueError(f"w must be [E, N, {a.shape[1]}] {a.dtype} with unit K stride on {device}, got {w.dtype} {tuple(w.shape)}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    m, k = a.shape
    n = w.shape[1]
    check_out_and_weights(out, topk_weights, m * top_k, n, device)
    check_routing(sorted_token_ids, expert_ids, num_tokens_post_padded, block_m, device)
    return m, n, k


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    top_k: int,
    *,
    block_m: int = 128,
    allow_tf32: bool = False,
    config: GroupedGemmConfig | None = None,
    held_routes: int | None = None,
) -> torch.Tensor:
    """``out[route] = (a[route // top_k] @ w[expert]^T) * topk_weights[route]`` over the routed rows.

    Args:
        a: ``[M, K]`` bfloat16/float16/float32 (``K = 0``: every routed row of ``out`` gets
            zeros, times its weight, as in :func:`grouped_gemm_reference`).
        w: ``[E, N, K]``, same dtype as ``a``.
        out: ``[M * top_k, N]`` bfloat16/float16/float32.
        topk_weights: float32 with ``M * top_k`` elements (flat route index), or None.
        sorted_token_ids, expert_ids, num_tokens_post_padded: int32, from
            ``moe_align_block_size(topk_ids, block_m, ...)``; expert ids -1 or in ``[0, E)``, unchecked
            on the device (as in :func:`lutb_kernels.lut_b_gemm.lut_b_moe_gemm`).
        top_k: routes per A row.
        block_m: the routing's block size.
        allow_tf32: let float32 inputs use TF32 tensor cores.
        config: launch parameters; default :func:`default_config`.
        held_routes: routes expected to land on ``w``'s experts when it holds a shard of the
            experts the routing chose from; None: all ``M * top_k``. Sizes the default launch only.

    Returns:
        ``out``.
    """
    m, n, k = _check_args(a, w, out, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_m)
    num_valid = m * top_k
    if num_valid == 0 or n == 0 or expert_ids.numel() == 0:
        return out
    from lutb_kernels._grouped_gemm_details.kernels import (
        grouped_gemm_kernel,
        split_k_finalize_kernel,
    )

    device = a.device
    if config is None:
        config = default_config(num_valid if held_routes is None else held_routes, n, k, w.shape[0], block_m, device, a.element_size())
    bm = min(config.block_m, block_m)
    if block_m % bm:
        raise ValueError(f"config.block_m {config.block_m} must divide block_m {block_m}")
    # K = 0: one split whose K loop runs no step, so each routed row gets 0 (times its weight), as in the reference
    k_per_split = max(1, cdiv(cdiv(k, config.split_k), config.block_k)) * config.block_k
    split_k = max(1, cdiv(k, k_per_split))
    ws = torch.zeros((num_valid, n), dtype=torch.float32, device=device) if split_k > 1 else out
    grid = (expert_ids.numel() * (block_m // bm), cdiv(n, config.block_n), split_k)
    grouped_gemm_kernel[grid](
        a, w, out, ws, topk_weights if topk_weights is not None else ws,
        sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, num_valid, k_per_split,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, ROUTE_BLOCK=block_m, BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split_k, MUL_WEIGHT=topk_weights is not None,
        ALLOW_TF32=bool(allow_tf32 and a.dtype == torch.float32 and not interpreting()),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(device),
    )
    if split_k > 1:
        fin_n = min(128, next_pow2(n))
        split_k_finalize_kernel[(expert_ids.numel(), cdiv(n, fin_n))](
            ws, out, topk_weights if topk_weights is not None else ws,
            sorted_token_ids, expert_ids, num_tokens_post_padded, n, num_valid, out.stride(0),
            ROUTE_BLOCK=block_m, BLOCK_N=fin_n, MUL_WEIGHT=topk_weights is not None, num_warps=4, **pdl_launch(device),
        )
    return out


def grouped_gemm_reference(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    top_k: int,
    *,
    block_m: int = 128,
    allow_tf32: bool = False,
    config: GroupedGemmConfig | None = None,
    held_routes: int | None = None,
) -> torch.Tensor:
    """Plain-PyTorch twin of :func:`grouped_gemm` (float32 math; ``allow_tf32``/``config``/``held_routes`` ignored)."""
    m, n, k = _check_args(a, w, out, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_m)
    num_valid = m * top_k
    used = int(num_tokens_post_padded.item())
    flat_w = topk_weights.reshape(-1) if topk_weights is not None else None
    for b in range(min(expert_ids.numel(), cdiv(used, block_m))):
        e = int(expert_ids[b])
        if e < 0:
            continue
        routes = sorted_token_ids[b * block_m:(b + 1) * block_m].long()
        routes = routes[routes < num_valid]
        if routes.numel() == 0:
            continue
        y = a[routes // top_k].float() @ w[e].float().T
        if flat_w is not None:
            y = y * flat_w[routes][:, None]
        out[routes] = y.to(out.dtype)
    return out


def moe_combine(y: torch.Tensor, held: torch.Tensor | None, top_k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum each token's held routes in float32 (spec step 7).

    Args:
        y: ``[T * top_k, H]`` per-route outputs in the model dtype (rows of routes not held may
            hold anything; they are not read).
        held: bool/int8 ``[T * top_k]`` (or ``[T, top_k]``): the route's expert is held here;
            None: every route is (a whole layer), no mask is read.
        top_k: routes per token.
        out: optional ``[T, H]`` in ``y.dtype``.

    Returns:
        ``[T, H]`` in ``y.dtype``: ``sum_j held[t, j] * y[t*k + j]`` (float32 sum, then rounded).
    """
    if y.dim() != 2 or y.shape[0] % top_k or y.stride(1) != 1:
        raise ValueError(f"y must be [T * top_k, H] with unit column stride, got {tuple(y.shape)}")
    tokens, hidden = y.shape[0] // top_k, y.shape[1]
    if held is not None and (held.numel() != y.shape[0] or held.dtype not in (torch.bool, torch.int8, torch.uint8)):
        raise ValueError(f"held must be bool/int8 with {y.shape[0]} elements, got {held.dtype} {tuple(held.shape)}")
    if out is None:
        out = torch.empty((tokens, hidden), dtype=y.dtype, device=y.device)
    elif tuple(out.shape) != (tokens, hidden) or out.dtype != y.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{tokens}, {hidden}] {y.dtype}, got {out.dtype} {tuple(out.shape)}")
    if tokens == 0 or hidden == 0:
        return out
    from lutb_kernels._grouped_gemm_details.kernels import moe_combine_kernel

    block_h = min(1024, next_pow2(hidden))
    moe_combine_kernel[(tokens, cdiv(hidden, block_h))](
        y, held.reshape(-1).view(torch.int8) if held is not None else y, out, hidden, y.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, HAS_HELD=held is not None, num_warps=4, **pdl_launch(y.device),
    )
    return out


def moe_combine_reference(y: torch.Tensor, held: torch.Tensor | None, top_k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch twin of :func:`moe_combine`."""
    tokens = y.shape[0] // top_k
    keep = held.reshape(tokens, top_k, 1).bool() if held is not None else torch.ones(tokens, top_k, 1, dtype=torch.bool, device=y.device)
    yy = y.reshape(tokens, top_k, -1).float()
    res = torch.where(keep, yy, torch.zeros_like(yy)).sum(dim=1).to(y.dtype)
    if out is not None:
        out.copy_(res)
        return out
    return res
