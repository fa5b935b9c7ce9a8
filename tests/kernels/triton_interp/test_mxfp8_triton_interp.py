"""Triton MXFP8 quantization vs lutb_kernels.mxfp8, bit for bit (CPU interpreter)."""

from __future__ import annotations

import re

import pytest
import torch

from lutb_kernels import mxfp8_triton as mt
from lutb_kernels.activations import ACTIVATIONS, is_gated
from lutb_kernels.errors import NonFiniteInputError
from lutb_kernels.mxfp8 import mxfp8_dequantize_into as torch_dequantize_into
from lutb_kernels.mxfp8 import mxfp8_qdq, mxfp8_quantize

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # triton interpreter



def _edge_rows(dtype: torch.dtype, rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    # magnitudes spanning the dtype's range, one per row
    lo, hi = (-140, 120) if dtype == torch.float32 else (-24, 14)
    exps = torch.randint(lo, hi, (rows, 1), generator=gen).double()
    x = x * torch.exp2(exps)
    if rows >= 1 and k >= 64:
        x[0, :32] = 0.0  # a zero block
        x[0, 32:64] = -0.0
    if rows >= 2 and k >= 128:
        x[1, :32] = torch.linspace(-1, 1, 32, dtype=torch.float64)
        x[1, 0] = 448.0  # amax exactly 448: scale 127 (rceil), 119 (floor)
        x[1, 32:64] = 448.0 * 2.0 ** -3
        x[1, 33] = 448.0 * 2.0 ** -3 * (1 + 2.0 ** -7)  # just above a power-of-two multiple of 448
        x[1, 64:96] = torch.arange(32, dtype=torch.float64) * 2.0 ** -6  # e4m3 ties
        x[1, 64] = 480.0  # floor mode saturates at +-448
        x[1, 96:128] = torch.tensor([1.0 + j / 16 for j in range(32)], dtype=torch.float64)  # halfway cases
    if rows >= 3 and dtype == torch.float32 and k >= 96:
        tiny = 2.0 ** -149
        x[2, :32] = tiny * torch.arange(32, dtype=torch.float64)  # float32 subnormals, d underflows
        x[2, 32:64] = 2.0 ** -120 * torch.linspace(-1, 1, 32, dtype=torch.float64)  # d subnormal
        x[2, 64:96] = 1.75 * 2.0 ** -119 * (1 + torch.arange(32, dtype=torch.float64) * 2.0 ** -23)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("rows", [0, 1, 4, 7])
def test_quantize_bit_exact(dtype: torch.dtype, mode: str, rows: int) -> None:
    x = _edge_rows(dtype, rows, 160, seed=rows)
    q, s = mt.mxfp8_quantize(x, mode)
    q_ref, s_ref = mxfp8_quantize(x, mode)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(_bits(mt.mxfp8_qdq(x, mode)), _bits(mxfp8_qdq(x, mode)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns (``torch.equal`` on floats takes -0.0 for +0.0)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def test_negative_values_that_round_to_zero_keep_their_sign() -> None:
    """A negative value below half the block's smallest step quantizes to e4m3 -0 (0x80) and dequantizes to
    -0.0, as the reference does (Triton's unary minus, 0 - x, once gave +0.0)."""
    x = torch.zeros(2, 64)
    x[:, 0] = 1.0
    x[0, 1], x[1, 40] = -1e-6, -0.0
    x[1, 32] = -3.0
    out, ref = mt.mxfp8_qdq(x), mxfp8_qdq(x)
    assert torch.equal(_bits(out), _bits(ref))
    assert out[0, 1].item() == 0.0 and torch.signbit(out[0, 1]) and torch.signbit(out[1, 40])


@pytest.mark.parametrize("shape", [(3, 0), (2, 0, 0), (0, 0)])
def test_no_columns_gives_the_references_empty_result(shape: tuple[int, ...]) -> None:
    x = torch.zeros(shape)
    q, s = mt.mxfp8_quantize(x)
    q_ref, s_ref = mxfp8_quantize(x)
    assert q.shape == q_ref.shape and s.shape == s_ref.shape and q.dtype == q_ref.dtype
    assert mt.mxfp8_qdq(x).shape == mxfp8_qdq(x).shape == shape
    if x.dim() == 2:  # the activation kernel takes [R, 2I]: gate and up of width 0
        assert mt.act_mxfp8_qdq(x, "silu").shape == shape


def test_quantize_every_e4m3_value_roundtrips() -> None:
    # all 126 positive finite codes and their negatives, block amax 448 -> scale 127 (x1)
    codes = torch.arange(0, 127, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    x = torch.cat([vals, -vals, torch.full((2,), 448.0)]).reshape(-1, 32)
    q, s = mt.mxfp8_quantize(x)
    q_ref, s_ref = mxfp8_quantize(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_decoder_order_and_row_weight() -> None:
    x = torch.randn(5, 128, dtype=torch.float16)
    w = torch.rand(5)
    q, s = mt.mxfp8_quantize(x, k_order="decoder", row_weight=w)
    q_ref, s_ref = mt.mxfp8_quantize_reference(x, k_order="decoder", row_weight=w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    order = mt.decoder_column_order(128)
    assert sorted(order.tolist()) == list(range(128)) and order[:9].tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_refused(bad: float) -> None:
    x = torch.randn(3, 64)
    x[2, 40] = bad
    with pytest.raises(NonFiniteInputError):
        mt.mxfp8_quantize(x)
    with pytest.raises(NonFiniteInputError):
        mt.mxfp8_qdq(x)
    flag = torch.zeros(1, dtype=torch.int32)
    mt.mxfp8_quantize(x, nonfinite=flag)  # collects instead of raising
    assert int(flag) == 1
    flag.zero_()
    mt.mxfp8_quantize(x[:2], nonfinite=flag)
    assert int(flag) == 0


@pytest.mark.parametrize("op", ["quantize", "qdq", "act_quantize", "act_qdq"])
def test_a_block_rounded_past_float16s_largest_is_flagged(op: str) -> None:
    """64000 in float16 quantizes to 256 x 2^8 = 65536, infinite once dequantized to float16 (spec steps 2 and 5):
    every op flags it (collected or raised) as its reference twin refuses it; 63000 (to 61440) is not flagged."""
    run = {
        "quantize": (mt.mxfp8_quantize, mt.mxfp8_quantize_reference, ()),
        "qdq": (mt.mxfp8_qdq, mt.mxfp8_qdq_reference, ()),
        "act_quantize": (mt.act_mxfp8_quantize, mt.act_mxfp8_quantize_reference, ("silu_no_mul",)),
        "act_qdq": (mt.act_mxfp8_qdq, mt.act_mxfp8_qdq_reference, ("silu_no_mul",)),
    }[op]
    fast, ref, extra = run
    x = torch.randn(3, 64).half()
    x[2, 40] = 63000.0
    flag = torch.zeros(1, dtype=torch.int32)
    fast(x, *extra, nonfinite=flag)
    ref(x, *extra)
    assert int(flag) == 0
    x[2, 40] = 64000.0
    fast(x, *extra, nonfinite=flag)
    assert int(flag) == 1
    for f in (fast, ref):
        with pytest.raises(NonFiniteInputError, match="32-block"):
            f(x, *extra)


def test_activation_of_another_rank_and_integer_outputs_refused() -> None:
    """act_rounded took a [2, 3, 64] h and answered [6, 64] (its siblings refuse anything but [R, N]); the QDQ ops
    wrote an integer out_dtype, truncating every value, where their twins fail later or not at all."""
    h = torch.randn(2, 3, 64)
    for fn in (mt.act_rounded, mt.act_rounded_reference, mt.act_mxfp8_qdq):
        with pytest.raises(ValueError, match=r"\[R, N\]"):
            fn(h, "silu_no_mul")
    x = torch.randn(2, 64)
    for fn in (mt.mxfp8_qdq, mt.mxfp8_qdq_reference):
        with pytest.raises(ValueError, match="out_dtype"):
            fn(x, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="out_dtype"):
        mt.act_mxfp8_qdq(x, "silu_no_mul", out_dtype=torch.int8)


def test_bad_arguments_refused() -> None:
    with pytest.raises(ValueError):
        mt.mxfp8_quantize(torch.randn(2, 48))
    with pytest.raises(ValueError):
        mt.mxfp8_quantize(torch.randn(2, 64).to(torch.int32))
    with pytest.raises(ValueError):
        mt.mxfp8_quantize(torch.randn(2, 64), "nearest")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        mt.mxfp8_quantize(torch.randn(2, 64), k_order="sorted")  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # sigmoid of large negative inputs: inf, then 0
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_act_quantize_matches_reference(activation: str) -> None:
    rows, inter = 6, 64
    h = (torch.randn(rows, 2 * inter if is_gated(activation) else inter) * 3).to(torch.float16)
    mask = torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.bool)
    q = torch.full((rows, inter), 0x7F, dtype=torch.uint8)  # poison: NaN codes
    qq, s = mt.act_mxfp8_quantize(h, activation, row_mask=mask, k_order="decoder")
    q_ref, s_ref = mt.act_mxfp8_quantize_reference(h, activation, row_mask=mask, k_order="decoder")
    q8, r8 = qq.view(torch.uint8)[mask], q_ref.view(torch.uint8)[mask]
    # float32 exp/erf may differ by an ulp, which can flip a rounding of g to float16
    assert (q8 != r8).float().mean() < 0.02
    assert (s[mask].int() - s_ref[mask].int()).abs().max() <= 1
    del q
    d = mt.act_mxfp8_qdq(h, activation, row_mask=mask)
    d_ref = mt.act_mxfp8_qdq_reference(h, activation, row_mask=mask)
    err = (d[mask].float() - d_ref[mask].float()).norm() / d_ref[mask].float().norm().clamp_min(1e-30)
    assert err < 1e-2
    plain = mt.act_rounded(h, activation)
    assert torch.allclose(plain.float(), mt.act_rounded_reference(h, activation).float(), rtol=2e-3, atol=1e-4)


def test_act_masked_rows_untouched_and_unflagged() -> None:
    h = torch.randn(4, 128, dtype=torch.float32)
    h[1] = float("nan")  # a row nobody routed: garbage must not raise
    mask = torch.tensor([True, False, True, True])
    flag = torch.zeros(1, dtype=torch.int32)
    out = mt.act_mxfp8_qdq(h, "silu", row_mask=mask, nonfinite=flag)
    assert int(flag) == 0
    assert torch.equal(out[mask], mt.act_mxfp8_qdq_reference(h, "silu", row_mask=mask)[mask])
    with pytest.raises(NonFiniteInputError):
        mt.act_mxfp8_qdq(h, "silu")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # silu of the edge rows' -2**100
@pytest.mark.parametrize("programs_per_sm", [0, 8])  # 0: blocks of 2-4 rows (fitted to the batch); 8: one row each here
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_row_blocks_give_the_reference_bytes(monkeypatch: pytest.MonkeyPatch, rows: int, programs_per_sm: int) -> None:
    """Any rows per program (fitted to the batch, or shrunk to fill the GPU) gives the same bytes: quantize in
    decoder order, QDQ with a row weight, and the gated activation's QDQ with a row mask, each against its
    reference."""
    monkeypatch.setattr(mt, "QDQ_PROGRAMS_PER_SM", programs_per_sm)
    x = _edge_rows(torch.float32, rows, 64, seed=rows)
    h = _edge_rows(torch.float32, rows, 128, seed=rows + 7)
    weight = torch.rand(rows, generator=torch.Generator().manual_seed(rows))
    mask = torch.arange(rows) % 2 == 0
    q, s = mt.mxfp8_quantize(x, k_order="decoder")
    q_ref, s_ref = mt.mxfp8_quantize_reference(x, k_order="decoder")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert torch.equal(mt.mxfp8_qdq(x, row_weight=weight), mt.mxfp8_qdq_reference(x, row_weight=weight))
    got = mt.act_mxfp8_qdq(h, "silu", row_mask=mask)[mask]  # masked rows are left unwritten
    assert torch.equal(got, mt.act_mxfp8_qdq_reference(h, "silu", row_mask=mask)[mask])


def _every_code_under_every_scale(columns: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Row s (0..254): the 254 non-NaN e4m3 codes (both signs, subnormals, zeros), and more, under scale byte s."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = codes.repeat(-(-columns // codes.numel()))[:columns]
    q = codes.view(torch.float8_e4m3fn).repeat(255, 1)
    return q, torch.arange(255, dtype=torch.uint8)[:, None].expand(255, columns // 32).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16 is checked on the GPU (the interpreter's bf16)
@pytest.mark.parametrize("columns", [32, 96, 256])
def test_dequantize_into_equals_the_reference_on_every_code_and_scale(dtype: torch.dtype, columns: int) -> None:
    q, scales = _every_code_under_every_scale(columns)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    assert mt.mxfp8_dequantize_into(q, scales, out) is out
    want = mt.mxfp8_dequantize_into_reference(q, scales, torch.empty_like(out))
    # bit for bit: signed zeros, subnormal scales and (float16, s >= 143) infinities included
    assert torch.equal(out.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


def _wide_rows(t: torch.Tensor, columns: int) -> torch.Tensor:
    """``t`` [M, K] as the first K columns of an [M, columns] buffer (rows contiguous, not the tensor)."""
    raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    wide = torch.zeros((t.shape[0], columns), dtype=raw.dtype)
    wide[:, : t.shape[1]] = raw
    return wide[:, : t.shape[1]].view(t.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter's bf16 is not the GPU's
@pytest.mark.parametrize("op", ["triton", "torch"])
def test_dequantize_into_of_no_rows_and_bad_arguments(op: str, dtype: torch.dtype) -> None:
    """The two ops ``dequantize_into_op`` picks from (one Triton launch on CUDA, torch ops elsewhere) take the same
    arguments: both accept rows of a wider buffer and refuse the same calls with the same messages, writing nothing."""
    into = {"triton": mt.mxfp8_dequantize_into, "torch": torch_dequantize_into}[op]
    q, scales = _every_code_under_every_scale(64)
    q, scales = q[:200].contiguous(), scales[:200].contiguous()  # scale bytes 0..199 (the torch ops' limit is 246)
    m = q.shape[0]
    want = mt.mxfp8_dequantize_into_reference(q, scales, torch.empty(q.shape, dtype=dtype))
    assert into(q[:0], scales[:0], torch.empty(0, 64, dtype=dtype)).shape == (0, 64)
    wide = torch.full((m, 80), float("nan"), dtype=dtype)
    out = wide[:, :64]
    assert into(_wide_rows(q, 96), _wide_rows(scales, 3), out) is out
    assert torch.equal(out.contiguous().view(torch.uint8), want.view(torch.uint8))
    assert wide[:, 64:].isnan().all()  # nothing written past the rows' ends

    expected = "expected float8_e4m3fn [M, K] (K % 32 == 0) and uint8 scales, got "
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    bad = [
        ((q, scales[:, :1], out), f"scales ({m}, 1) and out ({m}, 64) do not match q ({m}, 64)"),
        ((q, scales, torch.full((64, m), float("nan"), dtype=dtype)), f"scales ({m}, 2) and out (64, {m}) do not match q ({m}, 64)"),
        ((q.view(torch.uint8), scales, out), expected + f"torch.uint8 ({m}, 64) and torch.uint8"),
        ((q.view(1, m, 64), scales.view(1, m, 2), out.view(1, m, 64)), expected + f"torch.float8_e4m3fn (1, {m}, 64) and torch.uint8"),
        ((q[:, :48], scales, out), expected + f"torch.float8_e4m3fn ({m}, 48) and torch.uint8"),
        ((q, scales.int(), out), expected + f"torch.float8_e4m3fn ({m}, 64) and torch.int32"),
        ((q, scales, out.int()), "out must be float32/bfloat16/float16 on cpu with the scales, got torch.int32 on cpu"),
        ((q, scales, out.to("meta")), f"out must be float32/bfloat16/float16 on cpu with the scales, got {dtype} on meta"),
        ((q, scales.to("meta"), out), f"out must be float32/bfloat16/float16 on cpu with the scales, got {dtype} on cpu"),
        ((q, scales, torch.full((64, m), float("nan"), dtype=dtype).t()), "q, scales and out need contiguous rows"),
        ((q.view(torch.uint8).t().contiguous().t().view(torch.float8_e4m3fn), scales, out), "q, scales and out need contiguous rows"),
        ((q, scales.t().contiguous().t(), out), "q, scales and out need contiguous rows"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            into(*args)
        assert args[2].is_meta or args[2].dtype == torch.int32 or args[2].isnan().all(), message
