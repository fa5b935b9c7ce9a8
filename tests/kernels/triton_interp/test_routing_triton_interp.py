"""One-launch Triton moe_align_block_size vs the torch one (lutb_kernels.routing), CPU interpreter.

Every output element is compared (outputs preallocated and poisoned), including the order of
the routes inside each expert's run (both are stable).
"""

from __future__ import annotations

import re

import pytest
import torch
from lutb_kernels.routing import max_padded_routes, moe_align_block_size
from lutb_kernels.routing_triton import moe_align_block_size_triton, routing_launch

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # triton interpreter

POISON = -123456789


def _ids(tokens: int, top_k: int, experts: int, gen: torch.Generator, *, skewed: bool, dtype: torch.dtype) -> torch.Tensor:
    if skewed:  # ~90% of the routes to one expert, the rest anywhere (repeats within a token allowed)
        ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
        hot = torch.rand(tokens, top_k, generator=gen) < 0.9
        ids[hot] = int(torch.randint(0, experts, (1,), generator=gen))
    else:  # distinct experts per token, as a router gives
        k = min(top_k, experts)
        ids = torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices
        if k < top_k:
            ids = torch.cat([ids, torch.randint(0, experts, (tokens, top_k - k), generator=gen)], dim=1)
    return ids.to(dtype)


