"""lut_b_dequantize vs its torch twin, bit for bit (CPU interpreter; bf16 runs on the GPU)."""

from __future__ import annotations

import pytest
import torch

from lutb_kernels.lut_b_dequant import lut_b_dequantize, lut_b_dequantize_reference
from lutb_kernels.lut_b_gemm import random_tiles
from lutb_kernels.tiles import to_kernel_layout

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),  # triton interpreter
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),  # float16 inf, as the reference
]

# (experts, N/128, K/128): one tile, odd and even counts, no experts
SHAPES = [(1, 1, 1), (3, 2, 1), (2, 1, 3), (0, 2, 2)]


def _tiles(shape: tuple[int, int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tiles = random_tiles(shape, k=128 * shape[2], generator=gen, scale_jitter=20)
    if tiles.numel():
        tiles[0, 0, 0, 16 + 4 * 5 + 1] = 0  # the subnormal scale 2**-127 (row 5, group 1)
        tiles[0, 0, 0, 16 + 4 * 7 + 2] = 255  # E8M0 NaN (row 7, group 2)
    return tiles


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference_bit_for_bit(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    tiles = _tiles(shape, seed=sum(shape))
    want = lut_b_dequantize_reference(tiles, dtype=dtype)
    got = torch.full_like(want, float("nan"))  # poisoned: every element must be written
    assert lut_b_dequantize(tiles, got) is got
    assert torch.equal(_bits(got), _bits(want))
    if tiles.numel():
        assert got[0, 7, 64:96].isnan().all() and not got[0, 6].isnan().any()


def test_writes_into_a_slice_of_a_larger_scratch() -> None:
    tiles = _tiles((2, 1, 2), seed=3)
    scratch = torch.full((3, 128, 256), -7.0)
    lut_b_dequantize(tiles, scratch[1:])
    assert torch.equal(_bits(scratch[1:]), _bits(lut_b_dequantize_reference(tiles, dtype=torch.float32)))
    assert (scratch[0] == -7.0).all()


def test_bad_arguments_are_refused() -> None:
    tiles = _tiles((1, 1, 1), seed=4)
    with pytest.raises(ValueError, match="uint8"):
        lut_b_dequantize(tiles.view(torch.int8))
    with pytest.raises(ValueError, match="uint8"):
        lut_b_dequantize(tiles[0])
    with pytest.raises(ValueError, match="out must be"):
        lut_b_dequantize(tiles, torch.empty(1, 128, 64))
    with pytest.raises(ValueError, match="out must be"):
        lut_b_dequantize(tiles, torch.empty(1, 128, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        lut_b_dequantize(tiles, torch.empty(1, 128, 256)[:, :, :128])
    with pytest.raises(ValueError, match="dtype"):
        lut_b_dequantize(tiles, dtype=torch.int8)


def test_kernel_layout_bit_for_bit() -> None:
    """``kernel_layout=True`` on ``to_kernel_layout(tiles)`` (how the packed experts keep them) gives the same bits, in the
    kernel and in its twin."""
    tiles = _tiles((2, 1, 2), seed=11)
    want = lut_b_dequantize_reference(tiles, dtype=torch.float32)
    rotated = to_kernel_layout(tiles)
    got = torch.full_like(want, float("nan"))
    lut_b_dequantize(rotated, got, kernel_layout=True)
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(lut_b_dequantize_reference(rotated, dtype=torch.float32, kernel_layout=True)), _bits(want))
    assert not torch.equal(_bits(lut_b_dequantize(rotated, dtype=torch.float32)), _bits(want))
