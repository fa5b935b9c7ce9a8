"""Every refusal of the service: its status code and a message naming the field (unary and in-stream)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
import torch

from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
from lutb_client.codec import encode_tensor
from lutb_server.testing import SLEEP_EXPERTS_ENV, ServerThread, SleepExperts

HIDDEN = 128
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _request(tokens: int = 4, k: int = 2, **fields) -> pb.ForwardRequest:
    x = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
    ids = torch.randint(0, 8, (tokens, k), dtype=torch.int32)
    w = torch.rand(tokens, k)
    fields.setdefault("layer", 0)
    request = pb.ForwardRequest(request_id=7, **fields)
    encode_tensor(x, out=request.hidden_states)
    encode_tensor(ids, out=request.topk_ids)
    encode_tensor(w, out=request.topk_weights)
    return request


def _with(tensor_field: str, tensor: torch.Tensor, **kwargs) -> pb.ForwardRequest:
    request = _request(**kwargs)
    encode_tensor(tensor, out=getattr(request, tensor_field))
    return request


def _mutate(fn: Callable[[pb.ForwardRequest], None], **kwargs) -> pb.ForwardRequest:
    request = _request(**kwargs)
    fn(request)
    return request


def _nan_x() -> torch.Tensor:
    x = torch.randn(4, HIDDEN).to(torch.bfloat16)
    x[2, 5] = float("nan")
    return x


def _inf_x() -> torch.Tensor:
    x = torch.randn(4, HIDDEN).to(torch.bfloat16)
    x[0, 0] = float("-inf")
    return x


CASES = {
    "hidden dtype int32": (_with("hidden_states", torch.zeros(4, HIDDEN, dtype=torch.int32)), INVALID, "hidden_states"),
    "hidden dtype fp8": (_with("hidden_states", torch.zeros(4, HIDDEN, dtype=torch.float8_e4m3fn)), INVALID, "hidden_states"),
    "hidden dtype unspecified": (_mutate(lambda r: setattr(r.hidden_states, "dtype", 0)), INVALID, "hidden_states"),
    "hidden wrong H": (_with("hidden_states", torch.zeros(4, 64, dtype=torch.bfloat16)), INVALID, "hidden_states"),
    "hidden 1-D": (_with("hidden_states", torch.zeros(HIDDEN, dtype=torch.bfloat16)), INVALID, "hidden_states"),
    "hidden short data": (_mutate(lambda r: setattr(r.hidden_states, "data", r.hidden_states.data[:-2])), INVALID, "hidden_states"),
    "hidden NaN": (_with("hidden_states", _nan_x()), INVALID, "hidden_states"),
    "hidden Inf": (_with("hidden_states", _inf_x()), INVALID, "hidden_states"),
    "hidden missing": (_mutate(lambda r: r.ClearField("hidden_states")), INVALID, "hidden_states"),
    "ids dtype float": (_with("topk_ids", torch.zeros(4, 2)), INVALID, "topk_ids"),
    "ids T mismatch": (_with("topk_ids", torch.zeros(3, 2, dtype=torch.int32)), INVALID, "topk_ids"),
    "ids above range": (_with("topk_ids", torch.full((4, 2), 8, dtype=torch.int32)), INVALID, "topk_ids"),
    "ids negative": (_with("topk_ids", torch.full((4, 2), -1, dtype=torch.int64)), INVALID, "topk_ids"),
    "ids k over the experts": (_request(k=9), INVALID, "k = 9 routes per token exceed"),
    "ids k over the experts, no tokens": (  # the shape alone (no data) once made the server allocate and fail INTERNAL
        _mutate(lambda r: (r.topk_ids.shape.__setitem__(1, 2**62), r.topk_weights.shape.__setitem__(1, 2**62)), tokens=0),
        INVALID, "topk_ids"),
    "ids short data": (_mutate(lambda r: setattr(r.topk_ids, "data", r.topk_ids.data + b"\0")), INVALID, "topk_ids"),
    "weights dtype bf16": (_with("topk_weights", torch.ones(4, 2, dtype=torch.bfloat16)), INVALID, "topk_weights"),
    "weights shape": (_with("topk_weights", torch.ones(4, 3)), INVALID, "topk_weights"),
    "weights NaN": (_with("topk_weights", torch.full((4, 2), float("nan"))), INVALID, "topk_weights"),
    "route-major with weights on input": (
        _request(k=1, apply_router_weight_on_input=True, output_mode=pb.ROUTE_MAJOR), INVALID, "output_mode"),
    "weights on input with k=2": (_request(k=2, apply_router_weight_on_input=True), INVALID, "apply_router_weight_on_input"),
    "unknown output mode": (_request(output_mode=9), INVALID, "output_mode"),
    "too many tokens": (_request(tokens=65), INVALID, "max_tokens_per_request"),
    "hidden_scales set": (_mutate(lambda r: encode_tensor(torch.zeros(4, 4, dtype=torch.uint8), out=r.hidden_scales)),
                          INVALID, "hidden_scales"),
    "unknown layer": (_request(layer=5), grpc.StatusCode.NOT_FOUND, "layer 5"),
    "another checkpoint's content hash": (
        _request(expected_content_hash="sha256:not-this-checkpoint"), grpc.StatusCode.FAILED_PRECONDITION, "expected_content_hash"),
}


@pytest.fixture(scope="module")
def stub(server: ServerThread):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.ExpertServiceStub(channel)


@pytest.mark.parametrize("case", list(CASES))
def test_unary_refusal(stub, case: str) -> None:
    request, code, word = CASES[case]
    with pytest.raises(grpc.RpcError) as info:
        stub.Forward(request, timeout=10)
    assert info.value.code() == code, info.value.details()
    assert word in info.value.details()


def test_each_refusal_inside_one_stream(stub) -> None:
    """All the bad requests and good ones interleaved on one stream: each answered in order, the stream lives on."""
    requests, expected = [], []
    for i, (request, code, word) in enumerate(CASES.values()):
        good = _request()
        good.request_id = 1000 + i
        bad = pb.ForwardRequest()
        bad.CopyFrom(request)
        bad.request_id = 2000 + i
        requests += [good, bad]
        expected += [(1000 + i, OK, ""), (2000 + i, code, word)]
    responses = list(stub.ForwardStream(iter(requests), timeout=60))
    assert len(responses) == len(requests)
    for response, (request_id, code, word) in zip(responses, expected):
        assert response.request_id == request_id
        assert response.status.code == code.value[0], response.status.message
        assert word in response.status.message
        assert response.HasField("output") == (code == OK)


def test_float32_input_is_rounded_to_the_model_dtype(stub) -> None:
    x32 = torch.randn(4, HIDDEN)
    request32 = _with("hidden_states", x32)
    request16 = pb.ForwardRequest()
    request16.CopyFrom(request32)
    encode_tensor(x32.to(torch.bfloat16), out=request16.hidden_states)
    a = stub.Forward(request32, timeout=10)
    b = stub.Forward(request16, timeout=10)
    assert a.output == b.output and a.output.dtype == pb.BFLOAT16


GARBAGE = b"\xff\xff\xff\xff"
"""Field 31 of wire type 7: bytes that no protobuf message parses from."""


def test_a_request_that_is_not_protobuf_is_invalid_argument(server: ServerThread) -> None:
    """grpc.aio parses requests before the servicer runs: protobuf's DecodeError once escaped as UNKNOWN, naming
    a Python class. It is bad input: INVALID_ARGUMENT naming the request (GetModelInfo as Forward)."""
    with grpc.insecure_channel(server.address) as channel:
        for method in ("Forward", "GetModelInfo"):
            call = channel.unary_unary(f"/lutb.v1.ExpertService/{method}")  # raw bytes both ways
            with pytest.raises(grpc.RpcError) as info:
                call(GARBAGE, timeout=10)
            assert info.value.code() == INVALID, (method, info.value.code(), info.value.details())
            details = info.value.details()
            assert "request: not a valid lutb.v1." in details and "DecodeError" not in details and "<class" not in details


def test_a_request_that_is_not_protobuf_does_not_end_the_stream(server: ServerThread) -> None:
    """On a stream that request gets its own INVALID_ARGUMENT response (request_id 0: it has none) and the stream
    answers the requests after it; the parse error once ended the whole call."""
    first, last = _request(), _request()
    first.request_id, last.request_id = 1, 3
    with grpc.insecure_channel(server.address) as channel:
        stream = channel.stream_stream("/lutb.v1.ExpertService/ForwardStream")
        raw = [first.SerializeToString(), GARBAGE, last.SerializeToString()]
        try:
            responses = [pb.ForwardResponse.FromString(r) for r in stream(iter(raw), timeout=30)]
        except grpc.RpcError as err:
            pytest.fail(f"the stream ended with {err.code()}: {err.details()}")
    assert [(r.request_id, r.status.code) for r in responses] == [(1, OK.value[0]), (0, INVALID.value[0]), (3, OK.value[0])]
    assert "request: not a valid lutb.v1.ForwardRequest" in responses[1].status.message
    assert responses[0].HasField("output") and responses[2].HasField("output") and not responses[1].HasField("output")


def test_expected_content_hash_is_checked_against_the_served_checkpoint(stub) -> None:
    """A request naming another checkpoint's content hash is refused (FAILED_PRECONDITION naming both hashes, unary
    and in a stream); the served checkpoint's hash, or none, is accepted: a sharded client sets it so that a shard
    restarted with another checkpoint or placement cannot silently contribute zero for experts it no longer holds."""
    served = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).content_hash
    assert served
    wrong = "sha256:" + "0" * 64
    with pytest.raises(grpc.RpcError) as info:
        stub.Forward(_request(expected_content_hash=wrong), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert wrong in info.value.details() and served in info.value.details()
    for expected in (served, ""):
        assert stub.Forward(_request(expected_content_hash=expected), timeout=10).HasField("output")
    responses = list(stub.ForwardStream(iter([_request(expected_content_hash=h) for h in (served, wrong, "")]), timeout=60))
    codes = [r.status.code for r in responses]
    assert codes == [0, grpc.StatusCode.FAILED_PRECONDITION.value[0], 0], [r.status.message for r in responses]


class OutOfMemoryExperts(SleepExperts):
    """Runs out of device memory on batches of more than 4 tokens (``--backend test_server_errors:OutOfMemoryExperts``)."""

    def forward(self, x, topk_ids, topk_weights, **kwargs):  # type: ignore[no-untyped-def]
        if x.shape[0] > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB.")
        return super().forward(x, topk_ids, topk_weights, **kwargs)


def test_a_batch_the_device_cannot_hold_is_resource_exhausted(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Running out of device memory is no server bug: RESOURCE_EXHAUSTED with a hint (it was INTERNAL), and the
    next, smaller request is answered."""
    monkeypatch.setenv(SLEEP_EXPERTS_ENV, "0,0")
    with ServerThread(checkpoint=tiny_checkpoint, backend="test_server_errors:OutOfMemoryExperts", max_wait_us=0) as srv:
        stub = pb_grpc.ExpertServiceStub(grpc.insecure_channel(srv.address))
        with pytest.raises(grpc.RpcError) as info:
            stub.Forward(_request(tokens=8), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ran out of memory" in info.value.details() and "fewer tokens" in info.value.details()
        assert list(stub.Forward(_request(tokens=2), timeout=30).output.shape) == [2, HIDDEN]


@pytest.mark.parametrize(("left_s", "expected"), [(-0.5, grpc.StatusCode.DEADLINE_EXCEEDED), (0.0, grpc.StatusCode.DEADLINE_EXCEEDED),
                                                  (0.004, grpc.StatusCode.DEADLINE_EXCEEDED), (0.5, grpc.StatusCode.CANCELLED),
                                                  (None, grpc.StatusCode.CANCELLED)])
def test_a_cancel_just_before_the_servers_deadline_counts_as_the_deadline(left_s: float | None, expected: grpc.StatusCode) -> None:
    """The caller's deadline starts before the server's copy of it, so the caller's expiry can reach the server as a
    cancel a few milliseconds early: counted DEADLINE_EXCEEDED (errors.DEADLINE_SLACK_S); a cancel well before the
    deadline, or of a call without one, is CANCELLED."""
    import time

    from lutb_server.errors import cancelled_status

    assert cancelled_status(None if left_s is None else time.monotonic() + left_s) == expected
