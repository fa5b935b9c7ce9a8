"""lut_b_moe_gemm and the dense grouped GEMM vs their torch references (CPU interpreter, pure-Triton decoder)."""

from __future__ import annotations

import pytest
import torch

from lutb_kernels import mxfp8_triton as mt
from lutb_kernels.grouped_gemm import (
    GroupedGemmConfig,
    grouped_gemm,
    grouped_gemm_reference,
    moe_combine,
    moe_combine_reference,
)
from lutb_kernels.lut_b_gemm import LutBGemmConfig, lut_b_moe_gemm, lut_b_moe_gemm_reference, random_tiles
from lutb_kernels.reference import rel_l2
from lutb_kernels.routing import moe_align_block_size
from lutb_kernels.tiles import to_kernel_layout

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # triton interpreter



def _routing(tokens: int, top_k: int, experts: int, held: list[int] | None, block: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32) if tokens else torch.zeros(0, top_k, dtype=torch.int32)
    emap = None
    if held is not None:
        emap = torch.full((experts,), -1, dtype=torch.int32)
        emap[torch.tensor(held)] = torch.arange(len(held), dtype=torch.int32)
    return ids, emap, moe_align_block_size(ids, block, experts, emap)


CASES = [
    # tokens, top_k, experts, held, out dtype, weights, split_k, swap, order, block
    (5, 2, 3, None, torch.float32, True, 1, False, "natural", 16),
    (5, 2, 3, None, torch.float16, False, 2, True, "decoder", 16),
    (17, 1, 4, [1, 3], torch.float32, True, 1, True, "decoder", 32),
    (1, 2, 4, [0, 2], torch.float16, True, 2, False, "natural", 16),
    (0, 2, 3, None, torch.float32, True, 1, False, "natural", 16),
]


