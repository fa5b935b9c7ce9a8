"""Triton kernels behind :mod:`lutb_kernels.lut_b_gemm` (imports triton; load lazily)."""
