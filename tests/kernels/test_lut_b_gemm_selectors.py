"""The integer algebra of the ``prmt2`` LUT-B decoder, emulated on the CPU (no Triton, no GPU).

``prmt2`` (``lutb_kernels/_lut_b_gemm_details/kernels.py``) must give the same bf16 weights as
``prmt`` bit for bit. Its inline PTX cannot run here, so these tests replay its integer steps
in plain Python/torch integers against the ``prmt`` formulas: the selector words, the lookup
(``prmt`` emulated from the PTX ISA: nibble ``n`` of the selector's low 16 bits picks byte
``n & 7`` of the 8-byte pool, bit 3 would replicate that byte's sign) and the bf16 scale words.
The last test (GPU) compares the two decoders' outputs bit for bit on edge scales and LUTs.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

M32 = 0xFFFFFFFF
NIBBLE = 0x11111111


def _edge_words() -> list[int]:
    rng = random.Random(0)
    words = [0, M32, 0x55555555, 0xAAAAAAAA, 0x0F0F0F0F, 0x80000001]
    words += [1 << b for b in range(32)] + [M32 ^ (1 << b) for b in range(32)]
    return words + [rng.getrandbits(32) for _ in range(64)]


def _rotr(x: int, n: int) -> int:
    n &= 31  # shf.r.wrap: the amount mod 32
    return ((x >> n) | (x << (32 - n))) & M32 if n else x


def selector_prmt(p0: int, p1: int, p2: int, i: int) -> int:
    """The ``prmt`` decoder's selector ``i``: nibble ``j`` holds the code of column ``i + 4j``."""
    return ((p0 >> i) & NIBBLE) | (((p1 >> i) & NIBBLE) << 1) | (((p2 >> i) & NIBBLE) << 2)


def selector_prmt2(p0: int, p1: int, p2: int, i: int) -> int:
    """``prmt2_lookup``'s selector: 3 shifts by the per-thread amounts ``i, i + 31, i + 30`` and 3 masks."""
    return ((p0 >> i) & 0x11111111) | (_rotr(p1, i + 31) & 0x22222222) | (_rotr(p2, i + 30) & 0x44444444)


def selector_pre_rotated(p0: int, p1: int, p2: int, i: int) -> int:
    """The variant for a thread that owns all 4 selectors of a group (compile-time ``i``, immediate
    masks): ``B = rotl(p1, 1)``, ``C = rotl(p2, 2)`` once per group, then two bit-selects and one
    rotation per selector. Not used by the kernel (there a thread owns one ``i`` per group)."""
    b, c = _rotr(p1, 31), _rotr(p2, 30)
    m0, m1, m2 = (NIBBLE << i) & M32, _rotr(NIBBLE, 31 - i), _rotr(NIBBLE, 30 - i)
    return _rotr((p0 & m0) | (b & m1) | (c & m2), i)


def selector_stored_rotated(p0: int, p1: int, p2: int, i: int) -> int:
    """``prmt2``'s selector on rotated planes (PRMT2R_LOOKUP_ASM) as stored by ``to_kernel_layout`` (``b = rotl(p1, 1)``,
    ``c = rotl(p2, 2)``), step by step: two bit-selects (``lop3`` 0xE4) with the per-thread masks of
    ``rotated_selector_masks``, a mask, one rotation right by ``i``."""
    b, c = _rotr(p1, 31), _rotr(p2, 30)
    m0 = (NIBBLE << i) & M32
    m01 = m0 | _rotr(m0, 31)
    m012 = m01 | _rotr(m0, 30)
    x = (p0 & m0) | (b & ~m0 & M32)
    y = (x & m01) | (c & ~m01 & M32)
    return _rotr(y & m012, i)