@pytest.mark.parametrize("tokens,top_k,experts,held,dtype,weighted,split_k,swap,order,block", CASES)
def test_lut_b_moe_gemm(tokens, top_k, experts, held, dtype, weighted, split_k, swap, order, block) -> None:  # noqa: ANN001
    n, k = 128, 256
    e_local = len(held) if held is not None else experts
    gen = torch.Generator().manual_seed(tokens * 7 + top_k)
    w = random_tiles((e_local, n // 128, k // 128), k=k, generator=gen)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    q, s = mt.mxfp8_quantize(x, k_order=order)
    ids, emap, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, held, block, seed=tokens)
    tw = torch.rand(tokens, top_k, generator=gen) if weighted else None
    out = torch.full((tokens * top_k, n), float("nan"), dtype=dtype)
    ref = out.clone()
    cfg = LutBGemmConfig(block_m=16, block_n=64, split_k=split_k, swap_ab=swap, decoder="triton", num_stages=1,
                         groups_per_step=1 if swap else 4)
    lut_b_moe_gemm(q, s, w, out, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=block, a_k_order=order, config=cfg)
    lut_b_moe_gemm_reference(q, s, w, ref, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=block, a_k_order=order)
    routed = torch.ones(tokens * top_k, dtype=torch.bool) if emap is None else (emap[ids.long()] >= 0).reshape(-1)
    assert not out[routed].isnan().any(), "a routed row was not written"
    assert out[~routed].isnan().all(), "a row of an expert not held was touched"
    if routed.any():
        assert rel_l2(out[routed], ref[routed]) < (1e-5 if dtype == torch.float32 else 2e-3)


def test_lut_b_moe_gemm_refuses_bad_arguments() -> None:
    w = random_tiles((2, 1, 1), k=128)
    q, s = mt.mxfp8_quantize(torch.randn(3, 128))
    ids = torch.zeros(3, 1, dtype=torch.int32)
    st, ei, nt = moe_align_block_size(ids, 16, 2)
    out = torch.empty(3, 128)
    with pytest.raises(ValueError, match="block_m"):
        lut_b_moe_gemm(q, s, w, out, None, st, ei, nt, 1, block_m=32)  # routing aligned to 16
    with pytest.raises(ValueError, match="out"):
        lut_b_moe_gemm(q, s, w, torch.empty(2, 128), None, st, ei, nt, 1, block_m=16)
    with pytest.raises(ValueError, match="a_mxfp8"):
        lut_b_moe_gemm(q.float(), s, w, out, None, st, ei, nt, 1, block_m=16)
    with pytest.raises(ValueError, match="w_packed"):
        lut_b_moe_gemm(q, s, w[..., :-1], out, None, st, ei, nt, 1, block_m=16)
    with pytest.raises(ValueError, match="topk_weights"):
        lut_b_moe_gemm(q, s, w, out, torch.rand(2), st, ei, nt, 1, block_m=16)
    with pytest.raises(ValueError, match="positive multiple"):  # K = 0: no tile to give a program
        lut_b_moe_gemm(torch.zeros(3, 0), None, w[:, :, :0], out, None, st, ei, nt, 1, block_m=16)
    for regs in (16, 256):  # PTX .maxnreg outside what a thread can have
        with pytest.raises(ValueError, match="bad config"):
            lut_b_moe_gemm(q, s, w, out, None, st, ei, nt, 1, block_m=16,
                           config=LutBGemmConfig(block_m=16, block_n=64, decoder="triton", maxnreg=regs))
    for unroll in (0, 3):  # tiles per unrolled iteration: 1, 2 or 4
        with pytest.raises(ValueError, match="bad config"):
            lut_b_moe_gemm(q, s, w, out, None, st, ei, nt, 1, block_m=16,
                           config=LutBGemmConfig(block_m=16, block_n=64, decoder="triton", unroll=unroll))


@pytest.mark.parametrize("dtype,split_k,held", [(torch.float32, 1, None), (torch.float16, 2, [0, 2])])
def test_grouped_gemm_and_combine(dtype: torch.dtype, split_k: int, held: list[int] | None) -> None:
    tokens, top_k, experts, n, k = 9, 2, 3, 96, 128
    e_local = len(held) if held is not None else experts
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(e_local, n, k, generator=gen) / 11).to(dtype)
    a = torch.randn(tokens, k, generator=gen).to(dtype)
    ids, emap, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, held, 16, seed=4)
    tw = torch.rand(tokens, top_k, generator=gen)
    out = torch.full((tokens * top_k, n), float("nan"), dtype=dtype)
    ref = out.clone()
    cfg = GroupedGemmConfig(block_m=16, block_n=32, block_k=32, split_k=split_k, num_stages=1)
    grouped_gemm(a, w, out, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16, config=cfg)
    grouped_gemm_reference(a, w, ref, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16)
    routed = torch.ones(tokens * top_k, dtype=torch.bool) if emap is None else (emap[ids.long()] >= 0).reshape(-1)
    assert not out[routed].isnan().any() and out[~routed].isnan().all()
    assert rel_l2(out[routed], ref[routed]) < (1e-5 if dtype == torch.float32 else 2e-3)
    combined = moe_combine(out, routed, top_k)
    assert torch.equal(combined, moe_combine_reference(out, routed, top_k))
    if emap is None:  # a whole layer: no mask at all gives the same sums
        assert torch.equal(moe_combine(out, None, top_k), combined)
        assert torch.equal(moe_combine_reference(out, None, top_k), combined)


