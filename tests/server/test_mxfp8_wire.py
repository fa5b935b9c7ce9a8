"""MXFP8 hidden states on the wire: which equalities hold exactly, client wire="mxfp8", server validation."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
import torch

from lutb_client import AsyncExpertClient, ExpertClient, ExpertServiceError
from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
from lutb_client.client import build_request
from lutb_client.codec import encode_tensor
from lutb_kernels.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from lutb_server.testing import ServerThread, make_tiny_checkpoint

H = 128
E = 8


def _batch(tokens: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes: every block gets its own scale.
    x = (torch.randn(tokens, H, generator=gen) * torch.exp2(torch.randint(-6, 7, (tokens, 1), generator=gen).float())).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32) \
        if tokens else torch.zeros(0, k, dtype=torch.int32)
    w = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)
    return x, ids, w


@pytest.fixture(scope="module")
def fp16_floor_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("fp16") / "ckpt", layers=(0,), dtype="float16", scale_mode="floor", seed=3)
    with ServerThread(checkpoint=ckpt, max_wait_us=0) as running:
        yield running


@pytest.mark.parametrize(("tokens", "k", "mode"), [(1, 2, "combined"), (7, 3, "combined"), (33, 2, "route_major"), (0, 2, "combined")])
def test_mxfp8_wire_equals_dequantized_and_original(server: ServerThread, tokens: int, k: int, mode: str) -> None:
    x, ids, w = _batch(tokens, k, seed=tokens + k)
    with ExpertClient(server.address) as native, ExpertClient(server.address, wire="mxfp8") as mx:
        got = mx.forward(1, x, ids, w, output_mode=mode)
        info = native.model_info()
        q, s = mxfp8_quantize(x, info.mxfp8_scale_mode)
        dequantized = native.forward(1, mxfp8_dequantize(q, s, torch.bfloat16), ids, w, output_mode=mode)
        original = native.forward(1, x, ids, w, output_mode=mode)
    assert got.dtype == torch.bfloat16 and got.shape == original.shape
    assert torch.equal(got, dequantized)  # always: the server dequantizes exactly so
    assert torch.equal(got, original)  # QDQ is idempotent: sending MXFP8 loses nothing the server would keep


def test_other_dtype_and_scale_mode(fp16_floor_server: ServerThread) -> None:
    x32, ids, w = _batch(16, 2, seed=5, dtype=torch.float32)
    with ExpertClient(fp16_floor_server.address) as native, ExpertClient(fp16_floor_server.address, wire="mxfp8") as mx:
        got = mx.forward(0, x32, ids, w)  # float32 in: the client rounds to float16 first, as the server would
        assert mx._wire.scale_mode == "floor" and mx._wire.dtype == torch.float16
        assert got.dtype == torch.float16
        assert torch.equal(got, native.forward(0, x32, ids, w))
        q, s = mxfp8_quantize(x32.to(torch.float16), "floor")
        assert torch.equal(got, native.forward(0, mxfp8_dequantize(q, s, torch.float16), ids, w))


def test_weights_on_input_only_equal_to_dequantized(server: ServerThread) -> None:
    """With the router weight on the input the server quantizes x * w: sending MXFP8 x is exactly
    sending its dequantized values, but not (in general) the same as sending x."""
    x, ids, w = _batch(24, 1, seed=9)
    with ExpertClient(server.address) as native, ExpertClient(server.address, wire="mxfp8") as mx:
        got = mx.forward(0, x, ids, w, apply_router_weight_on_input=True)
        q, s = mxfp8_quantize(x, "rceil")
        assert torch.equal(got, native.forward(0, mxfp8_dequantize(q, s, torch.bfloat16), ids, w, apply_router_weight_on_input=True))
        original = native.forward(0, x, ids, w, apply_router_weight_on_input=True)
    rel = float((got.double() - original.double()).norm() / original.double().norm())
    assert rel < 0.1


def test_stream_and_async_clients(server: ServerThread) -> None:
    x, ids, w = _batch(5, 2, seed=11)
    with ExpertClient(server.address) as native:
        want = native.forward(0, x, ids, w)
    with ExpertClient(server.address, wire="mxfp8") as mx, mx.stream() as stream:
        futures = [stream.submit(0, x, ids, w) for _ in range(3)]
    assert all(torch.equal(f.result(30), want) for f in futures)

    async def run() -> list[torch.Tensor]:
        async with AsyncExpertClient(server.address, wire="mxfp8") as client:
            one = await client.forward(0, x, ids, w)
            async with client.stream() as stream:
                two = await stream.forward(0, x, ids, w)
            return [one, two]

    assert all(torch.equal(o, want) for o in asyncio.run(asyncio.wait_for(run(), 30)))


def test_request_bytes_about_halved() -> None:
    x, ids, w = _batch(64, 8, seed=1)
    q, s = mxfp8_quantize(x, "rceil")
    dense = build_request(0, x, ids, w).hidden_states.ByteSize()
    packed = build_request(0, q, ids, w, hidden_scales=s)
    ratio = (packed.hidden_states.ByteSize() + packed.hidden_scales.ByteSize()) / dense
    assert 0.5 < ratio < 0.53, ratio


def test_client_side_errors(server: ServerThread) -> None:
    with pytest.raises(ValueError, match="wire"):
        ExpertClient(server.address, wire="fp4")
    x, ids, w = _batch(2, 2, seed=2)
    x[0, 3] = float("nan")
    with ExpertClient(server.address, wire="mxfp8") as mx, pytest.raises(ExpertServiceError) as err:
        mx.forward(0, x, ids, w)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "hidden_states" in err.value.message


def _raw(tokens: int = 4, **overrides: object) -> pb.ForwardRequest:
    x, ids, w = _batch(tokens, 2, seed=3)
    q, s = mxfp8_quantize(x, "rceil")
    q = overrides.pop("q", q)  # type: ignore[assignment]
    s = overrides.pop("s", s)  # type: ignore[assignment]
    request = build_request(0, q, ids, w)  # type: ignore[arg-type]
    if s is not None:
        encode_tensor(s, out=request.hidden_scales)  # type: ignore[arg-type]
    return request


def _bad_q(fill: int) -> torch.Tensor:
    q = mxfp8_quantize(_batch(4, 2, seed=3)[0], "rceil")[0].clone()
    q.view(torch.uint8)[1, 7] = fill
    return q


_s = mxfp8_quantize(_batch(4, 2, seed=3)[0], "rceil")[1]
_s255 = _s.clone()
_s255[2, 1] = 255
_s254 = torch.full_like(_s, 254)
CASES = {
    "scales with bf16 hidden_states": (dict(q=_batch(4, 2, seed=3)[0]), "hidden_states (with hidden_scales): dtype BFLOAT16 not allowed; expected FLOAT8_E4M3FN"),
    "float8 without scales": (dict(s=None), "hidden_states: FLOAT8_E4M3FN (MXFP8) needs hidden_scales"),
    "scales dtype": (dict(s=_s.to(torch.int32)), "hidden_scales: dtype INT32 not allowed; expected UINT8"),
    "scales columns": (dict(s=torch.zeros(4, 8, dtype=torch.uint8)), "hidden_scales: shape [4, 8] does not match [T, H/32] = [4, 4]"),
    "scales rows": (dict(s=_s[:3]), "hidden_scales: shape [3, 4] does not match [T, H/32] = [4, 4]"),
    "hidden width": (dict(q=torch.zeros(4, 96, dtype=torch.float8_e4m3fn), s=torch.zeros(4, 3, dtype=torch.uint8)),
                     "hidden_states: shape [4, 96] does not match [T, 128]"),
    "scale byte 255": (dict(s=_s255), "hidden_scales: 1 scale byte(s) are 255 (E8M0 NaN), first at row 2, block 1"),
    "e4m3 NaN": (dict(q=_bad_q(0x7F)), "hidden_states: 1 MXFP8 value(s) are NaN"),
    "overflow": (dict(s=_s254), "overflow torch.bfloat16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_server_refuses_bad_mxfp8_input(server: ServerThread, case: str) -> None:
    overrides, message = CASES[case]
    request = _raw(**overrides)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ExpertServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Forward(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in err.value.details(), err.value.details()
        # On a stream the same error is the response's status, and the stream goes on.
        responses = list(stub.ForwardStream(iter([request, _raw()]), timeout=10))
    assert responses[0].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and message in responses[0].status.message
    assert responses[1].status.code == 0


def _engine(path: object, monkeypatch: pytest.MonkeyPatch, device: str):  # noqa: ANN202
    """A serving process's engine (expert ids only); ``device`` "cuda" makes it decide as on a GPU host."""
    from lutb_kernels.checkpoint import Checkpoint
    from lutb_server.backends import choose_backend
    from lutb_server.engine import ExpertEngine

    ckpt = Checkpoint(path)  # type: ignore[arg-type]
    engine = ExpertEngine(ckpt, choose_backend("reference", ckpt.config, torch.device("cpu")), load_experts=False)
    monkeypatch.setattr(engine, "device", torch.device(device))
    return engine


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_engine_carries_mxfp8_to_a_cuda_device_as_sent(tiny_checkpoint: object, monkeypatch: pytest.MonkeyPatch,
                                                           device: str) -> None:
    """On a CUDA engine MXFP8 input stays as sent (the worker dequantizes it on the device: pooled apart from
    model-dtype input); elsewhere it is dequantized at once. Either way its values are the dequantized ones."""
    from lutb_server.engine import PreparedRequest

    engine = _engine(tiny_checkpoint, monkeypatch, device)
    x, ids, w = _batch(6, 2, seed=8)
    q, s = mxfp8_quantize(x, "rceil")
    got = engine.prepare(0, q, ids, w, hidden_scales=s)
    dense = engine.prepare(0, mxfp8_dequantize(q, s, torch.bfloat16), ids, w)
    if device == "cuda":
        assert got.x is q and got.x_scales is s and got.dtype == torch.bfloat16
        assert got.pool_key != dense.pool_key and got.pool_key[:4] == dense.pool_key[:4]
    else:
        assert got.x_scales is None and got.x.dtype == torch.bfloat16 and got.pool_key == dense.pool_key
    assert torch.equal(got.dense_x().view(torch.int16), dense.x.view(torch.int16))
    assert got.output_shape == dense.output_shape and got.output_bytes == dense.output_bytes
    assert isinstance(got, PreparedRequest) and got.tokens == 6


def test_scales_too_large_for_the_device_path_are_dequantized_and_checked_here(tiny_checkpoint: object,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Scale bytes above 246 (values beyond 2**119) are not carried, even to a CUDA device: dequantized here, and
    refused when they overflow the model dtype."""
    from lutb_server.errors import InvalidArgument

    engine = _engine(tiny_checkpoint, monkeypatch, "cuda")
    ids, w = _batch(2, 2, seed=9)[1:]
    q = torch.full((2, H), 2.0 ** -9, dtype=torch.float32).to(torch.float8_e4m3fn)  # e4m3's least subnormal
    s = torch.full((2, H // 32), 250, dtype=torch.uint8)
    got = engine.prepare(0, q, ids, w, hidden_scales=s)
    assert got.x_scales is None and got.x.dtype == torch.bfloat16
    assert torch.equal(got.x.view(torch.int16), mxfp8_dequantize(q, s, torch.bfloat16).view(torch.int16))
    with pytest.raises(InvalidArgument, match="overflow"):
        engine.prepare(0, torch.full((2, H), 448.0).to(torch.float8_e4m3fn), ids, w, hidden_scales=s)
