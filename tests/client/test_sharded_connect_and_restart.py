"""ShardedExpertClient / AsyncShardedExpertClient: connecting, closing during a call, and shards restarted with
another placement (each test a regression of a review finding).

Servers: in-process ``ServerThread`` s on tiny float32 checkpoints (a whole one and shards cut from it), or small
fake ``ExpertService`` s where a server must misbehave (answer ModelInfo slowly, stop answering it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from lutb_client import AsyncShardedExpertClient, ExpertClient, ExpertServiceError, ShardedExpertClient
from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
from lutb_client.codec import encode_tensor
from lutb_kernels.checkpoint import Checkpoint
from lutb_kernels.sharding import write_shards
from lutb_server.backends import BackendChoice
from lutb_server.engine import ExpertEngine
from lutb_server.testing import SLEEP_EXPERTS_ENV, ServerThread, SleepExperts, free_port, make_tiny_checkpoint

E, H = 8, 128


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("whole") / "ckpt", layers=(0,), num_experts=E, dtype="float32")


def _batch(tokens: int, k: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
    return x, ids, torch.rand(tokens, k, generator=gen)


class Fake(pb_grpc.ExpertServiceServicer):
    """Holds ``experts`` of layer 0 and answers zeros. With ``front_ends=2`` the first two connections are told
    they reached front end 0 (so a client with 2 connections spreads them); ``fail_info_after``: GetModelInfo
    calls answered before it answers UNAVAILABLE; ``info_delay_s``: how long each GetModelInfo takes;
    ``refuse``: a Forward status code to answer (with content_hash set in ModelInfo)."""

    def __init__(self, experts: list[int], front_ends: int = 0, content_hash: str = "") -> None:
        self.experts, self.front_ends, self.content_hash = experts, front_ends, content_hash
        self.peers: list[str] = []
        self.info_calls = 0
        self.fail_info_after: int | None = None
        self.info_delay_s = 0.0
        self.refuse: grpc.StatusCode | None = None
        self.lock = threading.Lock()

    def GetModelInfo(self, request, context):  # noqa: N802, ANN001, ANN201
        time.sleep(self.info_delay_s)
        with self.lock:
            self.info_calls += 1
            if self.fail_info_after is not None and self.info_calls > self.fail_info_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
            peer = context.peer()
            if peer not in self.peers:
                self.peers.append(peer)
            front = 0 if self.peers.index(peer) < 2 else 1
        return pb.ModelInfo(format="lut-b", format_version=1, hidden_size=H, intermediate_size=H, num_experts=E,
                            activation="silu", dtype=pb.FLOAT32, mxfp8_scale_mode="rceil", content_hash=self.content_hash,
                            layers=[pb.LayerInfo(layer=0, expert_ids=self.experts)],
                            front_end=front if self.front_ends > 1 else 0, front_ends=self.front_ends)

    def Forward(self, request, context):  # noqa: N802, ANN001, ANN201
        if self.refuse is not None:
            context.abort(self.refuse, f"expected_content_hash: {request.expected_content_hash!r} refused")
        out = pb.ForwardResponse(request_id=request.request_id)
        encode_tensor(torch.zeros(request.hidden_states.shape[0], H), out=out.output)
        return out


def _serve(servicer: Fake) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_ExpertServiceServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, f"127.0.0.1:{port}"


# -- connecting --------------------------------------------------------------------------------


def test_async_lazy_connect_that_fails_halfway_leaves_no_closed_connection_in_use() -> None:
    """The first forward's connect() set the topology, then spread shard 0's connections (closing those it replaced)
    and failed on shard 1's probe: shard 0's stubs stayed on closed channels, no later connect() redid it, and every
    later call on them raised grpc.aio.UsageError "Channel is closed". Now a failed connect leaves the client
    unconnected, on the channels as they are, and the next call connects again."""
    a, b = Fake([0, 1, 2, 3], front_ends=2), Fake([4, 5, 6, 7])
    b.fail_info_after = 1  # answers the topology's GetModelInfo, then not its spread probe
    (sa, ta), (sb, tb) = _serve(a), _serve(b)
    x, w = torch.randn(4, H), torch.rand(4, 2)
    ids = torch.tensor([[0, 1]] * 4, dtype=torch.int32)  # shard 0 only

    async def body() -> list[str]:
        client = AsyncShardedExpertClient([ta, tb], connections=2, transport="unary", connect_timeout=5)
        try:
            with pytest.raises(ExpertServiceError):
                await client.forward(0, x, ids, w, timeout=5)
            b.fail_info_after = None  # shard 1 is back
            errors = []
            for _ in range(4):  # the calls take shard 0's two connections in turn
                try:
                    await client.forward(0, x, ids, w, timeout=5)
                except BaseException as exc:  # noqa: BLE001
                    errors.append(f"{type(exc).__name__}: {exc}")
            return errors
        finally:
            await client.close()

    try:
        assert asyncio.run(body()) == []
    finally:
        sa.stop(0)
        sb.stop(0)


def test_first_async_forward_keeps_its_timeout_while_connecting(whole: Path) -> None:
    """The async client's first forward connects (GetModelInfo with wait_for_ready): that now counts against the
    forward's own deadline (DEADLINE_EXCEEDED when it runs out), as for the plain clients, not connect_timeout."""
    nowhere = f"127.0.0.1:{free_port()}"  # a shard that is not up (yet)
    with ServerThread(checkpoint=whole) as up:
        async def body() -> tuple[float, ExpertServiceError]:
            client = AsyncShardedExpertClient([up.address, nowhere], connect_timeout=6.0)
            try:
                start = time.monotonic()
                with pytest.raises(ExpertServiceError) as info:
                    await client.forward(0, *_batch(4), timeout=0.5)
                return time.monotonic() - start, info.value
            finally:
                await client.close()

        elapsed, error = asyncio.run(body())
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert elapsed < 2.0, f"forward(timeout=0.5) returned after {elapsed:.1f} s"