@pytest.mark.parametrize("selector", [selector_prmt2, selector_pre_rotated, selector_stored_rotated])
def test_selectors_match_prmt(selector: Callable[[int, int, int, int], int]) -> None:
    words = _edge_words()
    rng = random.Random(1)
    triples = [(a, a, a) for a in words] + [tuple(rng.choice(words) for _ in range(3)) for _ in range(4000)]
    for p0, p1, p2 in triples:
        for i in range(4):
            want = selector_prmt(p0, p1, p2, i)
            assert want & 0x88888888 == 0  # prmt's sign-replicate bit stays clear
            assert selector(p0, p1, p2, i) == want, (hex(p0), hex(p1), hex(p2), i)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode) on Python ints: only bits 0-15 of ``sel`` are read."""
    pool = a | (b << 32)
    out = 0
    for n in range(4):
        nib = (sel >> (4 * n)) & 0xF
        byte = (pool >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * n)
    return out


def test_prmt2_lookup_decoder_order() -> None:
    """``lut_bytes`` + the lookup of ``prmt2_lookup`` (before the scale) give word ``w`` of selector
    ``i`` = LUT entries of columns ``i + 8w`` (low half) and ``i + 8w + 4`` (high half)."""
    rng = random.Random(2)
    for _ in range(300):
        lut = [rng.getrandbits(16) for _ in range(8)]  # any bf16 bit patterns
        w = [lut[2 * k] | (lut[2 * k + 1] << 16) for k in range(4)]
        p = [rng.getrandbits(32) for _ in range(3)]
        codes = [((p[0] >> c) & 1) | (((p[1] >> c) & 1) << 1) | (((p[2] >> c) & 1) << 2) for c in range(32)]
        for i in range(4):
            hi_bits = i << 16  # lut_bytes' thread-dependent upper selector bits (ignored by prmt)
            l0, l1 = _prmt(w[0], w[1], 0x6420 | hi_bits), _prmt(w[2], w[3], 0x6420 | hi_bits)
            h0, h1 = _prmt(w[0], w[1], 0x7531 | hi_bits), _prmt(w[2], w[3], 0x7531 | hi_bits)
            s = selector_prmt2(*p, i)
            lo, hi = _prmt(l0, l1, s), _prmt(h0, h1, s)
            lo2, hi2 = _prmt(l0, l1, s >> 16), _prmt(h0, h1, s >> 16)
            words = [_prmt(lo, hi, 0x5140), _prmt(lo, hi, 0x7362), _prmt(lo2, hi2, 0x5140), _prmt(lo2, hi2, 0x7362)]
            for k, word in enumerate(words):
                assert word & 0xFFFF == lut[codes[i + 8 * k]]
                assert word >> 16 == lut[codes[i + 8 * k + 4]]


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    """int64 tensor of 16-bit patterns -> bfloat16 (same bits)."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)


def _bf16_max(a: torch.Tensor, b: int) -> torch.Tensor:
    """``max.bf16x2`` of uint32 words (int64 tensor) with the constant word ``b``, half by half
    (torch on the CPU keeps subnormals, as bf16 ``max`` does: it has no flush-to-zero)."""
    halves = _bf16(torch.stack([a & 0xFFFF, a >> 16], -1))
    const = _bf16(torch.tensor([b & 0xFFFF, b >> 16]))
    m = torch.maximum(halves, const).view(torch.int16).to(torch.int64) & 0xFFFF
    return m[..., 0] | (m[..., 1] << 16)


