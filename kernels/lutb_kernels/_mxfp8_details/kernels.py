"""Triton kernels: MXFP8 quantization (optionally fused with the MoE activation).

Everything that decides a bit of the result is integer arithmetic on the float32
bit patterns, so the CPU interpreter (``TRITON_INTERPRET=1``, whose float8
conversion neither rounds to nearest even nor saturates) and every GPU give the
bytes of :func:`lutb_kernels.mxfp8.mxfp8_quantize`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lutb_kernels._pdl_details import pdl_prologue

# Activation ids (constexpr ACT); 0 = none (quantize the input as it is).
ACT_IDS = {
    None: 0,
    "silu": 1,
    "gelu": 2,
    "gelu_tanh": 3,
    "swigluoai": 4,
    "silu_no_mul": 5,
    "gelu_no_mul": 6,
    "relu2_no_mul": 7,
}
SCALE_MODE_IDS = {"rceil": 0, "floor": 1}
# Output modes (constexpr OUT_MODE).
OUT_MXFP8 = 0  # float8 codes + E8M0 scales
OUT_QDQ = 1  # dequantized values in the model dtype
OUT_PLAIN = 2  # the activation rounded to the model dtype, not quantized (bf16 peers)

# rceil scale of a block whose ``amax / 448`` rounds to 0 in float32 (amax <= 224 * 2**-149):
# spec section 3 reads clamp(127 + ceil(log2(0))) = clamp(-inf) = 0, and so does the reference.
RCEIL_UNDERFLOW_SCALE = 0


@triton.jit
def e8m0_scale(amax, SCALE_MODE: tl.constexpr, UNDERFLOW_SCALE: tl.constexpr):
    """E8M0 byte (int32) for finite float32 block maxima ``amax >= 0``, from the bits alone."""
    bits = amax.to(tl.int32, bitcast=True)
    eb = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    if SCALE_MODE == 0:
        # rceil: s = 127 + ceil(log2(fl32(amax / 448))). amax = f * 2**(eb-127) and 448 = 1.75 * 2**8,
        # so for a normal quotient s = eb - 8 + (f > 1.75); float32 rounding of the quotient never
        # moves it across a power of two there (its distance to one is > half an ulp).
        s_big = eb - 8 + (mant > 0x600000).to(tl.int32)
        # eb <= 9: the quotient may be subnormal. amax = A * 2**-149 with A an integer < 2**32;
        # the quotient in units of 2**-149 is A / 448, rounded to nearest even.
        small = eb <= 9
        shift = tl.where(small & (eb > 0), eb - 1, 0).to(tl.int64)
        a_int = tl.where(eb > 0, mant | 0x800000, mant).to(tl.int64) << shift
        q = a_int // 448
        r = a_int - q * 448
        q = q + ((r > 224) | ((r == 224) & ((q & 1) == 1))).to(tl.int64)
        s_small = tl.where(q > (1 << 23), 2, tl.where(q > (1 << 22), 1, 0))
        s_small = tl.where(q == 0, UNDERFLOW_SCALE, s_small)
        s = tl.where(small, s_small, s_big)
    else:
        # floor (OCP): s = 127 + floor(log2(amax)) - 8; subnormal amax clamps to 0.
        s = eb - 8
    s = tl.minimum(tl.maximum(s, 0), 254)
    return tl.where(amax > 0, s, 0)


@triton.jit
def pow2_from_e8m0(s):
    """float32 ``2**(s - 127)`` for int32 E8M0 bytes 0..254 (byte 0 is the subnormal 2**-127)."""
    bits = tl.where(s == 0, 0x400000, s << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def inv_pow2_from_e8m0(s):
    """float32 ``2**(127 - s)`` for int32 E8M0 bytes 0..254."""
    bits = tl.where(s == 254, 0x400000, (254 - s) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_rne(v):
    """Round float32 ``v`` to float8_e4m3fn, nearest-even, saturating at +-448.

    Returns ``(code, value)``: the int32 byte (sign in bit 7) and the float32 value it stands for.
    """
    u = v.to(tl.int32, bitcast=True)
    neg = u < 0
    a = tl.minimum(u & 0x7FFFFFFF, 0x43E00000)  # |v| clamped to 448 (bit order = value order)
    # Normal range (|v| >= 2**-6): keep 3 mantissa bits, ties to even.
    ur = a + 0x7FFFF + ((a >> 20) & 1)
    code_n = (ur >> 20) - 960  # (exp - 120) << 3 | mantissa
    val_n = (ur & 0x7FF00000).to(tl.float32, bitcast=True)
    # Subnormal range: code = rne(|v| * 2**9), 0..8 (8 is the smallest normal, code 0x08).
    e = a >> 23
    m = tl.where(e > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
    sh = tl.minimum(tl.maximum(141 - tl.maximum(e, 1), 1), 25)
    q = m >> sh
    rem = m & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    sub = a < 0x3C800000
    code = tl.where(sub, q, code_n)
    val = tl.where(sub, q.to(tl.float32) * 0.001953125, val_n)
    code = tl.where(neg, code | 0x80, code)
    val = tl.where(neg, val * -1.0, val)  # (not -val: Triton's unary minus is 0 - val, which loses -0.0)
    return code, val


# tl.sum / tl.max / tl.zeros (and the rest of triton/language/standard.py) are @triton.jit functions of triton.language, bound to compile or interpret
# mode when triton is first imported; reducing with our own combine functions keeps these
# kernels runnable under TRITON_INTERPRET=1 even when something imported triton earlier.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def apply_act(a, b, ACT: tl.constexpr):
    """Spec section 4 activations in float32. ``a``: gate (or the whole h); ``b``: up (gated only)."""
    if ACT == 1:  # silu
        y = a * _sigmoid(a) * b
    elif ACT == 2:  # gelu (erf)
        y = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476)) * b
    elif ACT == 3:  # gelu_tanh: 0.5 a (1 + tanh(z)) = a * sigmoid(2 z)
        z = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        y = a * _sigmoid(2.0 * z) * b
    elif ACT == 4:  # swigluoai (a = gate, b = up, de-interleaved by the caller)
        # NaN must survive the clamps (PTX min/max return the other operand), so that the caller flags it as the
        # reference's torch.clamp would leave it
        g = tl.minimum(a, 7.0, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(tl.maximum(b, -7.0, propagate_nan=tl.PropagateNan.ALL), 7.0, propagate_nan=tl.PropagateNan.ALL)
        y = (up + 1.0) * g * _sigmoid(1.702 * g)
    elif ACT == 5:  # silu_no_mul
        y = a * _sigmoid(a)
    elif ACT == 6:  # gelu_no_mul
        y = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))
    elif ACT == 7:  # relu2_no_mul
        r = tl.maximum(a, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) stays NaN (flagged), as in torch
        y = r * r
    else:
        y = a
    return y


# batch-size arguments unspecialised (docs/kernels.md, "One compile per config")
@triton.jit(do_not_specialize=["M"])
def mxfp8_quantize_kernel(
    x_ptr,  # [M, *] model dtype: the input (ACT == 0) or h (ACT > 0)
    q_ptr,  # uint8 [M, K] (OUT_MXFP8), or [M, K] in the output dtype (OUT_QDQ / OUT_PLAIN)
    s_ptr,  # uint8 [M, K/32] (OUT_MXFP8)
    row_w_ptr,  # float32 [M] row weights (HAS_ROW_WEIGHT)
    row_mask_ptr,  # int8 [M], rows with 0 are skipped (HAS_ROW_MASK)
    flag_ptr,  # int32 [1], set to 1 when a value is not finite or a block's QDQ overflows the model dtype
    M,
    K,  # output columns (multiple of 32)
    stride_xm,
    stride_qm,
    stride_sm,
    ACT: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    UNDERFLOW_SCALE: tl.constexpr,
    OUT_MODE: tl.constexpr,
    PERMUTE_K: tl.constexpr,
    HAS_ROW_WEIGHT: tl.constexpr,
    HAS_ROW_MASK: tl.constexpr,
    D_MAX: tl.constexpr,  # the model dtype's (x's) largest finite value
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (lutb_kernels._pdl_details)
):
    pdl_prologue(PDL)
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    if HAS_ROW_MASK:
        row_ok = row_ok & (tl.load(row_mask_ptr + rows, mask=row_ok, other=0) != 0)
    mask = row_ok[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x_row = x_ptr + rows64[:, None] * stride_xm
    if ACT == 0:
        v = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_ROW_WEIGHT:  # spec step 1: x * w in float32, rounded to the model dtype
            w = tl.load(row_w_ptr + rows, mask=row_ok, other=0.0)
            v = (v * w[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        if ACT >= 5:  # *_no_mul: the whole h
            a = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            b = a
        elif GATE_UP_INTERLEAVED:
            a = tl.load(x_row + 2 * cols[None, :], mask=mask, other=0.0).to(tl.float32)
            b = tl.load(x_row + 2 * cols[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
        else:
            a = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            b = tl.load(x_row + K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # spec step 4: computed in float32 from the model-dtype values, rounded to the model dtype
        v = apply_act(a, b, ACT).to(x_ptr.dtype.element_ty).to(tl.float32)

    bad = (v != v) | (tl.abs(v) > 3.4028234663852886e38)
    bad = bad & mask
    n_bad = tl.reduce(tl.reduce(bad.to(tl.int32), 1, _add), 0, _add)
    tl.store(flag_ptr, 1, mask=n_bad > 0)

    if OUT_MODE == 2:
        tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], v.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        v = tl.where(bad, 0.0, v)
        blocks = tl.reshape(v, (BLOCK_R, BLOCK_K // 32, 32))
        amax = tl.reduce(tl.abs(blocks), 2, _maximum)
        s = e8m0_scale(amax, SCALE_MODE, UNDERFLOW_SCALE)  # [BLOCK_R, BLOCK_K/32] int32
        scaled = blocks * inv_pow2_from_e8m0(s)[:, :, None]
        code, val = e4m3_rne(scaled)
        # Spec steps 2 and 5 round the dequantized block to the model dtype. rceil's rounding can carry a block's
        # largest element one e4m3 step up, past the dtype's largest finite value (float16 above ~63488): infinity
        # there, which the reference then refuses (docs/format.md (k)); refused here alike.
        top = tl.reduce(tl.abs(val), 2, _maximum) * pow2_from_e8m0(s)  # [BLOCK_R, BLOCK_K/32]
        n_over = tl.reduce(tl.reduce((top > D_MAX).to(tl.int32), 1, _add), 0, _add)
        tl.store(flag_ptr, 1, mask=n_over > 0)
        if PERMUTE_K:
            # decoder order: column 32g + i + 8w + 4h goes to position 32g + 8w + 2i + h
            c32 = cols % 32
            dest = cols - c32 + 8 * (c32 // 8) + 2 * (c32 % 4) + (c32 // 4) % 2
        else:
            dest = cols
        if OUT_MODE == 0:
            code = tl.reshape(code, (BLOCK_R, BLOCK_K))
            tl.store(q_ptr + rows64[:, None] * stride_qm + dest[None, :], code.to(tl.uint8), mask=mask)
            gcols = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
            smask = row_ok[:, None] & (gcols < K // 32)[None, :]
            tl.store(s_ptr + rows64[:, None] * stride_sm + gcols[None, :], s.to(tl.uint8), mask=smask)
        else:
            deq = val * pow2_from_e8m0(s)[:, :, None]
            deq = tl.reshape(deq, (BLOCK_R, BLOCK_K))
            tl.store(q_ptr + rows64[:, None] * stride_qm + dest[None, :], deq.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def mxfp8_dequantize_kernel(q_ptr, s_ptr, out_ptr, M, K, stride_qm, stride_sm, stride_om,
                            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[r, c] = float32(e4m3 q[r, c]) * 2**(s[r, c // 32] - 127)`` rounded once to ``out``'s dtype.

    ``q``: uint8 ``[M, K]`` e4m3 codes without NaN codes; ``s``: uint8 ``[M, K/32]`` E8M0 bytes 0..254; ``out``:
    ``[M, K]`` float32/bfloat16/float16. The element's float32 comes from its bits (normal: exponent rebased by
    120; subnormal: its 3-bit mantissa times 2**-9), so the interpreter decodes as a GPU does; the product is
    exact in float32 (a subnormal scale included), as in ``lutb_kernels.mxfp8.mxfp8_dequantize``.
    """
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    b = tl.load(q_ptr + rows[:, None] * stride_qm + cols[None, :], mask=mask, other=0).to(tl.int32)
    s = tl.load(s_ptr + rows[:, None] * stride_sm + (cols // 32)[None, :], mask=mask, other=127).to(tl.int32)
    exponent = (b >> 3) & 0xF
    mantissa = b & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent > 0, normal, mantissa.to(tl.float32) * 0.001953125)  # subnormal: m * 2**-9
    signed = (magnitude.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)  # -0.0 kept
    value = signed * pow2_from_e8m0(s)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], value.to(out_ptr.dtype.element_ty), mask=mask)
