"""MXFP8 activations: E4M3 elements with one E8M0 scale per 32-element block (spec section 3).

This is the reference implementation, in plain PyTorch on any device. The
Triton quantizer (``lutb_kernels.mxfp8_triton``) must agree with it bit for bit.

Scale modes (a deployment's checkpoint records which one it uses):

- ``rceil`` (default): ``s = 127 + ceil(log2(amax / 448))``, never saturates.
- ``floor`` (OCP MX v1.0): ``s = 127 + floor(log2(amax)) - 8``; may saturate to +-448.

Both are clamped to 0..254; a block with ``amax == 0`` gets ``s = 0``. Elements
are ``e4m3(x * 2**(127 - s))``, round-to-nearest-even, saturated to +-448.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import numpy as np
import torch

from lutb_kernels.errors import NonFiniteInputError

BLOCK = 32
"""Elements that share one scale."""
E4M3_MAX = 448.0
ScaleMode = Literal["rceil", "floor"]
SCALE_MODES: tuple[str, ...] = get_args(ScaleMode)


def check_scale_mode(scale_mode: str) -> ScaleMode:
    """Return ``scale_mode`` if it names a mode, else raise ValueError listing the modes."""
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown MXFP8 scale mode {scale_mode!r}; expected one of {', '.join(SCALE_MODES)}")
    return scale_mode  # type: ignore[return-value]


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    """floor(log2(v)) for positive finite float32 ``v`` (subnormals included), as int32."""
    _, exp = torch.frexp(v)  # v = m * 2**exp, m in [0.5, 1)
    return exp - 1


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2(v)) for positive finite float32 ``v``, as int32: exact, no log() rounding."""
    mant, exp = torch.frexp(v)
    return torch.where(mant == 0.5, exp - 1, exp)


def mxfp8_scales(amax: torch.Tensor, scale_mode: ScaleMode = "rceil") -> torch.Tensor:
    """E8M0 scale bytes for float32 block maxima ``amax`` (any shape) -> uint8, same shape."""
    check_scale_mode(scale_mode)
    amax = amax.float()
    positive = amax > 0
    safe = torch.where(positive, amax, torch.ones_like(amax))
    if scale_mode == "rceil":
        s = torch.where(safe / E4M3_MAX > 0, 127 + _ceil_log2(safe / E4M3_MAX), 0)  # d underflowing to 0: ceil(log2 0) = -inf -> s = 0
    else:
        s = 127 + _floor_log2(safe) - 8
    s = torch.where(positive, s.clamp(0, 254), torch.zeros_like(s))
    return s.to(torch.uint8)


