"""Exceptions raised by lutb_kernels."""


class LutBError(Exception):
    """Base class of every error lutb_kernels raises on bad data."""


class LutBFormatError(LutBError, ValueError):
    """A tile, tensor or checkpoint breaks the LUT-B v1 format (spec sections 1 and 5)."""


class NonFiniteInputError(LutBError, ValueError):
    """An activation handed to MXFP8 quantization holds NaN or infinity (spec section 3)."""
