"""One-launch Triton moe_align_block_size on the GPU: equal to the torch one, also inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from lutb_kernels.routing import max_padded_routes, moe_align_block_size

pytestmark = pytest.mark.gpu

POISON = -123456789
CASES = [(t, k, e) for t in (0, 1, 7, 33, 300) for k in (1, 2, 8) for e in (3, 8, 64, 256)] + [(8192, 8, 256), (8192, 2, 8)]


def _inputs(tokens: int, top_k: int, experts: int, seed: int, *, skewed: bool, sharded: bool):
    gen = torch.Generator().manual_seed(seed)
    if skewed:
        ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
        ids[torch.rand(tokens, top_k, generator=gen) < 0.9] = int(torch.randint(0, experts, (1,), generator=gen))
    else:
        k = min(top_k, experts)
        ids = torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices
        ids = torch.cat([ids, torch.randint(0, experts, (tokens, top_k - k), generator=gen)], dim=1)
    emap = None
    if sharded:
        held = torch.randperm(experts, generator=gen)[: int(torch.randint(0, experts + 1, (1,), generator=gen))]
        emap = torch.full((experts,), -1, dtype=torch.int32)
        emap[held] = torch.randperm(held.numel(), generator=gen).to(torch.int32)
        emap = emap.cuda()
    return ids.to(torch.int32).cuda(), emap


def _poisoned(num_routes: int, block_m: int, experts: int):
    n = max_padded_routes(num_routes, block_m, experts)
    return (torch.full((n,), POISON, dtype=torch.int32, device="cuda"),
            torch.full((-(-n // block_m),), POISON, dtype=torch.int32, device="cuda"),
            torch.full((1,), POISON, dtype=torch.int32, device="cuda"))


def _assert_equal(got, ref) -> None:
    for name, g, r in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, ref):
        assert g.dtype == r.dtype == torch.int32 and g.shape == r.shape, name
        assert torch.equal(g, r), (name, (g != r).nonzero()[:8].flatten().tolist())


@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("tokens,top_k,experts", CASES)
def test_matches_torch_gpu(tokens: int, top_k: int, experts: int, skewed: bool) -> None:
    from lutb_kernels.routing_triton import moe_align_block_size_triton

    for block_m in (16, 64, 128):
        for sharded in (False, True):
            ids, emap = _inputs(tokens, top_k, experts, tokens + top_k + experts + block_m, skewed=skewed, sharded=sharded)
            ref_held = torch.rand(tokens, top_k, device="cuda") < 0.5  # poison: every flag must be written
            ref = moe_align_block_size(ids, block_m, experts, emap, held_out=ref_held)
            out = _poisoned(ids.numel(), block_m, experts)
            held = ~ref_held
            _assert_equal(moe_align_block_size_triton(ids, block_m, experts, emap, out=out, held_out=held), ref)
            assert torch.equal(held, ref_held)
            assert torch.equal(held, emap.long()[ids.long()] >= 0 if emap is not None else torch.ones_like(held))
            if block_m == 16:  # int64 ids, the op's own allocation (fewer compiled variants)
                _assert_equal(moe_align_block_size_triton(ids.long(), block_m, experts, emap), ref)


def _replays_match(align, tokens: int, top_k: int, experts: int, block_m: int, seeds: tuple[int, ...]) -> None:
    """Capture ``align(static_ids, emap, out)`` once (after one call outside the capture: compile, allocator), then
    replay it on new routings written into the same input buffer, into poisoned outputs, against the torch op."""
    ids, emap = _inputs(tokens, top_k, experts, 1, skewed=False, sharded=True)
    static_ids = ids.clone()
    out = _poisoned(ids.numel(), block_m, experts)
    align(static_ids, emap, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        align(static_ids, emap, out)
    for seed in seeds:
        new_ids, _ = _inputs(tokens, top_k, experts, seed, skewed=seed == 3, sharded=False)
        static_ids.copy_(new_ids)
        for t in out:
            t.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        _assert_equal(out, moe_align_block_size(new_ids, block_m, experts, emap))


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 8, 256, 16), (33, 2, 8, 16), (8192, 8, 256, 128)])
def test_cuda_graph_gpu(tokens: int, top_k: int, experts: int, block_m: int) -> None:
    from lutb_kernels.routing_triton import moe_align_block_size_triton

    _replays_match(lambda ids, emap, out: moe_align_block_size_triton(ids, block_m, experts, emap, out=out),
                   tokens, top_k, experts, block_m, seeds=(2, 3, 4))


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(33, 2, 8, 16), (8192, 8, 256, 128)])
def test_torch_routing_in_a_cuda_graph_gpu(tokens: int, top_k: int, experts: int, block_m: int) -> None:
    """The torch op captures too (the experts use it above the Triton op's sizes, and bench/kernels.py's bf16 peer at
    every size); a host copy in it made every such capture fail."""
    held = torch.zeros(tokens, top_k, dtype=torch.bool, device="cuda")
    _replays_match(lambda ids, emap, out: moe_align_block_size(ids, block_m, experts, emap, out=out, held_out=held),
                   tokens, top_k, experts, block_m, seeds=(2, 3))