def test_blocking_connect_keeps_one_connect_timeout_for_info_and_spread() -> None:
    """The blocking client took a fresh connect_timeout for spreading connections after the GetModelInfo round,
    so connecting could take twice connect_timeout; the async client takes one deadline for both: so does it now."""
    fake = Fake(list(range(E)), front_ends=2)
    fake.info_delay_s = 0.4
    server, target = _serve(fake)
    try:
        start = time.monotonic()
        try:
            ShardedExpertClient([target], connections=2, connect_timeout=1.0).close()
        except ExpertServiceError:
            pass
        elapsed = time.monotonic() - start
    finally:
        server.stop(0)
    assert elapsed <= 1.3, f"connect_timeout=1.0 but the constructor took {elapsed:.2f} s"


# -- close during a call -----------------------------------------------------------------------


@pytest.fixture
def slow_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerThread]:
    """A server whose experts take 1 s per call."""
    ckpt = make_tiny_checkpoint(tmp_path / "c", layers=(0,), num_experts=E)
    monkeypatch.setenv(SLEEP_EXPERTS_ENV, "1000000,0")
    checkpoint = Checkpoint(ckpt)
    choice = BackendChoice("sleep", SleepExperts, torch.device("cpu"), "test")
    with ServerThread(engine_loader=lambda: ExpertEngine(checkpoint, choice, validate_tiles=False)) as running:
        yield running


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_blocking_close_during_a_call_reports_the_close(slow_server: ServerThread, transport: str) -> None:
    """close() while a forward waits: FAILED_PRECONDITION, as for the async and plain clients. Over streams the
    cancelled lane was taken for a broken shard (marked down, UNAVAILABLE "no live shard"); over unary calls the
    cancelled call's CANCELLED was raised."""
    x, ids, w = _batch(2)
    client = ShardedExpertClient([slow_server.address], transport=transport)
    errors: list[ExpertServiceError] = []

    def call() -> None:
        try:
            client.forward(0, x.bfloat16(), ids, w, timeout=10)
        except ExpertServiceError as exc:
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.3)
    client.close()
    t.join(10)
    stats = client.stats().shards[0]
    assert errors and errors[0].code == grpc.StatusCode.FAILED_PRECONDITION, (errors, stats)
    assert stats.failures == 0 and not stats.down and stats.outstanding == 0, stats


# -- a shard restarted with another placement --------------------------------------------------


def _first_answer(forward) -> torch.Tensor:  # noqa: ANN001
    """``forward()`` again while it fails with UNAVAILABLE or DEADLINE_EXCEEDED (the connections come back after a
    restart), for at most 15 s."""
    start = time.monotonic()
    while time.monotonic() - start < 15:
        try:
            return forward()
        except ExpertServiceError as exc:
            assert exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
            time.sleep(0.1)
    raise AssertionError("no answer 15 s after the restart")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_shards_restarted_with_another_placement_give_the_right_sum(
    whole: Path, tmp_path: Path, transport: str, asynchronous: bool
) -> None:
    """Both shards restart at their addresses with a re-split placement. The client routed by the placement it read
    when it connected, and the new shard 0 added exactly zero for experts 2, 3 it no longer holds: a "successful"
    wrong sum. Now each sub-request carries its shard's content hash, the restarted shard refuses it
    (FAILED_PRECONDITION), and the client reads the placement again and retries the call: the right sum."""
    old = write_shards(Checkpoint(whole), tmp_path / "old", {0: [[0, 1, 2, 3], [4, 5, 6, 7]]})
    new = write_shards(Checkpoint(whole), tmp_path / "new", {0: [[0, 1], [2, 3, 4, 5, 6, 7]]})
    ports = [free_port(), free_port()]
    targets = [f"127.0.0.1:{p}" for p in ports]
    x, ids, w = _batch(16, 2, seed=3)
    with ServerThread(checkpoint=whole) as single, ExpertClient(single.address) as c:
        expected = c.forward(0, x, ids, w)
    servers = [ServerThread(checkpoint=d, port=p, metrics_port=0).start() for d, p in zip(old, ports)]

    def restart() -> None:
        for s in servers:
            s.stop()
        servers[:] = [ServerThread(checkpoint=d, port=p, metrics_port=0).start() for d, p in zip(new, ports)]

    try:
        if asynchronous:
            async def body() -> tuple[torch.Tensor, torch.Tensor]:
                async with AsyncShardedExpertClient(targets, transport=transport, down_s=0.1) as client:
                    before = await client.forward(0, x, ids, w)
                    restart()
                    for _ in range(40):
                        try:
                            return before, await client.forward(0, x, ids, w, timeout=5)
                        except ExpertServiceError as exc:
                            assert exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
                            await asyncio.sleep(0.1)
                    raise AssertionError("no answer after the restart")

            before, after = asyncio.run(body())
        else:
            with ShardedExpertClient(targets, transport=transport, down_s=0.1) as client:
                before = client.forward(0, x, ids, w)
                restart()
                after = _first_answer(lambda: client.forward(0, x, ids, w, timeout=5))
                holders_of_2 = client.placement()[0][2]
    finally:
        for s in servers:
            s.stop()
    torch.testing.assert_close(before, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)
    if not asynchronous:
        assert holders_of_2 == [targets[1]]  # the placement was read again


