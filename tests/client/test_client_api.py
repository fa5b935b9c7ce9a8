"""ExpertClient, AsyncExpertClient and their stream sessions against a real server on loopback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from lutb_client import AsyncExpertClient, ExpertClient, ExpertServiceError
import lutb_client.client as client_module
from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client.client import AsyncForwardStream, ForwardStream, build_request, parse_response
from lutb_client.codec import encode_tensor
from lutb_kernels.checkpoint import Checkpoint
from lutb_kernels.reference import reference_moe_forward
from lutb_kernels.tiles import tiles_to_dense
from lutb_server.testing import ServerThread, free_port

HIDDEN = 128
NUM_EXPERTS = 8


def _batch(tokens: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    ids = torch.rand(tokens, NUM_EXPERTS, generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(tokens, k, generator=gen)
    return x, ids, w


def _reference(checkpoint: Path, layer: int, x, ids, w, **kwargs) -> torch.Tensor:
    ckpt = Checkpoint(checkpoint)
    weights = ckpt.layer(layer)
    return reference_moe_forward(
        x, ids, w, tiles_to_dense(weights.w13), tiles_to_dense(weights.w2), weights.expert_ids,
        num_experts=ckpt.config.num_experts, activation=ckpt.config.activation,
        scale_mode=ckpt.config.mxfp8_scale_mode, **kwargs,
    )


def test_model_info(server: ServerThread, client_checkpoint: Path) -> None:
    with ExpertClient(server.address) as client:
        info = client.model_info()
    assert (info.format, info.format_version) == ("lut-b", 1)
    assert (info.hidden_size, info.intermediate_size, info.num_experts) == (128, 128, 8)
    assert [(layer.layer, list(layer.expert_ids)) for layer in info.layers] == [(0, [0, 1, 2, 4, 5, 7]), (3, [0, 1, 2, 4, 5, 7])]
    assert info.dtype == pb.BFLOAT16 and info.activation == "silu" and info.mxfp8_scale_mode == "rceil"
    assert info.backend == "reference" and "auto" in info.backend_reason and info.device == "cpu"
    assert info.content_hash == Checkpoint(client_checkpoint).content_hash()
    assert info.server_version and info.max_tokens_per_request > 0
    assert info.max_message_bytes == server.settings.max_message_bytes  # the server's bound, said ahead
    assert len(info.instance_id) == 16 and info.instance_id == server.server.instance_id
    assert info.max_top_k == server.settings.max_top_k == 32  # the default


def test_more_routes_per_token_than_max_top_k_are_refused(client_checkpoint: Path) -> None:
    with ServerThread(checkpoint=client_checkpoint, max_top_k=2) as small, ExpertClient(small.address) as client:
        assert client.model_info().max_top_k == 2
        x = torch.randn(4, 128).to(torch.bfloat16)
        ids = torch.tensor([[0, 1, 2]] * 4, dtype=torch.int32)
        with pytest.raises(ExpertServiceError, match="exceed max_top_k = 2") as refused:
            client.forward(0, x, ids, torch.full((4, 3), 1 / 3))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert client.forward(0, x, ids[:, :2], torch.full((4, 2), 0.5)).shape == (4, 128)


@pytest.mark.parametrize(
    ("tokens", "k", "kwargs"),
    [
        (1, 1, {}),
        (17, 2, {}),
        (64, 4, {}),
        (9, 3, {"output_mode": "route_major"}),
        (12, 1, {"apply_router_weight_on_input": True}),
        (0, 2, {}),
    ],
)
def test_forward_equals_reference(server: ServerThread, client_checkpoint: Path, tokens: int, k: int, kwargs: dict) -> None:
    """Alone in its batch, the server's output is bit-identical to reference_moe_forward (routes to 3 and 6 add zero)."""
    x, ids, w = _batch(tokens, k, seed=tokens * 10 + k)
    with ExpertClient(server.address) as client:
        got = client.forward(3, x, ids, w, **kwargs)
    want = _reference(client_checkpoint, 3, x, ids, w, **kwargs)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got, want)


