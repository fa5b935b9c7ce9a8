"""Triton kernels behind :mod:`lutb_kernels.grouped_gemm` (imports triton; load lazily)."""
