"""Experts backends: one module per way of running a layer's LUT-B experts.

Every backend implements :class:`~lutb_kernels.experts.base.LayerExperts`:
built from one checkpoint layer on one device, it runs spec section 4 on a
routed token batch. The pipeline every backend follows::

    x [T, H] (model dtype)
      -> (weights on input)  -> MXFP8 quantize            (a1, a1_scales)
      -> GEMM1 per route over W13[e]                      h [T*k, 2I]
      -> activation, MXFP8 quantize                       (a2, a2_scales)
      -> GEMM2 per route over W2[e] (x router weight)     y [T*k, H]
      -> sum over routes (combined) | unweighted rows (route-major)

``reference`` does it in plain PyTorch (the judge); GPU backends fuse and
batch the same steps.
"""

from lutb_kernels.experts.base import LayerExperts, Support, all_of
from lutb_kernels.experts.reference import ReferenceExperts

__all__ = ["LayerExperts", "ReferenceExperts", "Support", "all_of"]
