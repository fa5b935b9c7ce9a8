"""BatchScheduler with a recording fake engine: pooling rules, limits, deadlines, isolation, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from lutb_server.engine import PreparedRequest
from lutb_server.errors import EXPIRED_IN_WORKER, DeadlineExpired, QueueFull, Unavailable
from lutb_server.metrics import ServerMetrics
from lutb_server import scheduler as scheduler_module
from lutb_server.scheduler import BatchScheduler
from lutb_server.worker import BatchOutput

H = 4
POISON = 7.0


class FakeEngine:
    """Returns x * 2 (combined) / x repeated per route (route-major); records every call; refuses POISON rows."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls: list[tuple[int, int, bool, str]] = []
        self.gate = gate

    def forward(self, layer, x, topk_ids, topk_weights, *, apply_router_weight_on_input=False, output_mode="combined"):
        if self.gate is not None:
            assert self.gate.wait(10)
        self.calls.append((layer, x.shape[0], apply_router_weight_on_input, output_mode))
        if (x == POISON).any():
            raise ValueError("poisoned row")
        if output_mode == "route_major":
            return x.unsqueeze(1).expand(-1, topk_ids.shape[1], -1).clone()
        return x * 2


def _req(tokens: int, *, layer: int = 0, k: int = 2, fill: float | None = None, mode: str = "combined",
         on_input: bool = False) -> PreparedRequest:
    x = torch.randn(tokens, H) if fill is None else torch.full((tokens, H), fill)
    return PreparedRequest(layer, x, torch.zeros(tokens, k, dtype=torch.int32), torch.ones(tokens, k), on_input, mode)


@pytest.fixture
def roomy_margin(monkeypatch: pytest.MonkeyPatch) -> float:
    """POOLING_DEADLINE_MARGIN_S widened to 80 ms for the tests that time a wait ended by a deadline: with the 5 ms
    default, a slow CI machine can take longer than the margin to run the batch ahead, and the request under test then
    expires (correctly) instead of being computed."""
    monkeypatch.setattr(scheduler_module, "POOLING_DEADLINE_MARGIN_S", 0.08)
    return 0.08


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _with_scheduler(engine, body, **kwargs):
    scheduler = BatchScheduler(engine, **kwargs)
    await scheduler.start()
    try:
        return await body(scheduler)
    finally:
        await scheduler.close()


def test_pools_compatible_requests_and_splits_results() -> None:
    engine = FakeEngine()
    requests = [_req(t) for t in (3, 1, 5)] + [_req(2, layer=1), _req(2, k=3), _req(2, mode="route_major")]

    async def body(s):
        return await asyncio.gather(*(s.submit(r) for r in requests))

    results = _run(_with_scheduler(engine, body, max_wait_us=50_000))
    assert sorted(engine.calls) == sorted([(0, 9, False, "combined"), (1, 2, False, "combined"),
                                           (0, 2, False, "combined"), (0, 2, False, "route_major")])
    for request, result in zip(requests[:3], results[:3]):
        assert torch.equal(result.output, request.x * 2)
        assert result.batch_tokens == 9 and result.batch_requests == 3
    assert results[5].output.shape == (2, 2, H)


def test_max_batch_tokens_and_oversized_requests() -> None:
    engine = FakeEngine()
    requests = [_req(10) for _ in range(5)] + [_req(40)]

    async def body(s):
        return await asyncio.gather(*(s.submit(r) for r in requests))

    results = _run(_with_scheduler(engine, body, max_wait_us=50_000, max_batch_tokens=25))
    assert all(tokens <= 25 for _, tokens, _, _ in engine.calls if tokens != 40)
    assert (0, 40, False, "combined") in engine.calls  # larger than the limit: runs alone
    assert sum(tokens for _, tokens, _, _ in engine.calls) == 90
    for request, result in zip(requests, results):
        assert torch.equal(result.output, request.x * 2)


