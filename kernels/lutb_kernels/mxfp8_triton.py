"""MXFP8 quantization in Triton: one pass over the activations, bit-exact with :mod:`lutb_kernels.mxfp8`.

Ops (validate, allocate, launch; the kernels live in :mod:`lutb_kernels._mxfp8_details`):

- :func:`mxfp8_quantize` -> float8 elements + E8M0 scales (optionally in the LUT-B
  GEMM's *decoder* column order, see :func:`decoder_column_order`);
- :func:`mxfp8_qdq` -> quantize-dequantize in the model dtype (the emulated path);
- :func:`act_mxfp8_quantize` / :func:`act_mxfp8_qdq` -> the MoE activation of spec
  section 4 step 4 fused with step 5's quantization;
- :func:`act_rounded` -> the activation alone, rounded to the model dtype (bf16 peers);
- :func:`mxfp8_dequantize_into` -> MXFP8 input back to the model dtype, one launch (a compute
  worker's MXFP8 input carried to the device; :func:`dequantize_into_op` picks it or its torch-ops twin).

Each op has a plain-PyTorch ``*_reference`` twin with the same signature built on
:mod:`lutb_kernels.mxfp8` and :mod:`lutb_kernels.activations` (the judges).

Non-finite input. The kernels flag a non-finite value (NaN/Inf in the input, or in the
activation's output), and a 32-block whose MXFP8 rounding carries it past the input dtype's largest
finite value (spec steps 2 and 5 round the dequantized block to the model dtype, where it is then
infinite: docs/format.md (k)), in an int32 ``[1]`` device tensor instead of reading the input a
second time. Pass ``nonfinite=`` to collect the flag yourself (no host sync: check it
once at the end of a forward pass); leave it ``None`` and the op checks it after the
launch, which costs one device->host sync (~10 us) but no extra pass over the data,
and raises :class:`~lutb_kernels.errors.NonFiniteInputError`.

Triton is optional: importing this module never imports triton.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import re
from collections.abc import Callable
from typing import Literal

import torch

from lutb_kernels._grouped_gemm_details.launch import pdl_launch, sm_count
from lutb_kernels.activations import apply_activation, check_activation, is_gated
from lutb_kernels.errors import NonFiniteInputError
from lutb_kernels.mxfp8 import BLOCK, ScaleMode, check_dequantize_into_args, check_scale_mode
from lutb_kernels.mxfp8 import mxfp8_dequantize as _ref_dequantize
from lutb_kernels.mxfp8 import mxfp8_quantize as _ref_quantize

NONFINITE_MESSAGE = ("MXFP8 quantization refuses NaN or infinite input, or a 32-block that MXFP8 rounds past the "
                     "model dtype's largest finite value")

KOrder = Literal["natural", "decoder"]
K_ORDERS = ("natural", "decoder")


MIN_TRITON = (3, 4)
"""The oldest triton the kernels compile with: the routing kernel counts with ``tl.histogram(..., mask=)``, which
triton 3.4 introduced (3.2 and 3.3, what torch 2.6 and 2.7 ship, refuse it). Tested with 3.6.0."""


def triton_installed() -> bool:
    """True when triton can be imported (the optional ``cuda`` extra); triton is not imported."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a stub in sys.modules without a spec
        return False


def triton_release() -> tuple[int, int] | None:
    """The installed triton's ``(major, minor)`` from its package metadata (``3.4.0+git1234`` -> ``(3, 4)``); None
    where there is none or it cannot be read."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # importable without metadata (a source tree on the path)
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def triton_available() -> bool:
    """True when triton is installed and not older than :data:`MIN_TRITON` (a version that cannot be read is given
    the benefit of the doubt)."""
    if not triton_installed():
        return False
    release = triton_release()
    return release is None or release >= MIN_TRITON


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def decoder_column_order(k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The LUT-B GEMM's column order: int64 ``[k]``, ``order[p]`` = the column stored at position ``p``.

    Inside each 32-column group, position ``8w + 2i + h`` holds column ``i + 8w + 4h``
    (i in 0..3, w in 0..3, h in 0..1): the order in which the decoder produces weights from the
    bit-planes (see ``lutb_kernels._lut_b_gemm_details.kernels``). A dot product does not care
    about the order of K as long as both operands use the same one.
    """
    if k % BLOCK:
        raise ValueError(f"k must be a multiple of {BLOCK}, got {k}")
    p = torch.arange(k, device=device)
    pp = p % BLOCK
    return p - pp + (pp % 8) // 2 + 8 * (pp // 8) + 4 * (pp % 2)