def test_int64_ids_and_float32_hidden_states_are_converted(server: ServerThread) -> None:
    x, ids, w = _batch(8, 2, seed=3, dtype=torch.float32)
    with ExpertClient(server.address) as client:
        converted = client.forward(0, x, ids.long(), w)
        native = client.forward(0, x.to(torch.bfloat16), ids, w)
    assert torch.equal(converted, native)


def test_errors_raise_expert_service_error(server: ServerThread) -> None:
    x, ids, w = _batch(4, 2, seed=1)
    with ExpertClient(server.address) as client:
        with pytest.raises(ExpertServiceError) as info:
            client.forward(0, x, ids + 8, w)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "topk_ids" in info.value.message
        with pytest.raises(ExpertServiceError) as info:
            client.forward(5, x, ids, w)
        assert info.value.code == grpc.StatusCode.NOT_FOUND and "layer 5" in info.value.message
        with pytest.raises(ExpertServiceError) as info:
            client.forward(0, x, ids, w, output_mode="sideways")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_sync_stream_keeps_order_and_survives_errors(server: ServerThread) -> None:
    batches = [_batch(3 + i, 2, seed=100 + i) for i in range(12)]
    with ExpertClient(server.address) as client:
        want = [client.forward(0, *b) for b in batches]
        with client.stream(max_in_flight=5) as stream:
            futures = []
            for i, b in enumerate(batches):
                futures.append(stream.submit(0, *b, detailed=True))
                if i == 4:
                    futures.append(stream.submit(9, *b))  # unknown layer: fails alone
        results = _outcomes(futures, timeout=30)
    errors = [r for r in results if isinstance(r, ExpertServiceError)]
    assert len(errors) == 1 and errors[0].code == grpc.StatusCode.NOT_FOUND and errors[0].request_id is not None
    good = [r for r in results if not isinstance(r, ExpertServiceError)]
    ids = [r.request_id for r in good]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for result, expected in zip(good, want):
        assert torch.equal(result.output, expected)


def test_async_client_and_stream(server: ServerThread) -> None:
    batches = [_batch(5, 2, seed=200 + i) for i in range(8)]

    async def main():
        async with AsyncExpertClient(server.address) as client:
            info = await client.model_info()
            alone = [await client.forward(0, *b) for b in batches]
            async with client.stream(max_in_flight=3) as stream:
                futures = [await stream.submit(0, *b) for b in batches[:4]]
                bad = await stream.submit(0, batches[0][0], batches[0][1] + 100, batches[0][2])
                futures += [await stream.submit(0, *b) for b in batches[4:]]
                outputs = await asyncio.gather(*futures)
                with pytest.raises(ExpertServiceError) as err:
                    await bad
                assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "topk_ids" in err.value.message
                again = await stream.forward(0, *batches[0])  # the stream is still open
            return info, alone, outputs, again

    info, alone, outputs, again = asyncio.run(main())
    assert info.hidden_size == HIDDEN
    for got, want in zip(outputs, alone):
        assert torch.equal(got, want)
    assert torch.equal(again, alone[0])


@pytest.mark.parametrize("connections", [1, 3])
def test_clients_over_several_connections(server: ServerThread, client_checkpoint: Path, connections: int) -> None:
    """Calls and streams take the connections in turn; answers do not depend on which."""
    batches = [_batch(4, 2, seed=300 + i) for i in range(2 * connections)]
    with ExpertClient(server.address, connections=connections) as client:
        assert len(client._channels) == connections
        got = [client.forward(0, *b) for b in batches]
        with client.stream() as stream:
            streamed = [f.result(timeout=30) for f in [stream.submit(0, *b) for b in batches]]

    async def main() -> list[torch.Tensor]:
        async with AsyncExpertClient(server.address, connections=connections) as client:
            return [await client.forward(0, *b) for b in batches]

    for b, g, s_, a in zip(batches, got, streamed, asyncio.run(main())):
        assert torch.equal(g, s_) and torch.equal(g, a)
        assert torch.equal(g, _reference(client_checkpoint, 0, *b))  # alone in its batch: bit for bit
    with pytest.raises(ValueError, match="connections"):
        ExpertClient(server.address, connections=0)


