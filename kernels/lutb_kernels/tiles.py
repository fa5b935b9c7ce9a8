"""LUT-B v1 weight tiles: pack, unpack, dequantize, validate (spec section 1).

A weight matrix ``W[N, K]`` (``N % 128 == K % 128 == 0``) is cut into 128 x 128
tiles; a stack of matrices is stored as ``uint8 [..., N/128, K/128, 6672]``.
Each tile holds

====== ====== ===========================================================
offset size   field
====== ====== ===========================================================
0      16     ``lut[8]``: eight bfloat16 values, little-endian
16     512    ``scale[128][4]``: E8M0 bytes, one per (row, 32-column group)
528    6144   ``plane[128][4][3]``: uint32 bit-planes, little-endian
====== ====== ===========================================================

Element ``(r, c)`` of a tile, with ``g = c // 32`` and ``i = c % 32``, has the
3-bit code ``sum_b ((plane[r][g][b] >> i) & 1) << b`` and the value
``float32(lut[code]) * 2**(scale[r][g] - 127)``, computed in float32.

Every function here is vectorised over all leading dimensions (no Python loop
per tile) and runs on whatever device its input lives on.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from lutb_kernels.errors import LutBFormatError

TILE = 128
"""Rows and columns of one tile."""
GROUP = 32
"""Columns that share one E8M0 scale."""
GROUPS_PER_ROW = TILE // GROUP
LUT_ENTRIES = 8
PLANES = 3

LUT_OFFSET = 0
SCALE_OFFSET = 16
PLANE_OFFSET = 528
TILE_BYTES = 6672
"""Bytes per 128 x 128 tile."""
BITS_PER_WEIGHT = TILE_BYTES * 8 / (TILE * TILE)

E8M0_NAN = 255

if sys.byteorder != "little":  # pragma: no cover - no big-endian torch build is supported
    raise ImportError("lutb_kernels assumes a little-endian host")


class TileFields(NamedTuple):
    """The three fields of a stack of tiles, decoded but not combined.

    ``codes``: uint8 ``[..., 128, 128]`` with values 0..7.
    ``scales``: uint8 ``[..., 128, 4]``, E8M0 bytes.
    ``lut``: bfloat16 ``[..., 8]``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    lut: torch.Tensor


_SPREAD = torch.tensor(
    [sum(((byte >> k) & 1) << (8 * k) for k in range(8)) for byte in range(256)], dtype=torch.int64
)


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=device)


