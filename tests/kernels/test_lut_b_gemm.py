"""lut_b_moe_gemm on the GPU: both decoders, several configs, vs the torch reference (outputs poisoned)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lutb_kernels.lut_b_gemm import LutBGemmConfig, lut_b_moe_gemm, lut_b_moe_gemm_reference, random_tiles
from lutb_kernels.reference import rel_l2
from lutb_kernels.routing import moe_align_block_size
from lutb_kernels.tiles import to_kernel_layout, tiles_to_dense

pytestmark = pytest.mark.gpu


def _routing(tokens, top_k, experts, held, block):  # noqa: ANN001, ANN202
    ids = torch.rand(tokens, experts).topk(top_k, dim=1).indices.to(torch.int32).cuda()
    emap = None
    if held is not None:
        emap = torch.full((experts,), -1, dtype=torch.int32)
        emap[torch.tensor(held)] = torch.arange(len(held), dtype=torch.int32)
        emap = emap.cuda()
    return ids, emap, moe_align_block_size(ids, block, experts, emap)


CONFIGS = [
    LutBGemmConfig(block_m=16, block_n=128, split_k=4, swap_ab=True, decoder="prmt", groups_per_step=1),
    LutBGemmConfig(block_m=64, block_n=128, split_k=1, swap_ab=True, decoder="prmt", groups_per_step=1),
    LutBGemmConfig(block_m=128, block_n=128, split_k=1, swap_ab=True, decoder="prmt", num_warps=8, groups_per_step=1),
    LutBGemmConfig(block_m=128, block_n=64, split_k=2, swap_ab=True, decoder="prmt", groups_per_step=2),
    LutBGemmConfig(block_m=16, block_n=64, split_k=1, swap_ab=True, decoder="prmt"),
    LutBGemmConfig(block_m=16, block_n=32, split_k=4, swap_ab=True, decoder="prmt"),
    LutBGemmConfig(block_m=16, block_n=128, split_k=2, swap_ab=False, decoder="prmt", num_warps=4),
    LutBGemmConfig(block_m=64, block_n=128, split_k=1, swap_ab=False, decoder="prmt"),
    LutBGemmConfig(block_m=128, block_n=128, split_k=1, swap_ab=False, decoder="prmt", num_warps=8),
    # the per-tile K loop (the defaults), with store-based split-K, register prefetch, other tilings
    LutBGemmConfig(block_m=16, block_n=128, split_k=4, swap_ab=True, decoder="prmt", groups_per_step=1, tile_loop=True),
    LutBGemmConfig(block_m=16, block_n=128, split_k=2, swap_ab=True, decoder="prmt", groups_per_step=1, tile_loop=True, maxnreg=80),
    # a deep decode grid's default (DECODE_WIDE_GRID_MAXNREG), unsplit
    LutBGemmConfig(block_m=16, block_n=128, split_k=1, swap_ab=True, decoder="prmt", groups_per_step=1, tile_loop=True, maxnreg=96),
    LutBGemmConfig(block_m=16, block_n=64, split_k=3, swap_ab=True, decoder="prmt", groups_per_step=1, tile_loop=True, prefetch=True),
    LutBGemmConfig(block_m=16, block_n=32, split_k=1, swap_ab=True, decoder="prmt", num_warps=2, groups_per_step=1, tile_loop=True),
    LutBGemmConfig(block_m=32, block_n=128, split_k=2, swap_ab=True, decoder="prmt", num_stages=4, groups_per_step=1, tile_loop=True),
    LutBGemmConfig(block_m=64, block_n=128, split_k=1, swap_ab=True, decoder="prmt", groups_per_step=1, tile_loop=True),
    LutBGemmConfig(block_m=128, block_n=128, split_k=1, swap_ab=True, decoder="prmt", num_warps=8, groups_per_step=1, tile_loop=True),
    LutBGemmConfig(block_m=128, block_n=64, split_k=1, swap_ab=False, decoder="prmt", num_warps=4, groups_per_step=1, tile_loop=True),
    LutBGemmConfig(block_m=16, block_n=64, split_k=2, swap_ab=True, decoder="triton", groups_per_step=1, tile_loop=True),
    # the tile loop unrolled (the defaults' unroll=2), with split-K leaving odd tile counts per split
    LutBGemmConfig(block_m=16, block_n=128, split_k=3, swap_ab=True, decoder="prmt", groups_per_step=1, tile_loop=True, unroll=2),
    LutBGemmConfig(block_m=16, block_n=128, split_k=1, swap_ab=True, decoder="prmt", groups_per_step=1, tile_loop=True, unroll=4),
    LutBGemmConfig(block_m=64, block_n=128, split_k=1, swap_ab=True, decoder="prmt", groups_per_step=1, tile_loop=True, unroll=2),
    LutBGemmConfig(block_m=128, block_n=128, split_k=1, swap_ab=True, decoder="prmt", num_warps=8, groups_per_step=1, tile_loop=True,
                   unroll=2),
    LutBGemmConfig(block_m=16, block_n=64, split_k=2, swap_ab=True, decoder="triton", groups_per_step=1, tile_loop=True, unroll=2),
    LutBGemmConfig(block_m=16, block_n=64, split_k=2, swap_ab=True, decoder="triton"),
    LutBGemmConfig(block_m=64, block_n=64, split_k=1, swap_ab=False, decoder="triton"),
    # stream-K grids (the decode default: 4 programs per SM, 128 registers), short and long runs
    LutBGemmConfig(block_m=16, block_n=128, split_k=4, swap_ab=True, decoder="prmt", groups_per_step=1, tile_loop=True,
                   stream_k=4, maxnreg=128),
    LutBGemmConfig(block_m=16, block_n=64, split_k=1, swap_ab=True, decoder="prmt", groups_per_step=1, tile_loop=True,
                   stream_k=1),
    LutBGemmConfig(block_m=32, block_n=128, split_k=8, swap_ab=True, decoder="prmt", groups_per_step=1, tile_loop=True,
                   stream_k=2, unroll=2),
]
# every "prmt" config again with "prmt2" (the same values bit for bit, fewer instructions)
CONFIGS += [replace(c, decoder="prmt2") for c in CONFIGS if c.decoder == "prmt"]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("tokens,top_k,experts,held,n,k,dtype,order", [
    (1, 2, 4, None, 256, 512, torch.bfloat16, "decoder"),
    (37, 2, 8, [1, 2, 5], 512, 1024, torch.bfloat16, "natural"),
    (300, 4, 8, None, 256, 768, torch.float32, "decoder"),
])
def test_lut_b_moe_gemm_gpu(config, tokens, top_k, experts, held, n, k, dtype, order) -> None:  # noqa: ANN001
    from lutb_kernels import mxfp8_triton as mt

    block = max(16, config.block_m)
    e_local = len(held) if held is not None else experts
    w = random_tiles((e_local, n // 128, k // 128), k=k, device="cuda")
    x = torch.randn(tokens, k, device="cuda").to(dtype)
    q, s = mt.mxfp8_quantize(x, k_order=order)
    ids, emap, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, held, block)
    tw = torch.rand(tokens, top_k, device="cuda")
    out = torch.full((tokens * top_k, n), float("nan"), dtype=dtype, device="cuda")
    ref = out.clone()
    lut_b_moe_gemm(q, s, w, out, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=block, a_k_order=order, config=config)
    lut_b_moe_gemm_reference(q, s, w, ref, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=block, a_k_order=order)
    routed = torch.ones(tokens * top_k, dtype=torch.bool, device="cuda") if emap is None else (emap[ids.long()] >= 0).reshape(-1)
    assert not out[routed].isnan().any(), "a routed row was not written"
    assert out[~routed].isnan().all(), "a row of an expert not held was touched"
    assert rel_l2(out[routed], ref[routed]) < (1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("decoder", ["prmt", "prmt2", "triton"])
def test_decoder_exact(decoder: str) -> None:
    """One-hot activations read single weights back: the decode must be exact."""
    from lutb_kernels import mxfp8_triton as mt

    w = random_tiles((1, 2, 1), k=128, device="cuda")
    x = torch.eye(128, device="cuda")
    q, s = mt.mxfp8_quantize(x, k_order="decoder")
    ids = torch.zeros(128, 1, dtype=torch.int32, device="cuda")
    sorted_ids, expert_ids, ntpp = moe_align_block_size(ids, 128, 1)
    out = torch.full((128, 256), float("nan"), device="cuda")
    cfg = LutBGemmConfig(block_m=128, block_n=64, decoder=decoder)  # type: ignore[arg-type]
    lut_b_moe_gemm(q, s, w, out, None, sorted_ids, expert_ids, ntpp, 1, block_m=128, a_k_order="decoder", config=cfg)
    assert torch.equal(out, tiles_to_dense(w[0]).T.contiguous())


@pytest.mark.parametrize("block", [16, 64, 128, 256])
def test_dequantized_bf16_a_gpu(block: int) -> None:
    """``a_scales=None``: bf16 MXFP8 values in decoder order give the reference's result."""
    from lutb_kernels import mxfp8_triton as mt

    tokens, top_k, experts, n, k = 200, 2, 4, 256, 1024
    w = random_tiles((experts, n // 128, k // 128), k=k, device="cuda")
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    a = mt.mxfp8_qdq(x, k_order="decoder", out_dtype=torch.bfloat16)
    q, s = mt.mxfp8_quantize(x, k_order="decoder")
    _, _, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, None, block)
    out = torch.full((tokens * top_k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ref = out.clone()
    lut_b_moe_gemm(a, None, w, out, None, sorted_ids, expert_ids, ntpp, top_k, block_m=block, a_k_order="decoder")
    lut_b_moe_gemm_reference(q, s, w, ref, None, sorted_ids, expert_ids, ntpp, top_k, block_m=block, a_k_order="decoder")
    assert rel_l2(out, ref) < 5e-3


@pytest.mark.parametrize("unroll", [1, 2, 4])
@pytest.mark.parametrize("k_tiles,split_k", [(1, 1), (3, 1), (5, 1), (7, 1), (7, 2), (6, 4)])
def test_unrolled_k_loop_any_tile_count(unroll: int, k_tiles: int, split_k: int) -> None:
    """The unrolled per-tile K loop over tile counts that are not a multiple of the unroll (its remainder
    iterations), alone and per split; bf16 activations, prmt2, outputs poisoned."""
    from lutb_kernels import mxfp8_triton as mt

    tokens, top_k, experts, n, k = 3, 2, 4, 256, 128 * k_tiles
    w = random_tiles((experts, n // 128, k_tiles), k=k, device="cuda")
    x = torch.randn(tokens, k, device="cuda").to(torch.bfloat16)
    q, s = mt.mxfp8_quantize(x, k_order="decoder")
    ids, _, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, None, 16)
    tw = torch.rand(tokens, top_k, device="cuda")
    out = torch.full((tokens * top_k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ref = out.clone()
    config = LutBGemmConfig(block_m=16, block_n=128, split_k=split_k, swap_ab=True, decoder="prmt2", groups_per_step=1,
                            tile_loop=True, unroll=unroll)
    lut_b_moe_gemm(q, s, w, out, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16, a_k_order="decoder", config=config)
    lut_b_moe_gemm_reference(q, s, w, ref, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16, a_k_order="decoder")
    assert not out.isnan().any()
    assert rel_l2(out, ref) < 5e-3


@pytest.mark.parametrize("tokens,route_block,block_m,per_sm,split_k,k_tiles", [
    (1, 16, 16, 4, 8, 8),  # runs of one tile: a unit meets 8 programs, most programs idle
    (3, 32, 16, 4, 2, 7),  # two sub-blocks per routing block, odd tile count
    (40, 16, 16, 1, 1, 5),  # more work than programs: runs of many units
    (64, 64, 16, 2, 4, 12),
])
def test_stream_k_any_work_split(tokens: int, route_block: int, block_m: int, per_sm: int, split_k: int,
                                 k_tiles: int) -> None:
    """Stream-K runs that start and end inside units, units met by several programs, idle programs, sub-blocks:
    the result matches the reference and only routed rows are written (prmt2, bf16, outputs poisoned)."""
    from lutb_kernels import mxfp8_triton as mt

    top_k, experts, n, k = 2, 6, 384, 128 * k_tiles
    w = random_tiles((experts, n // 128, k_tiles), k=k, device="cuda")
    x = torch.randn(tokens, k, device="cuda").to(torch.bfloat16)
    q, s = mt.mxfp8_quantize(x, k_order="decoder")
    ids, _, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, None, route_block)
    tw = torch.rand(tokens, top_k, device="cuda")
    out = torch.full((tokens * top_k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ref = out.clone()
    config = LutBGemmConfig(block_m=block_m, block_n=128, split_k=split_k, swap_ab=True, decoder="prmt2",
                            groups_per_step=1, tile_loop=True, stream_k=per_sm, maxnreg=128)
    lut_b_moe_gemm(q, s, w, out, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=route_block, a_k_order="decoder",
                   config=config)
    lut_b_moe_gemm_reference(q, s, w, ref, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=route_block,
                             a_k_order="decoder")
    assert not out.isnan().any()
    assert rel_l2(out, ref) < 5e-3


@pytest.mark.parametrize("stream_k,split_k", [(0, 2), (0, 8), (4, 4), (4, 16)])
def test_split_k_is_deterministic(stream_k: int, split_k: int) -> None:
    """Split-K sums the slices in slice order (stream-K: the unit's last program, whatever order the programs
    finish in; plain grids: a second launch): ten launches give the same bits, match the reference, and leave
    the shared counters all zero."""
    from lutb_kernels import mxfp8_triton as mt

    tokens, top_k, experts, n, k = 5, 8, 64, 2048, 2048
    w = to_kernel_layout(random_tiles((experts, n // 128, k // 128), k=k, device="cuda"))
    x = torch.randn(tokens, k, device="cuda").to(torch.bfloat16)
    a = mt.mxfp8_qdq(x, k_order="decoder", out_dtype=torch.bfloat16)
    q, s = mt.mxfp8_quantize(x, k_order="decoder")
    _, _, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, None, 16)
    tw = torch.rand(tokens, top_k, device="cuda")
    counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    config = LutBGemmConfig(block_m=16, block_n=128, split_k=split_k, swap_ab=True, decoder="prmt2", groups_per_step=1,
                            tile_loop=True, stream_k=stream_k, maxnreg=128 if stream_k else None)
    outs = []
    for _ in range(10):
        out = torch.full((tokens * top_k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        lut_b_moe_gemm(a, None, w, out, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16, a_k_order="decoder",
                       config=config, kernel_layout=True, split_k_counters=counters)
        outs.append(out)
    ref = torch.full_like(outs[0], float("nan"))
    lut_b_moe_gemm_reference(q, s, w, ref, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16, a_k_order="decoder",
                             kernel_layout=True)
    assert not outs[0].isnan().any()
    assert rel_l2(outs[0], ref) < 5e-3
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), "split-K results differ between launches"
    assert not counters.any(), "a split-K counter was left non-zero"


@pytest.mark.parametrize("decoder", ["prmt2", "prmt", "triton"])
@pytest.mark.parametrize("tokens,stream_k,block_n", [(1, 0, 128), (1, 4, 128), (37, 0, 64), (37, 2, 128)])
def test_kernel_layout_gives_the_same_bits(decoder: str, tokens: int, stream_k: int, block_n: int) -> None:
    """``kernel_layout=True`` on ``to_kernel_layout(w)`` gives the output of ``w`` bit for bit (same config otherwise),
    on the plain and the stream-K grid, for every decoder; on checkpoint-layout tiles it does not (the test can tell the
    layouts apart)."""
    from lutb_kernels import mxfp8_triton as mt

    top_k, experts, n, k = 2, 8, 256, 1024
    w = random_tiles((experts, n // 128, k // 128), k=k, device="cuda", scale_jitter=3)
    x = torch.randn(tokens, k, device="cuda").to(torch.bfloat16)
    a = mt.mxfp8_qdq(x, k_order="decoder", out_dtype=torch.bfloat16)
    _, _, routing = _routing(tokens, top_k, experts, None, 16)
    outs = []
    for tiles, rotated in ((w, False), (to_kernel_layout(w), True), (w, True)):
        out = torch.full((tokens * top_k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        cfg = LutBGemmConfig(block_m=16, block_n=block_n, split_k=2, swap_ab=True, decoder=decoder, groups_per_step=1,
                             tile_loop=True, stream_k=stream_k, maxnreg=128 if stream_k else None)
        lut_b_moe_gemm(a, None, tiles, out, None, *routing, top_k, block_m=16, a_k_order="decoder", config=cfg,
                       kernel_layout=rotated)
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert not torch.equal(outs[0].view(torch.int16), outs[2].view(torch.int16))
