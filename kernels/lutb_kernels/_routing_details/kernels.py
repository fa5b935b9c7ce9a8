"""Triton kernel: ``moe_align_block_size`` in one program (one launch, no host sync).

One program walks the routes in chunks, in four phases; ``tl.debug_barrier()`` (a CTA-wide
barrier: what a thread stored to global memory before it is seen by every thread after it)
orders the phases that read what another thread wrote:

1. count: per chunk of ``HIST_C`` routes, ``tl.histogram`` of the held routes' local experts,
   summed in registers (``counts [E_PAD]``); with ``HAS_HELD`` each route's held flag is stored;
2. layout: padded counts, their inclusive scan ``padded_end``, ``padded_start``, the total
   (stored); the sentinel over all of ``sorted_token_ids``; barrier;
3. place: per chunk of ``RANK_C`` routes, a held route goes to ``padded_start[e]`` + its rank
   among the routes of its expert ``e`` (stable: ascending route index) = a running
   per-expert counter (routes of ``e`` in earlier chunks) + its in-chunk rank.
   ``ONEHOT`` (few experts): a ``[C, E_PAD]`` one-hot block, scanned along the routes, gives
   the in-chunk rank; the counters stay in registers, no barrier. Otherwise a ``[C, C]``
   comparison gives the rank, the counters live in the global scratch ``run_ptr``: read
   them, barrier, the last route of each expert in the chunk writes its counter back,
   barrier;
4. expert of each block: expert ``e`` owns blocks ``padded_start[e] / BM`` to
   ``padded_end[e] / BM - 1``, written as ``[E_PAD]`` scatters, one per block an expert can
   hold (at most ``ceil(R / BM)``; at decode a few); blocks past the total get -1.

Only ``tl`` builtins are called (``tl.reduce`` / ``tl.associative_scan``, ``tl.full``,
``tl.histogram``), never ``triton.language``'s ``@jit`` helpers (``tl.sum``, ``tl.cumsum``,
``tl.zeros``...), which bind interpret/compile mode when triton is first imported and then
misbehave under ``TRITON_INTERPRET=1`` if another library imported triton earlier. The sums
pass triton's own ``_sum_combine`` as the combine function: the interpreter recognises it and
runs numpy, where any other combine function is called once per element (minutes per test);
compiled, it is the same add as ours (the fallback if the private name ever goes). All
indices are int32: the op refuses sizes whose padded length plus a chunk reaches 2**31.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lutb_kernels._pdl_details import pdl_prologue


@triton.jit
def _add(a, b):
    return a + b


# Identity-checked by the interpreter's numpy fast path for sums (see the module docstring).
_sum = getattr(tl.standard, "_sum_combine", _add)


@triton.jit
def _route_buckets(ids_ptr, map_ptr, offs, R, E, HAS_MAP: tl.constexpr):
    """``(bucket, held)`` of the routes ``offs``: int32 local expert (0 where not held), held mask.

    A route is held when its global id is in ``[0, E)`` and (with a map) its local id is too;
    anything else gets no row (and is never used as an address).
    """
    inb = offs < R
    gid = tl.load(ids_ptr + offs, mask=inb, other=-1)
    held = inb & (gid >= 0) & (gid < E)
    g32 = tl.where(held, gid, 0).to(tl.int32)
    if HAS_MAP:
        loc = tl.load(map_ptr + g32, mask=held, other=-1)
        held = held & (loc >= 0) & (loc < E)
        bucket = tl.where(held, loc, 0).to(tl.int32)
    else:
        bucket = g32
    return bucket, held


# batch-size arguments unspecialised (docs/kernels.md, "One compile per config")
@triton.jit(do_not_specialize=["R", "MAX_PADDED", "NUM_BLOCKS"])
def moe_align_block_size_kernel(
    ids_ptr,  # int32/int64 [R] global expert ids (topk_ids flattened)
    map_ptr,  # int32/int64 [E] global -> local expert, -1 = not held (HAS_MAP)
    sorted_ptr,  # int32 [MAX_PADDED] out: route indices grouped by expert, sentinel R
    expert_ids_ptr,  # int32 [NUM_BLOCKS] out: local expert of each block, -1 past the total
    total_ptr,  # int32 [1] out: rows in use
    run_ptr,  # int32 [E_PAD] scratch: running per-expert destinations (not ONEHOT)
    held_ptr,  # int8 [R] out: 1 where the route's expert is held, else 0 (HAS_HELD)
    R,  # routes (T * k)
    E,  # num_experts
    BM,  # block_m
    MAX_PADDED,  # R + E * (BM - 1)
    NUM_BLOCKS,  # ceil(MAX_PADDED / BM)
    HAS_MAP: tl.constexpr,
    HAS_HELD: tl.constexpr,
    ONEHOT: tl.constexpr,
    E_PAD: tl.constexpr,  # power of two >= E
    RANK_C: tl.constexpr,  # routes per chunk in phase 3
    HIST_C: tl.constexpr,  # routes per chunk in phase 1
    FILL_C: tl.constexpr,  # positions / blocks per chunk of the fills (phases 2 and 4)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (lutb_kernels._pdl_details)
):
    pdl_prologue(PDL)
    e_idx = tl.arange(0, E_PAD)

    # 1. count the held routes of every expert
    counts = tl.full((E_PAD,), 0, tl.int32)
    for start in range(0, R, HIST_C):
        offs = start + tl.arange(0, HIST_C)
        bucket, held = _route_buckets(ids_ptr, map_ptr, offs, R, E, HAS_MAP)
        counts += tl.histogram(bucket, E_PAD, mask=held)
        if HAS_HELD:
            tl.store(held_ptr + offs, held.to(tl.int8), mask=offs < R)

    # 2. padded layout, total, sentinel fill
    padded = (counts + BM - 1) // BM * BM
    padded_end = tl.associative_scan(padded, 0, _sum)
    padded_start = padded_end - padded
    total = tl.reduce(padded, 0, _sum)
    tl.store(total_ptr, total)
    sentinel = tl.full((FILL_C,), 0, tl.int32) + R
    for start in range(0, MAX_PADDED, FILL_C):
        offs = start + tl.arange(0, FILL_C)
        tl.store(sorted_ptr + offs, sentinel, mask=offs < MAX_PADDED)
    if not ONEHOT:
        tl.store(run_ptr + e_idx, padded_start)
    tl.debug_barrier()  # the sentinel (and the counters) before any route is placed

    # 3. place every held route at padded_start[e] + (its rank among the routes of e)
    ci = tl.arange(0, RANK_C)
    if ONEHOT:
        run = padded_start
        for start in range(0, R, RANK_C):
            offs = start + ci
            bucket, held = _route_buckets(ids_ptr, map_ptr, offs, R, E, HAS_MAP)
            hot = ((bucket[:, None] == e_idx[None, :]) & held[:, None]).to(tl.int32)  # [C, E_PAD]
            upto = tl.associative_scan(hot, 0, _sum)  # routes of e among offs[0..i]
            dest = tl.reduce(hot * (run[None, :] + upto - 1), 1, _sum)
            tl.store(sorted_ptr + dest, offs, mask=held)
            run += tl.reduce(hot, 0, _sum)
    else:
        for start in range(0, R, RANK_C):
            offs = start + ci
            bucket, held = _route_buckets(ids_ptr, map_ptr, offs, R, E, HAS_MAP)
            base = tl.load(run_ptr + bucket, mask=held, other=0)
            tl.debug_barrier()  # every thread has read the counters before any is written back
            same = (bucket[:, None] == bucket[None, :]) & held[:, None] & held[None, :]  # [C, C]
            rank = tl.reduce((same & (ci[None, :] < ci[:, None])).to(tl.int32), 1, _sum)
            n_same = tl.reduce(same.to(tl.int32), 1, _sum)
            tl.store(sorted_ptr + base + rank, offs, mask=held)
            tl.store(run_ptr + bucket, base + n_same, mask=held & (rank == n_same - 1))
            tl.debug_barrier()  # the counters are written back before the next chunk reads them

    # 4. expert e owns blocks padded_start[e] / BM .. padded_end[e] / BM - 1 (ranges disjoint); -1 after
    used = total // BM
    first_block = padded_start // BM
    own_blocks = padded // BM
    for j in range(0, (R + BM - 1) // BM):  # an expert holds at most ceil(R / BM) blocks
        tl.store(expert_ids_ptr + first_block + j, e_idx, mask=j < own_blocks)
    no_expert = tl.full((FILL_C,), -1, tl.int32)
    for start in range(used, NUM_BLOCKS, FILL_C):
        blk = start + tl.arange(0, FILL_C)
        tl.store(expert_ids_ptr + blk, no_expert, mask=blk < NUM_BLOCKS)
