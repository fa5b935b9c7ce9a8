"""Triton kernels: dense grouped GEMM over block-aligned routing, split-K finalize, route combine."""

from __future__ import annotations

import triton
import triton.language as tl

from lutb_kernels._pdl_details import pdl_prologue


# batch-size arguments unspecialised (docs/kernels.md, "One compile per config")
@triton.jit(do_not_specialize=["num_valid"])
def grouped_gemm_kernel(
    a_ptr,  # [M, K] model dtype
    w_ptr,  # [E, N, K] model dtype
    out_ptr,  # [num_valid, N]
    ws_ptr,  # float32 [num_valid, N] zeroed (SPLIT_K > 1)
    topk_w_ptr,  # float32, flat route index
    sorted_ptr,
    eid_ptr,
    ntpp_ptr,
    N,
    K,
    num_valid,
    k_per_split,  # multiple of BLOCK_K
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    ROUTE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    ALLOW_TF32: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (lutb_kernels._pdl_details)
):
    pdl_prologue(PDL)
    SUBS: tl.constexpr = ROUTE_BLOCK // BLOCK_M
    pid0 = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    blk = pid0 // SUBS
    sub = pid0 % SUBS
    ntpp = tl.load(ntpp_ptr)
    if blk * ROUTE_BLOCK >= ntpp:
        return
    expert = tl.load(eid_ptr + blk)
    if expert < 0:
        return
    offs_m = blk * ROUTE_BLOCK + sub * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(sorted_ptr + offs_m)
    valid = route < num_valid
    a_row = (route // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    a_ptrs = a_ptr + a_row[:, None] * stride_am + (k_lo + kk)[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + (k_lo + kk)[:, None]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + kk) < k_hi
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if a_ptr.dtype.element_ty != tl.float32:
            acc = tl.dot(a, w, acc)
        elif ALLOW_TF32:
            acc = tl.dot(a, w, acc, input_precision="tf32")
        else:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    route64 = route.to(tl.int64)
    o_mask = valid[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        if MUL_WEIGHT:
            wt = tl.load(topk_w_ptr + route, mask=valid, other=0.0)
            acc = acc * wt[:, None]
        tl.store(out_ptr + route64[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.atomic_add(ws_ptr + (route64 * N)[:, None] + cols[None, :], acc, mask=o_mask, sem="relaxed")


# batch-size arguments unspecialised (docs/kernels.md, "One compile per config")
@triton.jit(do_not_specialize=["num_valid"])
def split_k_finalize_kernel(
    ws_ptr,  # float32 [num_valid, N]
    out_ptr,  # [num_valid, N]
    topk_w_ptr,
    sorted_ptr,
    eid_ptr,
    ntpp_ptr,
    N,
    num_valid,
    stride_om,
    ROUTE_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (lutb_kernels._pdl_details)
):
    """Rows of held routes only: ``out[route] = (ws[route] * w[route]).to(out dtype)``."""
    pdl_prologue(PDL)
    blk = tl.program_id(0)
    pid_n = tl.program_id(1)
    ntpp = tl.load(ntpp_ptr)
    if blk * ROUTE_BLOCK >= ntpp:
        return
    expert = tl.load(eid_ptr + blk)
    if expert < 0:
        return
    route = tl.load(sorted_ptr + blk * ROUTE_BLOCK + tl.arange(0, ROUTE_BLOCK))
    valid = route < num_valid
    route64 = route.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = valid[:, None] & (cols < N)[None, :]
    acc = tl.load(ws_ptr + (route64 * N)[:, None] + cols[None, :], mask=mask, other=0.0)
    if MUL_WEIGHT:
        wt = tl.load(topk_w_ptr + route, mask=valid, other=0.0)
        acc = acc * wt[:, None]
    tl.store(out_ptr + route64[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_combine_kernel(
    y_ptr,  # [T * k, H] model dtype
    held_ptr,  # int8 [T * k] (HAS_HELD)
    out_ptr,  # [T, H]
    H,
    stride_ym,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_HELD: tl.constexpr,  # False: every route is held (a whole layer)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (lutb_kernels._pdl_details)
):
    """``out[t] = sum_j held[t, j] ? y[t*k + j] : 0`` in float32, rounded to the out dtype (spec step 7)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.full((BLOCK_H,), 0.0, tl.float32)
    for j in tl.static_range(TOP_K):
        r = t * TOP_K + j
        if HAS_HELD:
            held = tl.load(held_ptr + r) != 0
            y = tl.load(y_ptr + r * stride_ym + cols, mask=cmask & held, other=0.0)
        else:
            y = tl.load(y_ptr + r * stride_ym + cols, mask=cmask, other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)
