"""Deadlines, cancellation and closing, as a caller meets them: a caller that gives up, a shard that stops
answering, a client used after close. Each case once broke a stream or outlived its deadline."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import lutb_client.sharded as sharded
from lutb_client import AsyncExpertClient, AsyncShardedExpertClient, ExpertClient, ExpertServiceError, ShardedExpertClient
from lutb_kernels.checkpoint import Checkpoint
from lutb_server.backends import BackendChoice
from lutb_server.engine import ExpertEngine
from lutb_server.testing import SLEEP_EXPERTS_ENV, ServerThread, SleepExperts, free_port, make_tiny_checkpoint

HIDDEN = 128


def _batch(tokens: int, k: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, 8, generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
    return x, ids, torch.rand(tokens, k, generator=gen)


@pytest.fixture(scope="module")
def every_expert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "all", layers=(0,), num_experts=8)


@pytest.fixture(scope="module")
def server(every_expert: Path) -> Iterator[ServerThread]:
    with ServerThread(checkpoint=every_expert, max_wait_us=0) as running:
        yield running


@pytest.fixture
def slow_server(every_expert: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerThread]:
    """Every experts call takes 1.5 s (the fake backend), so answers are late on purpose."""
    monkeypatch.setenv(SLEEP_EXPERTS_ENV, "1500000,0")
    checkpoint = Checkpoint(every_expert)
    choice = BackendChoice("sleep", SleepExperts, torch.device("cpu"), "test")
    with ServerThread(engine_loader=lambda: ExpertEngine(checkpoint, choice, validate_tiles=False)) as running:
        yield running


class _SlowConnectProxy:
    """A TCP proxy to ``port`` that holds every new connection ``delay_s`` before relaying it."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.target, self.delay_s, self.port = port, delay_s, free_port()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", self.port))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(10)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self.delay_s)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
            try:
                while data := await a.read(65536):
                    b.write(data)
                    await b.drain()
            except OSError:
                pass
            finally:
                b.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def stop(self) -> None:
        async def cancel_relays() -> None:
            relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_relays(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_a_caller_giving_up_on_a_stream_leaves_the_others_their_own_answers(server: ServerThread) -> None:
    """The first request's caller gives up while the stream still connects. Its request goes out anyway (one writer
    writes every request in turn); it used to be counted as sent but never written, so the next response was paired
    with the wrong request and the stream failed as out of order."""
    proxy = _SlowConnectProxy(int(server.address.rsplit(":", 1)[1]), delay_s=1.0)

    async def body() -> None:
        async with AsyncExpertClient(f"127.0.0.1:{proxy.port}", timeout=10) as client:
            async with client.stream() as stream:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(stream.forward(0, *_batch(2, seed=1)), 0.3)
                assert not stream.broken
                x, ids, w = _batch(3, seed=2)
                out = await asyncio.wait_for(stream.forward(0, x, ids, w), 10)
                with ExpertClient(server.address) as direct:
                    torch.testing.assert_close(out, direct.forward(0, x, ids, w), rtol=0, atol=0)

    try:
        asyncio.run(body())
    finally:
        proxy.stop()


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_the_mxfp8_wire_learning_the_model_keeps_the_calls_deadline(aio: bool) -> None:
    """wire="mxfp8" asks for the model's info before the first call: within that call's deadline, not the client's."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts, never speaks HTTP/2
    target = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        start = time.monotonic()
        with pytest.raises(ExpertServiceError):
            if aio:
                async def body() -> None:
                    async with AsyncExpertClient(target, timeout=6, retries=0, wire="mxfp8") as client:
                        await client.forward(0, *_batch(2), timeout=0.5)

                asyncio.run(body())
            else:
                with ExpertClient(target, timeout=6, retries=0, wire="mxfp8") as client:
                    client.forward(0, *_batch(2), timeout=0.5)
        assert time.monotonic() - start < 3
    finally:
        listener.close()


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_a_closed_sharded_client_raises_the_clients_error(server: ServerThread, transport: str) -> None:
    client = ShardedExpertClient([server.address], transport=transport)
    client.forward(0, *_batch(2))
    client.close()
    with pytest.raises(ExpertServiceError, match="closed"):
        client.forward(0, *_batch(2))
    assert all(s.outstanding == 0 for s in client.stats().shards)

    async def body() -> None:
        aclient = AsyncShardedExpertClient([server.address], transport=transport)
        await aclient.connect()
        await aclient.forward(0, *_batch(2))
        await aclient.close()
        with pytest.raises(ExpertServiceError, match="closed"):
            await aclient.forward(0, *_batch(2))

    asyncio.run(body())


def test_a_full_lane_to_a_stalled_shard_keeps_the_deadline(slow_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard's stream holds at most LANE_MAX_IN_FLIGHT unanswered requests; once full, a call waits for room only
    until its deadline (it used to block until an answer came), and the full lane is dropped."""
    monkeypatch.setattr(sharded, "LANE_MAX_IN_FLIGHT", 2)  # stands for 1024 unanswered requests
    with ShardedExpertClient([slow_server.address]) as client:
        for _ in range(2):
            with pytest.raises(ExpertServiceError):
                client.forward(0, *_batch(2), timeout=0.3)
        start = time.monotonic()
        with pytest.raises(ExpertServiceError):
            client.forward(0, *_batch(2), timeout=0.3)
        assert time.monotonic() - start < 0.8


def test_an_async_sharded_attempt_has_one_deadline(slow_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting for room on a lane and waiting for the answer share the attempt's time (each used to get all of it)."""
    monkeypatch.setattr(sharded, "LANE_MAX_IN_FLIGHT", 1)

    async def body() -> float:
        async with AsyncShardedExpertClient([slow_server.address]) as client:
            first = asyncio.ensure_future(client.forward(0, *_batch(2), timeout=10))
            await asyncio.sleep(0.05)
            start = time.monotonic()
            with pytest.raises(ExpertServiceError):  # ~1.5 s for the slot, then ~1.5 s more for the answer
                await client.forward(0, *_batch(2, seed=1), timeout=2.0)
            elapsed = time.monotonic() - start
            await first
            return elapsed

    assert asyncio.run(body()) < 2.5


def test_a_bad_wire_opens_no_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[object] = []
    monkeypatch.setattr("lutb_client.client.channel_opener", lambda *a, **k: (lambda: opened.append(1)))
    with pytest.raises(ValueError):
        ExpertClient("127.0.0.1:1", wire="fp4")
    assert not opened


def test_a_call_running_when_its_client_closes_fails_as_closed(slow_server: ServerThread) -> None:
    """``ExpertClient.close()`` from another thread while a call waits: the call fails with FAILED_PRECONDITION, as
    the docstring says, not with grpc's CANCELLED ``Channel closed!``."""
    client = ExpertClient(slow_server.address)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            client.forward(0, *_batch(2))
        except BaseException as exc:  # noqa: BLE001 - examined below
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.5)
    client.close()
    caller.join(30)
    (error,) = outcome
    assert isinstance(error, ExpertServiceError) and error.code.name == "FAILED_PRECONDITION", error


needs_cancelling = pytest.mark.skipif(not hasattr(asyncio.Task, "cancelling"),
                                      reason="Python 3.10 cannot tell a closed channel's cancellation from the task's")


@needs_cancelling
@pytest.mark.parametrize("kind", ["client", "sharded unary", "sharded stream"])
def test_an_async_call_running_when_its_client_closes_fails_as_closed(slow_server: ServerThread, kind: str) -> None:
    """grpc.aio cancels the calls of a channel it closes: the caller's task, never cancelled itself, got a bare
    asyncio.CancelledError (which TaskGroup and wait_for take for its own cancellation) instead of the client's one
    exception type."""

    async def body() -> BaseException | None:
        if kind == "client":
            client: Any = AsyncExpertClient(slow_server.address)
        else:
            client = AsyncShardedExpertClient([slow_server.address], transport=kind.split()[1])
            await client.connect()
        call = asyncio.ensure_future(client.forward(0, *_batch(2)))
        await asyncio.sleep(0.5)
        await client.close()
        try:
            await call
        except BaseException as exc:  # noqa: BLE001 - examined below
            return exc
        return None

    error = asyncio.run(body())
    assert isinstance(error, ExpertServiceError) and error.code.name == "FAILED_PRECONDITION", repr(error)


def test_a_task_cancelled_while_it_closes_a_stream_is_cancelled(slow_server: ServerThread) -> None:
    """``AsyncForwardStream.close()`` waits for the answers; a cancellation of the waiting task used to end the stream's
    reader instead, and close() returned as if nothing happened. Now the task is cancelled, and the stream aborted: the
    request still in flight fails with CANCELLED."""

    async def body() -> tuple[bool, BaseException | None]:
        async with AsyncExpertClient(slow_server.address) as client:
            stream = client.stream()
            answer = await stream.submit(0, *_batch(2))
            closing = asyncio.ensure_future(stream.close())
            await asyncio.sleep(0.3)
            closing.cancel()
            try:
                await closing
            except asyncio.CancelledError:
                pass
            try:
                await answer
            except BaseException as exc:  # noqa: BLE001 - examined below
                return closing.cancelled(), exc
            return closing.cancelled(), None

    cancelled, error = asyncio.run(body())
    assert cancelled
    assert isinstance(error, ExpertServiceError) and error.code.name == "CANCELLED", repr(error)


def test_a_broken_stream_dropped_unclosed_leaves_no_thread(server: ServerThread) -> None:
    """A stream whose call ended (a server restart; here cancelled from outside) and that its owner drops without
    close(): grpc's thread taking its requests used to wait for the next one for ever, one thread per such stream."""
    import gc

    with ExpertClient(server.address) as client:
        client.forward(0, *_batch(2))
        before = threading.active_count()
        for _ in range(5):
            stream = client.stream()
            stream.submit(0, *_batch(2)).result(30)
            stream._call.cancel()
            deadline = time.monotonic() + 10
            while not stream.broken:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            del stream
        gc.collect()
        deadline = time.monotonic() + 10
        while threading.active_count() > before:
            assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
            time.sleep(0.05)


def test_mxfp8_wire_learns_its_scale_mode_before_it_reports_ready() -> None:
    """Another thread takes ``ready`` (the dtype learned) as its cue to encode: the scale mode must be there first, or
    that thread quantized with none (INVALID_ARGUMENT from the server)."""
    from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
    from lutb_client.client import _HiddenWire

    order: list[str] = []

    class Recording(_HiddenWire):
        def __setattr__(self, name: str, value: object) -> None:
            order.append(name)
            super().__setattr__(name, value)

    wire = Recording("mxfp8")
    order.clear()
    wire.learn(pb.ModelInfo(dtype=pb.BFLOAT16, mxfp8_scale_mode="floor"))
    assert order.index("scale_mode") < order.index("dtype") and wire.ready and wire.scale_mode == "floor"


def test_a_stream_opened_as_another_thread_closes_the_client_fails_as_closed(server: ServerThread,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``close()`` in another thread between ``stream()``'s closed check and grpc's call: grpc raised its raw
    ``ValueError`` ("Channel closed!") instead of the client's FAILED_PRECONDITION. The check is made to pass here,
    as the other thread's timing would have it."""
    import lutb_client.client as client_module

    client = ExpertClient(server.address)
    client.close()
    monkeypatch.setattr(client_module._Connections, "_stub", property(lambda self: next(self._stubs)))
    with pytest.raises(ExpertServiceError) as caught:
        client.stream()
    assert caught.value.code.name == "FAILED_PRECONDITION"


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_spreading_connections_as_the_client_closes_fails_as_closed(server: ServerThread, aio: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``close()`` while ``spread_connections()`` probes the front ends: its probes met closed channels, and grpc's
    raw error (``ValueError``, or ``UsageError`` from grpc.aio) reached the caller."""
    import lutb_client.client as client_module

    if aio:
        real_async = client_module.spread_async
        opened: list[AsyncExpertClient] = []

        async def closing_first_async(channels: Any, *args: Any, **kwargs: Any) -> Any:
            await opened[0].close()
            return await real_async(channels, *args, **kwargs)

        async def spread_one() -> None:
            opened.append(AsyncExpertClient(server.address))  # its channels belong to this event loop
            await opened[0].spread_connections()

        monkeypatch.setattr(client_module, "spread_async", closing_first_async)
        with pytest.raises(ExpertServiceError) as caught:
            asyncio.run(spread_one())
    else:
        real = client_module.spread

        def closing_first(channels: Any, *args: Any, **kwargs: Any) -> Any:
            client.close()
            return real(channels, *args, **kwargs)

        monkeypatch.setattr(client_module, "spread", closing_first)
        client = ExpertClient(server.address)
        with pytest.raises(ExpertServiceError) as caught:
            client.spread_connections()
    assert caught.value.code.name == "FAILED_PRECONDITION"