def test_stream_send_returns_raw_responses_with_their_status(server: ServerThread) -> None:
    """send(): a prebuilt request in, the response itself out; a request's error is its status, not an exception."""
    from lutb_client.client import build_request, parse_response

    x, ids, w = _batch(4, 2, seed=300)
    good = build_request(0, x, ids, w, request_id=7)
    bad = build_request(9, x, ids, w, request_id=8)  # unknown layer
    with ExpertClient(server.address) as client:
        want = client.forward(0, x, ids, w)
        with client.stream() as stream:
            sync = [stream.send(good).result(30), stream.send(bad).result(30)]
            assert not stream.broken

    async def main() -> list[pb.ForwardResponse]:
        async with AsyncExpertClient(server.address) as aclient, aclient.stream() as astream:
            out = [await (await astream.send(good)), await (await astream.send(bad))]
            assert not astream.broken
            astream.cancel()
            assert astream.broken
            return out

    for ok, err in (sync, asyncio.run(main())):
        assert ok.request_id == 7 and ok.status.code == 0 and torch.equal(parse_response(ok).output, want)
        assert err.request_id == 8 and err.status.code == grpc.StatusCode.NOT_FOUND.value[0]


def test_retries_unavailable_until_the_server_comes_up(client_checkpoint: Path) -> None:
    port = free_port()
    x, ids, w = _batch(2, 2, seed=5)
    late: dict[str, ServerThread] = {}

    def start_late() -> None:
        time.sleep(0.6)
        late["server"] = ServerThread(checkpoint=client_checkpoint, port=port).start()

    starter = threading.Thread(target=start_late)
    starter.start()
    try:
        with ExpertClient(f"127.0.0.1:{port}", timeout=30, retries=12, backoff_s=0.05, max_backoff_s=0.4) as client:
            out = client.forward(0, x, ids, w)
        assert out.shape == (2, HIDDEN)
    finally:
        starter.join()
        if "server" in late:
            late["server"].stop()


def test_retries_give_up_with_unavailable() -> None:
    port = free_port()
    x, ids, w = _batch(2, 2, seed=5)
    start = time.monotonic()
    with ExpertClient(f"127.0.0.1:{port}", timeout=10, retries=2, backoff_s=0.01) as client:
        with pytest.raises(ExpertServiceError) as info:
            client.forward(0, x, ids, w)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < 5


