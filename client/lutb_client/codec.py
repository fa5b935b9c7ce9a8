"""``lutb.v1.Tensor`` <-> ``torch.Tensor``, shared by the clients and the server.

The wire form is row-major and little-endian; every dtype travels as its raw
bytes (bfloat16 and float8 as bit patterns), so encoding and decoding are byte
views and one copy, never a Python loop over elements.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch

from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb

if sys.byteorder != "little":  # pragma: no cover - no big-endian torch build is supported
    raise ImportError("lutb_client.codec assumes a little-endian host")

TORCH_TO_PROTO: dict[torch.dtype, int] = {
    torch.bfloat16: pb.BFLOAT16,
    torch.float16: pb.FLOAT16,
    torch.float32: pb.FLOAT32,
    torch.int32: pb.INT32,
    torch.int64: pb.INT64,
    torch.uint8: pb.UINT8,
    torch.float8_e4m3fn: pb.FLOAT8_E4M3FN,
}
PROTO_TO_TORCH: dict[int, torch.dtype] = {v: k for k, v in TORCH_TO_PROTO.items()}
_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in TORCH_TO_PROTO}


class CodecError(ValueError):
    """A Tensor message that cannot become a torch tensor (or the reverse); the message names the field."""


def dtype_name(dtype: int | torch.dtype) -> str:
    """Wire name of a dtype: ``"BFLOAT16"`` for ``torch.bfloat16`` or ``pb.BFLOAT16``."""
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_TO_PROTO:
            return str(dtype)
        dtype = TORCH_TO_PROTO[dtype]
    try:
        return pb.DataType.Name(dtype)
    except ValueError:
        return f"DataType({dtype})"


def to_proto_dtype(dtype: torch.dtype) -> int:
    """The ``lutb.v1.DataType`` value of a torch dtype; :class:`CodecError` if it has none."""
    try:
        return TORCH_TO_PROTO[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} has no lutb.v1.DataType") from None


def to_torch_dtype(dtype: int) -> torch.dtype:
    """The torch dtype of a ``lutb.v1.DataType`` value; :class:`CodecError` if unknown."""
    try:
        return PROTO_TO_TORCH[dtype]
    except KeyError:
        raise CodecError(f"unknown or unspecified dtype {dtype_name(dtype)}") from None


def encode_tensor(tensor: torch.Tensor, out: pb.Tensor | None = None) -> pb.Tensor:
    """Encode ``tensor`` (any device, any strides) as a ``lutb.v1.Tensor``.

    Args:
        tensor: a tensor of one of the dtypes in :data:`TORCH_TO_PROTO`.
        out: a message to fill in place (e.g. ``response.output``); a new one if None.
    """
    proto_dtype = to_proto_dtype(tensor.dtype)
    cpu = tensor if tensor.device.type == "cpu" and not tensor.requires_grad else tensor.detach().to("cpu")
    if not cpu.is_contiguous():
        cpu = cpu.contiguous()
    msg = pb.Tensor() if out is None else out
    msg.dtype = proto_dtype
    del msg.shape[:]
    msg.shape.extend(cpu.shape)
    # One copy: the tensor's bytes straight into the message (few torch calls: this runs per request on the server).
    msg.data = cpu.view(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return msg


def decode_tensor(
    msg: pb.Tensor,
    *,
    name: str = "tensor",
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
) -> torch.Tensor:
    """Decode a ``lutb.v1.Tensor`` into a new, writable CPU tensor.

    Args:
        msg: the message.
        name: the field name used in error messages (e.g. ``"hidden_states"``).
        dtypes: dtypes accepted (all of :data:`PROTO_TO_TORCH` if None).
        ndim: required number of dimensions (any if None).

    Raises:
        CodecError: naming ``name``: unknown or refused dtype, wrong rank, negative
            dimension, or a data length that does not match shape and dtype.
    """
    dtype = PROTO_TO_TORCH.get(msg.dtype)
    if dtype is None or (dtypes is not None and dtype not in dtypes):
        allowed = tuple(dtypes) if dtypes is not None else tuple(PROTO_TO_TORCH.values())
        wanted = ", ".join(dtype_name(d) for d in allowed)
        raise CodecError(f"{name}: dtype {dtype_name(msg.dtype)} not allowed; expected {wanted}")
    shape = tuple(msg.shape)
    if ndim is not None and len(shape) != ndim:
        raise CodecError(f"{name}: needs {ndim} dimensions, got shape {list(shape)}")
    numel = 1
    for s in shape:
        if s < 0:
            raise CodecError(f"{name}: negative dimension in shape {list(shape)}")
        numel *= s
    data = msg.data  # one Python bytes object per access: read it once
    if len(data) != numel * _ITEMSIZE[dtype]:
        raise CodecError(
            f"{name}: data holds {len(data)} bytes, but shape {list(shape)} of {dtype_name(dtype)} needs {numel * _ITEMSIZE[dtype]}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


__all__ = [
    "PROTO_TO_TORCH",
    "TORCH_TO_PROTO",
    "CodecError",
    "decode_tensor",
    "dtype_name",
    "encode_tensor",
    "to_proto_dtype",
    "to_torch_dtype",
]
