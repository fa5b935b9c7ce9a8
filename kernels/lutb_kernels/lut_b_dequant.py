"""``lut_b_dequantize``: LUT-B v1 weight tiles to dense weights on the GPU (Triton).

The packed backend's prefill path uses it: at large batches every expert's weights are read
by many 128-row blocks, and decoding the tiles once into a bounded bf16 scratch, then running
the dense grouped GEMM, costs less than decoding them again in every block
(:class:`lutb_kernels.experts.packed.LutBPackedExperts`). :func:`lut_b_dequantize_reference`
is the same operation in plain PyTorch (:func:`lutb_kernels.tiles.tiles_to_dense`).
"""

from __future__ import annotations

import torch

from lutb_kernels._grouped_gemm_details.launch import interpreting, pdl_launch
from lutb_kernels.tiles import TILE, TILE_BYTES, tiles_to_dense, to_kernel_layout

ROWS_PER_PROGRAM = 32
"""Tile rows one program decodes (4 programs per tile)."""

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(w_packed: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if w_packed.dtype != torch.uint8 or w_packed.dim() != 4 or w_packed.shape[-1] != TILE_BYTES:
        raise ValueError(f"w_packed must be uint8 [E, N/128, K/128, {TILE_BYTES}], got {w_packed.dtype} {tuple(w_packed.shape)}")
    e, nt, kt, _ = w_packed.shape
    shape = (e, nt * TILE, kt * TILE)
    if out is None:
        if dtype not in OUT_DTYPES:
            raise ValueError(f"dtype must be one of {OUT_DTYPES}, got {dtype}")
        return torch.empty(shape, dtype=dtype, device=w_packed.device)
    if tuple(out.shape) != shape or out.dtype not in OUT_DTYPES or out.device != w_packed.device:
        raise ValueError(f"out must be {shape} in one of {OUT_DTYPES} on {w_packed.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if out.stride(2) != 1 or out.stride(1) != shape[2]:
        raise ValueError("out must be contiguous in its last two dimensions")
    return out


def lut_b_dequantize(w_packed: torch.Tensor, out: torch.Tensor | None = None, *,
                     dtype: torch.dtype = torch.bfloat16, kernel_layout: bool = False) -> torch.Tensor:
    """Dense weights of stacked LUT-B matrices, one Triton pass.

    Args:
        w_packed: uint8 ``[E, N/128, K/128, 6672]`` tiles (contiguous), on a CUDA device (or the
            CPU under ``TRITON_INTERPRET=1``).
        out: ``[E, N, K]`` bfloat16/float16/float32 on the same device, contiguous in its last
            two dimensions (a slice of a larger scratch is fine), or None to allocate one.
        dtype: the dtype of an allocated ``out``.
        kernel_layout: the tiles are in the kernel layout
            (:func:`lutb_kernels.tiles.to_kernel_layout`), as the packed experts keep them.

    Returns:
        ``out``: element ``(e, n, k)`` is ``lut[code] * 2**(scale - 127)`` of its tile, computed in
        float32 and rounded once to ``out.dtype``; bit for bit :func:`lut_b_dequantize_reference`.
    """
    out = _check(w_packed, out, dtype)
    e, nt, kt, _ = w_packed.shape
    if out.numel() == 0:
        return out
    if w_packed.device.type != "cuda" and not interpreting():
        raise ValueError(f"lut_b_dequantize runs on a CUDA device (or the Triton interpreter), got {w_packed.device}")
    from lutb_kernels._lut_b_gemm_details.dequant import lut_b_dequant_kernel

    words = w_packed.contiguous().view(torch.int32)
    lut_b_dequant_kernel[(e * nt * kt, TILE // ROWS_PER_PROGRAM)](
        words, out, nt * kt, kt, out.stride(0), out.stride(1), ROWS=ROWS_PER_PROGRAM, KERNEL_LAYOUT=kernel_layout, num_warps=4,
        **pdl_launch(w_packed.device),
    )
    return out


def lut_b_dequantize_reference(w_packed: torch.Tensor, out: torch.Tensor | None = None, *,
                               dtype: torch.dtype = torch.bfloat16, kernel_layout: bool = False) -> torch.Tensor:
    """Plain-PyTorch twin of :func:`lut_b_dequantize` (any device)."""
    out = _check(w_packed, out, dtype)
    for i in range(w_packed.shape[0]):  # one expert at a time bounds the float32 temporaries
        tiles = to_kernel_layout(w_packed[i], inverse=True) if kernel_layout else w_packed[i]
        out[i] = tiles_to_dense(tiles, out.dtype)
    return out


__all__ = ["lut_b_dequantize", "lut_b_dequantize_reference"]