def test_no_wait_runs_immediately() -> None:
    engine = FakeEngine()

    async def body(s):
        start = time.monotonic()
        await s.submit(_req(1))
        return time.monotonic() - start

    assert _run(_with_scheduler(engine, body, max_wait_us=0)) < 1.0


def test_expired_deadline_is_dropped_unrun() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate)
    metrics = ServerMetrics()

    async def body(s):
        first = asyncio.ensure_future(s.submit(_req(1)))
        await asyncio.sleep(0.05)  # the first call now blocks the worker
        late = asyncio.ensure_future(s.submit(_req(5), deadline=time.monotonic() + 0.05))
        await asyncio.sleep(0.2)
        gate.set()
        await first
        with pytest.raises(DeadlineExpired, match="not computed"):
            await late
        with pytest.raises(DeadlineExpired):
            await s.submit(_req(1), deadline=time.monotonic() - 1)

    _run(_with_scheduler(engine, body, max_wait_us=0, metrics=metrics))
    assert [tokens for _, tokens, _, _ in engine.calls] == [1]
    assert metrics.registry.get_sample_value("lutb_deadline_dropped_total", {"layer": "0"}) == 1


def test_the_worker_gets_the_latest_deadline_of_a_batch_and_may_refuse_it() -> None:
    """Each batch goes to the worker with the latest of its requests' deadlines (None when one has none). A batch the
    worker answers with DeadlineExpired (every deadline passed while it waited there) fails each of its requests with
    it, counted as dropped, and is not rerun request by request as a failed call would be."""
    worker = HeldWorker(FakeEngine())
    metrics = ServerMetrics()

    async def body(s):
        now = time.monotonic()
        first = asyncio.ensure_future(s.submit(_req(1), deadline=now + 50))
        await asyncio.sleep(0.01)  # on the worker; the next three pool behind it
        pooled = [asyncio.ensure_future(s.submit(_req(2), deadline=now + d)) for d in (30, 40, 20)]
        await asyncio.sleep(0.01)
        worker.release(0)
        await first
        await asyncio.sleep(0.01)
        assert [len(reqs) for reqs, _ in worker.jobs] == [1, 3]
        assert worker.deadlines == [pytest.approx(now + 50), pytest.approx(now + 40)]
        _, job = worker.jobs[1]
        job.set_exception(DeadlineExpired(EXPIRED_IN_WORKER))
        for f in pooled:
            with pytest.raises(DeadlineExpired, match="waited for the compute worker"):
                await f
        assert len(worker.jobs) == 2  # the refused batch is not rerun
        blocker = asyncio.ensure_future(s.submit(_req(1)))
        await asyncio.sleep(0.01)
        mixed = [asyncio.ensure_future(s.submit(_req(1), deadline=d)) for d in (now + 30, None)]
        await asyncio.sleep(0.01)
        worker.release(2)
        await blocker
        await asyncio.sleep(0.01)
        assert [len(reqs) for reqs, _ in worker.jobs][2:] == [1, 2]
        assert worker.deadlines[2:] == [None, None]  # one request without a deadline: its batch has none
        worker.release(3)
        await asyncio.gather(*mixed)

    _run(_with_scheduler(worker.engine, body, max_wait_us=0, worker=worker, metrics=metrics))
    assert metrics.registry.get_sample_value("lutb_deadline_dropped_total", {"layer": "0"}) == 3