def mxfp8_quantize(x: torch.Tensor, scale_mode: ScaleMode = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dimension of ``x`` to MXFP8.

    Args:
        x: float tensor ``[..., K]`` (bfloat16, float16 or float32), ``K % 32 == 0``,
            every element finite.
        scale_mode: ``"rceil"`` or ``"floor"``.

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn ``[..., K]``, ``scales`` uint8 ``[..., K/32]``.

    Raises:
        NonFiniteInputError: ``x`` holds NaN or infinity.
        ValueError: ``K`` is not a multiple of 32, or ``x`` is not floating point.
    """
    if not x.is_floating_point():
        raise ValueError(f"MXFP8 quantization needs a float tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"MXFP8 quantization needs a last dimension divisible by {BLOCK}, got {tuple(x.shape)}")
    x32 = x.float()
    if not bool(torch.isfinite(x32).all()):
        raise NonFiniteInputError("MXFP8 quantization refuses NaN or infinite input")
    blocks = x32.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    scales = mxfp8_scales(blocks.abs().amax(dim=-1), scale_mode)
    inv = torch.exp2(127.0 - scales.double()).float()  # 2**(127 - s); finite input gives s <= 247, so exact
    scaled = (blocks * inv.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    q = scaled.to(torch.float8_e4m3fn).reshape(x.shape)
    return q, scales


def _check_elements_and_scales(q: torch.Tensor, scales: torch.Tensor) -> None:
    if q.dtype != torch.float8_e4m3fn or scales.dtype != torch.uint8:
        raise ValueError(f"expected float8_e4m3fn elements and uint8 scales, got {q.dtype} and {scales.dtype}")
    if q.shape[:-1] != scales.shape[:-1] or q.shape[-1] != scales.shape[-1] * BLOCK:
        raise ValueError(f"scales {tuple(scales.shape)} do not match elements {tuple(q.shape)}")


def mxfp8_dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`mxfp8_quantize`: ``float32(q) * 2**(s - 127)``, then converted to ``dtype``.

    Args:
        q: float8_e4m3fn ``[..., K]``.
        scales: uint8 ``[..., K/32]``.
        dtype: output dtype.
    """
    _check_elements_and_scales(q, scales)
    blocks = q.float().reshape(*scales.shape, BLOCK)
    # 2**(s - 127) is a float32 subnormal for s == 0; build it in float64 to keep it exact.
    scale = torch.exp2(scales.double() - 127).float()
    return (blocks * scale.unsqueeze(-1)).reshape(q.shape).to(dtype)


FAST_DEQUANTIZE_MAX_SCALE = 246
"""Largest E8M0 byte :func:`mxfp8_dequantize_fast` handles itself: ``2**(s - 119)`` stays a
normal float32 up to ``s = 246`` (above, it hands over to :func:`mxfp8_dequantize`)."""


def e4m3_nan_count(q: torch.Tensor | np.ndarray) -> int:
    """How many float8_e4m3fn values are NaN (codes 0x7F and 0xFF); one byte pass in the common case.

    ``q``: a float8_e4m3fn tensor, or its codes as a uint8 numpy array (a server's view of the bytes it received:
    no torch call)."""
    codes = q.view(torch.uint8).cpu().numpy() if isinstance(q, torch.Tensor) else q
    magnitude = np.bitwise_and(codes, 0x7F)
    if not magnitude.size or int(magnitude.max()) != 0x7F:  # the common case: one cheap reduction
        return 0
    return int(np.count_nonzero(magnitude == 0x7F))


def mxfp8_dequantize_fast(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`mxfp8_dequantize`'s result, bit for bit, from integer bit operations (:func:`mxfp8_dequantize_into`).

    On the CPU torch converts float8 element by element (~3 ns each); this is ~3x faster
    (``bench/results/2026-12-02-mxfp8-wire-cpu.md``). Scales above :data:`FAST_DEQUANTIZE_MAX_SCALE` go to
    :func:`mxfp8_dequantize` (one host read of the largest scale decides).

    Args:
        q: float8_e4m3fn ``[..., K]`` without NaN codes (0x7F, 0xFF would come out as +-480,
            not NaN: check with :func:`e4m3_nan_count` first).
        scales: uint8 ``[..., K/32]``.
        dtype: output dtype.
    """
    _check_elements_and_scales(q, scales)
    if scales.numel() and int(scales.max()) > FAST_DEQUANTIZE_MAX_SCALE:
        return mxfp8_dequantize(q, scales, dtype)
    # [..., K] as the [M, K] rows mxfp8_dequantize_into takes (M spelled out: K = 0 leaves -1 ambiguous)
    rows = math.prod(q.shape[:-1])
    q2, s2 = (t.reshape(rows, t.shape[-1]) for t in (q, scales))
    q2, s2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q2, s2))
    out = torch.empty((rows, q.shape[-1]), dtype=dtype, device=q.device)
    return mxfp8_dequantize_into(q2, s2, out).view(q.shape)


def check_dequantize_into_args(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """The argument checks of both dequantize-into ops (this module's and :mod:`lutb_kernels.mxfp8_triton`'s):
    shapes, dtypes, devices and row layout, never a value (no host sync)."""
    if q.dtype != torch.float8_e4m3fn or scales.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % BLOCK:
        raise ValueError(f"expected float8_e4m3fn [M, K] (K % {BLOCK} == 0) and uint8 scales, got {q.dtype} "
                         f"{tuple(q.shape)} and {scales.dtype}")
    if tuple(scales.shape) != (q.shape[0], q.shape[1] // BLOCK) or tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"scales {tuple(scales.shape)} and out {tuple(out.shape)} do not match q {tuple(q.shape)}")
    if out.dtype not in (torch.float32, torch.bfloat16, torch.float16) or out.device != q.device or scales.device != q.device:
        raise ValueError(f"out must be float32/bfloat16/float16 on {q.device} with the scales, got {out.dtype} on {out.device}")
    if any(t.shape[1] and t.stride(1) != 1 for t in (q, scales, out)):
        raise ValueError("q, scales and out need contiguous rows")


def mxfp8_dequantize_into(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`mxfp8_dequantize` ``(q, scales, out.dtype)`` written into ``out``, bit for bit, on any device and
    without a host sync (no value is read back): what a compute worker runs on the GPU for MXFP8 input.

    The e4m3 byte, sign-extended to int16 and moved left by 7 bits with bit 14 cleared, is the float16
    with the same sign, exponent and mantissa bits, i.e. the element times ``2**-8`` exactly (subnormals
    included: both formats' subnormals line up); times the float32 ``2**(s - 119)`` built from the scale
    byte's bits that is one exact float32 product, rounded once to ``out.dtype``, as in the reference.

    The Triton twin :func:`lutb_kernels.mxfp8_triton.mxfp8_dequantize_into` takes the same arguments
    (:func:`lutb_kernels.mxfp8_triton.dequantize_into_op` picks one of the two) and this op refuses what it
    refuses, with the same messages; the checks read shapes, dtypes and devices only, never a value.

    Args:
        q: float8_e4m3fn ``[M, K]``, ``K % 32 == 0``, contiguous rows (unit column stride), without NaN
            codes (:func:`e4m3_nan_count`).
        scales: uint8 ``[M, K/32]``, contiguous rows, on ``q``'s device, every byte <=
            :data:`FAST_DEQUANTIZE_MAX_SCALE` (``2**(s - 119)`` must be a normal float32; the caller checks: a
            larger byte gives a wrong result, not an error).
        out: ``[M, K]`` float32/bfloat16/float16, contiguous rows, on ``q``'s device; returned.

    Raises:
        ValueError: an argument of another dtype, shape or device, or rows that are not contiguous.
    """
    check_dequantize_into_args(q, scales, out)
    bits = q.view(torch.int8).to(torch.int16)
    bits <<= 7
    bits &= -0x4001
    scale = ((scales.to(torch.int32) + 8) << 23).view(torch.float32)  # 2**(s - 119)
    blocks = (*scales.shape, BLOCK)
    torch.mul(bits.view(torch.float16).view(blocks), scale.unsqueeze(-1), out=out.view(blocks))  # in float32, rounded once
    return out


def mxfp8_max_finite_scale(dtype: torch.dtype) -> int:
    """The largest E8M0 byte ``s`` at which every e4m3 element (|e| <= 448) dequantizes to a finite ``dtype``
    value, at most :data:`FAST_DEQUANTIZE_MAX_SCALE`: 246 for float32 and bfloat16, 134 for float16. Blocks whose
    scales are all at most this need no NaN/Inf check after :func:`mxfp8_dequantize_into` (NaN codes aside)."""
    limit = torch.finfo(dtype).max
    s = FAST_DEQUANTIZE_MAX_SCALE
    while E4M3_MAX * 2.0 ** (s - 127) > limit:
        s -= 1
    return s


def mxfp8_qdq(x: torch.Tensor, scale_mode: ScaleMode = "rceil") -> torch.Tensor:
    """Round ``x [..., K]`` through MXFP8 and back; returns ``x.dtype``, same shape."""
    q, s = mxfp8_quantize(x, scale_mode)
    return mxfp8_dequantize(q, s, x.dtype)
