"""The dense grouped GEMM's default launch config (no GPU needed: the device queries are patched)."""

from __future__ import annotations

import pytest
import torch

from lutb_kernels import grouped_gemm as gg

H200_SMEM = 227 * 1024
A100_SMEM = 163 * 1024


@pytest.fixture
def on_gpu(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """default_config as on a CUDA device with the shared memory the test sets."""
    smem = {"bytes": H200_SMEM}
    monkeypatch.setattr(gg, "interpreting", lambda: False)
    monkeypatch.setattr(gg, "sm_count", lambda device: 132)
    monkeypatch.setattr(gg, "shared_memory_per_block", lambda device: smem["bytes"])
    return smem


# (route_block, n, elem_size, shared memory) -> (block_m, block_n, num_warps, num_stages)
CASES = [
    (256, 28672, 2, H200_SMEM, (128, 256, 8, 4)),  # mixtral T=8192 W13: the measured wide tile
    (128, 2048, 2, H200_SMEM, (128, 256, 8, 4)),  # qwen3 T=8192 W2
    (128, 4096, 2, A100_SMEM, (128, 128, 8, 3)),  # no room for 4 stages of the wide tile
    (128, 4096, 4, H200_SMEM, (128, 128, 8, 3)),  # float32 inputs
    (128, 128, 2, H200_SMEM, (128, 128, 8, 3)),  # narrower than the tile
    (64, 4096, 2, H200_SMEM, (64, 128, 4, 3)),
    (16, 4096, 2, H200_SMEM, (16, 64, 4, 4)),
]


@pytest.mark.parametrize("route_block,n,elem_size,smem,expected", CASES)
def test_tile_by_routing_block_and_shared_memory(on_gpu, route_block: int, n: int, elem_size: int, smem: int,  # noqa: ANN001
                                                  expected: tuple[int, int, int, int]) -> None:
    on_gpu["bytes"] = smem
    cfg = gg.default_config(8 * route_block, n, 4096, 8, route_block, torch.device("cuda"), elem_size)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == expected
    assert cfg.block_k == (64 if elem_size <= 2 else 32)


def test_wide_tile_fits_the_h200() -> None:
    assert A100_SMEM < gg.WIDE_TILE_SMEM <= H200_SMEM