def _check_k_order(k_order: str) -> None:
    if k_order not in K_ORDERS:
        raise ValueError(f"k_order must be one of {K_ORDERS}, got {k_order!r}")


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if not x.is_floating_point() or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # (not -1: K = 0 leaves the rows ambiguous)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def _check_out_dtype(out_dtype: torch.dtype | None) -> None:
    if out_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16, float16 or float32 (or None: the input's), got {out_dtype}")


def _check_row_args(m: int, device: torch.device, row_weight: torch.Tensor | None, row_mask: torch.Tensor | None) -> None:
    if row_weight is not None:
        if row_weight.dtype != torch.float32 or row_weight.numel() != m or row_weight.device != device:
            raise ValueError(f"row_weight must be float32 with {m} elements on {device}, got {row_weight.dtype} {tuple(row_weight.shape)} on {row_weight.device}")
    if row_mask is not None:
        if row_mask.dtype not in (torch.bool, torch.int8, torch.uint8) or row_mask.numel() != m or row_mask.device != device:
            raise ValueError(f"row_mask must be bool/int8 with {m} elements on {device}, got {row_mask.dtype} {tuple(row_mask.shape)} on {row_mask.device}")


def _check_flag(nonfinite: torch.Tensor | None, device: torch.device) -> None:
    if nonfinite is not None and (nonfinite.dtype != torch.int32 or nonfinite.numel() != 1 or nonfinite.device != device):
        raise ValueError(f"nonfinite must be an int32 [1] tensor on {device}")


# Programs per SM a quantization launch aims for: blocks of rows shrink until the grid holds this
# many (0: they only shrink to the batch). Every element goes through a fixed chain of integer
# operations (e4m3 rounding, the scale from bits), so a grid of few large blocks runs as a few long
# programs: mixtral T=32's activation QDQ (64 x 14336 outputs in 224 programs of 16 x 256) took
# 16.3 us, the QDQ of its x (32 programs of 16 x 256) 6.6 us (bench/results/2026-12-04-stream-k-h200.md,
# breakdown). At 8 per SM the packed forward gained 0.3-1.8 us at T=1, 7.7-8.4 at T=8 and 7.9-15.4 at
# T=32 (bench/results/2026-12-04-qdq-grid-h200.md).
QDQ_PROGRAMS_PER_SM = 8


def rows_per_program(m: int, k_blocks: int, cap: int, device: torch.device) -> int:
    """Rows per program of a quantization launch over ``m`` rows and ``k_blocks`` column blocks.

    ``cap`` (a power of two; the largest block the launch allows) shrunk to the batch (next power of
    two: mixtral T=1's activation has 2 rows, which blocks of 16 computed 8 times over; measured
    1.5-5.6 us off every packed forward at T = 1 and 8, bench/results/2026-12-04-fit-rows-h200.md),
    then halved while the grid would hold fewer than ``QDQ_PROGRAMS_PER_SM`` programs per SM.
    Only the launch changes: every element is computed the same way in any block.
    """
    block_r = min(cap, triton_next_pow2(m))
    target = QDQ_PROGRAMS_PER_SM * sm_count(device)
    while block_r > 1 and triton_cdiv(m, block_r) * k_blocks < target:
        block_r //= 2
    return block_r


def launch_blocks(m: int, k_out: int, device: torch.device) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_K)`` of a quantization launch over ``m`` rows and ``k_out`` output columns.

    Both are compile-time constants of the kernel, so they are part of the experts' ``launch_key``.
    """
    block_k = min(256, triton_next_pow2(k_out))
    cap = max(1, min(64, 4096 // block_k)) if not interpreting() else max(1, min(4, 256 // block_k))
    return rows_per_program(m, triton_cdiv(k_out, block_k), cap, device), block_k


def _launch(
    x2: torch.Tensor,
    k_out: int,
    *,
    activation: str | None,
    scale_mode: str,
    out_mode: int,
    k_order: str,
    row_weight: torch.Tensor | None,
    row_mask: torch.Tensor | None,
    nonfinite: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from lutb_kernels._mxfp8_details import kernels as K

    m = x2.shape[0]
    device = x2.device
    if out_mode == K.OUT_MXFP8:
        q = torch.empty((m, k_out), dtype=torch.uint8, device=device)
        s = torch.empty((m, k_out // BLOCK), dtype=torch.uint8, device=device)
    else:
        q = torch.empty((m, k_out), dtype=out_dtype or x2.dtype, device=device)
        s = None
    own_flag = nonfinite is None
    flag = torch.zeros(1, dtype=torch.int32, device=device) if own_flag else nonfinite
    if m and k_out:
        block_r, block_k = launch_blocks(m, k_out, device)
        mask_arg = flag if row_mask is None else row_mask.reshape(-1).view(torch.int8)
        grid = (triton_cdiv(m, block_r), triton_cdiv(k_out, block_k))
        K.mxfp8_quantize_kernel[grid](
            x2, q, s if s is not None else q,
            row_weight.reshape(-1) if row_weight is not None else flag,
            mask_arg, flag,
            m, k_out, x2.stride(0), q.stride(0), s.stride(0) if s is not None else 0,
            ACT=K.ACT_IDS[activation],
            GATE_UP_INTERLEAVED=activation == "swigluoai",
            SCALE_MODE=K.SCALE_MODE_IDS[scale_mode],
            UNDERFLOW_SCALE=K.RCEIL_UNDERFLOW_SCALE,
            OUT_MODE=out_mode,
            PERMUTE_K=k_order == "decoder",
            HAS_ROW_WEIGHT=row_weight is not None,
            HAS_ROW_MASK=row_mask is not None,
            D_MAX=torch.finfo(x2.dtype).max,
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            num_warps=4,
            **pdl_launch(device),
        )
    if own_flag and m and k_out and bool(flag.item()):
        raise NonFiniteInputError(NONFINITE_MESSAGE)
    return q, s


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _act_columns(h2: torch.Tensor, activation: str) -> int:
    n = h2.shape[1]
    if is_gated(activation):
        if n % (2 * BLOCK):
            raise ValueError(f"h for the gated activation {activation} needs a last dimension divisible by {2 * BLOCK}, got {n}")
        return n // 2
    if n % BLOCK:
        raise ValueError(f"h needs a last dimension divisible by {BLOCK}, got {n}")
    return n


# ----------------------------------------------------------------------------- ops


def _check_quantize_args(
    x: torch.Tensor, scale_mode: str, k_order: str, row_weight: torch.Tensor | None, nonfinite: torch.Tensor | None,
) -> torch.Tensor:
    """Validate the arguments of :func:`mxfp8_quantize` / :func:`mxfp8_qdq`; returns ``x`` as ``[M, K]``."""
    check_scale_mode(scale_mode)
    _check_k_order(k_order)
    x2 = _rows(x, "x")
    if x2.shape[1] % BLOCK:
        raise ValueError(f"MXFP8 quantization needs a last dimension divisible by {BLOCK}, got {tuple(x.shape)}")
    _check_row_args(x2.shape[0], x2.device, row_weight, None)
    _check_flag(nonfinite, x2.device)
    return x2


def _check_act_quantize_args(
    h: torch.Tensor, activation: str, scale_mode: str, k_order: str, row_mask: torch.Tensor | None,
    nonfinite: torch.Tensor | None,
) -> tuple[torch.Tensor, int]:
    """Validate the arguments of the activation ops; returns ``(h [R, N], output columns)``."""
    check_activation(activation)
    check_scale_mode(scale_mode)
    _check_k_order(k_order)
    h2 = _rows(h, "h")
    if h.dim() != 2:
        raise ValueError(f"h must be [R, N], got {tuple(h.shape)}")
    k_out = _act_columns(h2, activation)
    _check_row_args(h2.shape[0], h2.device, None, row_mask)
    _check_flag(nonfinite, h2.device)
    return h2, k_out


def mxfp8_quantize(
    x: torch.Tensor,
    scale_mode: ScaleMode = "rceil",
    *,
    k_order: KOrder = "natural",
    row_weight: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dimension of ``x`` to MXFP8 in one pass (Triton).

    Args:
        x: ``[..., K]`` bfloat16/float16/float32, ``K % 32 == 0``, on a Triton device.
        scale_mode: ``"rceil"`` or ``"floor"``.
        k_order: ``"natural"``, or ``"decoder"`` to store the elements of each 32-group in
            :func:`decoder_column_order` (scales are per group and do not move).
        row_weight: optional float32 ``[prod(...)]``; row ``r`` is first multiplied by it in
            float32 and rounded to ``x.dtype`` (spec step 1, weights on the input).
        nonfinite: optional int32 ``[1]`` flag set to 1 on NaN/Inf (see module doc).

    Returns:
        ``(q, scales)``: float8_e4m3fn ``[..., K]`` and uint8 ``[..., K/32]``.
    """
    from lutb_kernels._mxfp8_details.kernels import OUT_MXFP8

    x2 = _check_quantize_args(x, scale_mode, k_order, row_weight, nonfinite)
    q, s = _launch(x2, x2.shape[1], activation=None, scale_mode=scale_mode, out_mode=OUT_MXFP8, k_order=k_order,
                   row_weight=row_weight, row_mask=None, nonfinite=nonfinite)
    assert s is not None
    return q.view(torch.float8_e4m3fn).reshape(x.shape), s.reshape(*x.shape[:-1], x.shape[-1] // BLOCK)


def mxfp8_quantize_reference(
    x: torch.Tensor,
    scale_mode: ScaleMode = "rceil",
    *,
    k_order: KOrder = "natural",
    row_weight: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch twin of :func:`mxfp8_quantize`: raises on NaN/Inf input and on a block whose dequantized
    values overflow ``x.dtype`` (sets ``nonfinite`` first when given)."""
    _check_k_order(k_order)
    xin = x
    if row_weight is not None:
        xin = (x.float() * row_weight.reshape(*x.shape[:-1], 1)).to(x.dtype)
    if nonfinite is not None and not bool(torch.isfinite(xin).all()):
        nonfinite.fill_(1)
    q, s = _ref_quantize(xin, scale_mode)
    if not bool(torch.isfinite(_ref_dequantize(q, s, x.dtype)).all()):
        if nonfinite is not None:
            nonfinite.fill_(1)
        raise NonFiniteInputError(NONFINITE_MESSAGE)
    if k_order == "decoder":
        q = q[..., decoder_column_order(x.shape[-1], x.device)]
    return q, s


def mxfp8_qdq(
    x: torch.Tensor,
    scale_mode: ScaleMode = "rceil",
    *,
    k_order: KOrder = "natural",
    out_dtype: torch.dtype | None = None,
    row_weight: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round ``x [..., K]`` through MXFP8 and back in one pass (Triton); same shape.

    ``out_dtype`` (default ``x.dtype``): bfloat16 holds every MXFP8 value exactly (down to
    ``2**-133``), which is what the LUT-B GEMM consumes pre-dequantized. ``k_order``,
    ``row_weight`` and ``nonfinite`` as in :func:`mxfp8_quantize`.
    """
    from lutb_kernels._mxfp8_details.kernels import OUT_QDQ

    x2 = _check_quantize_args(x, scale_mode, k_order, row_weight, nonfinite)
    _check_out_dtype(out_dtype)
    out, _ = _launch(x2, x2.shape[1], activation=None, scale_mode=scale_mode, out_mode=OUT_QDQ, k_order=k_order,
                     row_weight=row_weight, row_mask=None, nonfinite=nonfinite, out_dtype=out_dtype)
    return out.reshape(x.shape)


def mxfp8_qdq_reference(
    x: torch.Tensor,
    scale_mode: ScaleMode = "rceil",
    *,
    k_order: KOrder = "natural",
    out_dtype: torch.dtype | None = None,
    row_weight: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch twin of :func:`mxfp8_qdq`."""
    _check_out_dtype(out_dtype)
    q, s = mxfp8_quantize_reference(x, scale_mode, row_weight=row_weight, nonfinite=nonfinite)
    out = _ref_dequantize(q, s, out_dtype or x.dtype)
    if k_order == "decoder":
        out = out[..., decoder_column_order(x.shape[-1], x.device)]
    return out


def act_mxfp8_quantize(
    h: torch.Tensor,
    activation: str,
    scale_mode: ScaleMode = "rceil",
    *,
    row_mask: torch.Tensor | None = None,
    k_order: KOrder = "natural",
    nonfinite: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec steps 4-5 fused: ``g = act(h)`` (float32, rounded to ``h.dtype``), then MXFP8-quantize ``g``.

    Args:
        h: ``[R, 2I]`` (gated) or ``[R, I]`` (``*_no_mul``) in the model dtype.
        activation: one of :data:`lutb_kernels.activations.ACTIVATIONS`.
        row_mask: optional bool/int8 ``[R]``; rows where it is false are neither read nor
            written (their outputs are left as allocated) and never raise the flag.
        k_order, nonfinite: as in :func:`mxfp8_quantize`.

    Returns:
        ``(q, scales)``: float8_e4m3fn ``[R, I]`` and uint8 ``[R, I/32]``.
    """
    from lutb_kernels._mxfp8_details.kernels import OUT_MXFP8

    h2, k_out = _check_act_quantize_args(h, activation, scale_mode, k_order, row_mask, nonfinite)
    q, s = _launch(h2, k_out, activation=activation, scale_mode=scale_mode, out_mode=OUT_MXFP8, k_order=k_order,
                   row_weight=None, row_mask=row_mask, nonfinite=nonfinite)
    assert s is not None
    return q.view(torch.float8_e4m3fn), s


def _act_reference(h: torch.Tensor, activation: str, row_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = apply_activation(activation, h).to(h.dtype)
    keep = torch.ones(h.shape[0], dtype=torch.bool, device=h.device) if row_mask is None else row_mask.reshape(-1).bool()
    return torch.where(keep[:, None], g, torch.zeros_like(g)), keep


def act_mxfp8_quantize_reference(
    h: torch.Tensor,
    activation: str,
    scale_mode: ScaleMode = "rceil",
    *,
    row_mask: torch.Tensor | None = None,
    k_order: KOrder = "natural",
    nonfinite: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch twin of :func:`act_mxfp8_quantize`; rows masked out come back as zeros."""
    g, _ = _act_reference(h, activation, row_mask)
    return mxfp8_quantize_reference(g, scale_mode, k_order=k_order, nonfinite=nonfinite)


def act_mxfp8_qdq(
    h: torch.Tensor,
    activation: str,
    scale_mode: ScaleMode = "rceil",
    *,
    row_mask: torch.Tensor | None = None,
    k_order: KOrder = "natural",
    out_dtype: torch.dtype | None = None,
    nonfinite: torch.Tensor | None = None,
) -> torch.Tensor:
    """Spec steps 4-5 as values: ``QDQ(act(h))`` in ``out_dtype`` (default ``h.dtype``), ``[R, I]``.

    Arguments as in :func:`act_mxfp8_quantize` and :func:`mxfp8_qdq`.
    """
    from lutb_kernels._mxfp8_details.kernels import OUT_QDQ

    h2, k_out = _check_act_quantize_args(h, activation, scale_mode, k_order, row_mask, nonfinite)
    _check_out_dtype(out_dtype)
    out, _ = _launch(h2, k_out, activation=activation, scale_mode=scale_mode, out_mode=OUT_QDQ, k_order=k_order,
                     row_weight=None, row_mask=row_mask, nonfinite=nonfinite, out_dtype=out_dtype)
    return out


def act_mxfp8_qdq_reference(
    h: torch.Tensor,
    activation: str,
    scale_mode: ScaleMode = "rceil",
    *,
    row_mask: torch.Tensor | None = None,
    k_order: KOrder = "natural",
    out_dtype: torch.dtype | None = None,
    nonfinite: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch twin of :func:`act_mxfp8_qdq`; rows masked out come back as zeros."""
    g, _ = _act_reference(h, activation, row_mask)
    return mxfp8_qdq_reference(g, scale_mode, k_order=k_order, out_dtype=out_dtype, nonfinite=nonfinite)


def mxfp8_dequantize_into(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dequantize MXFP8 rows into ``out`` in one launch (Triton), bit for bit :func:`lutb_kernels.mxfp8.mxfp8_dequantize`.

    Args:
        q: float8_e4m3fn ``[M, K]``, ``K % 32 == 0``, contiguous rows, without NaN codes (0x7F/0xFF: the caller
            checked, e.g. ``lutb_kernels.mxfp8.e4m3_nan_count``), on a Triton device.
        scales: uint8 ``[M, K/32]`` E8M0 bytes 0..254 (255, E8M0's NaN, checked by the caller).
        out: ``[M, K]`` float32/bfloat16/float16, contiguous rows, on ``q``'s device; returned.

    No host sync. An element whose value overflows ``out.dtype`` becomes +-inf, as in the reference.
    """
    from lutb_kernels._mxfp8_details import kernels as K

    check_dequantize_into_args(q, scales, out)
    m, k = q.shape
    if m and k:
        block_k = min(1024, triton_next_pow2(k)) if not interpreting() else min(256, triton_next_pow2(k))
        block_r = max(1, min(16, 4096 // block_k))
        grid = (triton_cdiv(m, block_r), triton_cdiv(k, block_k))
        K.mxfp8_dequantize_kernel[grid](q.view(torch.uint8), scales, out, m, k, q.stride(0), scales.stride(0), out.stride(0),
                                        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return out


def mxfp8_dequantize_into_reference(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch twin of :func:`mxfp8_dequantize_into`."""
    return out.copy_(_ref_dequantize(q, scales, out.dtype))


DequantizeInto = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(q, scales, out) -> out``: :func:`mxfp8_dequantize_into`'s signature."""


def dequantize_into_op(device: torch.device) -> DequantizeInto:
    """The op that dequantizes MXFP8 input on ``device`` fastest, bit for bit the same either way: this module's
    :func:`mxfp8_dequantize_into` (one Triton launch) on CUDA with triton installed, else
    :func:`lutb_kernels.mxfp8.mxfp8_dequantize_into` (a few torch ops, any device; scales at most
    ``FAST_DEQUANTIZE_MAX_SCALE``). Both run without a host sync, so both can be captured in a CUDA graph."""
    if device.type == "cuda" and triton_available():
        return mxfp8_dequantize_into
    from lutb_kernels.mxfp8 import mxfp8_dequantize_into as torch_ops

    return torch_ops


def act_rounded(h: torch.Tensor, activation: str, *, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The activation alone (float32 math, rounded to ``h.dtype``), ``[R, I]``; no quantization, no flag.

    Used by the unquantized bf16 peer in ``bench/kernels.py``.
    """
    from lutb_kernels._mxfp8_details.kernels import OUT_PLAIN

    h2, k_out = _check_act_quantize_args(h, activation, "rceil", "natural", row_mask, None)
    flag = torch.zeros(1, dtype=torch.int32, device=h2.device)
    out, _ = _launch(h2, k_out, activation=activation, scale_mode="rceil", out_mode=OUT_PLAIN, k_order="natural",
                     row_weight=None, row_mask=row_mask, nonfinite=flag)
    return out


def act_rounded_reference(h: torch.Tensor, activation: str, *, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch twin of :func:`act_rounded` (the same argument checks)."""
    _check_act_quantize_args(h, activation, "rceil", "natural", row_mask, None)
    return _act_reference(h, activation, row_mask)[0]
