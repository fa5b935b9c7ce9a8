"""lutb_client.codec: round trips of every dtype, the wire layout, and refusals naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client.codec import (CodecError, WireTensor, as_tensor, decode_tensor, encode_tensor, host_array, host_bytes,
                               tensor_field_parts)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8, torch.float8_e4m3fn]
SHAPES = [(0,), (1,), (3, 5), (2, 0, 4), (7, 33), ()]


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape) * 10).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=dtype)
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _random(shape, dtype)
    msg = encode_tensor(t)
    assert list(msg.shape) == list(shape)
    back = decode_tensor(pb.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_wire_tensor_holds_the_message_as_it_is(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """A WireTensor keeps the message's bytes: encoded again it is the same message; its tensor and numpy view hold
    the values (bfloat16 and float8 as their bit patterns)."""
    t = _random(shape, dtype)
    msg = pb.Tensor.FromString(encode_tensor(t).SerializeToString())
    wire = WireTensor.from_message(msg)
    assert (wire.dtype, wire.shape, wire.nbytes) == (dtype, shape, t.numel() * t.element_size())
    assert encode_tensor(wire).SerializeToString() == msg.SerializeToString()
    back = wire.tensor()
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert as_tensor(wire).shape == t.shape and as_tensor(t) is t
    view = wire.numpy()
    assert view.shape == shape and not view.flags.writeable
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    assert view.reshape(-1).view(f"<i{t.element_size()}" if t.element_size() > 1 else "u1").tolist() == t.reshape(-1).view(bits).tolist()
    # the torch tensor seen the same way, also through a transposed (non-contiguous) view
    width = f"u{t.element_size()}"
    assert host_array(t).dtype == view.dtype and host_array(t).view(width).tolist() == view.view(width).tolist()
    assert bytes(host_bytes(t)) == bytes(host_bytes(wire)) == msg.data
    if len(shape) == 2:
        assert bytes(host_bytes(t.t())) == encode_tensor(t.t()).data


def test_wire_tensor_refuses_what_decode_refuses() -> None:
    with pytest.raises(CodecError, match="x: data holds 3 bytes"):
        WireTensor.from_message(pb.Tensor(dtype=pb.FLOAT32, shape=[1], data=b"\0" * 3), name="x")


def test_wire_tensor_copies_are_independent_of_each_other() -> None:
    wire = WireTensor.from_message(encode_tensor(torch.zeros(4)))
    t = wire.tensor()
    t += 1
    assert wire.tensor().sum() == 0 and wire.numpy().sum() == 0


def test_wire_layout_is_row_major_little_endian() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # non-contiguous: encoded row-major as [3, 2]
    msg = encode_tensor(t)
    assert np.frombuffer(msg.data, dtype="<f4").tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
    bf = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert encode_tensor(bf).data == bytes([0x80, 0x3F, 0x00, 0xC0])  # bf16 bit patterns, little-endian
    assert encode_tensor(torch.tensor([1.0], dtype=torch.float8_e4m3fn)).data == bytes([0x38])


def test_decoded_tensor_is_writable_and_independent() -> None:
    msg = encode_tensor(torch.zeros(4))
    t = decode_tensor(msg)
    t += 1
    assert decode_tensor(msg).sum() == 0


@pytest.mark.parametrize(
    ("msg", "kwargs", "words"),
    [
        (pb.Tensor(dtype=pb.FLOAT32, shape=[2, 2], data=b"\0" * 15), {}, ["x", "15 bytes", "16"]),
        (pb.Tensor(dtype=pb.DATA_TYPE_UNSPECIFIED, shape=[1], data=b"\0"), {}, ["x", "DATA_TYPE_UNSPECIFIED"]),
        (pb.Tensor(dtype=99, shape=[1], data=b"\0"), {}, ["x", "DataType(99)"]),
        (pb.Tensor(dtype=pb.INT32, shape=[1], data=b"\0" * 4), {"dtypes": (torch.float32,)}, ["x", "INT32", "FLOAT32"]),
        (pb.Tensor(dtype=pb.FLOAT32, shape=[4], data=b"\0" * 16), {"ndim": 2}, ["x", "2 dimensions"]),
        (pb.Tensor(dtype=pb.FLOAT32, shape=[-1, 4], data=b""), {}, ["x", "negative"]),
    ],
)
def test_refusals_name_the_field(msg: pb.Tensor, kwargs: dict, words: list[str]) -> None:
    with pytest.raises(CodecError) as info:
        decode_tensor(msg, name="x", **kwargs)
    for word in words:
        assert word in str(info.value)


def test_encode_refuses_dtype_without_wire_type() -> None:
    with pytest.raises(CodecError, match="complex64"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ([2**62, 2**62, 0], ["x", "too large"]),  # no elements, so 0 bytes of data match it: torch / numpy then refused it
        ([0, 2**62], ["x", "too large"]),  # 2**62 bfloat16 elements would take 2**63 bytes, over numpy's limit
        ([2**61, 4, 0], ["x", "too large"]),
        ([0] * 33, ["x", "33 dimensions"]),
    ],
)
def test_shapes_no_array_can_take_are_refused(shape: list[int], words: list[str]) -> None:
    """A shape is checked for what numpy and torch can hold, not only against the data's length: with a zero
    among the dims any other dims matched no data, and decoding or viewing then raised RuntimeError / ValueError
    instead of the documented CodecError."""
    msg = pb.Tensor(dtype=pb.BFLOAT16, shape=shape, data=b"")
    for decode in (lambda: decode_tensor(msg, name="x"), lambda: WireTensor.from_message(msg, name="x").numpy()):
        with pytest.raises(CodecError) as info:
            decode()
        for word in words:
            assert word in str(info.value)


@pytest.mark.parametrize("shape", [[2**30, 2**31, 0], [0] * 32, [1, 0, 2**61 - 1]])
def test_empty_shapes_within_the_limits_decode(shape: list[int]) -> None:
    msg = pb.Tensor(dtype=pb.BFLOAT16, shape=shape, data=b"")
    assert decode_tensor(msg).shape == tuple(shape) and WireTensor.from_message(msg).numpy().shape == tuple(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(128, 2048), (3, 1, 4096)])
def test_a_tensor_field_joined_to_a_message_parses_as_the_message_with_it(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """tensor_field_parts: a ForwardResponse serialized without its output, with the two parts appended, parses as the
    same response with the output encoded (data of 0 bytes to 2 MB: one- to four-byte varints)."""
    t = (torch.randn(shape) * 8).to(dtype)
    wire = WireTensor.from_message(encode_tensor(t))
    whole = pb.ForwardResponse(request_id=7, status=pb.Status(code=0))
    whole.timing.compute_us = 123
    head_only = pb.ForwardResponse()
    head_only.CopyFrom(whole)
    encode_tensor(wire, out=whole.output)
    head, data = tensor_field_parts(pb.ForwardResponse.DESCRIPTOR.fields_by_name["output"].number, wire)
    assert data is wire.data  # not copied until joined
    joined = pb.ForwardResponse.FromString(b"".join((head_only.SerializeToString(), head, data)))
    assert joined == whole
    assert torch.equal(decode_tensor(joined.output).reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