@pytest.mark.parametrize("split_k", [None, 1, 4])  # None: the default config
@pytest.mark.parametrize("held,weighted", [(None, True), ([0, 2], True), ([1], False)])
def test_grouped_gemm_of_k_zero_equals_the_reference(split_k: int | None, held: list[int] | None, weighted: bool) -> None:
    """K = 0: every routed, held row is an empty sum, 0 (times its weight: -0.0 for a negative one), as the reference
    writes; rows of routes not held are not touched. (Before, the K split divided by zero.)"""
    tokens, top_k, experts, n = 9, 2, 3, 48
    e_local = len(held) if held is not None else experts
    ids, emap, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, held, 16, seed=11)
    tw = torch.randn(tokens, top_k, generator=torch.Generator().manual_seed(12)) if weighted else None
    a, w = torch.zeros(tokens, 0, dtype=torch.float16), torch.zeros(e_local, n, 0, dtype=torch.float16)
    out = torch.full((tokens * top_k, n), float("nan"), dtype=torch.float16)
    ref = out.clone()
    cfg = None if split_k is None else GroupedGemmConfig(block_m=16, block_n=32, block_k=32, split_k=split_k, num_stages=1)
    assert grouped_gemm(a, w, out, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16, config=cfg) is out
    grouped_gemm_reference(a, w, ref, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))  # bit for bit: NaN rows and signed zeros
    routed = torch.ones(tokens * top_k, dtype=torch.bool) if emap is None else (emap[ids.long()] >= 0).reshape(-1)
    assert (out[routed] == 0).all() and out[~routed].isnan().all()


def test_triton_decoder_exact() -> None:
    """One-hot activations read single weights back: the pure-Triton decode must be exact."""
    from lutb_kernels.tiles import tiles_to_dense

    w = random_tiles((1, 1, 1), k=128)
    q, s = mt.mxfp8_quantize(torch.eye(128)[:32].contiguous(), k_order="decoder")
    ids = torch.zeros(32, 1, dtype=torch.int32)
    sorted_ids, expert_ids, ntpp = moe_align_block_size(ids, 32, 1)
    out = torch.full((32, 128), float("nan"))
    cfg = LutBGemmConfig(block_m=16, block_n=64, decoder="triton", num_stages=1)
    lut_b_moe_gemm(q, s, w, out, None, sorted_ids, expert_ids, ntpp, 1, block_m=32, a_k_order="decoder", config=cfg)
    assert torch.equal(out, tiles_to_dense(w[0]).T[:32])


@pytest.mark.parametrize("order", ["natural", "decoder"])
def test_lut_b_moe_gemm_dequantized_a(order: str) -> None:
    """``a_scales=None``: A holds MXFP8 values already dequantized (float32 here, bf16 on the GPU)."""
    tokens, top_k, experts, n, k = 7, 2, 3, 128, 256
    gen = torch.Generator().manual_seed(11)
    w = random_tiles((experts, 1, 2), k=k, generator=gen)
    x = torch.randn(tokens, k, generator=gen)
    a = mt.mxfp8_qdq(x, k_order=order, out_dtype=torch.float32)
    assert torch.equal(a, mt.mxfp8_qdq_reference(x, k_order=order, out_dtype=torch.float32))
    q, s = mt.mxfp8_quantize(x, k_order=order)
    ids, _, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, None, 16, seed=2)
    out = torch.full((tokens * top_k, n), float("nan"))
    ref = out.clone()
    cfg = LutBGemmConfig(block_m=16, block_n=64, decoder="triton", num_stages=1)
    lut_b_moe_gemm(a, None, w, out, None, sorted_ids, expert_ids, ntpp, top_k, block_m=16, a_k_order=order, config=cfg)
    lut_b_moe_gemm_reference(q, s, w, ref, None, sorted_ids, expert_ids, ntpp, top_k, block_m=16, a_k_order=order)
    assert rel_l2(out, ref) < 1e-5


