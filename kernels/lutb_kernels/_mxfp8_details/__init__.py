"""Triton kernels behind :mod:`lutb_kernels.mxfp8_triton` (imports triton; load lazily)."""
