"""LUT-B v1 tiles against the spec's byte offsets, decoded independently with struct."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from lutb_kernels.errors import LutBFormatError
from lutb_kernels.tiles import (
    TILE_BYTES,
    dense_to_tiles,
    pack_tiles,
    tiles_from_dense_fields,
    tiles_to_dense,
    unpack_tiles,
    validate_tiles,
)


def _bf16_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def _decode_element(tile: bytes, r: int, c: int) -> np.float32:
    """Spec section 1, read straight off the bytes."""
    g, i = divmod(c, 32)
    lut = struct.unpack_from("<8H", tile, 0)
    scale = tile[16 + 4 * r + g]
    code = 0
    for b in range(3):
        (word,) = struct.unpack_from("<I", tile, 528 + 12 * (4 * r + g) + 4 * b)
        code |= ((word >> i) & 1) << b
    return np.float32(_bf16_to_float(lut[code])) * np.float32(2.0 ** (scale - 127))


def _random_fields(*lead: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 8, (*lead, 128, 128), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, (*lead, 128, 4), generator=gen, dtype=torch.uint8)
    lut = torch.randn(*lead, 8, generator=gen).bfloat16()
    return codes, scales, lut


def test_hand_made_tile_fields_at_spec_offsets() -> None:
    codes = torch.zeros(128, 128, dtype=torch.uint8)
    codes[0, 0] = 0b101  # planes 0 and 2, bit 0 of word (0, 0)
    codes[3, 37] = 0b010  # group 1, position 5: plane 1, bit 5 of word (3, 1)
    codes[127, 127] = 0b111  # group 3, position 31: all planes, bit 31 of word (127, 3)
    scales = torch.full((128, 4), 127, dtype=torch.uint8)
    scales[3, 1] = 130
    scales[127, 3] = 1
    lut = torch.tensor([0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0]).bfloat16()
    tile = bytes(pack_tiles(codes, scales, lut).tolist())
    assert len(tile) == TILE_BYTES == 6672

    assert struct.unpack_from("<8H", tile, 0) == (0x0000, 0x3F80, 0xBF80, 0x3F00, 0xBF00, 0x4000, 0xC000, 0x4040)
    assert tile[16 + 4 * 3 + 1] == 130
    assert tile[16 + 4 * 127 + 3] == 1
    assert tile[16] == 127

    def word(r: int, g: int, b: int) -> int:
        return struct.unpack_from("<I", tile, 528 + 12 * (4 * r + g) + 4 * b)[0]

    assert (word(0, 0, 0), word(0, 0, 1), word(0, 0, 2)) == (1, 0, 1)
    assert (word(3, 1, 0), word(3, 1, 1), word(3, 1, 2)) == (0, 1 << 5, 0)
    assert (word(127, 3, 0), word(127, 3, 1), word(127, 3, 2)) == (1 << 31,) * 3
    nonzero_words = sum(word(r, g, b) != 0 for r in range(128) for g in range(4) for b in range(3))
    assert nonzero_words == 2 + 1 + 3


def test_hand_made_tile_values() -> None:
    codes = torch.zeros(128, 128, dtype=torch.uint8)
    codes[0, 0] = 5
    codes[3, 37] = 2
    codes[127, 127] = 7
    scales = torch.full((128, 4), 127, dtype=torch.uint8)
    scales[3, 1] = 130
    scales[127, 3] = 1
    lut = torch.tensor([0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0]).bfloat16()
    dense = tiles_to_dense(pack_tiles(codes, scales, lut).reshape(1, 1, TILE_BYTES))
    assert dense[0, 0] == 2.0
    assert dense[3, 37] == -1.0 * 2.0**3
    assert dense[127, 127] == 3.0 * 2.0**-126
    assert dense[5, 5] == 0.0


@pytest.mark.parametrize("lead", [(1,), (2, 3), (2, 1, 2)])
def test_pack_unpack_round_trip(lead: tuple[int, ...]) -> None:
    codes, scales, lut = _random_fields(*lead, seed=sum(lead))
    tiles = pack_tiles(codes, scales, lut)
    assert tiles.shape == (*lead, TILE_BYTES) and tiles.dtype == torch.uint8
    back = unpack_tiles(tiles)
    assert torch.equal(back.codes, codes)
    assert torch.equal(back.scales, scales)
    assert torch.equal(back.lut.view(torch.int16), lut.view(torch.int16))


def test_dequantize_matches_struct_decoder() -> None:
    codes, scales, lut = _random_fields(2, 3, 2, seed=7)  # E=2, N=384, K=256
    tiles = pack_tiles(codes, scales, lut)
    dense = tiles_to_dense(tiles)
    assert dense.shape == (2, 384, 256) and dense.dtype == torch.float32
    rng = np.random.default_rng(1)
    for _ in range(300):
        e, n, k = int(rng.integers(2)), int(rng.integers(384)), int(rng.integers(256))
        tile = bytes(tiles[e, n // 128, k // 128].tolist())
        assert dense[e, n, k].item() == _decode_element(tile, n % 128, k % 128)


def test_dense_layout_round_trip_through_fields() -> None:
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 8, (2, 256, 384), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 130, (2, 256, 384 // 32), generator=gen, dtype=torch.uint8)
    lut = torch.randn(2, 2, 3, 8, generator=gen).bfloat16()
    tiles = tiles_from_dense_fields(codes, scales, lut)
    assert tiles.shape == (2, 2, 3, TILE_BYTES)
    fields = unpack_tiles(tiles)
    assert torch.equal(fields.codes, dense_to_tiles(codes))
    dense = tiles_to_dense(tiles)
    expected = torch.gather(
        lut.float().repeat_interleave(128, 1).repeat_interleave(128, 2), -1, codes.long().unsqueeze(-1)
    ).squeeze(-1) * torch.exp2(scales.double() - 127).float().repeat_interleave(32, -1)
    assert torch.equal(dense, expected)


def test_dequantize_to_bfloat16_is_exact_for_normal_values() -> None:
    codes, scales, lut = _random_fields(1, 1, 1, seed=4)
    tiles = pack_tiles(codes, scales, lut)
    assert torch.equal(tiles_to_dense(tiles, torch.bfloat16).float(), tiles_to_dense(tiles))


def _one_tile(seed: int = 0) -> torch.Tensor:
    return pack_tiles(*_random_fields(2, 2, 1, seed=seed))


def test_validate_accepts_good_tiles() -> None:
    validate_tiles(_one_tile(), "layers.0.w13", (2, 2, 1))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda t: t[1, 0, 0].__setitem__(16 + 4 * 7 + 2, 255), r"layers\.0\.w13: tile \(1, 0, 0\): scale byte 255"),
        (lambda t: t[0, 1, 0, 0:2].copy_(torch.tensor([0xC0, 0x7F], dtype=torch.uint8)), r"tile \(0, 1, 0\): LUT entry is NaN"),
        (lambda t: t[0, 1, 0, 14:16].copy_(torch.tensor([0x80, 0x7F], dtype=torch.uint8)), r"tile \(0, 1, 0\): LUT entry is NaN or infinite"),
    ],
)
def test_validate_rejects_with_tensor_and_tile(corrupt, message: str) -> None:
    tiles = _one_tile()
    corrupt(tiles)
    with pytest.raises(LutBFormatError, match=message):
        validate_tiles(tiles, "layers.0.w13")


def test_validate_rejects_bfloat16_overflow_only_for_used_codes() -> None:
    codes = torch.zeros(1, 128, 128, dtype=torch.uint8)
    scales = torch.full((1, 128, 4), 127, dtype=torch.uint8)
    lut = torch.tensor([[1.0, 2.0**100, 0, 0, 0, 0, 0, 0]]).bfloat16()
    scales[0, 9, 2] = 127 + 40  # 1.0 * 2**40: fine
    validate_tiles(pack_tiles(codes, scales, lut), "w")
    scales[0, 9, 2] = 127 + 100  # still only code 0 used there: 2**100, fine
    validate_tiles(pack_tiles(codes, scales, lut), "w")
    codes[0, 9, 70] = 1  # group 2 of row 9 now uses 2**100 * 2**100: overflows
    with pytest.raises(LutBFormatError, match=r"w: tile \(0,\): largest decoded magnitude overflows bfloat16"):
        validate_tiles(pack_tiles(codes, scales, lut), "w")


@pytest.mark.parametrize(
    "tiles, shape, message",
    [
        (torch.zeros(1, 2, 1, 6671, dtype=torch.uint8), None, "last dimension must be 6672"),
        (torch.zeros(1, 2, 1, 6672, dtype=torch.int16), None, "dtype must be uint8"),
        (torch.zeros(1, 2, 1, 6672, dtype=torch.uint8), (1, 2, 2), r"tile counts \(1, 2, 1\) disagree"),
    ],
)
def test_validate_rejects_bad_shapes(tiles: torch.Tensor, shape, message: str) -> None:
    with pytest.raises(LutBFormatError, match=message):
        validate_tiles(tiles, "layers.2.w2", shape)


def test_pack_refuses_bad_fields() -> None:
    codes, scales, lut = _random_fields(1)
    with pytest.raises(ValueError, match="0..7"):
        pack_tiles(codes + 8, scales, lut)
    for wide in (codes.int() + 256, codes.int() - 256):  # once wrapped to a valid code by the uint8 cast
        with pytest.raises(ValueError, match="0..7"):
            pack_tiles(wide, scales, lut)
    with pytest.raises(ValueError, match="scales"):
        pack_tiles(codes, scales[..., :3], lut)
    with pytest.raises(ValueError, match="lut"):
        pack_tiles(codes, scales, lut.float())


def test_kernel_layout_rotates_planes_and_makes_rows_chunk_major() -> None:
    """``to_kernel_layout``: plane word ``q = 3g + b`` of row ``r`` moves from word ``132 + 12r + q`` to
    ``132 + 512 (q // 4) + 4r + q % 4``, plane-1 words rotated left by 1 bit and plane-2 words by 2; LUT and
    scales unchanged, the input untouched; ``inverse=True`` undoes it. Checked word by word, independently of
    the implementation's reshapes."""
    from lutb_kernels.lut_b_gemm import random_tiles
    from lutb_kernels.tiles import to_kernel_layout

    def rotl(x: int, n: int) -> int:
        return ((x << n) | (x >> (32 - n))) & 0xFFFFFFFF

    w = random_tiles((2, 3, 2), k=256, generator=torch.Generator().manual_seed(3))
    before = w.clone()
    kl = to_kernel_layout(w)
    assert torch.equal(w, before) and kl.shape == w.shape and kl.dtype == torch.uint8
    assert torch.equal(to_kernel_layout(kl, inverse=True), w)
    old = [[v & 0xFFFFFFFF for v in t] for t in w.view(torch.int32).reshape(-1, 1668).tolist()]
    new = [[v & 0xFFFFFFFF for v in t] for t in kl.view(torch.int32).reshape(-1, 1668).tolist()]
    for t, (a, b) in enumerate(zip(old, new, strict=True)):
        assert a[:132] == b[:132], t
        for r in range(128):
            for q in range(12):
                plane = q % 3
                got = b[132 + 512 * (q // 4) + 4 * r + q % 4]
                want = rotl(a[132 + 12 * r + q], plane) if plane else a[132 + 12 * r + q]
                assert got == want, (t, r, q, hex(got), hex(want))
    with pytest.raises(ValueError, match="uint8"):
        to_kernel_layout(w[..., :100])
