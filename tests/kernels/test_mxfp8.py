"""MXFP8 quantization against an independent pure-Python implementation of spec section 3."""

from __future__ import annotations

import math

import pytest
import torch

from lutb_kernels.errors import NonFiniteInputError
from lutb_kernels.mxfp8 import (
    FAST_DEQUANTIZE_MAX_SCALE,
    e4m3_nan_count,
    mxfp8_dequantize,
    mxfp8_dequantize_fast,
    mxfp8_dequantize_into,
    mxfp8_max_finite_scale,
    mxfp8_qdq,
    mxfp8_quantize,
)


def _e4m3_values() -> list[float]:
    """Every finite non-negative float8_e4m3fn value, ascending (bits 0x00..0x7E)."""
    values = []
    for bits in range(0x7F):
        exp, mant = bits >> 3, bits & 7
        values.append(mant / 8 * 2.0**-6 if exp == 0 else (1 + mant / 8) * 2.0 ** (exp - 7))
    return values


_E4M3 = _e4m3_values()


def _round_e4m3(v: float) -> float:
    """Round to nearest e4m3, ties to even mantissa, saturating at 448."""
    a = min(abs(v), 448.0)
    lo = max(i for i, e in enumerate(_E4M3) if e <= a)
    if lo == len(_E4M3) - 1 or a == _E4M3[lo]:
        r = _E4M3[lo]
    else:
        below, above = _E4M3[lo], _E4M3[lo + 1]
        if a - below < above - a:
            r = below
        elif a - below > above - a:
            r = above
        else:
            r = below if lo % 2 == 0 else above
    return math.copysign(r, v)


def _f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def _scale_byte(amax: float, mode: str) -> int:
    if amax == 0:
        return 0
    if mode == "rceil":
        d = _f32(amax / 448.0)  # float32 division, as the spec says
        m, e = math.frexp(d)
        s = 127 + (e - 1 if m == 0.5 else e)
    else:
        s = 127 + (math.frexp(amax)[1] - 1) - 8
    return min(max(s, 0), 254)


def _python_quantize(row: list[float], mode: str) -> tuple[list[float], list[int]]:
    elems, scales = [], []
    for start in range(0, len(row), 32):
        block = row[start : start + 32]
        s = _scale_byte(max(abs(v) for v in block), mode)
        scales.append(s)
        elems += [_round_e4m3(_f32(v * 2.0 ** (127 - s))) for v in block]
    return elems, scales