def test_scale_words_match_prmt() -> None:
    """``e8m0_bf16x2`` and ``e8m0_pairs_bf16x2`` give ``prmt``'s bf16 ``2**(s-127)`` for every byte."""
    s = torch.arange(256, dtype=torch.int64)
    sb = torch.where(s == 0, 0x40, s << 7)  # decode_prmt's bf16 bits
    want = sb | (sb << 16)
    assert torch.equal(torch.maximum(s * 0x00800080, torch.tensor(0x00400040)), want)
    # one scale word per row: byte g holds group g's scale; the other bytes are random
    gen = torch.Generator().manual_seed(3)
    for g in range(4):
        other = torch.randint(0, 256, (256, 4), generator=gen, dtype=torch.int64)
        other[:, g] = s
        csu = other[:, 0] | (other[:, 1] << 8) | (other[:, 2] << 16) | (other[:, 3] << 24)
        even = _bf16_max((csu << 7) & 0x7F807F80, 0x00400040)
        odd = _bf16_max((csu >> 1) & 0x7F807F80, 0x00400040)
        word = even if g % 2 == 0 else odd
        half = (word >> (16 * (g // 2))) & 0xFFFF
        assert torch.equal(half, sb)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_loop,groups,block_m,block_n", [(True, 1, 16, 128), (True, 1, 128, 64), (False, 4, 128, 64),
                                                               (False, 2, 64, 128)])
def test_prmt2_equals_prmt_edge_values_gpu(tile_loop: bool, groups: int, block_m: int, block_n: int) -> None:
    """Edge scales (0 = the subnormal 2**-127, 1, 2, ...) and LUTs (+-0, bf16 subnormals, the
    smallest normal) read back through one-hot activations: ``prmt2`` == ``prmt`` bit for bit, and
    both on the same tiles in the kernel layout (``to_kernel_layout``, ``kernel_layout=True``) too."""
    from lutb_kernels import mxfp8_triton as mt
    from lutb_kernels.lut_b_gemm import LutBGemmConfig, lut_b_moe_gemm, random_tiles
    from lutb_kernels.tiles import to_kernel_layout
    from lutb_kernels.routing import moe_align_block_size

    gen = torch.Generator(device="cuda").manual_seed(4)
    w = random_tiles((1, 2, 1), k=128, device="cuda", generator=gen)
    scales = torch.tensor([0, 1, 2, 3, 7, 100, 126, 127, 128, 140], dtype=torch.uint8, device="cuda")
    w[..., 16:528] = scales[torch.randint(0, len(scales), (1, 2, 1, 512), device="cuda", generator=gen)]
    lut_bits = [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x3F80, 0xC0A0, 0x4000]  # +0, -0, subnormals, min normal, ...
    w[0, 1, 0, :16] = torch.tensor([v for b in lut_bits for v in (b & 0xFF, b >> 8)], dtype=torch.uint8, device="cuda")
    x = torch.eye(128, device="cuda")
    q, s = mt.mxfp8_quantize(x, k_order="decoder")
    ids = torch.zeros(128, 1, dtype=torch.int32, device="cuda")
    sorted_ids, expert_ids, ntpp = moe_align_block_size(ids, 128, 1)
    outs = []
    for decoder, rotated in (("prmt", False), ("prmt2", False), ("prmt2", True), ("prmt", True)):
        out = torch.full((128, 256), float("nan"), device="cuda")
        cfg = LutBGemmConfig(block_m=block_m, block_n=block_n, swap_ab=True, decoder=decoder, groups_per_step=groups,
                             tile_loop=tile_loop)
        lut_b_moe_gemm(q, s, to_kernel_layout(w) if rotated else w, out, None, sorted_ids, expert_ids, ntpp, 1, block_m=128,
                       a_k_order="decoder", config=cfg, kernel_layout=rotated)
        outs.append(out)
    assert not outs[0].isnan().any()
    for other in outs[1:]:
        assert torch.equal(outs[0].view(torch.int32), other.view(torch.int32))


@pytest.mark.parametrize("route_block,expected", [(16, "prmt2"), (32, "prmt2"), (64, "prmt2"), (128, "prmt"), (256, "prmt")])
def test_default_config_keeps_prmt_for_prefill_blocks(monkeypatch: pytest.MonkeyPatch, route_block: int, expected: str) -> None:
    """prmt2 was faster at decode-sized routing blocks and slower from 128 rows on (H200 results)."""
    import lutb_kernels.lut_b_gemm as op

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(op, "default_decoder", lambda device: "prmt2")
    monkeypatch.setattr(op, "sm_count", lambda device: 132)
    config = op.default_config(4096, 1536, 2048, 128, route_block, torch.device("cpu"))
    assert config.decoder == expected
