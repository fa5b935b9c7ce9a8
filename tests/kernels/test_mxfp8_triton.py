"""Triton MXFP8 quantization on the GPU: bit-exact with lutb_kernels.mxfp8 (bf16/fp16/fp32, both modes)."""

from __future__ import annotations

import pytest
import torch

from lutb_kernels.activations import ACTIVATIONS, is_gated
from lutb_kernels.errors import NonFiniteInputError
from lutb_kernels.mxfp8 import mxfp8_qdq, mxfp8_quantize

pytestmark = pytest.mark.gpu


def _x(dtype: torch.dtype, rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    lo, hi = {torch.float32: (-140, 120), torch.bfloat16: (-130, 120), torch.float16: (-24, 14)}[dtype]
    x = x * torch.exp2(torch.randint(lo, hi, (rows, 1), generator=gen).double())
    if rows >= 2 and k >= 128:
        x[0, :32] = 0.0
        x[1, :32] = 448.0 * torch.linspace(-1, 1, 32, dtype=torch.float64)
        x[1, 32:64] = torch.arange(32, dtype=torch.float64) * 2.0 ** -6
        x[1, 64] = 480.0
        x[1, 96:128] = torch.tensor([1.0 + j / 16 for j in range(32)], dtype=torch.float64)
    return x.to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("rows,k", [(1, 128), (7, 2048), (64, 768), (1000, 4096), (8191, 2048)])  # on an H200: 1, 1, 1, 8, 16 rows per program
def test_quantize_bit_exact_gpu(dtype: torch.dtype, mode: str, rows: int, k: int) -> None:
    from lutb_kernels import mxfp8_triton as mt

    x = _x(dtype, rows, k, seed=rows + k)
    q, s = mt.mxfp8_quantize(x, mode)
    q_ref, s_ref = mxfp8_quantize(x, mode)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(mt.mxfp8_qdq(x, mode), mxfp8_qdq(x, mode))
    qd, sd = mt.mxfp8_quantize(x, mode, k_order="decoder")
    qd_ref, _ = mt.mxfp8_quantize_reference(x, mode, k_order="decoder")
    assert torch.equal(qd.view(torch.uint8), qd_ref.view(torch.uint8)) and torch.equal(sd, s_ref)


def test_every_e4m3_value_gpu() -> None:
    from lutb_kernels import mxfp8_triton as mt

    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    x = torch.cat([vals, -vals, torch.full((2,), 448.0)]).reshape(-1, 32).cuda()
    for dtype in (torch.float32, torch.bfloat16):
        q, s = mt.mxfp8_quantize(x.to(dtype))
        q_ref, s_ref = mxfp8_quantize(x.to(dtype))
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_nonfinite_refused_gpu() -> None:
    from lutb_kernels import mxfp8_triton as mt

    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    x[3, 100] = float("inf")
    with pytest.raises(NonFiniteInputError):
        mt.mxfp8_quantize(x)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    mt.mxfp8_qdq(x[:3], nonfinite=flag)
    assert int(flag) == 0


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("where", ["gate", "up"])
def test_act_nan_is_flagged_gpu(activation: str, where: str) -> None:
    """A NaN in h is flagged by every activation: PTX min/max return the non-NaN operand, so relu2's max(h, 0) and
    swigluoai's clamps would have turned it into a finite value (the reference keeps the NaN and refuses it)."""
    from lutb_kernels import mxfp8_triton as mt

    inter = 256
    h = torch.randn(4, 2 * inter if is_gated(activation) else inter, device="cuda").to(torch.bfloat16)
    if activation == "swigluoai":  # gate/up interleaved: gate h[0::2], up h[1::2]
        column = 8 if where == "gate" else 7
    else:  # gate h[:I], up h[I:] (the *_no_mul activations: the whole h, either column)
        column = 7 if where == "gate" or not is_gated(activation) else inter + 7
    h[2, column] = float("nan")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    mt.act_mxfp8_quantize(h, activation, nonfinite=flag)
    assert int(flag) == 1
    flag.zero_()
    mt.act_mxfp8_qdq(h, activation, nonfinite=flag)
    assert int(flag) == 1


@pytest.mark.parametrize("dtype, big, fine", [(torch.bfloat16, 3.38e38, 3.0e38), (torch.float16, 64000.0, 63000.0)])
def test_a_block_rounded_past_the_dtypes_largest_is_flagged_gpu(dtype: torch.dtype, big: float, fine: float) -> None:
    """A value within one e4m3 step of the dtype's largest rounds past it (infinite once dequantized to the model
    dtype, spec steps 2 and 5): flagged by quantize and QDQ, as the reference twins refuse it."""
    from lutb_kernels import mxfp8_triton as mt

    x = torch.randn(3, 256, device="cuda").to(dtype)
    x[1, 100] = fine
    for op in (mt.mxfp8_quantize, mt.mxfp8_qdq):
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        op(x, nonfinite=flag)
        assert int(flag) == 0
    x[1, 100] = big
    for op, ref in ((mt.mxfp8_quantize, mt.mxfp8_quantize_reference), (mt.mxfp8_qdq, mt.mxfp8_qdq_reference)):
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        op(x, nonfinite=flag)
        assert int(flag) == 1
        with pytest.raises(NonFiniteInputError, match="32-block"):
            op(x)
        with pytest.raises(NonFiniteInputError, match="32-block"):
            ref(x)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_act_quantize_gpu(activation: str) -> None:
    from lutb_kernels import mxfp8_triton as mt

    rows, inter = 300, 768
    h = (torch.randn(rows, 2 * inter if is_gated(activation) else inter, device="cuda") * 3).to(torch.bfloat16)
    mask = torch.rand(rows, device="cuda") > 0.3
    q, s = mt.act_mxfp8_quantize(h, activation, row_mask=mask, k_order="decoder")
    q_ref, s_ref = mt.act_mxfp8_quantize_reference(h, activation, row_mask=mask, k_order="decoder")
    assert (q.view(torch.uint8)[mask] != q_ref.view(torch.uint8)[mask]).float().mean() < 0.01
    d = mt.act_mxfp8_qdq(h, activation, row_mask=mask)
    d_ref = mt.act_mxfp8_qdq_reference(h, activation, row_mask=mask)
    err = (d[mask].float() - d_ref[mask].float()).norm() / d_ref[mask].float().norm()
    assert err < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,k", [(255, 256), (16, 7168), (3, 2048)])
def test_dequantize_into_bit_exact_gpu(dtype: torch.dtype, rows: int, k: int) -> None:
    """Every non-NaN code under every scale byte (cycled over the rows), into poisoned memory."""
    from lutb_kernels import mxfp8_triton as mt

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    q = codes[torch.arange(rows * k) % codes.numel()].view(rows, k).view(torch.float8_e4m3fn).cuda()
    scales = (torch.arange(rows * (k // 32)) % 255).to(torch.uint8).view(rows, k // 32).cuda()
    out = torch.full((rows, k), float("nan"), dtype=dtype, device="cuda")
    mt.mxfp8_dequantize_into(q, scales, out)
    want = mt.mxfp8_dequantize_into_reference(q, scales, torch.empty_like(out))
    assert torch.equal(out.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