def test_a_rerun_refused_for_its_deadline_counts_as_dropped() -> None:
    """A pooled call fails, so each request is rerun alone, each with its own deadline; one the worker refuses as past
    its deadline ends DeadlineExpired and is counted as dropped, the other is answered."""
    worker = HeldWorker(FakeEngine())
    metrics = ServerMetrics()

    async def body(s):
        now = time.monotonic()
        blocker = asyncio.ensure_future(s.submit(_req(1)))
        await asyncio.sleep(0.01)
        late, good = (asyncio.ensure_future(s.submit(_req(2), deadline=now + d)) for d in (20, 30))
        await asyncio.sleep(0.01)
        worker.release(0)
        await blocker
        await asyncio.sleep(0.01)
        _, pooled = worker.jobs[1]
        pooled.set_exception(ValueError("the pooled call failed"))
        await asyncio.sleep(0.01)
        assert worker.deadlines[2] == pytest.approx(now + 20)  # the first rerun, alone, with its own deadline
        _, first = worker.jobs[2]
        first.set_exception(DeadlineExpired(EXPIRED_IN_WORKER))
        await asyncio.sleep(0.01)
        assert worker.deadlines[3] == pytest.approx(now + 30)
        worker.release(3)
        with pytest.raises(DeadlineExpired):
            await late
        await good

    _run(_with_scheduler(worker.engine, body, max_wait_us=0, worker=worker, metrics=metrics))
    assert metrics.registry.get_sample_value("lutb_deadline_dropped_total", {"layer": "0"}) == 1


def test_a_deadline_inside_the_pooling_wait_ends_it_on_an_idle_worker(roomy_margin: float) -> None:
    """A lone request on an idle worker whose deadline falls inside its wait for company (``max_wait_us``) is computed:
    the wait ends POOLING_DEADLINE_MARGIN_S before the deadline, instead of holding the request until it expired and
    then dropping it (DEADLINE_EXCEEDED, reported only after the whole wait)."""
    engine = FakeEngine()

    async def body(s):
        start = time.monotonic()
        result = await s.submit(_req(2, fill=1.0), deadline=start + 0.2)
        return result, time.monotonic() - start

    result, took = _run(_with_scheduler(engine, body, max_wait_us=2_000_000))  # a 2 s wait, a 200 ms deadline
    assert [tokens for _, tokens, _, _ in engine.calls] == [2]
    assert torch.equal(result.output, torch.full((2, H), 2.0))
    assert 0.2 - roomy_margin - 0.01 < took < 1.0  # it did wait for company, until shortly before its deadline


def test_the_earliest_deadline_in_a_batch_ends_its_wait(roomy_margin: float) -> None:
    """The wait of the oldest request (no deadline of its own) ends before the deadline of a later request that joins
    its batch, and both go in one call."""
    engine = FakeEngine()

    async def body(s):
        start = time.monotonic()
        head = asyncio.ensure_future(s.submit(_req(2)))
        await asyncio.sleep(0.02)
        joins = asyncio.ensure_future(s.submit(_req(3), deadline=start + 0.3))
        results = await asyncio.gather(head, joins)
        return results, time.monotonic() - start

    (head, joins), took = _run(_with_scheduler(engine, body, max_wait_us=2_000_000))
    assert head.batch_requests == joins.batch_requests == 2 and head.batch_tokens == 5
    assert [tokens for _, tokens, _, _ in engine.calls] == [5]
    assert 0.3 - roomy_margin - 0.01 < took < 1.5  # the joiner's deadline ended the wait, not the 2 s


@pytest.mark.parametrize("other", ["layer", "top_k"])
def test_a_deadline_behind_the_pooling_wait_ends_it_on_an_idle_worker(other: str, roomy_margin: float) -> None:
    """A request of another pool key (layer, top-k) than the oldest one's, queued behind it during its long wait for
    company with a short deadline, is computed on the idle worker: the head's wait ends POOLING_DEADLINE_MARGIN_S
    before that deadline too, not only before those of its own batch, and the other batch goes after it. (A request
    of the head's key with no room left in its batch needs no such care: the batch is full and goes at once.)"""
    engine = FakeEngine()
    behind = _req(3, layer=1) if other == "layer" else _req(3, k=4)

    async def body(s):
        start = time.monotonic()
        head = asyncio.ensure_future(s.submit(_req(2)))
        await asyncio.sleep(0.02)
        late = asyncio.ensure_future(s.submit(behind, deadline=start + 0.3))
        results = await asyncio.gather(head, late)
        return results, time.monotonic() - start

    (head, late), took = _run(_with_scheduler(engine, body, max_wait_us=2_000_000))
    assert head.batch_requests == late.batch_requests == 1
    assert [tokens for _, tokens, _, _ in engine.calls] == [2, 3]  # the head's batch first, then the other
    assert 0.3 - roomy_margin - 0.01 < took < 1.5  # the other's deadline ended the head's wait, not the 2 s


