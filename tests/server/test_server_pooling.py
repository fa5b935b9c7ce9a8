"""Continuous batching: requests pool while the worker is busy, and the worker gets the next batch at once."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from typing import Any
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from lutb_client import ExpertClient
from lutb_kernels.checkpoint import Checkpoint
from lutb_server.backends import BackendChoice
from lutb_server.engine import ExpertEngine, PreparedRequest
from lutb_server.scheduler import BatchScheduler, ForwardResult
from lutb_server.testing import SLEEP_EXPERTS_ENV, ServerThread, SleepExperts

SLOW_DEVICE = "20000,0"
"""``LUTB_SLEEP_EXPERTS`` for a slow device: every experts call sleeps 20 ms (GIL released, like a GPU wait)."""


def test_batches_grow_with_concurrency_on_a_slow_backend(tiny_checkpoint, monkeypatch) -> None:
    monkeypatch.setenv(SLEEP_EXPERTS_ENV, SLOW_DEVICE)
    checkpoint = Checkpoint(tiny_checkpoint)
    choice = BackendChoice("sleep", SleepExperts, torch.device("cpu"), "test")
    hidden = checkpoint.config.hidden_size
    tokens = 2

    def loader() -> ExpertEngine:
        return ExpertEngine(checkpoint, choice, validate_tiles=False)

    def caller(address: str, count: int) -> list[int]:
        gen = torch.Generator().manual_seed(threading.get_ident() % 1000)
        with ExpertClient(address, timeout=30) as client:
            sizes = []
            for _ in range(count):
                x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
                ids = torch.zeros(tokens, 2, dtype=torch.int32)
                result = client.forward_detailed(0, x, ids, torch.full((tokens, 2), 0.5))
                assert torch.equal(result.output, torch.zeros_like(x))
                sizes.append(int(result.timing.batch_tokens))
            return sizes

    with ServerThread(engine_loader=loader) as server:  # default settings: max_wait_us = 0
        alone = caller(server.address, 4)
        with ThreadPoolExecutor(8) as pool:
            pooled = [s for part in pool.map(lambda _: caller(server.address, 6), range(8)) for s in part]
    assert alone == [tokens] * 4  # nothing to pool with, and no wait for company
    # 8 callers against a 20 ms device: while one batch runs, the others queue and form the next one
    assert statistics.median(pooled) >= 4 * tokens, pooled
    assert max(pooled) <= 8 * tokens


def test_next_batch_goes_to_the_worker_before_results_are_delivered() -> None:
    """The device must not idle while the event loop hands out a finished batch's results."""
    events: list[tuple[str, int]] = []
    first_started = threading.Event()

    class Engine:
        def forward(self, layer, x, topk_ids, topk_weights, *, apply_router_weight_on_input=False, output_mode="combined"):
            first_started.set()
            time.sleep(0.05)
            return x * 2

    class Recording(BatchScheduler):
        def _finish(self, item, *args):  # type: ignore[override]
            events.append(("deliver", item.request.tokens))
            super()._finish(item, *args)

    def req(tokens: int) -> PreparedRequest:
        return PreparedRequest(0, torch.randn(tokens, 4), torch.zeros(tokens, 1, dtype=torch.int32), torch.ones(tokens, 1),
                               False, "combined")

    async def body() -> None:
        scheduler = Recording(Engine())
        submit = scheduler.worker.submit

        def recording_submit(requests, deadline=None):
            events.append(("submit", sum(r.tokens for r in requests)))
            return submit(requests, deadline)

        scheduler.worker.submit = recording_submit  # type: ignore[method-assign]
        await scheduler.start()
        try:
            first = asyncio.ensure_future(scheduler.submit(req(1)))
            while not first_started.is_set():
                await asyncio.sleep(0.001)
            rest = [asyncio.ensure_future(scheduler.submit(req(t))) for t in (2, 3, 4)]
            results = await asyncio.gather(first, *rest)
        finally:
            await scheduler.close()
        assert [r.batch_tokens for r in results] == [1, 9, 9, 9]

    asyncio.run(asyncio.wait_for(body(), 30))
    assert events == [("submit", 1), ("submit", 9), ("deliver", 1), ("deliver", 2), ("deliver", 3), ("deliver", 4)]