@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "async"])
def test_a_refusal_that_survives_the_refresh_is_raised(asynchronous: bool) -> None:
    """A shard that keeps refusing with FAILED_PRECONDITION after the placement was read again: the client reads it
    once (one more GetModelInfo), retries once, then raises the shard's error; the hash it read was sent."""
    fake = Fake(list(range(E)), content_hash="sha256:abc")
    fake.refuse = grpc.StatusCode.FAILED_PRECONDITION
    server, target = _serve(fake)
    x, ids, w = _batch(4)
    try:
        if asynchronous:
            async def body() -> ExpertServiceError:
                async with AsyncShardedExpertClient([target], transport="unary") as client:
                    with pytest.raises(ExpertServiceError) as info:
                        await client.forward(0, x, ids, w, timeout=5)
                    return info.value

            error = asyncio.run(body())
        else:
            with ShardedExpertClient([target], transport="unary") as client:
                with pytest.raises(ExpertServiceError) as info:
                    client.forward(0, x, ids, w, timeout=5)
                error = info.value
    finally:
        server.stop(0)
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and "'sha256:abc'" in error.message, error
    assert fake.info_calls == 2  # connecting, and the one refresh


@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "async"])
def test_a_stale_shard_retried_while_another_shard_is_down(whole: Path, tmp_path: Path, asynchronous: bool) -> None:
    """A rolling restart: shard 0 comes back with another checkpoint while shard 1 is down (its replica, shard 2, up).
    The call that meets the stale shard reads the placement again and retries. That read used to wait for every shard,
    the down one too, until the call's deadline; now it takes the shards that answer within about a second, marks the
    silent one down, and the retry computes on shard 0's new placement and shard 1's replica."""
    old = write_shards(Checkpoint(whole), tmp_path / "old", {0: [[0, 1], [2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7]]})
    new = write_shards(Checkpoint(whole), tmp_path / "new", {0: [[0, 1, 2], [3, 4, 5, 6, 7]]})
    ports = [free_port() for _ in range(3)]
    targets = [f"127.0.0.1:{p}" for p in ports]
    x, _, w = _batch(4, 2, seed=5)
    ids = torch.tensor([[0, 5], [1, 6], [0, 7], [1, 4]], dtype=torch.int32)  # shard 0 alone holds 0 and 1
    with ServerThread(checkpoint=whole) as single, ExpertClient(single.address) as c:
        expected = c.forward(0, x, ids, w)
    servers = [ServerThread(checkpoint=d, port=p, metrics_port=0).start() for d, p in zip(old, ports)]

    try:
        def rolling_restart() -> None:
            servers[0].stop()
            servers[1].stop()  # down for the rest of the test
            servers[0] = ServerThread(checkpoint=new[0], port=ports[0], metrics_port=0).start()

        # the restart breaks the client's connections to shard 0: calls fail with UNAVAILABLE until they are back
        retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        if asynchronous:
            async def body() -> tuple[torch.Tensor, float]:
                async with AsyncShardedExpertClient(targets, down_s=0.1) as client:
                    await client.forward(0, x, ids, w)
                    rolling_restart()
                    start = time.monotonic()
                    while time.monotonic() - start < 15:
                        try:
                            return await client.forward(0, x, ids, w, timeout=5), time.monotonic() - start
                        except ExpertServiceError as exc:
                            assert exc.code in retryable, exc
                            await asyncio.sleep(0.1)
                    raise AssertionError("no answer 15 s after the restart")

            got, took = asyncio.run(body())
        else:
            with ShardedExpertClient(targets, down_s=0.1) as client:
                client.forward(0, x, ids, w)
                rolling_restart()
                start = time.monotonic()
                got = _first_answer(lambda: client.forward(0, x, ids, w, timeout=5))
                took = time.monotonic() - start
    finally:
        for s in servers:
            s.stop()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert took < 10, took  # each call waited for the down shard until its 5 s deadline, and failed