def test_default_deadline_applies() -> None:
    """A server that never answers: the call ends with DEADLINE_EXCEEDED after the client's default timeout."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts TCP but never speaks HTTP/2
    try:
        with ExpertClient(f"127.0.0.1:{listener.getsockname()[1]}", timeout=0.5, retries=0) as client:
            start = time.monotonic()
            with pytest.raises(ExpertServiceError) as info:
                client.forward(0, *_batch(1, 1, seed=0))
        assert info.value.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        assert time.monotonic() - start < 5
    finally:
        listener.close()


def test_a_closed_client_raises_expert_service_error(server: ServerThread) -> None:
    """Calls on a closed client (or racing its close) raise the client's one exception type, not grpc's ValueError."""
    x, ids, w = _batch(2, 2, seed=6)
    client = ExpertClient(server.address)
    client.forward(0, x, ids, w)
    client.close()
    for call in (lambda: client.forward(0, x, ids, w), client.model_info, client.stream):
        with pytest.raises(ExpertServiceError) as info:
            call()
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "closed" in info.value.message

    async def body() -> None:
        aclient = AsyncExpertClient(server.address)
        await aclient.forward(0, x, ids, w)
        await aclient.close()
        with pytest.raises(ExpertServiceError) as info:
            await aclient.forward(0, x, ids, w)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION

    asyncio.run(body())


@pytest.mark.parametrize("timeout", [None, 0, -1.0, float("inf"), float("nan"), "5"])
def test_a_client_without_a_default_deadline_is_refused(timeout: object) -> None:
    """Every call gets a deadline; ``timeout=None`` once failed only at the first call, with a TypeError."""
    for cls in (ExpertClient, AsyncExpertClient):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            cls("127.0.0.1:1", timeout=timeout)


def test_client_package_needs_no_server_dependencies() -> None:
    code = (
        "import sys\n"
        "for name in ('pydantic', 'pydantic_settings', 'prometheus_client', 'yaml', 'lutb_server'):\n"
        "    sys.modules[name] = None\n"
        "import lutb_client, lutb_client.client, lutb_client.codec, lutb_client.routing, lutb_client.errors\n"
        "assert not any(m.startswith('lutb_server') for m in sys.modules if sys.modules[m] is not None)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


HUGE_EMPTY = pb.Tensor(dtype=pb.BFLOAT16, shape=[2**62, 2**62, 0], data=b"")
"""A tensor of no elements whose other dims no array can take: no data matches its shape."""


def test_a_malformed_output_shape_raises_expert_service_error() -> None:
    """parse_response once let the RuntimeError of torch.empty escape on such an output, not ExpertServiceError."""
    with pytest.raises(ExpertServiceError) as info:
        parse_response(pb.ForwardResponse(request_id=5, output=HUGE_EMPTY))
    assert info.value.code == grpc.StatusCode.INTERNAL and info.value.request_id == 5 and "output" in info.value.message


def _answer(request: pb.ForwardRequest) -> pb.ForwardResponse:
    """A good response of a fake server (a 1 x HIDDEN output), or one with :data:`HUGE_EMPTY` for layer 9."""
    response = pb.ForwardResponse(request_id=request.request_id)
    if request.layer == 9:
        response.output.CopyFrom(HUGE_EMPTY)
    else:
        encode_tensor(torch.zeros(1, HIDDEN, dtype=torch.bfloat16), out=response.output)
    return response


class _FakeCall:
    """A blocking ForwardStream call of a fake server: reads ``batch`` requests, answers them in order, and ends."""

    def __init__(self, requests: Iterator[pb.ForwardRequest], batch: int) -> None:
        self._requests, self._batch = requests, batch
        self.cancelled = False

    def __iter__(self) -> Iterator[pb.ForwardResponse]:
        received = [next(self._requests) for _ in range(self._batch)]
        for request in received:
            yield _answer(request)

    def cancel(self) -> None:
        self.cancelled = True


class _FakeStub:
    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.call: Any = None

    def ForwardStream(self, requests: Any = None, timeout: float | None = None) -> Any:  # noqa: N802 - grpc's name
        self.call = _FakeCall(requests, self.batch)
        return self.call


class _FakeAsyncCall:
    """The asyncio form of :class:`_FakeCall`."""

    def __init__(self, batch: int) -> None:
        self._batch = batch
        self._requests: asyncio.Queue[pb.ForwardRequest] = asyncio.Queue()
        self._answers: list[pb.ForwardResponse] = []
        self.cancelled = False

    async def write(self, request: pb.ForwardRequest) -> None:
        self._requests.put_nowait(request)

    async def done_writing(self) -> None:
        pass

    async def read(self) -> Any:
        if not self._answers:
            self._answers = [_answer(await self._requests.get()) for _ in range(self._batch)]
        return self._answers.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class _FakeAsyncStub(_FakeStub):
    def ForwardStream(self, requests: Any = None, timeout: float | None = None) -> Any:  # noqa: N802 - grpc's name
        self.call = _FakeAsyncCall(self.batch)
        return self.call


def _one_token() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros(1, HIDDEN, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)


def _outcomes(futures: list[Future[Any]], timeout: float = 10) -> list[Any]:
    """Each future's result or ExpertServiceError; a future not done within ``timeout`` s fails the test (a dead reader)."""
    outcomes = []
    for future in futures:
        try:
            outcomes.append(future.result(timeout=timeout))
        except ExpertServiceError as err:
            outcomes.append(err)
        except FutureTimeoutError:
            pytest.fail("a stream future never completed: the stream's reader died")
    return outcomes


