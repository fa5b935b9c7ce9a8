"""``lutb.v1.Tensor`` <-> ``torch.Tensor``, shared by the clients and the server.

The wire form is row-major and little-endian; every dtype travels as its raw
bytes (bfloat16 and float8 as bit patterns), so encoding and decoding are byte
views and one copy, never a Python loop over elements.

:class:`WireTensor` is a tensor still in that form (dtype, shape, bytes): the server's
request path keeps tensors so, because every torch call on it costs the event loop
several microseconds (more with the caches cold between requests), and the bytes are
all it needs: numpy views of them to validate, one copy into a compute process's shared
memory, and one copy out of it for the response.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
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
_BIT_CARRIERS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}
"""Torch dtypes numpy has no type for, and the integer dtype of their width that carries their bits to numpy."""
_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.bfloat16: np.dtype("<u2"),  # numpy has no bfloat16 or float8: their bit patterns
    torch.float16: np.dtype("<f2"),
    torch.float32: np.dtype("<f4"),
    torch.int32: np.dtype("<i4"),
    torch.int64: np.dtype("<i8"),
    torch.uint8: np.dtype("u1"),
    torch.float8_e4m3fn: np.dtype("u1"),
}


MAX_NDIM = 32
"""Most dimensions a Tensor may have (numpy's limit before 2.0)."""
MAX_SHAPE_BYTES = 2**62
"""Largest byte size a Tensor's shape may claim, with each 0 among its dims counted as 1: numpy and torch refuse
a shape by that size even when it holds no elements (numpy beyond 2**63 - 1 bytes, torch where the dims' product
overflows int64), so a shape of no elements whose other dims are huge matches 0 bytes of data, yet no array can
take it."""


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


class WireTensor(NamedTuple):
    """A tensor as a ``lutb.v1.Tensor`` carries it: dtype, shape and the row-major little-endian bytes.

    Made from a message by :meth:`from_message` (the checks of :func:`decode_tensor`, no torch call), written
    into one by :func:`encode_tensor` as it is, viewed by numpy without a copy (:meth:`numpy`), and turned into a
    torch tensor by :meth:`tensor` where one is needed.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes
    """Exactly ``numel * itemsize`` bytes."""

    @classmethod
    def from_message(
        cls,
        msg: pb.Tensor,
        *,
        name: str = "tensor",
        dtypes: Iterable[torch.dtype] | None = None,
        ndim: int | None = None,
    ) -> WireTensor:
        """The tensor ``msg`` holds, checked; arguments and errors as for :func:`decode_tensor`."""
        dtype = PROTO_TO_TORCH.get(msg.dtype)
        if dtype is None or (dtypes is not None and dtype not in dtypes):
            allowed = tuple(dtypes) if dtypes is not None else tuple(PROTO_TO_TORCH.values())
            wanted = ", ".join(dtype_name(d) for d in allowed)
            raise CodecError(f"{name}: dtype {dtype_name(msg.dtype)} not allowed; expected {wanted}")
        shape = tuple(msg.shape)
        if ndim is not None and len(shape) != ndim:
            raise CodecError(f"{name}: needs {ndim} dimensions, got shape {list(shape)}")
        if len(shape) > MAX_NDIM:
            raise CodecError(f"{name}: {len(shape)} dimensions; at most {MAX_NDIM}")
        numel = 1
        span = 1  # the dims' product with each 0 counted as 1: what numpy and torch bound a shape by
        for s in shape:
            if s < 0:
                raise CodecError(f"{name}: negative dimension in shape {list(shape)}")
            numel *= s
            span *= s or 1
        itemsize = _ITEMSIZE[dtype]
        if span * itemsize > MAX_SHAPE_BYTES:
            raise CodecError(
                f"{name}: shape {list(shape)} of {dtype_name(dtype)} is too large: over {MAX_SHAPE_BYTES} bytes "
                "(each 0 among its dims counted as 1)"
            )
        data = msg.data  # one Python bytes object per access: read it once
        if len(data) != numel * itemsize:
            raise CodecError(
                f"{name}: data holds {len(data)} bytes, but shape {list(shape)} of {dtype_name(dtype)} needs {numel * itemsize}"
            )
        return cls(dtype, shape, data)

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def numpy(self) -> np.ndarray:
        """A read-only numpy view of the bytes in :attr:`shape`: numpy's own dtype where it has one, bfloat16 as
        uint16 and float8 as uint8 bit patterns."""
        return np.frombuffer(self.data, dtype=_NUMPY[self.dtype]).reshape(self.shape)

    def tensor(self) -> torch.Tensor:
        """A new, writable CPU tensor of these values (one copy of the bytes)."""
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(bytearray(self.data), dtype=self.dtype).view(self.shape)


def as_tensor(t: torch.Tensor | WireTensor) -> torch.Tensor:
    """``t`` itself if it is a torch tensor, else :meth:`WireTensor.tensor`."""
    return t.tensor() if isinstance(t, WireTensor) else t


def host_array(t: torch.Tensor | WireTensor) -> np.ndarray:
    """A numpy view of ``t``'s values, no copy, as :meth:`WireTensor.numpy` gives it (bfloat16 and float8 as their
    bit patterns); a torch tensor keeps its strides (one not on the CPU is copied there first)."""
    if isinstance(t, WireTensor):
        return t.numpy()
    t = t.detach() if t.device.type == "cpu" else t.detach().cpu()
    carrier = _BIT_CARRIERS.get(t.dtype)
    array = (t if carrier is None else t.view(carrier)).numpy()
    return array.view(_NUMPY[t.dtype]) if t.dtype in _NUMPY else array


def host_bytes(t: torch.Tensor | WireTensor) -> bytes | np.ndarray:
    """``t``'s row-major bytes as a buffer: a WireTensor's own bytes, or a flat uint8 numpy view of a CPU tensor
    (copied first only when it is not contiguous)."""
    if isinstance(t, WireTensor):
        return t.data
    return host_array(t.contiguous()).reshape(-1).view(np.uint8)


def pack_bytes(parts: Iterable[torch.Tensor | WireTensor], out: np.ndarray) -> None:
    """``parts``' row-major bytes one after another into ``out``, a flat uint8 array they must fill exactly (shared
    memory, a staging buffer): one copy each, no torch call for a WireTensor.

    Raises:
        ValueError: the parts hold more or fewer bytes than ``out``.
    """
    offset = 0
    for part in parts:
        data = np.frombuffer(host_bytes(part), dtype=np.uint8)
        if offset + data.size > out.size:
            raise ValueError(f"the parts hold more bytes than the destination ({out.size})")
        out[offset:offset + data.size] = data
        offset += data.size
    if offset != out.size:
        raise ValueError(f"the parts hold {offset} bytes, the destination {out.size}")


def encode_tensor(tensor: torch.Tensor | WireTensor, out: pb.Tensor | None = None) -> pb.Tensor:
    """Encode ``tensor`` (any device, any strides) as a ``lutb.v1.Tensor``.

    Args:
        tensor: a tensor of one of the dtypes in :data:`TORCH_TO_PROTO`, or a :class:`WireTensor` (its bytes
            are written as they are: no torch call).
        out: a message to fill in place (e.g. ``response.output``); a new one if None.
    """
    msg = pb.Tensor() if out is None else out
    if isinstance(tensor, WireTensor):
        msg.dtype = to_proto_dtype(tensor.dtype)
        del msg.shape[:]
        msg.shape.extend(tensor.shape)
        msg.data = tensor.data
        return msg
    proto_dtype = to_proto_dtype(tensor.dtype)
    cpu = tensor if tensor.device.type == "cpu" and not tensor.requires_grad else tensor.detach().to("cpu")
    if not cpu.is_contiguous():
        cpu = cpu.contiguous()
    msg.dtype = proto_dtype
    del msg.shape[:]
    msg.shape.extend(cpu.shape)
    # One copy: the tensor's bytes straight into the message (few torch calls: this runs per request on the server).
    msg.data = cpu.view(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return msg


def _varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_LENGTH_DELIMITED = 2  # protobuf wire type of bytes and embedded messages
_DATA_TAG = _varint(pb.Tensor.DESCRIPTOR.fields_by_name["data"].number << 3 | _LENGTH_DELIMITED)
"""The tag of ``lutb.v1.Tensor.data``, once (every spliced answer writes it)."""


def tensor_field_parts(field_number: int, tensor: WireTensor) -> tuple[bytes, bytes]:
    """Field ``field_number`` of a message holding ``tensor`` as a ``lutb.v1.Tensor``, in wire form: two parts to
    append to the message's other serialized fields, the field's header (tag, length, dtype, shape, the data's tag
    and length) and ``tensor.data`` itself, the same object.

    Protobuf parsers take a message's fields in any order, so ``message.SerializeToString() + b"".join(parts)`` is the
    message with that field set: the data is copied once, into the joined bytes, instead of into the message and
    again out of it (:func:`encode_tensor` then ``SerializeToString``). The server answers large outputs so.
    """
    head = pb.Tensor(dtype=to_proto_dtype(tensor.dtype), shape=tensor.shape).SerializeToString()
    data_head = _DATA_TAG + _varint(len(tensor.data))
    length = len(head) + len(data_head) + len(tensor.data)
    return _varint(field_number << 3 | _LENGTH_DELIMITED) + _varint(length) + head + data_head, tensor.data


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
        CodecError: naming ``name``: unknown or refused dtype, wrong rank, more than :data:`MAX_NDIM`
            dimensions, a negative dimension, a shape over :data:`MAX_SHAPE_BYTES` (each 0 among its dims
            counted as 1: no array can take it), or a data length that does not match shape and dtype.
    """
    return WireTensor.from_message(msg, name=name, dtypes=dtypes, ndim=ndim).tensor()


__all__ = [
    "MAX_NDIM",
    "MAX_SHAPE_BYTES",
    "PROTO_TO_TORCH",
    "TORCH_TO_PROTO",
    "CodecError",
    "WireTensor",
    "as_tensor",
    "decode_tensor",
    "dtype_name",
    "encode_tensor",
    "host_array",
    "host_bytes",
    "pack_bytes",
    "tensor_field_parts",
    "to_proto_dtype",
    "to_torch_dtype",
]
