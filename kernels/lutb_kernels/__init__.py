"""lutb_kernels: the LUT-B v1 numeric contract in PyTorch, and the fast kernels checked against it.

Reference modules (plain PyTorch, any device): :mod:`~lutb_kernels.tiles`,
:mod:`~lutb_kernels.mxfp8`, :mod:`~lutb_kernels.activations`,
:mod:`~lutb_kernels.reference`, :mod:`~lutb_kernels.routing`,
:mod:`~lutb_kernels.quantizer`, :mod:`~lutb_kernels.checkpoint`.
"""

__version__ = "0.1.0"