def test_cancelled_caller_is_not_computed() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate)

    async def body(s):
        first = asyncio.ensure_future(s.submit(_req(1)))
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(s.submit(_req(6)))
        await asyncio.sleep(0.05)
        gone.cancel()
        gate.set()
        await first
        await s.submit(_req(2))

    _run(_with_scheduler(engine, body, max_wait_us=0))
    assert [tokens for _, tokens, _, _ in engine.calls] == [1, 2]


def test_queue_full() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate)

    async def body(s):
        running = asyncio.ensure_future(s.submit(_req(1)))
        await asyncio.sleep(0.05)
        queued = [asyncio.ensure_future(s.submit(_req(1))) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert s.queue_depth == 2
        with pytest.raises(QueueFull, match="max_queue_requests = 2"):
            await s.submit(_req(1))
        gate.set()
        await asyncio.gather(running, *queued)

    _run(_with_scheduler(engine, body, max_wait_us=0, max_queue_requests=2))


def test_cancelled_callers_leave_the_queue_at_once() -> None:
    """A caller cancelled while the worker is busy (gRPC cancels a handler whose deadline passes) gives
    its queue place back at once: a fresh request is not refused as queue-full behind dead ones, and
    the one whose deadline passed counts as a deadline drop."""
    gate = threading.Event()
    engine = FakeEngine(gate)
    metrics = ServerMetrics()

    async def body(s):
        running = asyncio.ensure_future(s.submit(_req(1)))
        await asyncio.sleep(0.05)
        expired = asyncio.ensure_future(s.submit(_req(2), deadline=time.monotonic() + 0.02))
        gone = asyncio.ensure_future(s.submit(_req(3)))
        await asyncio.sleep(0.05)
        assert s.queue_depth == 2
        expired.cancel()
        gone.cancel()
        await asyncio.gather(expired, gone, return_exceptions=True)
        assert s.queue_depth == 0
        assert metrics.registry.get_sample_value("lutb_queue_depth") == 0
        fresh = asyncio.ensure_future(s.submit(_req(4)))
        fresh2 = asyncio.ensure_future(s.submit(_req(5)))
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(running, fresh, fresh2)

    _run(_with_scheduler(engine, body, max_wait_us=0, max_queue_requests=2, metrics=metrics))
    assert [tokens for _, tokens, _, _ in engine.calls] == [1, 9]
    assert metrics.registry.get_sample_value("lutb_deadline_dropped_total", {"layer": "0"}) == 1


def test_a_failing_pooled_call_fails_only_the_culprit() -> None:
    engine = FakeEngine()
    requests = [_req(2), _req(3, fill=POISON), _req(4)]

    async def body(s):
        return await asyncio.gather(*(s.submit(r) for r in requests), return_exceptions=True)

    metrics = ServerMetrics()
    results = _run(_with_scheduler(engine, body, max_wait_us=50_000, metrics=metrics, backend_name="fake"))
    assert isinstance(results[1], ValueError)
    for i in (0, 2):
        assert torch.equal(results[i].output, requests[i].x * 2)
        assert results[i].batch_requests == 1  # rerun alone after the pooled call failed
    assert engine.calls[0][1] == 9
    labels = {"backend": "fake", "layer": "0"}  # the reruns that answered are calls like any other
    assert metrics.registry.get_sample_value("lutb_tokens_processed_total", labels) == 6
    assert metrics.registry.get_sample_value("lutb_compute_seconds_count", labels) == 2
    assert metrics.registry.get_sample_value("lutb_batches_total", {**labels, "path": "eager"}) == 2


def test_close_fails_waiting_requests_with_unavailable() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate)

    async def body():
        s = BatchScheduler(engine, max_wait_us=0)
        await s.start()
        running = asyncio.ensure_future(s.submit(_req(1)))
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(s.submit(_req(1)))
        await asyncio.sleep(0.01)
        closing = asyncio.ensure_future(s.close())
        await asyncio.sleep(0.05)
        gate.set()
        await closing
        with pytest.raises(Unavailable):
            await waiting
        with pytest.raises(Unavailable):
            await s.submit(_req(1))
        running.cancel()

    _run(body())