def pack_tiles(codes: torch.Tensor, scales: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Encode tile fields into LUT-B v1 tile bytes.

    Args:
        codes: integer ``[..., 128, 128]``, values 0..7; element ``(r, c)`` of each tile.
        scales: uint8 ``[..., 128, 4]``, the E8M0 byte of each (row, 32-column group).
        lut: bfloat16 ``[..., 8]``, each tile's lookup table.

    Returns:
        uint8 ``[..., 6672]``, one row of bytes per tile, laid out as the spec says.
    """
    lead = codes.shape[:-2]
    if codes.shape[-2:] != (TILE, TILE):
        raise ValueError(f"codes must end in (128, 128), got {tuple(codes.shape)}")
    if scales.shape != (*lead, TILE, GROUPS_PER_ROW) or scales.dtype != torch.uint8:
        raise ValueError(f"scales must be uint8 {(*lead, TILE, GROUPS_PER_ROW)}, got {scales.dtype} {tuple(scales.shape)}")
    if lut.shape != (*lead, LUT_ENTRIES) or lut.dtype != torch.bfloat16:
        raise ValueError(f"lut must be bfloat16 {(*lead, LUT_ENTRIES)}, got {lut.dtype} {tuple(lut.shape)}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 7):  # before the cast: 256 would wrap to 0
        raise ValueError(f"codes must lie in 0..7, got [{int(codes.min())}, {int(codes.max())}]")
    codes = codes.to(torch.uint8)
    device = codes.device
    # [..., 128, 4 groups, 32 positions] -> bit b of every code
    c = codes.reshape(*lead, TILE, GROUPS_PER_ROW, GROUP)
    planes = torch.stack([(c >> b) & 1 for b in range(PLANES)], dim=-2)  # [..., 128, 4, 3, 32]
    # Position i lands in bit (i % 8) of little-endian byte i // 8 of the uint32 word.
    planes = planes.reshape(*lead, TILE, GROUPS_PER_ROW, PLANES, 4, 8)
    plane_bytes = (planes * _bit_weights(device)).sum(dim=-1, dtype=torch.uint8)  # [..., 128, 4, 3, 4]
    lut_bytes = lut.contiguous().view(torch.uint8).reshape(*lead, 2 * LUT_ENTRIES)
    out = torch.cat(
        [
            lut_bytes,
            scales.reshape(*lead, TILE * GROUPS_PER_ROW),
            plane_bytes.reshape(*lead, TILE * GROUPS_PER_ROW * PLANES * 4),
        ],
        dim=-1,
    )
    assert out.shape[-1] == TILE_BYTES
    return out


def _split_fields(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Byte views of the fields: (lut bf16 [..., 8], scales u8 [..., 128, 4], planes u8 [..., 128, 4, 3, 4])."""
    if tiles.dtype != torch.uint8 or tiles.shape[-1:] != (TILE_BYTES,):
        raise ValueError(f"tiles must be uint8 [..., {TILE_BYTES}], got {tiles.dtype} {tuple(tiles.shape)}")
    lead = tiles.shape[:-1]
    lut = tiles[..., LUT_OFFSET:SCALE_OFFSET].contiguous().view(torch.bfloat16)
    scales = tiles[..., SCALE_OFFSET:PLANE_OFFSET].reshape(*lead, TILE, GROUPS_PER_ROW)
    planes = tiles[..., PLANE_OFFSET:].reshape(*lead, TILE, GROUPS_PER_ROW, PLANES, 4)
    return lut, scales, planes


def unpack_tiles(tiles: torch.Tensor) -> TileFields:
    """Decode tile bytes ``uint8 [..., 6672]`` into their fields (see :class:`TileFields`)."""
    lut, scales, planes = _split_fields(tiles)
    lead = tiles.shape[:-1]
    # One plane byte holds bit b of 8 consecutive codes. _SPREAD[byte] puts bit k of the byte
    # into byte k of an int64, so OR-ing the three planes' spreads (shifted by b) yields
    # 8 codes whose little-endian bytes are the codes in column order.
    spread = _SPREAD.to(tiles.device)
    p = planes.long()
    packed = spread[p[..., 0, :]] | (spread[p[..., 1, :]] << 1) | (spread[p[..., 2, :]] << 2)
    codes = packed.view(torch.uint8)  # [..., 128, 4, 4 bytes * 8 codes]
    return TileFields(codes.reshape(*lead, TILE, TILE), scales.clone(), lut.clone())


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """``2**(s - 127)`` as float32 for E8M0 bytes ``s`` (exact; 255 gives NaN)."""
    table = torch.exp2(torch.arange(256, dtype=torch.float64) - 127).to(torch.float32)
    table[E8M0_NAN] = float("nan")
    return table.to(scales.device)[scales.long()]


def decode_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """Dequantize each tile to float32 in tile order.

    Args:
        tiles: uint8 ``[..., 6672]``.

    Returns:
        float32 ``[..., 128, 128]``; element ``(r, c)`` of each tile.
    """
    codes, scales, lut = unpack_tiles(tiles)
    lead = tiles.shape[:-1]
    lut32 = lut.float().reshape(-1, 1)  # [tiles * 8, 1]
    # Row (tile * 8 + code) of the flat LUT; an embedding lookup is the fastest gather on CPU.
    base = torch.arange(0, lut32.shape[0], LUT_ENTRIES, dtype=torch.int32, device=tiles.device)
    index = codes.reshape(base.numel(), -1).int() + base[:, None]
    values = torch.nn.functional.embedding(index, lut32).reshape(*lead, TILE, GROUPS_PER_ROW, GROUP)
    return (values * e8m0_to_float32(scales).unsqueeze(-1)).reshape(*lead, TILE, TILE)


def tiles_to_dense(tiles: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize stacked matrices of tiles into dense weights.

    Args:
        tiles: uint8 ``[..., N/128, K/128, 6672]``.
        dtype: output dtype; values are computed in float32 then converted.

    Returns:
        ``[..., N, K]`` in ``dtype``.
    """
    if tiles.dim() < 3:
        raise ValueError(f"tiles must be [..., N/128, K/128, {TILE_BYTES}], got {tuple(tiles.shape)}")
    *lead, nt, kt, _ = tiles.shape
    dense = decode_tiles(tiles)  # [..., nt, kt, 128, 128]
    dense = dense.transpose(-3, -2)  # [..., nt, 128, kt, 128]
    return dense.reshape(*lead, nt * TILE, kt * TILE).to(dtype)


def dense_to_tiles(w: torch.Tensor) -> torch.Tensor:
    """Cut ``[..., N, K]`` into ``[..., N/128, K/128, 128, 128]`` tiles (a view-preserving reshape)."""
    *lead, n, k = w.shape
    if n % TILE or k % TILE:
        raise ValueError(f"matrix dimensions must be multiples of {TILE}, got {n} x {k}")
    return w.reshape(*lead, n // TILE, TILE, k // TILE, TILE).transpose(-3, -2)


def tiles_from_dense_fields(codes: torch.Tensor, scales: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Pack fields given in matrix layout into ``[..., N/128, K/128, 6672]`` tiles.

    Args:
        codes: integer ``[..., N, K]`` with values 0..7.
        scales: uint8 ``[..., N, K/32]``.
        lut: bfloat16 ``[..., N/128, K/128, 8]``.
    """
    *lead, n, k = codes.shape
    tile_codes = dense_to_tiles(codes)
    tile_scales = scales.reshape(*lead, n // TILE, TILE, k // TILE, GROUPS_PER_ROW).transpose(-3, -2)
    return pack_tiles(tile_codes, tile_scales.contiguous(), lut)


def to_kernel_layout(tiles: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """A copy of tiles ``uint8 [..., 6672]`` in the kernel layout (``inverse``: back to the
    checkpoint layout): the same bytes per weight, arranged for the GEMM's loads and decoder.

    How the packed experts keep their tiles on the GPU (``lut_b_moe_gemm(..., kernel_layout=True)``,
    ``lut_b_dequantize(..., kernel_layout=True)``). LUT (words 0-3) and scales (words 4-131) are
    unchanged. In the checkpoint layout the 12 plane words of row ``r`` (plane ``b`` of group ``g``
    at ``q = 3g + b``) are words ``132 + 12 r + q``. The kernel layout changes two things:

    - *rotated planes*: every plane-1 word is rotated left by 1 bit and every plane-2 word by 2,
      so the bits of column ``c`` of a (row, group) sit at bits ``c``, ``c + 1`` and ``c + 2``
      mod 32 of its three words (the decoder's selectors then need two shifts fewer);
    - *chunk-major rows*: the 12 words of a row are cut into three 16-byte chunks ``v = q // 4``
      and chunk ``v`` of row ``r`` is stored at words ``132 + 512 v + 4 r + q % 4``, so the GEMM's
      16-byte load of chunk ``v`` for consecutive rows reads consecutive bytes (whole 32-byte
      sectors, where the 48-byte row stride fetched every sector twice).
    """
    if tiles.dtype != torch.uint8 or tiles.dim() == 0 or tiles.shape[-1] != TILE_BYTES:
        raise ValueError(f"tiles must be uint8 [..., {TILE_BYTES}], got {tiles.dtype} {tuple(tiles.shape)}")
    words = tiles.contiguous().view(torch.int32).clone()
    if inverse:  # chunk-major back to row-major first ([3, 128, 4] -> [128, 3, 4]); reshape copies
        words[..., 132:] = words[..., 132:].unflatten(-1, (3, TILE, 4)).transpose(-3, -2).flatten(-3)
    planes = words[..., 132:].unflatten(-1, (-1, 3))
    p1, p2 = planes[..., 1], planes[..., 2]  # each right-hand side is computed before its store
    if inverse:  # int32 >> is arithmetic: mask the sign copies off
        planes[..., 1] = ((p1 >> 1) & 0x7FFFFFFF) | (p1 << 31)
        planes[..., 2] = ((p2 >> 2) & 0x3FFFFFFF) | (p2 << 30)
    else:
        planes[..., 1] = (p1 << 1) | ((p1 >> 31) & 1)
        planes[..., 2] = (p2 << 2) | ((p2 >> 30) & 3)
        words[..., 132:] = words[..., 132:].unflatten(-1, (TILE, 3, 4)).transpose(-3, -2).flatten(-3)
    return words.view(torch.uint8)


def _tile_index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def check_tile_layout(tiles: torch.Tensor, name: str, expected_shape: tuple[int, ...] | None = None) -> None:
    """The cheap part of :func:`validate_tiles`: dtype, last dimension and tile counts (reads no tile bytes).

    Raises:
        LutBFormatError: naming the tensor (and giving its shape).
    """
    if tiles.dtype != torch.uint8:
        raise LutBFormatError(f"{name}: dtype must be uint8, got {tiles.dtype}")
    if tiles.dim() < 1 or tiles.shape[-1] != TILE_BYTES:
        raise LutBFormatError(f"{name}: last dimension must be {TILE_BYTES} tile bytes, got shape {tuple(tiles.shape)}")
    if expected_shape is not None and tuple(tiles.shape[:-1]) != tuple(expected_shape):
        raise LutBFormatError(
            f"{name}: tile counts {tuple(tiles.shape[:-1])} disagree with the checkpoint's sizes, "
            f"which give {tuple(expected_shape)}"
        )


def validate_tiles(tiles: torch.Tensor, name: str, expected_shape: tuple[int, ...] | None = None) -> None:
    """Check a stack of tiles against every rejection rule of spec section 1.

    Args:
        tiles: uint8 ``[..., N/128, K/128, 6672]``.
        name: the tensor's name, used in error messages (e.g. ``"layers.3.w13"``).
        expected_shape: the tile-count shape the checkpoint's sizes imply
            (e.g. ``(E, 2I/128, H/128)``), or None to skip that check.

    Raises:
        LutBFormatError: naming the tensor and the first offending tile index.
    """
    check_tile_layout(tiles, name, expected_shape)
    lead = tuple(tiles.shape[:-1])
    flat = tiles.reshape(-1, TILE_BYTES)
    if flat.shape[0] == 0:
        return
    lut, scales, planes = _split_fields(flat)

    def fail(bad: torch.Tensor, what: str) -> None:
        hits = bad.reshape(bad.shape[0], -1).any(dim=1)
        if bool(hits.any()):
            first = int(hits.nonzero()[0, 0])
            raise LutBFormatError(f"{name}: tile {_tile_index(first, lead)}: {what}")

    fail(scales == E8M0_NAN, "scale byte 255 (E8M0 NaN)")
    lut32 = lut.float()
    fail(~torch.isfinite(lut32), "LUT entry is NaN or infinite")

    # Largest decoded magnitude per (row, group), over the codes actually used there.
    # Code j occurs in a group iff some position has exactly j's bits in the three planes.
    words = planes.contiguous().view(torch.int32)[..., 0]  # [T, 128, 4, 3]
    used_max = torch.zeros(scales.shape, dtype=torch.float32, device=tiles.device)
    lut_abs = lut32.abs()
    for j in range(LUT_ENTRIES):
        hit = torch.full(words.shape[:-1], -1, dtype=torch.int32, device=tiles.device)
        for b in range(PLANES):
            p = words[..., b]
            hit &= p if (j >> b) & 1 else ~p
        used_max = torch.where(hit != 0, torch.maximum(used_max, lut_abs[:, j, None, None]), used_max)
    largest = used_max * e8m0_to_float32(scales)  # float32, as the decoder computes it
    fail(largest.to(torch.bfloat16).isinf(), "largest decoded magnitude overflows bfloat16")