def test_a_malformed_output_fails_only_its_stream_future() -> None:
    """The blocking stream's reader once died on such an output (a RuntimeError): every later future hung."""
    stub = _FakeStub(batch=3)
    stream = ForwardStream(stub, timeout=None, max_in_flight=4, ids=iter(range(1, 100)))
    futures = [stream.submit(layer, *_one_token()) for layer in (0, 9, 0)]
    outcomes = _outcomes(futures)
    assert isinstance(outcomes[1], ExpertServiceError) and outcomes[1].code == grpc.StatusCode.INTERNAL
    assert "output" in outcomes[1].message and outcomes[1].request_id == 2
    assert outcomes[0].shape == outcomes[2].shape == (1, HIDDEN)


@pytest.fixture
def settling_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settling a response raises what no stream expects (a client bug)."""
    def boom(response: pb.ForwardResponse) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(client_module, "parse_response", boom)


def _assert_failed_alike(outcomes: list[Any], ids: list[int]) -> None:
    assert [type(o) for o in outcomes] == [ExpertServiceError] * len(ids)
    assert [o.request_id for o in outcomes] == ids
    for outcome in outcomes:
        assert outcome.code == grpc.StatusCode.INTERNAL and "RuntimeError: boom" in outcome.message


def test_a_failure_settling_a_response_fails_the_sync_stream_not_hangs_it(settling_fails: None) -> None:
    """An unexpected exception in the blocking stream's reader fails that future and the pending ones with
    ExpertServiceError (the call cancelled), where the reader thread once died and left them all pending."""
    stub = _FakeStub(batch=3)
    stream = ForwardStream(stub, timeout=None, max_in_flight=4, ids=iter(range(1, 100)))
    futures = [stream.submit(0, *_one_token()) for _ in range(3)]
    _assert_failed_alike(_outcomes(futures), [1, 2, 3])
    assert stub.call.cancelled and stream.broken
    with pytest.raises(ExpertServiceError):
        stream.submit(0, *_one_token())
    stream.close(timeout=10)


def test_a_failure_settling_a_response_fails_the_async_stream_not_hangs_it(settling_fails: None) -> None:
    async def body() -> None:
        stub = _FakeAsyncStub(batch=3)
        stream = AsyncForwardStream(stub, timeout=None, max_in_flight=4, ids=iter(range(1, 100)))
        futures = [await stream.submit(0, *_one_token()) for _ in range(3)]
        outcomes = []
        for future in futures:  # awaited one by one: a hang is a timeout, not the whole test's
            try:
                outcomes.append(await asyncio.wait_for(future, 10))
            except ExpertServiceError as err:
                outcomes.append(err)
            except asyncio.TimeoutError:
                pytest.fail("a stream future never completed: the stream's reader died")
        _assert_failed_alike(outcomes, [1, 2, 3])
        assert stub.call.cancelled and stream.broken
        with pytest.raises(ExpertServiceError):
            await stream.submit(0, *_one_token())
        await asyncio.wait_for(stream.close(), 10)

    asyncio.run(body())


def test_a_stream_future_its_owner_cancelled_leaves_the_others_answered() -> None:
    """Settling a future its owner had cancelled raised InvalidStateError in the blocking stream's reader (once
    a dead reader, now an unexpected exception): the reader skips it and answers the rest."""
    stub = _FakeStub(batch=2)
    stream = ForwardStream(stub, timeout=None, max_in_flight=4, ids=iter(range(1, 100)))
    first = stream.submit(0, *_one_token())
    assert first.cancel()
    second = stream.submit(0, *_one_token())
    assert second.result(timeout=10).shape == (1, HIDDEN) and first.cancelled()


@pytest.mark.parametrize(
    ("arguments", "word"),
    [
        ({"layer": 2**31}, "layer"),  # int32: protobuf's ValueError("Value out of range") once escaped
        ({"layer": -(2**31) - 1}, "layer"),
        ({"layer": 1.0}, "layer"),  # protobuf's TypeError
        ({"layer": True}, "layer"),
        ({"layer": None}, "layer"),  # protobuf took it for layer 0
        ({"request_id": -1}, "request_id"),  # uint64
        ({"request_id": 2**64}, "request_id"),
        ({"apply_router_weight_on_input": "yes"}, "apply_router_weight_on_input"),
    ],
)
def test_build_request_refuses_bad_scalars_with_the_clients_error(arguments: dict, word: str) -> None:
    layer = arguments.pop("layer", 0)
    with pytest.raises(ExpertServiceError) as info:
        build_request(layer, *_one_token(), **arguments)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.message.startswith(f"{word}: ")


def test_build_request_takes_every_integer_in_range() -> None:
    for layer in (2**31 - 1, -(2**31), np.int64(3), torch.tensor(3)):
        assert build_request(layer, *_one_token(), request_id=2**64 - 1).layer == int(layer)


def test_a_layer_out_of_range_raises_the_clients_error_before_any_call() -> None:
    """Refused before the call: no server needed (a channel connects lazily)."""
    async def refused() -> ExpertServiceError:
        async with AsyncExpertClient("127.0.0.1:1", timeout=1, retries=0) as aclient:
            with pytest.raises(ExpertServiceError) as ainfo:
                await aclient.forward(2**31, *_one_token())
        return ainfo.value

    with ExpertClient("127.0.0.1:1", timeout=1, retries=0) as client, pytest.raises(ExpertServiceError) as info:
        client.forward(-(2**31) - 1, *_one_token())
    for error in (info.value, asyncio.run(refused())):
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "layer" in error.message


BAD_TIMEOUTS = [0, -1.0, float("inf"), float("nan"), "5", True]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_a_bad_per_call_timeout_raises_the_clients_error(timeout: object) -> None:
    """Per-call timeouts follow the constructor's rule (a positive finite number of seconds; None: the client's,
    or a stream's none) and fail with INVALID_ARGUMENT naming ``timeout``, where they once raised TypeError or
    reached grpc as they were. No server is needed: the argument is refused before any call."""
    def refused(call: Any) -> None:
        with pytest.raises(ExpertServiceError) as info:
            call()
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "timeout" in info.value.message

    with ExpertClient("127.0.0.1:1", timeout=1, retries=0) as client:
        refused(lambda: client.forward(0, *_one_token(), timeout=timeout))
        refused(lambda: client.forward_detailed(0, *_one_token(), timeout=timeout))
        refused(lambda: client.model_info(timeout=timeout))
        refused(lambda: client.spread_connections(timeout=timeout))
        refused(lambda: client.stream(timeout=timeout))

    async def body() -> None:
        async with AsyncExpertClient("127.0.0.1:1", timeout=1, retries=0) as aclient:
            for call in (
                lambda: aclient.forward(0, *_one_token(), timeout=timeout),
                lambda: aclient.forward_detailed(0, *_one_token(), timeout=timeout),
                lambda: aclient.model_info(timeout=timeout),
                lambda: aclient.spread_connections(timeout=timeout),
            ):
                with pytest.raises(ExpertServiceError) as info:
                    await call()
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "timeout" in info.value.message
            refused(lambda: aclient.stream(timeout=timeout))

    asyncio.run(body())
