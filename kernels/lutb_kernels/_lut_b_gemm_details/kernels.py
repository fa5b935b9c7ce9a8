"""The LUT-B x MXFP8 grouped GEMM kernel: tiles decoded in registers, bf16 tensor-core dots.

Tile layout (spec section 1), seen as int32 words: word 0..3 hold the 8 bf16 LUT entries
(entry 2w in the low half of word w, 2w+1 in the high half); bytes 16 + 4r + g the E8M0
scale of (row r, group g); words 132 + 3 (4r + g) + b the bit-plane b of (r, g).

Decoder order. From the three plane words of one (row, 32-group),
``sel_i = ((p0 >> i) & 0x11111111) | ((p1 >> i) & 0x11111111) << 1 | ((p2 >> i) & 0x11111111) << 2``
holds in nibble j the code of column ``i + 4j``; a lookup turns it into 4 bf16x2 words
``w = 0..3`` holding the columns ``i + 8w`` and ``i + 8w + 4``. The decoder emits a group's 32
weights in position order ``8w + 2i + h`` (column ``i + 8w + 4h``), which puts the 4 words of
selector ``i`` exactly where the tensor cores' register operand wants lane ``i`` of a quad; the
activations are read in the same order (``lutb_kernels.mxfp8_triton.decoder_column_order``),
which the dot product does not mind.

Three decoders produce the same values (constexpr ``DECODER``):

- ``DECODER == 1`` (NVIDIA, sm80+): ``prmt.b32`` looks up 4 weights per instruction. Per
  (row, group) the 4 LUT words are multiplied by the group's power-of-two scale as bf16x2
  (4 ``fma.rn.bf16x2``, exact while the result is a normal bf16) and split into two words
  of low bytes and two of high bytes (4 ``prmt``); per 8 weights two ``prmt`` pick the low
  and high bytes and two more (selectors 0x5140, 0x7362) interleave them into bf16x2 words.
- ``DECODER == 2`` ("prmt2", NVIDIA sm80+; the same bf16 bits as 1, fewer instructions). Under
  the MMA's register layout each thread decodes, per (row, group), only the 8 weights of one
  selector ``i`` (its lane in the quad), so per-(row, group) work dominates: ``prmt`` spends 4
  ``fma`` + 4 ``prmt`` there to scale and split the LUT. ``prmt2`` splits the *unscaled* LUT
  once per tile, looks up, then multiplies the 4 looked-up bf16x2 words by the scale (the same
  ``fma.rn.bf16x2`` per entry, so the same rounding); builds each selector with 3 shifts and
  3 LOP3 (:func:`prmt2_lookup`); and, in the tile loop, turns a row's 4 scale bytes into two
  bf16x2 words once per tile (:func:`e8m0_pairs_bf16x2`), read through HMUL2's half swizzle.
  Offline sm90 SASS, 16x128 tile loop: 498 instead of 638 loop instructions (3.9 per weight).
- ``DECODER == 0`` (pure Triton, for the interpreter and other GPUs): shifts, masks and a
  3-level select over the LUT, float32 scale multiply.

Kernel layout (constexpr ``KERNEL_LAYOUT``; how the packed experts keep their tiles on the GPU,
see ``lutb_kernels.tiles.to_kernel_layout``), two changes, same values bit for bit:

- rotated planes (the decoders' constexpr ``ROTATED``): every plane-1 word is stored rotated left
  by 1 bit and every plane-2 word by 2, so the bits of column ``c`` sit at bits ``c``, ``c + 1``
  and ``c + 2`` (mod 32) of the three words. ``prmt2`` then builds a selector with two
  bit-selects, a mask and one rotation (4 integer instructions instead of 6); ``prmt`` and the
  pure decoder shift by ``c + 1`` and ``c + 2`` (rotating) instead of ``c``, at no extra cost;
- chunk-major rows: plane word ``q = 3g + b`` of row ``r`` sits at word ``132 + 512 (q // 4) +
  4 r + q % 4`` (:func:`plane_word`), so the tile loop's three 16-byte loads per row each read
  consecutive bytes across consecutive rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lutb_kernels._pdl_details import pdl_prologue


PLANE_CHUNK_WORDS = tl.constexpr(512)
"""Kernel layout: words between chunk ``v`` and ``v + 1`` of a row's plane words (128 rows x 4 words)."""


