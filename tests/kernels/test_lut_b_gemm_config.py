"""lut_b_moe_gemm's default launch configs: a function of sizes, pinned to what the H200 measured.

The split-K choices below are the fastest of the candidates timed on an H200 for the same GEMMs
(bench/results/2026-12-02-kernels-maxnreg-h200.md, run B; the earlier breakdown in
2026-12-02-kernels-prmt2-h200.md agrees), re-timed on the kernel layout with the register caps
(2026-12-04-min-split-h200.md). CPU only: the device is faked as 132 SMs.
"""

from __future__ import annotations

import pytest
import torch

import lutb_kernels.lut_b_gemm as op

# name: (experts, hidden, intermediate, top_k)
SHAPES = {"mixtral": (8, 4096, 14336, 2), "deepseek": (256, 7168, 2048, 8), "qwen3": (128, 2048, 768, 8)}


@pytest.fixture
def h200(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    monkeypatch.setattr(op, "sm_count", lambda device: 132)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return torch.device("cpu")


@pytest.fixture
def plain_grid(h200: torch.device, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """The H200 with the plain (one program per unit and split) decode grid, no stream-K."""
    monkeypatch.setattr(op, "STREAM_K_PER_SM", 0)
    return h200


# The plain grid's split and register cap (None: the compiler's 127, 4 blocks per SM; 96: 5).
@pytest.mark.parametrize("shape,tokens,gemm,split_k,maxnreg", [
    ("mixtral", 1, "w13", 2, None), ("mixtral", 1, "w2", 16, None),
    # were split 1 and 2: 185.6 -> 162.7 us, 112.8 -> 87.5 us; the cap 2% faster on w13, 2-21% slower on w2
    ("mixtral", 8, "w13", 2, 96), ("mixtral", 8, "w2", 4, None),
    ("mixtral", 32, "w13", 2, 96), ("mixtral", 32, "w2", 2, None),
    ("deepseek", 1, "w13", 4, None), ("deepseek", 1, "w2", 2, None),
    # w13 T=8 (~15 programs per SM): two splits won (425.4 -> 382.0 us; on the kernel layout 351.6 -> 344.8 us);
    # the deeper grids ran as fast or faster unsplit on the kernel layout (w2 T=8 190.4 -> 184.5 us, T=32
    # 491.9 -> 472.7 us; w13 T=32 900.7 -> 897.9 us), and the forward 2.4-3.1% faster with the cap
    # (bench/results/2026-12-04-min-split-h200.md)
    ("deepseek", 8, "w13", 2, 96), ("deepseek", 8, "w2", 1, 96),
    ("deepseek", 32, "w13", 1, 96), ("deepseek", 32, "w2", 1, 96),
    # ~5 programs per SM: unsplit, the forward 8.6 us slower (same results file)
    ("qwen3", 8, "w13", 2, None), ("qwen3", 32, "w13", 2, 96),
])
def test_decode_plain_grid_config_is_the_measured_best(plain_grid: torch.device, shape: str, tokens: int, gemm: str,
                                                       split_k: int, maxnreg: int | None) -> None:
    experts, hidden, inter, top_k = SHAPES[shape]
    n, k = (2 * inter, hidden) if gemm == "w13" else (hidden, inter)
    config = op.default_config(tokens * top_k, n, k, experts, 16, plain_grid)
    assert (config.split_k, config.maxnreg) == (split_k, maxnreg)
    assert config.tile_loop and config.swap_ab and config.unroll == op.TILE_UNROLL


def test_only_deep_decode_grids_drop_the_minimum_split_or_take_the_cap(plain_grid: torch.device,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Both decode rules follow the grid's depth in programs per SM: deepseek's w2 at T=8 (~3400 programs)
    is deep on 132 SMs and shallow on 8x as many."""
    experts, hidden, inter, top_k = SHAPES["deepseek"]
    deep = op.default_config(8 * top_k, hidden, inter, experts, 16, plain_grid)
    assert (deep.split_k, deep.maxnreg) == (1, op.DECODE_WIDE_GRID_MAXNREG)
    monkeypatch.setattr(op, "sm_count", lambda device: 8 * 132)
    shallow = op.default_config(8 * top_k, hidden, inter, experts, 16, plain_grid)
    assert (shallow.split_k, shallow.maxnreg) == (2, None)


@pytest.mark.parametrize("tokens,route_block", [(128, 16), (512, 16), (2048, 64), (8192, 128)])
def test_larger_batches_keep_one_split(plain_grid: torch.device, tokens: int, route_block: int) -> None:
    """The decode minimum of two splits stops at 256 routes: larger batches fill the GPU without it."""
    experts, hidden, inter, top_k = SHAPES["deepseek"]
    assert op.default_config(tokens * top_k, 2 * inter, hidden, experts, route_block, plain_grid).split_k == 1


@pytest.mark.parametrize("routes,experts,block,expected", [
    (0, 8, 16, 0.0), (1, 8, 16, 1.0), (2, 8, 16, 1.875), (8, 1, 16, 1.0), (4096, 128, 32, 128.0 + 128),
])
def test_expected_blocks(routes: int, experts: int, block: int, expected: float) -> None:
    assert op.expected_blocks(routes, experts, block) == pytest.approx(expected, rel=1e-6)


def test_expected_blocks_against_sampling() -> None:
    """The closed form against the mean over random uniform routings (an independent estimate)."""
    gen = torch.Generator().manual_seed(0)
    for routes, experts in ((16, 8), (64, 256), (256, 256)):
        draws = torch.randint(0, experts, (4000, routes), generator=gen)
        touched = torch.tensor([row.unique().numel() for row in draws], dtype=torch.float64).mean().item()
        assert op.expected_blocks(routes, experts, 16) - routes // 16 == pytest.approx(touched, rel=0.02)


@pytest.mark.parametrize("routes,experts,held", [(64, 256, 32), (256, 256, 32), (128, 128, 16), (16, 8, 4)])
def test_a_shard_estimates_its_blocks_from_its_share_of_the_routes(routes: int, experts: int, held: int) -> None:
    """The experts classes pass ``held_routes = ceil(routes * held / experts)``: the closed form on that many
    routes over the held experts against sampled uniform routings over all experts (counting held ones)."""
    gen = torch.Generator().manual_seed(1)
    draws = torch.randint(0, experts, (4000, routes), generator=gen)
    touched = torch.tensor([row[row < held].unique().numel() for row in draws], dtype=torch.float64).mean().item()
    held_routes = -(-routes * held // experts)
    assert op.expected_blocks(held_routes, held, 16) - held_routes // 16 == pytest.approx(touched, rel=0.05)
    if held < experts:  # all routes over the held experts: every one looks touched, the grid too big
        assert op.expected_blocks(routes, held, 16) - routes // 16 > 1.1 * touched


def test_a_deepseek_shard_splits_k_as_its_share_of_the_batch(plain_grid: torch.device) -> None:
    """Decode on 32 of deepseek's 256 experts (8-way expert parallel): one token's 8 routes put ~1 on the shard
    (one block); sized on all 8 routes over 32 experts the grid would look 7x larger and split K less."""
    _, hidden, inter, top_k = SHAPES["deepseek"]
    held_routes = -(-1 * top_k * 32 // 256)
    assert held_routes == 1
    shard = op.default_config(held_routes, 2 * inter, hidden, 32, 16, plain_grid).split_k
    assert shard > op.default_config(top_k, 2 * inter, hidden, 32, 16, plain_grid).split_k


def test_pdl_only_on_cuda() -> None:
    """Kernels launch with PDL only on an NVIDIA GPU of compute capability 9.0+, never on the CPU interpreter."""
    from lutb_kernels._grouped_gemm_details.launch import pdl_launch, use_pdl

    assert not use_pdl(torch.device("cpu"))
    assert pdl_launch(torch.device("cpu")) == {"PDL": False}


@pytest.mark.parametrize("shape,tokens,gemm,stream_k", [
    # plain grids of 1024 / 896 programs of 14 / 8 tiles, measured 17% / 12% faster as stream-K
    ("deepseek", 1, "w13", True), ("deepseek", 1, "w2", True),
    ("mixtral", 1, "w2", True),  # 1024 programs of 7 tiles: 7% faster
    ("mixtral", 1, "w13", False),  # 896 programs of 16 tiles: 6% slower
    ("mixtral", 8, "w2", False), ("mixtral", 32, "w2", False),  # under 2 waves, 28 / 56 tiles: 2-4% slower
    ("mixtral", 8, "w13", False), ("deepseek", 8, "w13", False), ("deepseek", 8, "w2", False),  # >= 2 waves
    ("deepseek", 32, "w2", False),
    ("qwen3", 1, "w13", True), ("qwen3", 1, "w2", True),  # 8 blocks: the forward 4.3-4.6 us faster
    ("qwen3", 8, "w2", False),  # 800 programs of 6 tiles, but ~50 blocks: the forward 3.3 us slower as stream-K
])
def test_decode_runs_stream_k_only_on_short_grids(h200: torch.device, shape: str, tokens: int, gemm: str,
                                                  stream_k: bool) -> None:
    """Stream-K (4 programs per SM, 128 registers) where the plain grid would be under two waves of 4 programs
    per SM of fewer than 16 K tiles each, over at most 16 routing blocks; a program's run is at least MIN_TILES_PER_SPLIT tiles and half its expected share (or a whole K
    row), which bounds the workspace slices."""
    experts, hidden, inter, top_k = SHAPES[shape]
    n, k = (2 * inter, hidden) if gemm == "w13" else (hidden, inter)
    k_tiles = k // 128
    config = op.default_config(tokens * top_k, n, k, experts, 16, h200)
    assert config.tile_loop and config.swap_ab
    if not stream_k:
        assert config.stream_k == 0 and config.maxnreg in (None, op.DECODE_WIDE_GRID_MAXNREG)
        return
    assert config.stream_k == op.STREAM_K_PER_SM == 4 and config.maxnreg == op.STREAM_K_MAXNREG == 128
    run = -(-k_tiles // config.split_k)  # the least run lut_b_moe_gemm derives from split_k
    share = op.expected_blocks(tokens * top_k, experts, 16) * (n // 128) * k_tiles / (4 * 132)
    assert run >= min(k_tiles, max(op.MIN_TILES_PER_SPLIT, share // 2))
    assert config.split_k + 1 <= k_tiles // op.MIN_TILES_PER_SPLIT + 1  # workspace slices


def test_larger_routing_blocks_keep_the_plain_grid(h200: torch.device) -> None:
    experts, hidden, inter, top_k = SHAPES["deepseek"]
    for block in (32, 64, 128):
        assert op.default_config(2048 * top_k, 2 * inter, hidden, experts, block, h200).stream_k == 0


def test_stream_k_pieces_fit_the_workspace() -> None:
    """The stream-K split (``stream_k_run``, replayed here in Python) never gives a unit more partials than the
    ``cdiv(k_tiles, tiles_per_split) + 1`` workspace slices ``lut_b_moe_gemm`` allocates, every program's run
    stays inside the items, and the units' pieces cover each K tile exactly once."""
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    for k_tiles in (1, 2, 3, 7, 16, 56, 112):
        for split_k in (1, 2, 3, 4, 8, 16):
            min_run = cdiv(k_tiles, min(split_k, k_tiles))
            slices = cdiv(k_tiles, min_run) + 1
            for units in (1, 2, 3, 8, 33, 448):
                for programs in (8, 132, 528):
                    items = units * k_tiles
                    run = max(cdiv(items, programs), min_run)
                    covered = [0] * items
                    for p in range(programs):
                        for it in range(p * run, min((p + 1) * run, items)):
                            covered[it] += 1
                    assert covered == [1] * items
                    for u in range(units):
                        first, last = u * k_tiles // run, ((u + 1) * k_tiles - 1) // run
                        assert last - first + 1 <= slices, (k_tiles, split_k, units, programs)
