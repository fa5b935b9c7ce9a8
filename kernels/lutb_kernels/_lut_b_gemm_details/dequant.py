"""Triton kernel behind :func:`lutb_kernels.lut_b_dequant.lut_b_dequantize`: LUT-B tiles to dense.

Tile layout as int32 words (spec section 1; see the GEMM kernel module): words 0..3 hold the 8
bf16 LUT entries (entry 2w in the low half of word w), word 4 + r the 4 E8M0 scale bytes of row
r (group g in byte g), words 132 + 3 (4r + g) + b the bit-plane b of (row r, group g); or the
kernel layout (``lutb_kernels.tiles.to_kernel_layout``: planes rotated, rows chunk-major).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lutb_kernels._lut_b_gemm_details.kernels import load_lut_words, plane_word
from lutb_kernels._pdl_details import pdl_prologue

TILE_WORDS = tl.constexpr(1668)  # 6672 bytes


@triton.jit
def lut_b_dequant_kernel(
    w_words_ptr,  # int32 [E * NT * KT, 1668]: the tiles as little-endian words
    out_ptr,  # [E, NT * 128, KT * 128], row-major in its last two dimensions
    tiles_per_expert,  # NT * KT
    KT,
    stride_oe,
    stride_on,
    ROWS: tl.constexpr,  # tile rows per program (divides 128)
    KERNEL_LAYOUT: tl.constexpr = False,  # tiles in the kernel layout (tiles.to_kernel_layout)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (lutb_kernels._pdl_details)
):
    """Program (tile, row block): ``out[e, 128 nt + r, 128 kt + c] = lut[code] * 2**(s - 127)``.

    The value is computed in float32 (the LUT entry widened, times the exact power of two; E8M0
    255 gives NaN) and rounded once to the output dtype, as the spec's dequantization says.
    """
    pdl_prologue(PDL)
    tile = tl.program_id(0)
    rblk = tl.program_id(1)
    e = tile // tiles_per_expert
    rest = tile % tiles_per_expert
    nt = rest // KT
    kt = rest % KT
    base = tile.to(tl.int64) * TILE_WORDS
    w0, w1, w2, w3 = load_lut_words(w_words_ptr, base)
    l0 = (w0 << 16).to(tl.float32, bitcast=True)
    l1 = ((w0 >> 16) << 16).to(tl.float32, bitcast=True)
    l2 = (w1 << 16).to(tl.float32, bitcast=True)
    l3 = ((w1 >> 16) << 16).to(tl.float32, bitcast=True)
    l4 = (w2 << 16).to(tl.float32, bitcast=True)
    l5 = ((w2 >> 16) << 16).to(tl.float32, bitcast=True)
    l6 = (w3 << 16).to(tl.float32, bitcast=True)
    l7 = ((w3 >> 16) << 16).to(tl.float32, bitcast=True)

    r = rblk * ROWS + tl.arange(0, ROWS)  # [ROWS] tile rows
    g = tl.arange(0, 4)  # 32-column groups
    i = tl.arange(0, 32).to(tl.uint32)  # column in the group
    scale_word = tl.load(w_words_ptr + base + 4 + r)  # [ROWS]
    s = (scale_word[:, None] >> (8 * g[None, :])) & 0xFF  # [ROWS, 4]
    bits = tl.where(s == 0, 0x400000, s << 23)  # 2**(s - 127); 0 is the subnormal 2**-127
    scale = tl.where(s == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)  # 255: NaN
    q = 3 * g[None, :]  # [1, 4] plane 0 of each group
    p0 = tl.load(w_words_ptr + base + plane_word(r[:, None], q, KERNEL_LAYOUT)).to(tl.uint32, bitcast=True)[:, :, None]
    p1 = tl.load(w_words_ptr + base + plane_word(r[:, None], q + 1, KERNEL_LAYOUT)).to(tl.uint32, bitcast=True)[:, :, None]
    p2 = tl.load(w_words_ptr + base + plane_word(r[:, None], q + 2, KERNEL_LAYOUT)).to(tl.uint32, bitcast=True)[:, :, None]
    b0 = ((p0 >> i[None, None, :]) & 1) != 0  # [ROWS, 4, 32]: bit 0 of each code
    i1 = (i + 1) % 32 if KERNEL_LAYOUT else i  # where plane 1 (2) keeps column i's bit (rotated planes)
    i2 = (i + 2) % 32 if KERNEL_LAYOUT else i
    b1 = ((p1 >> i1[None, None, :]) & 1) != 0
    b2 = ((p2 >> i2[None, None, :]) & 1) != 0
    low = tl.where(b1, tl.where(b0, l3, l2), tl.where(b0, l1, l0))
    high = tl.where(b1, tl.where(b0, l7, l6), tl.where(b0, l5, l4))
    value = tl.where(b2, high, low) * scale[:, :, None]

    rows = (nt * 128 + r).to(tl.int64)
    cols = kt * 128 + g[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    ptrs = out_ptr + e.to(tl.int64) * stride_oe + rows[:, None, None] * stride_on + cols
    tl.store(ptrs, value.to(out_ptr.dtype.element_ty))
