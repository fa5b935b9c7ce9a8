"""lut_b_dequantize on the GPU vs its torch twin, bit for bit, bfloat16 included (output poisoned)."""

from __future__ import annotations

import pytest
import torch

from lutb_kernels.lut_b_dequant import lut_b_dequantize, lut_b_dequantize_reference
from lutb_kernels.lut_b_gemm import random_tiles

pytestmark = pytest.mark.gpu

# (experts, N/128, K/128): one tile, odd counts, one mixtral-8x7b W2 expert (4096 x 14336)
SHAPES = [(1, 1, 1), (3, 5, 2), (1, 32, 112)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_reference_bit_for_bit(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    tiles = random_tiles(shape, k=128 * shape[2], device="cuda", generator=gen, scale_jitter=20)
    tiles[0, 0, 0, 16 + 4 * 3] = 0  # the subnormal scale 2**-127
    tiles[0, 0, 0, 16 + 4 * 9 + 3] = 255  # E8M0 NaN
    want = lut_b_dequantize_reference(tiles, dtype=dtype)
    got = torch.full_like(want, float("nan"))
    lut_b_dequantize(tiles, got)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))
    assert got[0, 9, 96:128].isnan().all()