def test_a_lone_request_goes_to_the_worker_without_a_dispatcher_task() -> None:
    """Latency of a lone request: ``submit`` hands it to the idle worker on the caller's own task (no task
    of the scheduler's to wake first), and the result comes back through the worker's done-callback."""
    engine = FakeEngine()
    handed_over_on: list[asyncio.Task | None] = []

    async def body():
        baseline = asyncio.all_tasks()
        s = BatchScheduler(engine, max_wait_us=0)
        await s.start()
        try:
            assert asyncio.all_tasks() == baseline  # the scheduler runs no task of its own
            submit = s.worker.submit

            def recording_submit(requests, deadline=None):
                handed_over_on.append(asyncio.current_task())
                return submit(requests, deadline)

            s.worker.submit = recording_submit
            request = _req(3)
            caller = asyncio.ensure_future(s.submit(request))
            result = await caller
            assert handed_over_on == [caller]
            assert torch.equal(result.output, request.x * 2)
            assert (result.batch_tokens, result.batch_requests) == (3, 1)
            assert asyncio.all_tasks() == baseline
        finally:
            await s.close()

    _run(body())


def test_close_gives_the_worker_a_finite_time() -> None:
    """The worker's close gets a timeout (a compute process that does not exit is killed after it), so a stuck
    worker cannot hold the server's shutdown forever."""
    from lutb_server.scheduler import WORKER_CLOSE_TIMEOUT_S

    class Worker:
        timeouts: list[float | None] = []

        def start(self) -> None:
            pass

        def submit(self, requests, deadline=None):  # pragma: no cover - nothing is submitted
            raise AssertionError

        def close(self, timeout: float | None = None) -> None:
            self.timeouts.append(timeout)

    worker = Worker()

    async def body() -> None:
        s = BatchScheduler(FakeEngine(), worker=worker)
        await s.start()
        await s.close()

    _run(body())
    assert worker.timeouts == [WORKER_CLOSE_TIMEOUT_S] and 0 < WORKER_CLOSE_TIMEOUT_S < float("inf")