def test_handoff_is_the_workers_round_trip_less_compute() -> None:
    """``ForwardResult.handoff_s``: the batch's trip to the worker and back less its compute. A worker whose answer
    reaches the loop 80 ms after its compute ended (a slow hand-off, injected) shows >= 80 ms of hand-off, and
    queue + compute + hand-off never exceed the request's time in the scheduler."""
    delay_s, compute_sleep_s = 0.08, 0.03

    class Engine:
        def forward(self, layer, x, topk_ids, topk_weights, *, apply_router_weight_on_input=False, output_mode="combined"):
            time.sleep(compute_sleep_s)
            return x * 2

    async def body() -> None:
        scheduler = BatchScheduler(Engine())
        submit = scheduler.worker.submit

        def slow_return(requests, deadline=None):  # the result reaches the loop delay_s after the worker finished
            late: Future = Future()
            submit(requests, deadline).add_done_callback(lambda f: threading.Timer(delay_s, late.set_result, (f.result(),)).start())
            return late

        scheduler.worker.submit = slow_return  # type: ignore[method-assign]
        await scheduler.start()
        try:
            t0 = time.monotonic()
            result = await scheduler.submit(PreparedRequest(0, torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.int32),
                                                            torch.ones(3, 1), False, "combined"))
            elapsed = time.monotonic() - t0
        finally:
            await scheduler.close()
        assert result.compute_s >= compute_sleep_s
        assert delay_s <= result.handoff_s < delay_s + 0.5
        assert result.queue_s + result.compute_s + result.handoff_s <= elapsed

    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.mark.parametrize("late", ["on the way in", "on the way back"])
def test_wait_is_the_handoff_before_the_call_started(late: str) -> None:
    """``ForwardResult.wait_s`` splits the hand-off at the call's start: a batch that reaches the worker 80 ms after
    the hand-over (injected) waits >= 80 ms; one whose result reaches the loop 80 ms late waits far less, and the
    80 ms show in the rest of the hand-off."""
    delay_s = 0.08

    class Engine:
        def forward(self, layer, x, topk_ids, topk_weights, *, apply_router_weight_on_input=False, output_mode="combined"):
            time.sleep(0.01)
            return x * 2

    async def body() -> ForwardResult:
        scheduler = BatchScheduler(Engine())
        submit = scheduler.worker.submit

        def delayed(requests, deadline=None):
            late_future: Future = Future()
            if late == "on the way in":
                threading.Timer(delay_s, lambda: submit(requests, deadline).add_done_callback(
                    lambda f: late_future.set_result(f.result()))).start()
            else:
                submit(requests, deadline).add_done_callback(
                    lambda f: threading.Timer(delay_s, late_future.set_result, (f.result(),)).start())
            return late_future

        scheduler.worker.submit = delayed  # type: ignore[method-assign]
        await scheduler.start()
        try:
            return await scheduler.submit(PreparedRequest(0, torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.int32),
                                                          torch.ones(3, 1), False, "combined"))
        finally:
            await scheduler.close()

    result = asyncio.run(asyncio.wait_for(body(), 30))
    assert 0.0 <= result.wait_s <= result.handoff_s
    if late == "on the way in":
        assert delay_s <= result.wait_s < delay_s + 0.5
    else:
        assert result.wait_s < delay_s / 2 and result.handoff_s - result.wait_s >= delay_s


def test_a_stream_computes_up_to_its_window_of_requests_at_once(tiny_checkpoint, monkeypatch) -> None:
    """Requests sent ahead on one ForwardStream pool while the slow backend runs, at most ``STREAM_WINDOW`` of them
    in flight (reading pauses beyond), and their responses leave in request order."""
    import grpc

    from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
    from lutb_client.client import build_request
    from lutb_server import servicer

    monkeypatch.setenv(SLEEP_EXPERTS_ENV, SLOW_DEVICE)
    checkpoint = Checkpoint(tiny_checkpoint)
    choice = BackendChoice("sleep", SleepExperts, torch.device("cpu"), "test")
    hidden, tokens, count = checkpoint.config.hidden_size, 2, 40
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    ids = torch.zeros(tokens, 2, dtype=torch.int32)
    requests = [build_request(0, x, ids, torch.full((tokens, 2), 0.5), request_id=i + 1) for i in range(count)]
    largest = {}
    with ServerThread(engine_loader=lambda: ExpertEngine(checkpoint, choice, validate_tiles=False)) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ExpertServiceStub(channel)
            for window in (3, servicer.STREAM_WINDOW):
                monkeypatch.setattr(servicer, "STREAM_WINDOW", window)
                responses = list(stub.ForwardStream(iter(requests), timeout=60))
                assert [r.request_id for r in responses] == list(range(1, count + 1))
                assert all(r.status.code == 0 and r.HasField("output") for r in responses)
                largest[window] = max(r.timing.batch_tokens for r in responses) // tokens
    assert largest[3] <= 3  # never more than the window in flight
    assert largest[max(largest)] > 3  # and with the default window the requests sent ahead do pool beyond it