def _map(experts: int, gen: torch.Generator, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A random subset of the experts held (possibly none), numbered in a random local order."""
    held = torch.randperm(experts, generator=gen)[: int(torch.randint(0, experts + 1, (1,), generator=gen))]
    emap = torch.full((experts,), -1, dtype=dtype)
    emap[held] = torch.randperm(held.numel(), generator=gen).to(dtype)
    return emap


def _poisoned_out(num_routes: int, block_m: int, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max_padded_routes(num_routes, block_m, experts)
    return (torch.full((n,), POISON, dtype=torch.int32), torch.full((-(-n // block_m),), POISON, dtype=torch.int32),
            torch.full((1,), POISON, dtype=torch.int32))


def _held_by_hand(ids: torch.Tensor, experts: int, emap: torch.Tensor | None) -> list[bool]:
    return [0 <= e < experts and (emap is None or int(emap[e]) >= 0) for e in ids.reshape(-1).tolist()]


def _check(ids: torch.Tensor, block_m: int, experts: int, emap: torch.Tensor | None) -> None:
    ref = moe_align_block_size(ids, block_m, experts, emap)
    out = _poisoned_out(ids.numel(), block_m, experts)
    held = torch.rand(ids.shape) < 0.5  # poison: every route's flag must be written
    got = moe_align_block_size_triton(ids, block_m, experts, emap, out=out, held_out=held)
    assert all(g is o for g, o in zip(got, out))
    assert held.reshape(-1).tolist() == _held_by_hand(ids, experts, emap)
    for name, g, r in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, ref):
        assert g.dtype == r.dtype == torch.int32 and g.shape == r.shape, name
        assert torch.equal(g, r), (name, (g != r).nonzero()[:8].flatten().tolist())
    fresh = moe_align_block_size_triton(ids, block_m, experts, emap)  # the op's own allocation
    assert all(torch.equal(f, r) for f, r in zip(fresh, ref))
    out = _poisoned_out(ids.numel(), block_m, experts)  # the torch op fills out= the same way
    assert all(g is o for g, o in zip(moe_align_block_size(ids, block_m, experts, emap, out=out), out))
    assert all(torch.equal(o, r) for o, r in zip(out, ref))


@pytest.mark.parametrize("experts", [3, 8, 64, 256])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("tokens", [0, 1, 7, 33, 300])
def test_matches_torch(tokens: int, top_k: int, experts: int) -> None:
    gen = torch.Generator().manual_seed(1000 * tokens + 10 * top_k + experts)
    for block_m in (16, 64, 128):
        for sharded in (False, True):
            ids = _ids(tokens, top_k, experts, gen, skewed=False, dtype=torch.int32)
            _check(ids, block_m, experts, _map(experts, gen) if sharded else None)


@pytest.mark.parametrize("experts,block_m", [(8, 16), (64, 64), (256, 16), (256, 128)])
@pytest.mark.parametrize("tokens,top_k", [(1, 8), (300, 2), (300, 8)])
def test_skewed_routing(tokens: int, top_k: int, experts: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(tokens + experts + block_m)
    ids = _ids(tokens, top_k, experts, gen, skewed=True, dtype=torch.int32)
    _check(ids, block_m, experts, None)
    emap = _map(experts, gen)
    emap[ids.flatten()[0]] = experts - 1  # the hot expert (usually) held, as the last local expert
    _check(ids, block_m, experts, emap)


@pytest.mark.parametrize("experts", [8, 256])
def test_int64_ids_and_map(experts: int) -> None:
    gen = torch.Generator().manual_seed(experts)
    ids = _ids(57, 4, experts, gen, skewed=False, dtype=torch.int64)
    _check(ids, 32, experts, None)
    _check(ids, 32, experts, _map(experts, gen, torch.int64))


def test_several_chunks_both_modes() -> None:
    """More routes than one chunk holds, in both placement modes (one-hot and pairwise)."""
    gen = torch.Generator().manual_seed(5)
    for experts in (16, 128):
        for tokens in (700, 1500):
            launch = routing_launch(tokens * 2, experts, max_padded_routes(tokens * 2, 16, experts), 0)
            assert tokens * 2 > launch.rank_chunk and tokens * 2 > launch.hist_chunk
            ids = _ids(tokens, 2, experts, gen, skewed=False, dtype=torch.int32)
            _check(ids, 16, experts, None)
            _check(ids, 16, experts, _map(experts, gen))


def test_block_m_one_and_single_expert() -> None:
    gen = torch.Generator().manual_seed(9)
    _check(_ids(9, 2, 4, gen, skewed=False, dtype=torch.int32), 1, 4, None)
    _check(torch.zeros(5, 1, dtype=torch.int32), 16, 1, None)
    _check(torch.zeros(5, 1, dtype=torch.int32), 16, 1, torch.tensor([-1], dtype=torch.int32))


@pytest.mark.parametrize("align", [moe_align_block_size_triton, moe_align_block_size], ids=["triton", "torch"])
@pytest.mark.parametrize("mapped", [False, True])
def test_ids_out_of_range_get_no_rows(align, mapped: bool) -> None:  # noqa: ANN001
    """Ids outside [0, E) (-1: CudaGraphExperts' padding routes) get no rows and are not held, with or without a
    map: the kernel stays in bounds, and the torch op must not read the map's last entry for -1."""
    ids = torch.tensor([[0, 9], [-1, 2], [1, 3], [-1, -1]], dtype=torch.int32)  # 9, -1 and 3 are not experts of 3
    emap = torch.tensor([0, 1, 2], dtype=torch.int32) if mapped else None
    held = torch.ones(4, 2, dtype=torch.bool)
    sorted_ids, expert_ids, total = align(ids, 4, 3, emap, held_out=held)  # 8 + 3 * 3 = 17 rows, 5 blocks
    assert held.tolist() == [[True, False], [False, True], [True, False], [False, False]]
    assert int(total) == 12 and sorted_ids.numel() == 17
    assert sorted_ids[:12].tolist() == [0, 8, 8, 8, 4, 8, 8, 8, 3, 8, 8, 8]
    assert expert_ids.tolist() == [0, 1, 2, -1, -1]
    assert (sorted_ids[12:] == 8).all()


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("ids", [[[0, 0], [0, 0], [0, 0]], [[0, -1], [3, 1]], []], ids=["zeros", "any", "no-tokens"])
def test_no_experts_give_no_rows(ids: list[list[int]], mapped: bool) -> None:
    """num_experts = 0 (a map of no entries): no route is held or gets a row, both ops alike; the torch op used to
    index an empty per-expert table (IndexError) when any route was present."""
    topk_ids = torch.tensor(ids, dtype=torch.int32).reshape(-1, 2)
    num_routes = topk_ids.numel()
    emap = torch.zeros(0, dtype=torch.int32) if mapped else None
    results = []
    for align in (moe_align_block_size_triton, moe_align_block_size):
        out = _poisoned_out(num_routes, 16, 0)
        held = torch.ones(topk_ids.shape, dtype=torch.bool)
        got = align(topk_ids, 16, 0, emap, out=out, held_out=held)
        assert all(g is o for g, o in zip(got, out))
        assert not held.any()
        results.append([t.tolist() for t in got])
    assert results[0] == results[1] == [[num_routes] * num_routes, [-1] * -(-num_routes // 16), [0]]


@pytest.mark.parametrize("align", [moe_align_block_size_triton, moe_align_block_size], ids=["triton", "torch"])
def test_bad_out_and_held_out_refused_alike(align) -> None:  # noqa: ANN001
    """``out=`` and ``held_out=`` are checked by both ops, with the same messages, before anything is written."""
    ids = torch.zeros(2, 2, dtype=torch.int32)
    out = _poisoned_out(4, 16, 4)  # 4 + 4 * 15 = 64 rows, 4 blocks
    bad = [
        ({"held_out": torch.zeros(4, dtype=torch.int8)},
         "held_out must be a contiguous bool tensor of 4 elements on cpu, got torch.int8 (4,) on cpu"),
        ({"held_out": torch.zeros(3, dtype=torch.bool)},
         "held_out must be a contiguous bool tensor of 4 elements on cpu, got torch.bool (3,) on cpu"),
        ({"out": out[:2]}, "out must be a tuple (sorted_token_ids, expert_ids, num_tokens_post_padded)"),
        ({"out": list(out)}, "out must be a tuple (sorted_token_ids, expert_ids, num_tokens_post_padded)"),
        ({"out": (out[0], out[1][:-1], out[2])},
         "out expert_ids must be a contiguous int32 [4] tensor on cpu, got torch.int32 (3,) on cpu"),
        ({"out": (out[0].long(), out[1], out[2])},
         "out sorted_token_ids must be a contiguous int32 [64] tensor on cpu, got torch.int64 (64,) on cpu"),
        ({"out": (out[0], out[1], out[2].reshape(1, 1))},
         "out num_tokens_post_padded must be a contiguous int32 [1] tensor on cpu, got torch.int32 (1, 1) on cpu"),
        ({"out": (torch.full((128,), POISON, dtype=torch.int32)[::2], out[1], out[2])},
         "out sorted_token_ids must be a contiguous int32 [64] tensor on cpu, got torch.int32 (64,) on cpu"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            align(ids, 16, 4, **kwargs)
    assert all((t == POISON).all() for t in out)


def test_bad_arguments_refused() -> None:
    ids = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_align_block_size_triton(ids.float(), 16, 4)
    with pytest.raises(ValueError, match="held_out"):
        moe_align_block_size_triton(ids, 16, 4, held_out=torch.zeros(4, dtype=torch.int8))
    with pytest.raises(ValueError, match="held_out"):
        moe_align_block_size_triton(ids, 16, 4, held_out=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="block_m"):
        moe_align_block_size_triton(ids, 0, 4)
    with pytest.raises(ValueError, match="expert_map"):
        moe_align_block_size_triton(ids, 16, 4, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="expert_map"):
        moe_align_block_size_triton(ids, 16, 4, torch.zeros(4))
    out = _poisoned_out(4, 16, 4)
    with pytest.raises(ValueError, match="expert_ids"):
        moe_align_block_size_triton(ids, 16, 4, out=(out[0], out[1][:-1], out[2]))
    with pytest.raises(ValueError, match="sorted_token_ids"):
        moe_align_block_size_triton(ids, 16, 4, out=(out[0].long(), out[1], out[2]))