@triton.jit
def plane_word(r, q, KERNEL_LAYOUT: tl.constexpr):
    """Word index inside a tile of plane word ``q = 3g + b`` (0..11: plane ``b`` of group ``g``) of
    tile row ``r``, in the checkpoint layout or the kernel layout (chunk-major rows)."""
    if KERNEL_LAYOUT:
        return 132 + PLANE_CHUNK_WORDS * (q // 4) + 4 * r + q % 4
    else:
        return 132 + 12 * r + q


@triton.jit
def pow2_e8m0_f32(s):
    """float32 ``2**(s - 127)`` for int32 E8M0 bytes (0 is the subnormal 2**-127)."""
    return tl.where(s == 0, 0x400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def rotr32(x, s):
    """uint32 ``x`` rotated right by ``s`` bits (mod 32): one funnel shift (NVIDIA only; Triton's
    ``(x >> s) | (x << (32 - s))`` compiles to three instructions)."""
    return tl.inline_asm_elementwise(asm="shf.r.wrap.b32 $0, $1, $1, $2;", constraints="=r,r,r", args=[x, s],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def load_lut_words(w_words_ptr, tile_word):
    """The 4 uint32 words holding a tile's 8 bf16 LUT entries (scalar loads, broadcast to all threads)."""
    w0 = tl.load(w_words_ptr + tile_word).to(tl.uint32, bitcast=True)
    w1 = tl.load(w_words_ptr + tile_word + 1).to(tl.uint32, bitcast=True)
    w2 = tl.load(w_words_ptr + tile_word + 2).to(tl.uint32, bitcast=True)
    w3 = tl.load(w_words_ptr + tile_word + 3).to(tl.uint32, bitcast=True)
    return w0, w1, w2, w3


@triton.jit
def decode_pure(p0, p1, p2, sc, w0, w1, w2, w3, BLOCK_N: tl.constexpr, G: tl.constexpr, ROTATED: tl.constexpr = False):
    """Pure-Triton decoder: float32 ``[BLOCK_N, 32 G]`` in decoder order.

    ``p0, p1, p2``: uint32 ``[BLOCK_N, G]`` plane words per (row, group); ``sc``: int32
    ``[BLOCK_N, G]`` E8M0 bytes; ``w0..w3``: uint32 LUT words.
    """
    pos = tl.arange(0, 32)
    col = ((pos % 8) // 2 + 8 * (pos // 8) + 4 * (pos % 2)).to(tl.uint32)[None, None, :]
    col1 = (col + 1) % 32 if ROTATED else col  # where plane 1 (2) keeps column col's bit
    col2 = (col + 2) % 32 if ROTATED else col
    code = ((p0[:, :, None] >> col) & 1) | (((p1[:, :, None] >> col1) & 1) << 1) | (((p2[:, :, None] >> col2) & 1) << 2)
    # LUT entries as float32 bit patterns (bf16 bits in the high half)
    e0 = w0 << 16
    e1 = w0 & 0xFFFF0000
    e2 = w1 << 16
    e3 = w1 & 0xFFFF0000
    e4 = w2 << 16
    e5 = w2 & 0xFFFF0000
    e6 = w3 << 16
    e7 = w3 & 0xFFFF0000
    b0 = (code & 1) != 0
    b1 = (code & 2) != 0
    b2 = (code & 4) != 0
    lo = tl.where(b1, tl.where(b0, e3, e2), tl.where(b0, e1, e0))
    hi = tl.where(b1, tl.where(b0, e7, e6), tl.where(b0, e5, e4))
    bits = tl.where(b2, hi, lo)
    val = bits.to(tl.float32, bitcast=True) * pow2_e8m0_f32(sc)[:, :, None]
    return tl.reshape(val, (BLOCK_N, 32 * G))


@triton.jit
def scaled_lut_bytes(w0, w1, w2, w3, scale_word):
    """Per (row, group): the LUT times the group's scale (bf16x2 fma), split into byte words.

    ``scale_word``: uint32 ``[...]``, the bf16 ``2**(s-127)`` in both halves. Returns uint32
    ``(L0, L1, H0, H1)`` of the same shape: low bytes of entries 0-3, 4-7, high bytes 0-3, 4-7.
    """
    z = tl.full(scale_word.shape, 0, tl.uint32)
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t0, t1, t2, t3, nz;
        mov.b32 nz, 0x80008000;
        fma.rn.bf16x2 t0, $4, $8, nz;
        fma.rn.bf16x2 t1, $5, $8, nz;
        fma.rn.bf16x2 t2, $6, $8, nz;
        fma.rn.bf16x2 t3, $7, $8, nz;
        prmt.b32 $0, t0, t1, 0x6420;
        prmt.b32 $1, t2, t3, 0x6420;
        prmt.b32 $2, t0, t1, 0x7531;
        prmt.b32 $3, t2, t3, 0x7531;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[z + w0, z + w1, z + w2, z + w3, scale_word],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def prmt_lookup(sel, l0, l1, h0, h1):
    """8 weights per selector word: returns 4 bf16x2 words (elements j = 0,1 / 2,3 / 4,5 / 6,7)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lo, hi, lo2, hi2, s2;
        prmt.b32 lo, $4, $5, $8;
        prmt.b32 hi, $6, $7, $8;
        shr.b32 s2, $8, 16;
        prmt.b32 lo2, $4, $5, s2;
        prmt.b32 hi2, $6, $7, s2;
        prmt.b32 $0, lo, hi, 0x5140;
        prmt.b32 $1, lo, hi, 0x7362;
        prmt.b32 $2, lo2, hi2, 0x5140;
        prmt.b32 $3, lo2, hi2, 0x7362;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[l0, l1, h0, h1, sel],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def decode_prmt(p0, p1, p2, sc, w0, w1, w2, w3, BLOCK_N: tl.constexpr, G: tl.constexpr, ROTATED: tl.constexpr = False):
    """prmt decoder: bfloat16 ``[BLOCK_N, 32 G]`` in decoder order (arguments as :func:`decode_pure`)."""
    sb = tl.where(sc == 0, 0x40, sc << 7).to(tl.uint32)  # bf16 bits of 2**(s-127)
    scale_word = sb | (sb << 16)
    l0, l1, h0, h1 = scaled_lut_bytes(w0, w1, w2, w3, scale_word)  # [BLOCK_N, G]
    ii = tl.arange(0, 4).to(tl.uint32)[None, None, :]
    m = 0x11111111
    if ROTATED:  # bit i + 4j of plane 1 (2) sits at i + 4j + 1 (+ 2) mod 32: rotate instead of shift
        q1 = rotr32(p1[:, :, None], ii + 1)
        q2 = rotr32(p2[:, :, None], ii + 2)
    else:
        q1 = p1[:, :, None] >> ii
        q2 = p2[:, :, None] >> ii
    sel = ((p0[:, :, None] >> ii) & m) | ((q1 & m) << 1) | ((q2 & m) << 2)
    z = tl.full(sel.shape, 0, tl.uint32)
    o0, o1, o2, o3 = prmt_lookup(sel, z + l0[:, :, None], z + l1[:, :, None], z + h0[:, :, None], z + h1[:, :, None])
    return words_to_decoder_order(o0, o1, o2, o3, BLOCK_N, G)


@triton.jit
def words_to_decoder_order(o0, o1, o2, o3, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """bfloat16 ``[BLOCK_N, 32 G]`` in decoder order from the bf16x2 words of the selectors.

    ``o0..o3``: uint32 ``[BLOCK_N, G, 4]`` (last axis: selector ``i``), word ``w`` of selector
    ``i`` holding columns ``i + 8w`` (low half) and ``i + 8w + 4`` (high half). The split into
    uint16 halves and the bitcast are pure register renaming: sm90 SASS shows no instruction
    for them (the MMA reads the lookup's output registers directly).
    """
    words = tl.join(tl.join(o0, o2), tl.join(o1, o3))  # [BN, G, 4i, 2, 2]: word w = 2a + b
    words = tl.reshape(words, (BLOCK_N, G, 4, 4))  # [BN, g, i, w]
    # [BN, g, w, i]: position 8w + 2i + h of a group. The MMA's register operand gives lane q of
    # each quad the bf16 pairs at k = 2q, 2q+1, 2q+8, 2q+9 of every 16-wide k step; with this order
    # those are exactly the 4 words one selector (i = q) produced, so no data moves between lanes.
    words = tl.permute(words, (0, 1, 3, 2))
    words = tl.reshape(words, (BLOCK_N, 16 * G))
    lo = (words & 0xFFFF).to(tl.uint16)
    hi = (words >> 16).to(tl.uint16)
    halves = tl.reshape(tl.join(lo, hi), (BLOCK_N, 32 * G))
    return halves.to(tl.bfloat16, bitcast=True)


@triton.jit
def lut_bytes(w0, w1, w2, w3, SHAPE: tl.constexpr):
    """The unscaled LUT split into byte words (``prmt2``): once per tile, shared by all its rows.

    Returns uint32 ``(L0, L1, H0, H1)`` of shape ``SHAPE`` (3-D, last axis the 4 selectors; all
    elements equal, identical asm calls on identical inputs are merged): low bytes of entries 0-3,
    4-7, high bytes of entries 0-3, 4-7 (byte ``e % 4`` of each word holds entry ``e``).
    """
    z = tl.full(SHAPE, 0, tl.uint32)
    # prmt reads only bits 0-15 of its selector. Thread-dependent upper bits (the selector index
    # i) keep ptxas from moving the split to the uniform datapath, from where every prmt reading
    # it would get its own copy into a vector register (~64 extra moves per tile). Built inside
    # the asm (3 instructions per tile) rather than hoisted: that costs fewer registers.
    ii = tl.broadcast_to(tl.reshape(tl.arange(0, 4).to(tl.uint32), (1, 1, 4)), SHAPE)
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 k, sl, sh;
        shl.b32 k, $8, 16;
        or.b32 sl, k, 0x6420;
        or.b32 sh, k, 0x7531;
        prmt.b32 $0, $4, $5, sl;
        prmt.b32 $1, $6, $7, sl;
        prmt.b32 $2, $4, $5, sh;
        prmt.b32 $3, $6, $7, sh;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[z + w0, z + w1, z + w2, z + w3, ii],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def e8m0_bf16x2(sc):
    """uint32 word holding the bf16 ``2**(s - 127)`` in both halves, for int32 E8M0 bytes ``s``.

    ``s * 0x00800080`` puts ``s << 7`` (the bf16 exponent field) in each half; ``s == 0`` (the
    subnormal ``2**-127``, bf16 bits 0x0040) is the only value below 0x00400040 (unsigned max).
    """
    return tl.maximum(sc.to(tl.uint32) * 0x00800080, 0x00400040)


@triton.jit
def e8m0_pairs_bf16x2(csu):
    """The bf16 ``2**(s - 127)`` of a word's 4 E8M0 bytes, two per bf16x2 word (``prmt2``, tile loop).

    ``csu``: uint32, bytes ``s0..s3`` (the scales of groups 0-3 of a row). Returns uint32
    ``(even, odd)``: ``even`` holds groups 0 (low half) and 2 (high half), ``odd`` groups 1 and 3.
    Masking the shifted word leaves ``s << 7`` (the bf16 exponent field, 0x7F80 for s = 255 as in
    :func:`e8m0_bf16x2`) in each half; ``max.bf16x2`` with 2**-127 (bits 0x0040, a subnormal:
    bf16 ``max`` has no flush-to-zero) turns the halves of ``s == 0`` (+0.0) into 2**-127.
    """
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 e, o, m;
        shl.b32 e, $2, 7;
        and.b32 e, e, 0x7F807F80;
        shr.b32 o, $2, 1;
        and.b32 o, o, 0x7F807F80;
        mov.b32 m, 0x00400040;
        max.bf16x2 $0, e, m;
        max.bf16x2 $1, o, m;
        }
        """,
        constraints="=r,=r,r",
        args=[csu],
        dtype=(tl.uint32, tl.uint32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def bf16x2_broadcast_half(x, HALF: tl.constexpr):
    """uint32 word with half ``HALF`` (0: low, 1: high) of the bf16x2 word ``x`` in both halves.

    ptxas folds this into the consumer's operand swizzle (``HMUL2 ... R.H0_H0``): no instruction.
    """
    if HALF == 0:
        return tl.inline_asm_elementwise(
            asm="{ .reg .b16 a, b; mov.b32 {a, b}, $1; mov.b32 $0, {a, a}; }",
            constraints="=r,r", args=[x], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            asm="{ .reg .b16 a, b; mov.b32 {a, b}, $1; mov.b32 $0, {b, b}; }",
            constraints="=r,r", args=[x], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def selector_shifts(SHAPE: tl.constexpr):
    """Per-thread shift registers of the ``prmt2`` selectors: ``i``, ``i + 31``, ``i + 30``.

    ``i`` (the selector index) runs along the last axis of ``SHAPE`` (length 4); under the
    MMA's register layout each thread owns one ``i``, so these are loop-invariant registers.
    ``shf.r.wrap`` uses the amount mod 32: ``i + 31`` rotates right by ``i - 1``, ``i + 30`` by ``i - 2``.
    """
    ii = tl.arange(0, 4).to(tl.uint32)
    ii = tl.broadcast_to(tl.reshape(ii, (1, 1, 4)), SHAPE)
    return ii, ii + 31, ii + 30


def _lookup_ptx(selector: str, lut: int) -> str:
    """PTX of one ``prmt2`` decode step: ``selector`` (instructions leaving the selector word in
    ``s``), then the lookup of 8 codes in the LUT byte words ``$lut .. $lut+3`` (l0, l1, h0, h1),
    the bf16x2 interleave and the scale ``$lut+4``, into ``$0..$3``."""
    l0, l1, h0, h1, sc = (f"${lut + j}" for j in range(5))
    return f"""{{
    .reg .b32 a0, a1, a2, x, y, s, s2, lo, hi, lo2, hi2, t0, t1, t2, t3, nz;
{selector}
    shr.b32 s2, s, 16;
    prmt.b32 lo, {l0}, {l1}, s;
    prmt.b32 hi, {h0}, {h1}, s;
    prmt.b32 lo2, {l0}, {l1}, s2;
    prmt.b32 hi2, {h0}, {h1}, s2;
    prmt.b32 t0, lo, hi, 0x5140;
    prmt.b32 t1, lo, hi, 0x7362;
    prmt.b32 t2, lo2, hi2, 0x5140;
    prmt.b32 t3, lo2, hi2, 0x7362;
    mov.b32 nz, 0x80008000;
    fma.rn.bf16x2 $0, t0, {sc}, nz;
    fma.rn.bf16x2 $1, t1, {sc}, nz;
    fma.rn.bf16x2 $2, t2, {sc}, nz;
    fma.rn.bf16x2 $3, t3, {sc}, nz;
}}"""


# prmt2_lookup's PTX: $0..$3 out; $4..$6 planes p0..p2; $7..$9 the per-thread shifts; $10..$13 the
# LUT byte words l0, l1, h0, h1; $14 the bf16x2 scale.
PRMT2_LOOKUP_ASM = tl.constexpr(_lookup_ptx("""
    shr.b32 a0, $4, $7;
    shf.r.wrap.b32 a1, $5, $5, $8;
    shf.r.wrap.b32 a2, $6, $6, $9;
    and.b32 a0, a0, 0x11111111;
    and.b32 a1, a1, 0x22222222;
    and.b32 a2, a2, 0x44444444;
    or.b32 s, a0, a1;
    or.b32 s, s, a2;""", 10))


@triton.jit
def prmt2_lookup(p0, p1, p2, r0, r1, r2, l0, l1, h0, h1, scale_word):
    """Selector, lookup and scale of 8 weights (``prmt2``): 4 bf16x2 words (as ``prmt_lookup``).

    ``p0..p2``: uint32 plane words of one (row, group); ``r0..r2``: :func:`selector_shifts`;
    ``l0, l1, h0, h1``: :func:`lut_bytes` (unscaled); ``scale_word``: the bf16 scale in both halves. The
    selector (nibble ``j`` = code of column ``i + 4j``, bit 3 zero) is
    ``(p0 >> i) & 0x11111111 | rotr(p1, i - 1) & 0x22222222 | rotr(p2, i - 2) & 0x44444444``,
    equal to ``((p0 >> i) & m) | ((p1 >> i) & m) << 1 | ((p2 >> i) & m) << 2`` with ``m =
    0x11111111`` (3 shifts + 3 LOP3 instead of 8 instructions). The looked-up bf16 entries are
    multiplied by the scale afterwards (``fma.rn.bf16x2`` with a -0 addend, the same rounding
    as scaling the LUT first), so the byte split of the LUT is done once per tile, not per row.
    """
    return tl.inline_asm_elementwise(
        asm=PRMT2_LOOKUP_ASM,
        constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r",
        args=[p0, p1, p2, r0, r1, r2, l0, l1, h0, h1, scale_word],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def rotated_selector_masks(SHAPE: tl.constexpr):
    """Per-thread registers of the ``prmt2`` selectors on rotated planes: ``i``, ``m0 = 0x11111111 << i``,
    ``m01 = m0 | rotl(m0, 1)`` and ``m012 = m01 | rotl(m0, 2)`` (``i`` along the last axis of
    ``SHAPE``, as :func:`selector_shifts`)."""
    ii = tl.broadcast_to(tl.reshape(tl.arange(0, 4).to(tl.uint32), (1, 1, 4)), SHAPE)
    m0 = (ii * 0 + 0x11111111) << ii
    m1 = (m0 << 1) | (m0 >> 31)
    m2 = (m0 << 2) | (m0 >> 30)
    return ii, m0, m0 | m1, m0 | m1 | m2


# The same step on rotated planes ($5 = rotl(p1, 1), $6 = rotl(p2, 2)): two bit-selects, a mask
# and one rotation. $7 i; $8 m0; $9 m01; $10 m012 (rotated_selector_masks); $11..$14 the LUT byte
# words; $15 the scale. lop3 0xE4 = (a & c) | (b & ~c).
PRMT2R_LOOKUP_ASM = tl.constexpr(_lookup_ptx("""
    lop3.b32 x, $4, $5, $8, 0xE4;
    lop3.b32 y, x, $6, $9, 0xE4;
    and.b32 y, y, $10;
    shf.r.wrap.b32 s, y, y, $7;""", 11))


@triton.jit
def decode_prmt2(p0, p1, p2, sw, l0, l1, h0, h1, BLOCK_N: tl.constexpr, G: tl.constexpr, ROTATED: tl.constexpr = False):
    """``prmt2`` decoder: the same bfloat16 ``[BLOCK_N, 32 G]`` as :func:`decode_prmt`, bit for bit.

    ``p0, p1, p2``: uint32 ``[BLOCK_N, G]`` plane words (``ROTATED``: planes 1 and 2 as stored by
    ``lutb_kernels.tiles.to_kernel_layout``, rotated left by 1 and 2 bits; the selector then
    takes 4 instead of 6 integer instructions); ``sw``: uint32 ``[BLOCK_N, G]``, the bf16 scale of
    each (row, group) in both halves (:func:`e8m0_bf16x2` or a broadcast half of
    :func:`e8m0_pairs_bf16x2`); ``l0, l1, h0, h1``: the tile's :func:`lut_bytes`, shape
    ``[BLOCK_N, G, 4]``.
    """
    if ROTATED:
        ii, m0, m01, m012 = rotated_selector_masks((BLOCK_N, G, 4))
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            asm=PRMT2R_LOOKUP_ASM,
            constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
            args=[p0[:, :, None], p1[:, :, None], p2[:, :, None], ii, m0, m01, m012, l0, l1, h0, h1, sw[:, :, None]],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
            is_pure=True,
            pack=1,
        )
    else:
        r0, r1, r2 = selector_shifts((BLOCK_N, G, 4))
        o0, o1, o2, o3 = prmt2_lookup(p0[:, :, None], p1[:, :, None], p2[:, :, None], r0, r1, r2, l0, l1, h0, h1,
                                      sw[:, :, None])
    return words_to_decoder_order(o0, o1, o2, o3, BLOCK_N, G)


@triton.jit
def split4(x):
    """The 4 columns of an ``[R, 4]`` tensor (held by one thread: free) as four ``[R]`` tensors."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # a: columns 0, 2; b: 1, 3
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _dot_step(acc, w_op, af, DOT_BF16: tl.constexpr, SWAP_AB: tl.constexpr):
    """``acc`` plus the products of decoded weights ``w_op`` ``[BLOCK_N, k]`` and activations ``af``
    ``[BLOCK_M, k]`` (bf16 tensor cores when ``DOT_BF16``, else float32 for the interpreter);
    ``acc`` is ``[BLOCK_N, BLOCK_M]`` with ``SWAP_AB``, else ``[BLOCK_M, BLOCK_N]``."""
    if DOT_BF16:
        a_op = af.to(tl.bfloat16)
        w_op = w_op.to(tl.bfloat16)
    else:
        a_op = af
        w_op = w_op.to(tl.float32)
    if SWAP_AB:
        acc = tl.dot(w_op, tl.trans(a_op), acc)
    else:
        acc = tl.dot(a_op, tl.trans(w_op), acc)
    return acc


@triton.jit
def _group_loop(acc, a_base, as_base, w_bytes_ptr, w_words_ptr, tile0, rows, gg, valid, k_lo, k_hi,
                BLOCK_N: tl.constexpr, DECODER: tl.constexpr, A_DEQUANTIZED: tl.constexpr, SWAP_AB: tl.constexpr,
                DOT_BF16: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, KERNEL_LAYOUT: tl.constexpr):
    """The per-group K loop (``G`` 32-column groups per step; the first version, any G)."""
    STEPS: tl.constexpr = 4 // G  # K steps per tile
    rg = 4 * rows[:, None] + gg[None, :]  # [BN, G] (row, group) index of the step's first group
    for step in range(k_lo * STEPS, k_hi * STEPS):
        tile = tile0 + step // STEPS
        g0 = (step % STEPS) * G
        tw = tile * 1668
        w0, w1, w2, w3 = load_lut_words(w_words_ptr, tw)
        sc = tl.load(w_bytes_ptr + tile * 6672 + 16 + g0 + rg).to(tl.int32)
        q = 3 * (gg[None, :] + g0)  # [1, G] plane 0 of the step's groups
        p0 = tl.load(w_words_ptr + tw + plane_word(rows[:, None], q, KERNEL_LAYOUT)).to(tl.uint32, bitcast=True)
        p1 = tl.load(w_words_ptr + tw + plane_word(rows[:, None], q + 1, KERNEL_LAYOUT)).to(tl.uint32, bitcast=True)
        p2 = tl.load(w_words_ptr + tw + plane_word(rows[:, None], q + 2, KERNEL_LAYOUT)).to(tl.uint32, bitcast=True)
        if DECODER == 1:
            w_op = decode_prmt(p0, p1, p2, sc, w0, w1, w2, w3, BLOCK_N, G, KERNEL_LAYOUT)
        elif DECODER == 2:
            l0, l1, h0, h1 = lut_bytes(w0, w1, w2, w3, (BLOCK_N, G, 4))
            w_op = decode_prmt2(p0, p1, p2, e8m0_bf16x2(sc), l0, l1, h0, h1, BLOCK_N, G, KERNEL_LAYOUT)
        else:
            w_op = decode_pure(p0, p1, p2, sc, w0, w1, w2, w3, BLOCK_N, G, KERNEL_LAYOUT)

        if A_DEQUANTIZED:  # MXFP8 values already dequantized (bf16 holds them exactly)
            af = tl.load(a_base + step * (32 * G), mask=valid[:, None], other=0.0)
        else:  # e4m3 -> float32, times the block's power of two
            a8 = tl.load(a_base + step * (32 * G), mask=valid[:, None], other=0)
            sa = tl.load(as_base + step * G, mask=valid[:, None], other=0).to(tl.int32)
            af = a8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            af = tl.reshape(tl.reshape(af, (BLOCK_M, G, 32)) * pow2_e8m0_f32(sa)[:, :, None], (BLOCK_M, 32 * G))
        acc = _dot_step(acc, w_op, af, DOT_BF16, SWAP_AB)

    return acc


@triton.jit
def _load_tile_words(w_words_ptr, tw, pv_off, sw_off, CHUNK: tl.constexpr):
    """A tile's words for the per-tile loop (``tw``: its first word): the 4 LUT words, the three
    ``[BLOCK_N, 4]`` plane-word chunks of its rows (words ``4v + j`` of a row's 12; chunk ``v`` at
    ``pv_off + v * CHUNK``) and each row's scale word."""
    w0, w1, w2, w3 = load_lut_words(w_words_ptr, tw)
    c0 = tl.load(w_words_ptr + tw + pv_off)
    c1 = tl.load(w_words_ptr + tw + pv_off + CHUNK)
    c2 = tl.load(w_words_ptr + tw + pv_off + 2 * CHUNK)
    cs = tl.load(w_words_ptr + tw + sw_off)
    return w0, w1, w2, w3, c0, c1, c2, cs


@triton.jit
def _tile_loop(acc, a_base, as_base, w_words_ptr, tile0, rows, valid, k_lo, k_hi,
               BLOCK_N: tl.constexpr, DECODER: tl.constexpr, A_DEQUANTIZED: tl.constexpr, SWAP_AB: tl.constexpr,
               DOT_BF16: tl.constexpr, PREFETCH: tl.constexpr, UNROLL: tl.constexpr, KERNEL_LAYOUT: tl.constexpr):
    """The per-tile K loop over tiles ``k_lo .. k_hi - 1`` of the row of tiles starting at ``tile0``.

    One iteration per tile. Each thread owns whole tile rows: 3 x 16-byte loads fetch the 12
    plane words of a row (4 groups x 3 planes; in the kernel layout each load reads the same
    chunk of consecutive rows, consecutive bytes), one word its 4 scale bytes, so a
    program has 4x (8x with PREFETCH) the bytes in flight of the per-group loop; the 4 groups are
    then decoded and fed to the MMA one at a time (the G == 1 register layout). Returns ``acc``
    plus the range's products.
    """
    jj = tl.arange(0, 4)
    pv_off = plane_word(rows[:, None], jj[None, :], KERNEL_LAYOUT)  # [BN, 4] words 0-3 of the row's planes
    if KERNEL_LAYOUT:  # words 4v + j of a row are CHUNK * v further on
        CHUNK: tl.constexpr = PLANE_CHUNK_WORDS
    else:
        CHUNK: tl.constexpr = 4
    sw_off = 4 + rows  # word holding the row's 4 scale bytes
    if PREFETCH:
        lw0, lw1, lw2, lw3, v0, v1, v2, swd = _load_tile_words(w_words_ptr, (tile0 + k_lo) * 1668, pv_off, sw_off, CHUNK)
    for t in tl.range(k_lo, k_hi, loop_unroll_factor=UNROLL):
        if PREFETCH:
            w0, w1, w2, w3 = lw0, lw1, lw2, lw3
            c0, c1, c2, cs = v0, v1, v2, swd
            twn = (tile0 + tl.minimum(t + 1, k_hi - 1)) * 1668  # the last iteration reloads its own tile
            lw0, lw1, lw2, lw3, v0, v1, v2, swd = _load_tile_words(w_words_ptr, twn, pv_off, sw_off, CHUNK)
        else:
            w0, w1, w2, w3, c0, c1, c2, cs = _load_tile_words(w_words_ptr, (tile0 + t) * 1668, pv_off, sw_off, CHUNK)
        # plane word index 4v + j = 3g + b
        q0, q1, q2, q3 = split4(c0)  # words 0-3: g0 b0,b1,b2; g1 b0
        q4, q5, q6, q7 = split4(c1)  # words 4-7: g1 b1,b2; g2 b0,b1
        q8, q9, q10, q11 = split4(c2)  # words 8-11: g2 b2; g3 b0,b1,b2
        csu = cs.to(tl.uint32, bitcast=True)
        if DECODER == 2:  # once per tile: the LUT's byte split and the 4 groups' bf16 scales
            l0, l1, h0, h1 = lut_bytes(w0, w1, w2, w3, (BLOCK_N, 1, 4))
            s02, s13 = e8m0_pairs_bf16x2(csu)
        for g in tl.static_range(4):
            if g == 0:
                p0, p1, p2 = q0, q1, q2
            elif g == 1:
                p0, p1, p2 = q3, q4, q5
            elif g == 2:
                p0, p1, p2 = q6, q7, q8
            else:
                p0, p1, p2 = q9, q10, q11
            sc = ((csu >> (8 * g)) & 0xFF).to(tl.int32)
            p0 = p0.to(tl.uint32, bitcast=True)[:, None]
            p1 = p1.to(tl.uint32, bitcast=True)[:, None]
            p2 = p2.to(tl.uint32, bitcast=True)[:, None]
            sc = sc[:, None]
            if DECODER == 1:
                w_op = decode_prmt(p0, p1, p2, sc, w0, w1, w2, w3, BLOCK_N, 1, KERNEL_LAYOUT)
            elif DECODER == 2:
                sw = bf16x2_broadcast_half(s02 if g % 2 == 0 else s13, g // 2)[:, None]
                w_op = decode_prmt2(p0, p1, p2, sw, l0, l1, h0, h1, BLOCK_N, 1, KERNEL_LAYOUT)
            else:
                w_op = decode_pure(p0, p1, p2, sc, w0, w1, w2, w3, BLOCK_N, 1, KERNEL_LAYOUT)
            step = t * 4 + g
            if A_DEQUANTIZED:
                af = tl.load(a_base + step * 32, mask=valid[:, None], other=0.0)
            else:
                a8 = tl.load(a_base + step * 32, mask=valid[:, None], other=0)
                sa = tl.load(as_base + step, mask=valid[:, None], other=0).to(tl.int32)
                af = a8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * pow2_e8m0_f32(sa)
            acc = _dot_step(acc, w_op, af, DOT_BF16, SWAP_AB)
    return acc


@triton.jit
def stream_k_run(ntpp, num_blocks, n_units, k_tiles, num_programs, min_run, ROUTE_BLOCK: tl.constexpr,
                 SUBS: tl.constexpr):
    """Stream-K split of a launch: ``(run, items)``.

    The work is the sequence of ``items`` K tiles of every unit (routing sub-block, column block),
    unit-major, over the sub-blocks in use (``num_tokens_post_padded`` on the device); program
    ``p`` takes items ``[p * run, (p + 1) * run)``, ``run = max(ceil(items / num_programs),
    min_run)``. The GEMM and its reduce compute the same split from the same inputs.
    """
    blocks = tl.minimum((ntpp + ROUTE_BLOCK - 1) // ROUTE_BLOCK, num_blocks)
    items = blocks * SUBS * n_units * k_tiles
    run = tl.maximum((items + num_programs - 1) // num_programs, min_run)
    return run, items


@triton.jit
def _unit_partial(a_ptr, as_ptr, w_bytes_ptr, w_words_ptr, sorted_ptr, expert, offs_m, n0, k_lo, k_hi,
                  N, K, num_valid, stride_am, stride_asm,
                  TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DECODER: tl.constexpr,
                  A_PERMUTED: tl.constexpr, A_DEQUANTIZED: tl.constexpr, SWAP_AB: tl.constexpr, DOT_BF16: tl.constexpr,
                  G: tl.constexpr, TILE_LOOP: tl.constexpr, PREFETCH: tl.constexpr, UNROLL: tl.constexpr,
                  KERNEL_LAYOUT: tl.constexpr):
    """Float32 products of one unit (routed rows ``offs_m``, output columns ``n0 .. n0 + BLOCK_N``)
    over its K tiles ``k_lo .. k_hi - 1``: ``(acc, route, valid)``; ``acc`` is ``[BLOCK_N, BLOCK_M]``
    with ``SWAP_AB``, else ``[BLOCK_M, BLOCK_N]``."""
    route = tl.load(sorted_ptr + offs_m)
    valid = route < num_valid
    a_row = (route // TOP_K).to(tl.int64)
    n_tiles = N // 128
    k_tiles = K // 128
    rows = (n0 % 128) + tl.arange(0, BLOCK_N)  # rows inside the tile
    gg = tl.arange(0, G)
    tile0 = (expert.to(tl.int64) * n_tiles + n0 // 128) * k_tiles  # index of tile (expert, n0 // 128, 0)

    kk = tl.arange(0, 32 * G)
    if A_PERMUTED:
        a_cols = kk
    else:  # gather the decoder order by address: position 8w + 2i + h holds column i + 8w + 4h
        kp = kk % 32
        a_cols = kk - kp + (kp % 8) // 2 + 8 * (kp // 8) + 4 * (kp % 2)
    a_base = a_ptr + a_row[:, None] * stride_am + a_cols[None, :]
    as_base = as_ptr + a_row[:, None] * stride_asm + gg[None, :]

    if SWAP_AB:
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    else:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    if BLOCK_M >= 64:
        # Every launch gives a program at least one tile (lut_b_moe_gemm normalises split_k so that no
        # split is empty; stream-K units are non-empty; K >= 128). Said to the compiler, the accumulators'
        # zero initialisation is no longer duplicated on an empty-loop path, which made ptxas serialise
        # every wgmma of unsplit kernels (advisory C7515; offline sm_90: 32 instead of 7 warpgroup waits
        # per tile; bench/results/2026-12-04-sass-wgmma-serialized-cpu.md). Only for the prefill tiles:
        # the decode tiles then take more registers and ran 1-2% slower on the H200.
        tl.assume(k_lo < k_hi)
    if TILE_LOOP:
        acc = _tile_loop(acc, a_base, as_base, w_words_ptr, tile0, rows, valid, k_lo, k_hi, BLOCK_N, DECODER,
                         A_DEQUANTIZED, SWAP_AB, DOT_BF16, PREFETCH, UNROLL, KERNEL_LAYOUT)
    else:
        acc = _group_loop(acc, a_base, as_base, w_bytes_ptr, w_words_ptr, tile0, rows, gg, valid, k_lo, k_hi,
                          BLOCK_N, DECODER, A_DEQUANTIZED, SWAP_AB, DOT_BF16, G, BLOCK_M, KERNEL_LAYOUT)
    return acc, route, valid


@triton.jit
def _unit_offsets(route, valid, n0, N, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """Offsets ``route * N + column`` of a unit's outputs in a row-major ``[*, N]`` array and their
    mask (held rows), in the accumulator's shape (``[BLOCK_N, BLOCK_M]`` with ``SWAP_AB``)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    route64 = route.to(tl.int64)
    if SWAP_AB:
        off = (route64 * N)[None, :] + cols[:, None]
        mask = valid[None, :]
    else:
        off = (route64 * N)[:, None] + cols[None, :]
        mask = valid[:, None]
    return off, mask


@triton.jit
def _store_out(out_ptr, topk_w_ptr, acc, route, valid, n0, stride_om, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr,
               MUL_WEIGHT: tl.constexpr):
    """``out[route, n0:n0+BLOCK_N] = (acc * w[route]).to(out dtype)`` for the held rows."""
    if MUL_WEIGHT:
        w = tl.load(topk_w_ptr + route, mask=valid, other=0.0)
        if SWAP_AB:
            acc = acc * w[None, :]
        else:
            acc = acc * w[:, None]
    off, mask = _unit_offsets(route, valid, n0, stride_om, BLOCK_N, SWAP_AB)
    tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_partial(ws_ptr, slot, acc, route, valid, n0, N, num_valid, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """A split-K partial into its own float32 slice ``ws[slot]`` (no zeroing pass, no float atomics);
    returns the unit's offsets and mask inside a slice (:func:`_unit_offsets`)."""
    off, mask = _unit_offsets(route, valid, n0, N, BLOCK_N, SWAP_AB)
    tl.store(ws_ptr + slot.to(tl.int64) * num_valid * N + off, acc, mask=mask)
    return off, mask


@triton.jit
def _store_partial_and_finish(ws_ptr, counters_ptr, out_ptr, topk_w_ptr, unit, slot, pieces, acc, route, valid, n0, N,
                              num_valid, stride_om, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr,
                              MUL_WEIGHT: tl.constexpr):
    """Deterministic split-K in one launch (stream-K): store this program's partial into its own
    float32 slice ``ws[slot]`` (no zeroing pass, no float atomics), count it on the unit's int32
    counter, and if it was the unit's last of ``pieces`` partials, sum the slices in slot order (the
    same float32 additions whatever order the programs finished in), apply the routed weight, store
    ``out`` and set the counter back to 0 (the buffer is left as found: all zero).

    The fence and the atomic's round trip lengthen every program by a little: that pays in a
    stream-K launch (one wave, where a second launch would wait for the slowest program) and cost
    0.7-3.6% in plain split grids of many waves on the H200, which keep :func:`split_k_reduce_kernel`
    (bench/results/2026-12-04-split-k-fixup-h200.md)."""
    off, mask = _store_partial(ws_ptr, slot, acc, route, valid, n0, N, num_valid, BLOCK_N, SWAP_AB)
    # Every thread's partial is stored before the count says so (the barrier orders the CTA's stores
    # before the release), and the last program reads the others' slices after its acquire.
    tl.debug_barrier()
    arrived = tl.atomic_add(counters_ptr + unit, 1, sem="acq_rel", scope="gpu")
    if arrived == pieces - 1:
        tl.store(counters_ptr + unit, 0)
        total = tl.load(ws_ptr + off, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, pieces):
            total += tl.load(ws_ptr + (s * num_valid).to(tl.int64) * N + off, mask=mask, other=0.0, cache_modifier=".cg")
        _store_out(out_ptr, topk_w_ptr, total, route, valid, n0, stride_om, BLOCK_N, SWAP_AB, MUL_WEIGHT)


# batch-size arguments unspecialised (docs/kernels.md, "One compile per config")
@triton.jit(do_not_specialize=["num_valid", "num_programs", "num_route_blocks"])
def lut_b_moe_gemm_kernel(
    a_ptr,  # uint8 [M, K]: float8_e4m3fn bytes; or [M, K] float values (A_DEQUANTIZED)
    as_ptr,  # uint8 [M, K/32]: E8M0 (unused when A_DEQUANTIZED)
    w_bytes_ptr,  # uint8 [E, N/128, K/128, 6672]
    w_words_ptr,  # int32 view of the same memory, [E, N/128, K/128, 1668]
    out_ptr,  # [num_valid, N] out dtype (SPLIT_K == 1)
    ws_ptr,  # float32 [SPLIT_K, num_valid, N] workspace (SPLIT_K > 1): one slice per partial
    counters_ptr,  # int32 [units] (STREAM_K): partials stored per unit; all zero before and after
    topk_w_ptr,  # float32, flat route index
    sorted_ptr,  # int32 [EM]
    eid_ptr,  # int32 [EM / ROUTE_BLOCK]
    ntpp_ptr,  # int32 [1]
    N,
    K,
    num_valid,
    tiles_per_split,  # K tiles per split; STREAM_K: the least tiles a program runs
    num_programs,  # STREAM_K: programs in the grid
    num_route_blocks,  # EM / ROUTE_BLOCK
    stride_am,
    stride_asm,
    stride_om,
    TOP_K: tl.constexpr,
    ROUTE_BLOCK: tl.constexpr,  # rows per routing block (moe_align_block_size's block_m)
    BLOCK_M: tl.constexpr,  # rows per program (divides ROUTE_BLOCK)
    BLOCK_N: tl.constexpr,  # output columns per program (divides 128)
    SPLIT_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DECODER: tl.constexpr,
    A_PERMUTED: tl.constexpr,
    A_DEQUANTIZED: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_BF16: tl.constexpr,
    G: tl.constexpr,  # 32-column groups per K step: 4 (a whole tile), 2 or 1 (fewer registers)
    TILE_LOOP: tl.constexpr = False,  # one loop iteration per tile: all its words loaded up front (G == 1)
    PREFETCH: tl.constexpr = False,  # TILE_LOOP: load tile t+1's words while decoding tile t
    UNROLL: tl.constexpr = 1,  # TILE_LOOP: tiles per loop iteration after unrolling (1: none)
    STREAM_K: tl.constexpr = False,  # a 1-D grid of num_programs programs walks the work in equal runs
    KERNEL_LAYOUT: tl.constexpr = False,  # tiles in the kernel layout (tiles.to_kernel_layout)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (lutb_kernels._pdl_details)
):
    """Grid ``(EM / ROUTE_BLOCK * SUBS, N / BLOCK_N, SPLIT_K)``: one program per unit (routing
    sub-block of BLOCK_M rows, BLOCK_N output columns) and split; or, with ``STREAM_K``,
    ``(num_programs,)``: program ``p`` runs the K tiles ``[p * run, (p + 1) * run)`` of the
    unit-major tile sequence (:func:`stream_k_run`), storing one partial per unit it touches
    into slice ``p - first(unit)`` of ``ws``, where ``first(unit) = unit * k_tiles // run``."""
    pdl_prologue(PDL)
    SUBS: tl.constexpr = ROUTE_BLOCK // BLOCK_M
    k_tiles = K // 128
    ntpp = tl.load(ntpp_ptr)
    if STREAM_K:
        n_units = N // BLOCK_N
        pid = tl.program_id(0)
        run, items = stream_k_run(ntpp, num_route_blocks, n_units, k_tiles, num_programs, tiles_per_split, ROUTE_BLOCK, SUBS)
        it = pid * run
        end = tl.minimum(it + run, items)
        while it < end:
            unit = it // k_tiles
            k_lo = it - unit * k_tiles
            k_hi = tl.minimum(k_tiles, k_lo + end - it)
            pid0 = unit // n_units
            n0 = (unit % n_units) * BLOCK_N
            blk = pid0 // SUBS
            expert = tl.load(eid_ptr + blk)
            if expert >= 0:
                offs_m = blk * ROUTE_BLOCK + (pid0 % SUBS) * BLOCK_M + tl.arange(0, BLOCK_M)
                acc, route, valid = _unit_partial(
                    a_ptr, as_ptr, w_bytes_ptr, w_words_ptr, sorted_ptr, expert, offs_m, n0, k_lo, k_hi,
                    N, K, num_valid, stride_am, stride_asm, TOP_K, BLOCK_M, BLOCK_N, DECODER, A_PERMUTED,
                    A_DEQUANTIZED, SWAP_AB, DOT_BF16, G, TILE_LOOP, PREFETCH, UNROLL, KERNEL_LAYOUT)
                first = unit * k_tiles // run
                pieces = ((unit + 1) * k_tiles - 1) // run - first + 1
                _store_partial_and_finish(ws_ptr, counters_ptr, out_ptr, topk_w_ptr, unit, pid - first, pieces, acc, route,
                                          valid, n0, N, num_valid, stride_om, BLOCK_N, SWAP_AB, MUL_WEIGHT)
            it += k_hi - k_lo
        return

    pid0 = tl.program_id(0)
    pid_k = tl.program_id(2)
    blk = pid0 // SUBS
    if blk * ROUTE_BLOCK >= ntpp:
        return
    expert = tl.load(eid_ptr + blk)
    if expert < 0:
        return
    n0 = tl.program_id(1) * BLOCK_N
    offs_m = blk * ROUTE_BLOCK + (pid0 % SUBS) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_lo = pid_k * tiles_per_split
    k_hi = tl.minimum(k_lo + tiles_per_split, k_tiles)
    acc, route, valid = _unit_partial(
        a_ptr, as_ptr, w_bytes_ptr, w_words_ptr, sorted_ptr, expert, offs_m, n0, k_lo, k_hi,
        N, K, num_valid, stride_am, stride_asm, TOP_K, BLOCK_M, BLOCK_N, DECODER, A_PERMUTED,
        A_DEQUANTIZED, SWAP_AB, DOT_BF16, G, TILE_LOOP, PREFETCH, UNROLL, KERNEL_LAYOUT)
    if SPLIT_K == 1:
        _store_out(out_ptr, topk_w_ptr, acc, route, valid, n0, stride_om, BLOCK_N, SWAP_AB, MUL_WEIGHT)
    else:  # split_k_reduce_kernel sums the slices (a second launch: see _store_partial_and_finish)
        _store_partial(ws_ptr, pid_k, acc, route, valid, n0, N, num_valid, BLOCK_N, SWAP_AB)


# batch-size arguments unspecialised (docs/kernels.md, "One compile per config")
@triton.jit(do_not_specialize=["num_valid"])
def split_k_reduce_kernel(
    ws_ptr,  # float32 [SPLIT_K, num_valid, N]
    out_ptr,  # [num_valid, N]
    topk_w_ptr,
    sorted_ptr,
    eid_ptr,
    ntpp_ptr,
    N,
    num_valid,
    stride_om,
    ROUTE_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program (divides ROUTE_BLOCK)
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,  # slices to sum
    MUL_WEIGHT: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (lutb_kernels._pdl_details)
):
    """Plain split-K grids: rows of held routes only, ``out[route] = (sum_s ws[s, route] * w[route]).to(out dtype)``,
    slices summed in slice order."""
    pdl_prologue(PDL)
    SUBS: tl.constexpr = ROUTE_BLOCK // BLOCK_R
    pid0 = tl.program_id(0)
    blk = pid0 // SUBS
    pid_n = tl.program_id(1)
    ntpp = tl.load(ntpp_ptr)
    if blk * ROUTE_BLOCK >= ntpp:
        return
    expert = tl.load(eid_ptr + blk)
    if expert < 0:
        return
    route = tl.load(sorted_ptr + blk * ROUTE_BLOCK + (pid0 % SUBS) * BLOCK_R + tl.arange(0, BLOCK_R))
    valid = route < num_valid
    route64 = route.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = valid[:, None] & (cols < N)[None, :]
    off = (route64 * N)[:, None] + cols[None, :]
    acc = tl.load(ws_ptr + off, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + (s * num_valid).to(tl.int64) * N + off, mask=mask, other=0.0)  # 64-bit, as off
    if MUL_WEIGHT:
        wt = tl.load(topk_w_ptr + route, mask=valid, other=0.0)
        acc = acc * wt[:, None]
    tl.store(out_ptr + route64[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
