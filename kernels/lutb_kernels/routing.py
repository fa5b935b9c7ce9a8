"""Routing helpers for the grouped GEMMs: block-aligned token order, in plain torch.

``moe_align_block_size`` follows vLLM's semantics so that kernels written for
that layout (ours included) can consume it. It does no host synchronisation,
so it can run inside a CUDA graph.
"""

from __future__ import annotations

import torch


def check_held_out(held_out: torch.Tensor, num_routes: int, device: torch.device) -> None:
    """Refuse a ``held_out`` that is not a contiguous bool tensor of ``num_routes`` elements on ``device``."""
    if held_out.dtype != torch.bool or held_out.numel() != num_routes or not held_out.is_contiguous() or held_out.device != device:
        raise ValueError(f"held_out must be a contiguous bool tensor of {num_routes} elements on {device}, "
                         f"got {held_out.dtype} {tuple(held_out.shape)} on {held_out.device}")


def check_routing_out(
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], max_padded: int, num_blocks: int, device: torch.device,
) -> None:
    """Refuse an ``out=`` that is not a tuple of three contiguous int32 1-D tensors on ``device`` of
    ``max_padded``, ``num_blocks`` and 1 elements (the check of both routing ops' ``out=``)."""
    if not isinstance(out, tuple) or len(out) != 3:
        raise ValueError("out must be a tuple (sorted_token_ids, expert_ids, num_tokens_post_padded)")
    for name, t, n in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), out, (max_padded, num_blocks, 1)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.numel() != n or t.device != device or not t.is_contiguous():
            raise ValueError(f"out {name} must be a contiguous int32 [{n}] tensor on {device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def max_padded_routes(num_routes: int, block_m: int, num_experts: int) -> int:
    """Upper bound on the padded route count: every expert may waste ``block_m - 1`` rows."""
    return num_routes + num_experts * (block_m - 1)


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_m: int,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    held_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort routes by expert and pad each expert's run to a multiple of ``block_m``.

    A route is one (token, slot) pair; its flat index is ``token * k + slot``.

    Args:
        topk_ids: int32/int64 ``[T, k]`` global expert ids in ``[0, num_experts)``. Ids outside that
            range (-1: a padding route) get no rows, as in :func:`~lutb_kernels.routing_triton.moe_align_block_size_triton`.
        block_m: rows per block of the grouped GEMM.
        num_experts: the global expert count (>= 0; with 0, no route gets a row: every position
            holds the sentinel, every block -1, the total 0).
        expert_map: optional int32 ``[num_experts]`` mapping a global id to the local
            index of the expert held, or -1 when it is not held. Routes to experts not
            held get no rows at all (they contribute zero).
        out: optional preallocated ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``,
            contiguous int32 on ``topk_ids``' device with the shapes below: every element is
            written and these tensors are returned (as
            :func:`~lutb_kernels.routing_triton.moe_align_block_size_triton` does).
        held_out: optional contiguous bool tensor of ``T*k`` elements (e.g. ``[T, k]``), filled
            with whether each route's expert is held (True for every route without a map): the
            mask a shard's combine and activation need, from the same pass.

    Returns:
        ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``:

        - ``sorted_token_ids``: int32 ``[T*k + E*(block_m-1)]``, flat route indices grouped
          by expert, each group padded to a multiple of ``block_m`` with the sentinel
          ``T*k``; positions past ``num_tokens_post_padded`` also hold the sentinel.
        - ``expert_ids``: int32 ``[ceil(len(sorted_token_ids) / block_m)]``, the (local)
          expert of each block; -1 for blocks past ``num_tokens_post_padded``.
        - ``num_tokens_post_padded``: int32 ``[1]``, rows in use.

    Raises:
        ValueError: ``held_out`` or ``out`` of another dtype, size or device, or not contiguous.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_routes = flat.numel()
    max_padded = max_padded_routes(num_routes, block_m, num_experts)
    num_blocks = -(-max_padded // block_m)
    if held_out is not None:
        check_held_out(held_out, num_routes, device)
    if out is not None:
        check_routing_out(out, max_padded, num_blocks, device)

    valid = (flat >= 0) & (flat < num_experts)
    if expert_map is None or not num_experts:
        local = flat
    else:  # clamped: an id out of range must not index the map (-1 would read its last entry)
        local = expert_map.to(device=device, dtype=torch.long)[flat.clamp(0, num_experts - 1)]
    held = valid & (local >= 0) & (local < num_experts)
    if held_out is not None:
        held_out.view(-1).copy_(held)
    # Routes to experts not held sort after every held one, into a bucket that gets no rows.
    bucket = torch.where(held, local, torch.full_like(local, num_experts))

    # Per bucket, the not-held one last (it gets no rows, so none are padded for it; with no experts
    # at all it is the only bucket).
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # a kernel: `padded[i] = 0` would copy a host scalar in (no CUDA graph capture)
    padded_end_all = torch.cumsum(padded, 0)
    padded_start = padded_end_all - padded
    padded_end = padded_end_all[:num_experts]
    count_start = torch.cumsum(counts, 0) - counts

    order = torch.sort(bucket, stable=True).indices
    sorted_bucket = bucket[order]
    in_range = sorted_bucket < num_experts
    rank = torch.arange(num_routes, device=device) - count_start[sorted_bucket]
    dest = torch.where(in_range, padded_start[sorted_bucket] + rank, torch.full_like(rank, max_padded))

    sorted_token_ids = torch.full((max_padded + 1,), num_routes, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_token_ids = sorted_token_ids[:max_padded]

    total = padded_end[-1:] if num_experts else torch.zeros(1, dtype=torch.long, device=device)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(block_start < total, block_expert, torch.full_like(block_expert, -1)).to(torch.int32)
    total = total.to(torch.int32)
    if out is None:
        return sorted_token_ids, expert_ids, total
    for dst, src in zip(out, (sorted_token_ids, expert_ids, total)):
        dst.copy_(src)
    return out