@pytest.mark.parametrize("tokens,top_k,experts,held,dtype,split_k,prefetch,order,k,unroll,stream_k", [
    (5, 2, 3, None, torch.float32, 1, False, "decoder", 256, 1, 0),
    (5, 2, 3, None, torch.float32, 3, True, "natural", 384, 2, 0),  # uneven split-K: 2 + 1 tiles
    (17, 1, 4, [1, 3], torch.float16, 2, True, "decoder", 512, 2, 0),
    (3, 2, 4, [0, 2], torch.float32, 2, False, "decoder", 256, 4, 0),
    (4, 2, 3, None, torch.float32, 1, False, "decoder", 384, 2, 0),  # 3 tiles, unrolled by 2
    # stream-K (8 programs per "SM" on the interpreter's 8): runs of >= ceil(k_tiles / split_k) tiles
    (5, 2, 3, None, torch.float32, 4, False, "decoder", 512, 1, 1),  # 3 blocks x 2 units x 4 tiles: runs of 3
    (5, 2, 3, None, torch.float16, 1, False, "natural", 384, 1, 1),  # runs of whole units, some straddle two
    (1, 2, 4, [0, 2], torch.float32, 8, True, "decoder", 1024, 2, 2),  # 16 programs, 16 tiles, one held route
    (17, 1, 4, [1, 3], torch.float32, 3, False, "decoder", 384, 1, 1),  # 2 routing blocks of 16 rows
    (0, 2, 3, None, torch.float32, 2, False, "decoder", 256, 1, 1),  # no tokens
])
def test_lut_b_moe_gemm_tile_loop(tokens, top_k, experts, held, dtype, split_k, prefetch, order, k, unroll,  # noqa: ANN001
                                  stream_k) -> None:  # noqa: ANN001
    """The per-tile K loop (16-byte plane loads, 4 groups per iteration), unrolled or not, the store-based split-K
    and the stream-K grid.

    (The interpreter runs the loop as written; the unrolled machine code is checked on the GPU by
    tests/kernels/test_lut_b_gemm.py::test_unrolled_k_loop_any_tile_count.)"""
    n = 128
    e_local = len(held) if held is not None else experts
    gen = torch.Generator().manual_seed(tokens * 11 + k)
    w = random_tiles((e_local, n // 128, k // 128), k=k, generator=gen, scale_jitter=3)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    q, s = mt.mxfp8_quantize(x, k_order=order)
    ids, emap, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, held, 16, seed=tokens + 1)
    tw = torch.rand(tokens, top_k, generator=gen)
    out = torch.full((tokens * top_k, n), float("nan"), dtype=dtype)
    ref = out.clone()
    cfg = LutBGemmConfig(block_m=16, block_n=64, split_k=split_k, swap_ab=True, decoder="triton", num_stages=1,
                         groups_per_step=1, tile_loop=True, prefetch=prefetch, unroll=unroll, stream_k=stream_k)
    rotated = stream_k == 1  # the stream-K cases also read the tiles in the kernel layout (as packed keeps them)
    tiles = to_kernel_layout(w) if rotated else w
    lut_b_moe_gemm(q, s, tiles, out, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16, a_k_order=order, config=cfg,
                   kernel_layout=rotated)
    lut_b_moe_gemm_reference(q, s, tiles, ref, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16, a_k_order=order,
                             kernel_layout=rotated)
    routed = torch.ones(tokens * top_k, dtype=torch.bool) if emap is None else (emap[ids.long()] >= 0).reshape(-1)
    assert not out[routed].isnan().any(), "a routed row was not written"
    assert out[~routed].isnan().all(), "a row of an expert not held was touched"
    if routed.any():
        assert rel_l2(out[routed], ref[routed]) < (1e-5 if dtype == torch.float32 else 2e-3)


def test_stream_k_sub_blocks() -> None:
    """Stream-K over routing blocks of 32 rows run as two 16-row sub-blocks (units of half a block)."""
    tokens, top_k, experts, n, k = 20, 2, 3, 128, 384
    gen = torch.Generator().manual_seed(5)
    w = random_tiles((experts, n // 128, k // 128), k=k, generator=gen)
    x = torch.randn(tokens, k, generator=gen)
    q, s = mt.mxfp8_quantize(x, k_order="decoder")
    _, _, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, None, 32, seed=3)
    out = torch.full((tokens * top_k, n), float("nan"))
    ref = out.clone()
    cfg = LutBGemmConfig(block_m=16, block_n=64, split_k=2, swap_ab=True, decoder="triton", num_stages=1,
                         groups_per_step=1, tile_loop=True, stream_k=1)
    lut_b_moe_gemm(q, s, w, out, None, sorted_ids, expert_ids, ntpp, top_k, block_m=32, a_k_order="decoder", config=cfg)
    lut_b_moe_gemm_reference(q, s, w, ref, None, sorted_ids, expert_ids, ntpp, top_k, block_m=32, a_k_order="decoder")
    assert not out.isnan().any()
    assert rel_l2(out, ref) < 1e-5


@pytest.mark.parametrize("stream_k,split_k", [(1, 2), (1, 4), (2, 8)])
def test_split_k_counters_are_left_zero(stream_k: int, split_k: int) -> None:
    """Stream-K sums each unit's partials in the same launch: a caller's counter buffer is used (its tail past the
    launch's units untouched), left all zero, and serves the next call; the results equal the reference's both times."""
    tokens, top_k, experts, n, k = 7, 2, 3, 128, 512
    gen = torch.Generator().manual_seed(17 + split_k)
    w = random_tiles((experts, n // 128, k // 128), k=k, generator=gen)
    x = torch.randn(tokens, k, generator=gen)
    q, s = mt.mxfp8_quantize(x, k_order="decoder")
    _, _, (sorted_ids, expert_ids, ntpp) = _routing(tokens, top_k, experts, None, 16, seed=9)
    tw = torch.rand(tokens, top_k, generator=gen)
    units = expert_ids.numel() * (n // 64)
    counters = torch.zeros(units + 5, dtype=torch.int32)
    counters[units:] = 7
    cfg = LutBGemmConfig(block_m=16, block_n=64, split_k=split_k, swap_ab=True, decoder="triton", num_stages=1,
                         groups_per_step=1, tile_loop=True, stream_k=stream_k)
    ref = torch.full((tokens * top_k, n), float("nan"))
    lut_b_moe_gemm_reference(q, s, w, ref, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16, a_k_order="decoder")
    for _ in range(2):
        out = torch.full_like(ref, float("nan"))
        lut_b_moe_gemm(q, s, w, out, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16, a_k_order="decoder", config=cfg,
                       split_k_counters=counters)
        assert not out.isnan().any()
        assert rel_l2(out, ref) < 1e-5
        assert not counters[:units].any(), "a unit's counter was not set back to zero"
        assert (counters[units:] == 7).all(), "a counter past the launch's units was touched"
    with pytest.raises(ValueError, match="split_k_counters"):
        lut_b_moe_gemm(q, s, w, out, tw, sorted_ids, expert_ids, ntpp, top_k, block_m=16, a_k_order="decoder", config=cfg,
                       split_k_counters=counters.float())


def test_kernel_layout_group_loop_and_reference() -> None:
    """The per-group loop (G = 4) reads the kernel layout too; the reference twin undoes it (so kernel-layout tiles
    read as checkpoint-layout ones would give another result)."""
    tokens, top_k, experts, n, k = 6, 2, 3, 128, 256
    gen = torch.Generator().manual_seed(9)
    w = random_tiles((experts, n // 128, k // 128), k=k, generator=gen)
    x = torch.randn(tokens, k, generator=gen)
    q, s = mt.mxfp8_quantize(x, k_order="natural")
    _, _, routing = _routing(tokens, top_k, experts, None, 16, seed=4)
    ref = torch.full((tokens * top_k, n), float("nan"))
    lut_b_moe_gemm_reference(q, s, w, ref, None, *routing, top_k, block_m=16)
    out = torch.full_like(ref, float("nan"))
    cfg = LutBGemmConfig(block_m=16, block_n=64, decoder="triton", num_stages=1, groups_per_step=4)
    lut_b_moe_gemm(q, s, to_kernel_layout(w), out, None, *routing, top_k, block_m=16, config=cfg, kernel_layout=True)
    assert rel_l2(out, ref) < 1e-5
    ref_rot = torch.full_like(ref, float("nan"))
    lut_b_moe_gemm_reference(q, s, to_kernel_layout(w), ref_rot, None, *routing, top_k, block_m=16, kernel_layout=True)
    assert torch.equal(ref_rot, ref)
    lut_b_moe_gemm_reference(q, s, to_kernel_layout(w), ref_rot, None, *routing, top_k, block_m=16)
    assert rel_l2(ref_rot, ref) > 0.1