class HeldWorker:
    """A worker whose batches wait until the test releases them (any order); records what it was handed."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.jobs: list[tuple[list[PreparedRequest], Future]] = []
        self.deadlines: list[float | None] = []  # each batch's, as the scheduler handed it over

    def start(self) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        pass

    def submit(self, requests: list[PreparedRequest], deadline: float | None = None) -> Future:
        future: Future = Future()
        self.jobs.append((requests, future))
        self.deadlines.append(deadline)
        return future

    def release(self, index: int) -> None:
        requests, future = self.jobs[index]
        x = torch.cat([r.x for r in requests])
        try:
            out = self.engine.forward(0, x, torch.cat([r.topk_ids for r in requests]), None)
        except ValueError as exc:
            future.set_exception(exc)
            return
        future.set_result(BatchOutput(list(torch.split(out, [r.tokens for r in requests])), 0.001, x.shape[0], "eager"))


@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_batches_in_flight_bounds_what_the_worker_holds(in_flight: int) -> None:
    """Up to ``batches_in_flight`` batches go to the worker before any is answered, each as soon as a request
    arrives with room; the rest pool and go over as answers free room; any order of answers delivers each result."""
    worker = HeldWorker(FakeEngine())
    requests = [_req(t) for t in (1, 2, 3, 4, 5)]

    async def body():
        s = BatchScheduler(worker.engine, max_wait_us=0, worker=worker, batches_in_flight=in_flight)
        await s.start()
        try:
            futures = []
            for r in requests:
                futures.append(asyncio.ensure_future(s.submit(r)))
                await asyncio.sleep(0)  # each request reaches the scheduler on its own
            await asyncio.sleep(0.01)
            handed = [sum(r.tokens for r in reqs) for reqs, _ in worker.jobs]
            assert handed == [1, 2, 3][:in_flight], handed
            assert s.queue_depth == len(requests) - in_flight
            worker.release(in_flight - 1)  # the newest first: its results come back, and the rest go over as one batch
            await asyncio.sleep(0.01)
            assert [sum(r.tokens for r in reqs) for reqs, _ in worker.jobs][in_flight:] == [sum((1, 2, 3, 4, 5)[in_flight:])]
            assert s.queue_depth == 0
            for i in range(len(worker.jobs)):
                if i != in_flight - 1:
                    worker.release(i)
            results = await asyncio.gather(*futures)
        finally:
            await s.close()
        for r, result in zip(requests, results):
            assert torch.equal(result.output, r.x * 2)

    _run(body())


def test_a_failing_batch_among_several_in_flight_fails_only_its_culprit() -> None:
    worker = HeldWorker(FakeEngine())
    good, bad, late = _req(2), _req(3, fill=POISON), _req(4)

    async def body():
        s = BatchScheduler(worker.engine, max_wait_us=0, worker=worker, batches_in_flight=2)
        await s.start()
        try:
            first = asyncio.ensure_future(s.submit(good))
            await asyncio.sleep(0)
            second = asyncio.ensure_future(s.submit(bad))
            await asyncio.sleep(0.01)
            third = asyncio.ensure_future(s.submit(late))  # no room: waits
            await asyncio.sleep(0.01)
            assert len(worker.jobs) == 2
            worker.release(1)  # the poisoned one fails; alone, it is not rerun
            with pytest.raises(ValueError):
                await second
            await asyncio.sleep(0.01)
            assert len(worker.jobs) == 3  # its room went to the waiting request
            worker.release(2)
            worker.release(0)
            return await first, await third
        finally:
            await s.close()

    a, c = _run(body())
    assert torch.equal(a.output, good.x * 2) and torch.equal(c.output, late.x * 2)


def test_close_fails_every_batch_in_flight() -> None:
    worker = HeldWorker(FakeEngine())

    async def body():
        s = BatchScheduler(worker.engine, max_wait_us=0, worker=worker, batches_in_flight=2)
        await s.start()
        calls = []
        for t in (1, 2, 3):
            calls.append(asyncio.ensure_future(s.submit(_req(t))))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        await s.close()
        return await asyncio.gather(*calls, return_exceptions=True)

    results = _run(body())
    assert all(isinstance(r, Unavailable) for r in results), results


def test_batches_in_flight_must_be_positive() -> None:
    with pytest.raises(ValueError, match="batches_in_flight"):
        BatchScheduler(FakeEngine(), batches_in_flight=0)


def test_unanswered_s_counts_the_workers_silence_while_it_holds_batches() -> None:
    """0.0 while the worker holds no batch; while it holds one, the seconds since its last answer (or since it was
    handed a batch while holding none): what the server's compute_stall_s watchdog reads."""
    gate = threading.Event()
    engine = FakeEngine(gate)

    async def body(s):
        assert s.unanswered_s == 0.0
        held = asyncio.ensure_future(s.submit(_req(1)))
        await asyncio.sleep(0.2)
        silent = s.unanswered_s
        gate.set()
        await held
        return silent, s.unanswered_s

    silent, after = _run(_with_scheduler(engine, body, max_wait_us=0))
    assert 0.15 < silent < 5.0 and after == 0.0