def _stream_answers(server: ServerThread) -> float:
    value = server.server.metrics.registry.get_sample_value(  # type: ignore[union-attr]
        "lutb_forward_requests_total", {"rpc": "ForwardStream", "code": "OK"})
    return value or 0.0


def _counting_reads(servicer: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the stream requests ``servicer`` reads (each is sized by ``_held_bytes`` right after its read)."""
    reads: list[int] = []
    sized = servicer._held_bytes

    def counted(request: Any) -> int:
        reads.append(request.request_id)
        return sized(request)

    monkeypatch.setattr(servicer, "_held_bytes", counted)
    return reads


def test_a_stream_whose_client_does_not_read_stops_being_read(tiny_checkpoint, monkeypatch) -> None:
    """With responses unread, a stream holds at most its share of ``stream_budget_bytes``: the server stops reading
    its requests (they wait in HTTP/2 flow control) instead of computing them all into memory, and reads none ahead
    of its bytes; another stream is served meanwhile; once the client reads, every response arrives, in order, and
    nothing stays held."""
    import grpc

    from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
    from lutb_client.client import build_request
    from lutb_server.servicer import STREAM_SHARE

    budget = 8 * 1024 * 1024
    hidden, tokens, k, count = 128, 64, 8, 200
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    ids = torch.randint(0, 8, (tokens, k), dtype=torch.int32)
    w = torch.full((tokens, k), 0.125)
    # route-major [64, 8, 128] bf16: 128 KiB a response, 26 MB for the stream; a share (1 MiB) holds 7 of them
    requests = [build_request(0, x, ids, w, output_mode="route_major", request_id=i + 1) for i in range(count)]
    with ServerThread(checkpoint=tiny_checkpoint, stream_budget_bytes=budget) as server:
        servicer = server.server.servicer  # type: ignore[union-attr]
        reads = _counting_reads(servicer, monkeypatch)
        with grpc.insecure_channel(server.address) as stalled, grpc.insecure_channel(server.address) as other:
            unread = pb_grpc.ExpertServiceStub(stalled).ForwardStream(iter(requests), timeout=60)
            time.sleep(1.0)  # the server reads what its share lets it, gRPC what the transport's windows take
            answered = _stream_answers(server)
            held = servicer._stream_budget.held
            assert 0 < held <= budget // STREAM_SHARE
            assert server.server.metrics.registry.get_sample_value("lutb_stream_held_bytes") == held  # type: ignore[union-attr]
            # more than the 7 held went to gRPC's buffers (its flow-control windows: ~4 MB on the sandbox), but nowhere
            # near all 200 (before the budget: all 200)
            assert answered < count // 2, answered
            assert len(reads) == answered  # every request read holds its bytes: none waits for them, read ahead
            served = list(pb_grpc.ExpertServiceStub(other).ForwardStream(iter(requests[:20]), timeout=30))
            assert [r.status.code for r in served] == [0] * 20
            responses = list(unread)
        assert [r.request_id for r in responses] == list(range(1, count + 1))
        assert all(r.status.code == 0 and list(r.output.shape) == [tokens, k, hidden] for r in responses)
        deadline = time.monotonic() + 5
        while servicer._stream_budget.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert servicer._stream_budget.held == 0


def test_a_request_claiming_a_huge_output_does_not_stop_the_other_streams(tiny_checkpoint) -> None:
    """A request whose shapes claim a huge output (refused once decoded) counts as one stream's share, not the whole
    budget: with a stream whose client does not read holding its share as well, a third stream is still served."""
    import grpc

    from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
    from lutb_client.client import build_request

    hidden, tokens, k = 128, 64, 8
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    ids = torch.randint(0, 8, (tokens, k), dtype=torch.int32)
    w = torch.full((tokens, k), 0.125)
    stalling = [build_request(0, x, ids, w, output_mode="route_major", request_id=i + 1) for i in range(100)]
    claim = build_request(0, x[:1], ids[:1], w[:1], request_id=7)
    del claim.topk_ids.shape[:]
    claim.topk_ids.shape.extend([10**9, 8])  # the data holds 8 ids: INVALID_ARGUMENT once decoded
    small = [build_request(0, x[:2], ids[:2, :2], w[:2, :2], request_id=i + 1) for i in range(3)]
    with ServerThread(checkpoint=tiny_checkpoint, stream_budget_bytes=8 * 1024 * 1024) as server:
        with grpc.insecure_channel(server.address) as a, grpc.insecure_channel(server.address) as b, \
                grpc.insecure_channel(server.address) as c:
            unread = pb_grpc.ExpertServiceStub(a).ForwardStream(iter(stalling), timeout=60)
            time.sleep(0.5)
            claimed = list(pb_grpc.ExpertServiceStub(b).ForwardStream(iter([claim]), timeout=10))
            assert [r.status.code for r in claimed] == [grpc.StatusCode.INVALID_ARGUMENT.value[0]]
            served = list(pb_grpc.ExpertServiceStub(c).ForwardStream(iter(small), timeout=10))
            assert [r.status.code for r in served] == [0, 0, 0]
            assert len(list(unread)) == 100


@pytest.mark.parametrize("end", ["cancel", "deadline"])
def test_a_stalled_stream_that_ends_gives_its_bytes_back(tiny_checkpoint, end: str) -> None:
    import grpc

    from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
    from lutb_client.client import build_request

    hidden, tokens, k = 128, 64, 8
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    ids = torch.randint(0, 8, (tokens, k), dtype=torch.int32)
    requests = [build_request(0, x, ids, torch.full((tokens, k), 0.125), output_mode="route_major", request_id=i + 1)
                for i in range(100)]
    with ServerThread(checkpoint=tiny_checkpoint, stream_budget_bytes=8 * 1024 * 1024) as server:
        budget = server.server.servicer._stream_budget  # type: ignore[union-attr]
        with grpc.insecure_channel(server.address) as channel:
            unread = pb_grpc.ExpertServiceStub(channel).ForwardStream(iter(requests), timeout=2 if end == "deadline" else 60)
            time.sleep(1.0)
            assert budget.held > 0
            if end == "cancel":
                unread.cancel()
            deadline = time.monotonic() + 10
            while budget.held and time.monotonic() < deadline:
                time.sleep(0.02)
            assert budget.held == 0 and budget.waiting == 0


def test_streams_beyond_max_streams_are_refused_at_their_start(tiny_checkpoint) -> None:
    """``max_streams`` open ForwardStream calls: one more ends at once with RESOURCE_EXHAUSTED (the open ones go on);
    once one of them ends, a new stream is served again. Before, nothing bounded the number of streams."""
    import grpc

    from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
    from lutb_client.client import build_request

    x = torch.randn(4, 128).to(torch.bfloat16)
    ids = torch.randint(0, 8, (4, 2), dtype=torch.int32)
    request = build_request(0, x, ids, torch.full((4, 2), 0.5), request_id=1)
    ends = [threading.Event() for _ in range(2)]

    def held_open(end: threading.Event) -> Any:
        yield request
        end.wait(30)

    with ServerThread(checkpoint=tiny_checkpoint, max_streams=2) as server:
        servicer = server.server.servicer  # type: ignore[union-attr]
        registry = server.server.metrics.registry  # type: ignore[union-attr]
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ExpertServiceStub(channel)
            open_streams = [stub.ForwardStream(held_open(end), timeout=60) for end in ends]
            assert [next(s).status.code for s in open_streams] == [0, 0]  # both open and answering
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.ForwardStream(iter([request]), timeout=30))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_streams = 2" in refused.value.details()
            labels = {"service": "lutb.v1.ExpertService", "method": "ForwardStream", "code": "RESOURCE_EXHAUSTED"}
            deadline = time.monotonic() + 10  # counted as the interceptor sees the call end: after the client's status
            while registry.get_sample_value("lutb_grpc_requests_total", labels) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert registry.get_sample_value("lutb_grpc_requests_total", labels) == 1
            ends[0].set()
            assert list(open_streams[0]) == []  # ended cleanly
            deadline = time.monotonic() + 10
            while servicer._open_streams > 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            served = list(stub.ForwardStream(iter([request]), timeout=30))
            assert [r.status.code for r in served] == [0]
            ends[1].set()
            assert list(open_streams[1]) == []
        deadline = time.monotonic() + 10
        while servicer._open_streams and time.monotonic() < deadline:
            time.sleep(0.01)
        assert servicer._open_streams == 0