def _inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 96, generator=gen)
    heavy = torch.distributions.StudentT(2.0).sample((4, 64))
    wide = base[:4, :64] * torch.exp2(torch.randint(-130, 120, (4, 64), generator=gen).float())
    zeros = torch.zeros(2, 32)
    mixed = torch.cat([torch.zeros(1, 32), torch.full((1, 32), 448.0), torch.full((1, 32), 449.0), torch.full((1, 32), 1e-40)], 1)
    return [base, base * 1e-3, base * 1e4, heavy, wide, zeros, mixed]


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("case", range(7))
def test_quantize_matches_python_reference(mode: str, case: int) -> None:
    x = _inputs(seed=case)[case]
    q, s = mxfp8_quantize(x, mode)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
    assert q.shape == x.shape and s.shape == (x.shape[0], x.shape[1] // 32)
    for r in range(x.shape[0]):
        elems, scales = _python_quantize(x[r].tolist(), mode)
        assert s[r].tolist() == scales
        assert q[r].float().tolist() == elems


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_qdq_returns_input_dtype_and_bounded_error(dtype: torch.dtype) -> None:
    x = torch.randn(17, 256).to(dtype)
    y = mxfp8_qdq(x)
    assert y.dtype == dtype and y.shape == x.shape
    rel = ((y.float() - x.float()).norm() / x.float().norm()).item()
    assert 0 < rel < 0.05  # 3 mantissa bits: ~2-3% relative RMS error


def test_dequantize_is_elements_times_power_of_two() -> None:
    x = torch.randn(3, 64)
    q, s = mxfp8_quantize(x)
    expected = q.float() * torch.exp2(s.double() - 127).float().repeat_interleave(32, 1)
    assert torch.equal(mxfp8_dequantize(q, s), expected)


def test_rceil_never_saturates_and_floor_can() -> None:
    x = torch.full((1, 32), 511.0)
    q_r, s_r = mxfp8_quantize(x, "rceil")
    q_f, s_f = mxfp8_quantize(x, "floor")
    assert s_r.item() == 127 + 1 and q_r.float()[0, 0].item() == 256.0  # 511 / 2 = 255.5 -> 256
    assert s_f.item() == 127 and q_f.float()[0, 0].item() == 448.0  # saturated


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(bad: float) -> None:
    x = torch.randn(2, 64)
    x[1, 40] = bad
    with pytest.raises(NonFiniteInputError, match="NaN or infinite"):
        mxfp8_quantize(x)


@pytest.mark.parametrize("shape", [(3, 33), (31,), ()])
def test_bad_shapes_are_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        mxfp8_quantize(torch.zeros(shape))


def test_empty_batch() -> None:
    q, s = mxfp8_quantize(torch.zeros(0, 64))
    assert q.shape == (0, 64) and s.shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fast_dequantize_equals_the_reference_on_every_code_and_scale(dtype: torch.dtype) -> None:
    """All 254 non-NaN e4m3 codes (both signs, subnormals, zeros) under every scale byte 0..254."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = torch.cat([codes, codes[torch.randperm(codes.numel())][:2]])  # 256 = 8 blocks of 32
    q = codes.view(torch.float8_e4m3fn).repeat(255, 1)  # row s: every code, scale byte s
    scales = torch.arange(255, dtype=torch.uint8)[:, None].expand(255, codes.numel() // 32).contiguous()
    for rows in (slice(0, 247), slice(247, 255)):  # the bit path (s <= 246), the hand-over to the reference above
        got, want = mxfp8_dequantize_fast(q[rows], scales[rows], dtype), mxfp8_dequantize(q[rows], scales[rows], dtype)
        assert got.dtype == want.dtype == dtype
        # bit for bit, infinities (fp16 overflows from s ~ 143) and signed zeros included
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


def test_fast_dequantize_random_blocks_and_shapes() -> None:
    x = torch.randn(3, 5, 96) * torch.logspace(-30, 30, 96)
    q, s = mxfp8_quantize(x)
    assert torch.equal(mxfp8_dequantize_fast(q, s, torch.bfloat16).view(torch.int16), mxfp8_dequantize(q, s, torch.bfloat16).view(torch.int16))
    with pytest.raises(ValueError, match="do not match"):
        mxfp8_dequantize_fast(q, s[..., :2])


def _every_code_under_every_fast_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """Row s: all 254 non-NaN e4m3 codes (and two repeated, 256 = 8 blocks) under scale byte s, s = 0..246."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = torch.cat([codes, codes[:2]])
    rows = FAST_DEQUANTIZE_MAX_SCALE + 1
    q = codes.view(torch.float8_e4m3fn).repeat(rows, 1)
    return q, torch.arange(rows, dtype=torch.uint8)[:, None].expand(rows, codes.numel() // 32).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_into_writes_the_reference_into_out(dtype: torch.dtype) -> None:
    q, scales = _every_code_under_every_fast_scale()
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    assert mxfp8_dequantize_into(q, scales, out) is out
    want = mxfp8_dequantize(q, scales, dtype)
    assert torch.equal(out.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


@pytest.mark.parametrize(("dtype", "largest"), [(torch.bfloat16, 246), (torch.float32, 246), (torch.float16, 134)])
def test_max_finite_scale_is_the_last_scale_without_overflow(dtype: torch.dtype, largest: int) -> None:
    assert mxfp8_max_finite_scale(dtype) == largest
    q, scales = _every_code_under_every_fast_scale()
    finite = torch.isfinite(mxfp8_dequantize(q, scales, dtype).float()).all(dim=1)
    assert bool(finite[: largest + 1].all())  # every code at every scale up to it
    assert largest == FAST_DEQUANTIZE_MAX_SCALE or not bool(finite[largest + 1])  # and the next one overflows


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_into_on_the_gpu_equals_the_reference(dtype: torch.dtype) -> None:
    """What a compute worker runs for MXFP8 input carried to the device: bit for bit the CPU reference."""
    q, scales = _every_code_under_every_fast_scale()
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    mxfp8_dequantize_into(q.cuda(), scales.cuda(), out)
    want = mxfp8_dequantize(q, scales, dtype)
    assert torch.equal(out.cpu().view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


def test_e4m3_nan_count_finds_both_nan_codes() -> None:
    codes = torch.tensor([0x00, 0x7F, 0x7E, 0xFF, 0x80, 0xFE], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert e4m3_nan_count(codes) == 2
    assert e4m3_nan_count(codes.view(torch.uint8).numpy()) == 2  # the codes as a server reads them off the wire
    assert e4m3_nan_count(codes[:0]) == 0
    assert int(torch.isnan(codes.float()).sum()) == 2  # the same two, by torch's own conversion
