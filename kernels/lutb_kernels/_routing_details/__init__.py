"""Triton kernel behind :mod:`lutb_kernels.routing_triton` (imports triton; load lazily)."""
