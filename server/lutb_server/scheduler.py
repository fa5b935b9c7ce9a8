"""The batching scheduler: pools concurrent requests into experts calls run off the event loop.

Requests arrive validated (:class:`~lutb_server.engine.PreparedRequest`). The
scheduler keeps up to ``batches_in_flight`` batches (default one) on the compute worker
(:class:`~lutb_server.worker.ComputeWorker`: staging buffers, device copies, CUDA
graphs) and takes the next one the moment one of them is done (continuous batching):
every waiting request with the oldest one's
:attr:`~lutb_server.engine.PreparedRequest.pool_key` (layer, top-k, weighting, output
mode), oldest first, up to ``max_batch_tokens`` (a larger request runs alone),
concatenated along the token axis into one experts call, the output split back. While
a call runs, new requests queue up and form the next batch, which goes to the worker
before the finished batch's results are handed out.

Dispatching is event-driven on the event loop, without a dispatcher task: a request that
finds the worker idle is handed to it from :meth:`BatchScheduler.submit` itself, and the
worker's done-callback schedules the batch's completion on the loop directly. A lone
request thus costs one thread hop to the worker and one back, and no extra turns of the
event loop (each turn, with the wake-up of a task, measured 10-25 us on the CPU sandbox).

``batches_in_flight`` > 1 hands the next batch over while earlier ones still compute: a
compute process that merges several front ends' batches then finds it waiting at the start
of its next call, instead of receiving it only after this front end has had its answer.

``max_wait_us`` (default 0): when the worker has room for a batch, how long the oldest request may
wait for company (from its arrival; cut short once a full batch is queued, and never outlasting the deadline of any
queued request, whether it would join that batch or not (another pool key: its batch goes after this one): it goes
:data:`POOLING_DEADLINE_MARGIN_S` before the earliest of them, so a request is not held behind a wait for company
until it expires). Under load
the worker is busy and requests pool while they wait for it anyway, so a wait only adds
latency to lone requests; it can help bursty open-loop traffic whose requests arrive
microseconds apart.

Isolation: every request was validated before it was queued; should a pooled call
fail anyway, each of its requests is rerun alone so that only the culprit fails.
Requests whose deadline passed or whose caller went away are dropped before
computing (a cancelled caller's request leaves the queue at once). Each batch goes to the worker with the latest of
its requests' deadlines; a worker that finds it passed before the call fails the batch with
:class:`~lutb_server.errors.DeadlineExpired`, which fails its requests as it is (no rerun one by one). The queue holds at
most ``max_queue_requests`` waiting requests; beyond that
:meth:`BatchScheduler.submit` raises :class:`~lutb_server.errors.QueueFull`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from concurrent.futures import Future
from typing import Any, NamedTuple, Protocol

import torch

from lutb_client.codec import WireTensor
from lutb_kernels.reference import OutputMode
from lutb_server.engine import PreparedRequest
from lutb_server.errors import DeadlineExpired, QueueFull, Unavailable, deadline_reached
from lutb_server.metrics import ServerMetrics
from lutb_server.worker import BATCH_PATHS, BatchOutput, BatchWorker, ComputeWorker, running_loop

log = logging.getLogger(__name__)


class ForwardEngine(Protocol):
    """What the scheduler needs of an engine (``ExpertEngine`` is one)."""

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
        apply_router_weight_on_input: bool = False, output_mode: OutputMode = "combined",
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class ForwardResult:
    """A request's output and where its time went."""

    output: torch.Tensor | WireTensor
    """Its output: what the worker returned (:attr:`~lutb_server.worker.BatchOutput.outputs`)."""
    queue_s: float
    compute_s: float
    handoff_s: float
    """The batch's trip to the worker and back to the event loop, less ``compute_s`` (wake-ups, IPC)."""
    wait_s: float
    """Of ``handoff_s``: from the hand-over to the start of the experts call that ran the batch (the worker's
    wake-up; with a compute process the message and the wait behind the call running when it arrived)."""
    batch_tokens: int
    """Tokens of the experts call that ran the request (see :attr:`~lutb_server.worker.BatchOutput.call_tokens`)."""
    batch_requests: int
    """Requests of this scheduler's batch (a compute process may merge it with other front ends' batches)."""


class _LayerMetrics(NamedTuple):
    queue_wait: Any
    compute: Any
    to_call: Any
    """``lutb_handoff_seconds{part="to_call"}``."""
    back: Any
    """``lutb_handoff_seconds{part="back"}``."""
    batch_tokens: Any
    batch_requests: Any
    tokens: Any
    batches: dict[str, Any]
    """The ``lutb_batches_total`` child of each path (:data:`~lutb_server.worker.BATCH_PATHS`)."""


@dataclass(eq=False)
class _Item:
    request: PreparedRequest
    deadline: float | None  # time.monotonic() seconds
    future: asyncio.Future[ForwardResult]
    enqueued: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Running:
    """The batch on the compute worker: its requests, when it started, the worker's future (and a rerun task)."""

    batch: list[_Item]
    started: float  # time.monotonic()
    job: Future[BatchOutput]
    rerun: asyncio.Task[None] | None = None


WORKER_CLOSE_TIMEOUT_S = 30.0
"""How long :meth:`BatchScheduler.close` lets the worker finish: a thread worker's last batch, or a compute process
that has to exit (killed after this, so that a stuck child cannot hold the server's shutdown forever)."""


POOLING_DEADLINE_MARGIN_S = 0.005
"""How long before the earliest deadline among the queued requests the oldest one's wait for company (``max_wait_us``)
ends at the latest. The wait's timer fires late by up to the event loop's lag (epoll rounds its timeout up to the
millisecond; on the 2-CPU sandbox at most 0.7 ms on uvloop idle, 3.1-4.7 ms with both CPUs taken:
bench/results/2026-12-07-timer-lag-cpu.md), and a batch it carried past a deadline would
drop that request instead of computing it."""


class BatchScheduler:
    """Pools requests into experts calls (see the module docstring).

    Args:
        engine: runs one (pooled) experts call, blocking.
        max_batch_tokens: most tokens per pooled call.
        max_wait_us: how long the oldest request waits for company when the worker has room (0: never); the batch
            goes earlier, :data:`POOLING_DEADLINE_MARGIN_S` before the earliest deadline among the queued requests
            (its own or not), where that is sooner.
        max_queue_requests: most requests waiting (not yet in a batch).
        metrics: where to record queue wait, compute, batch sizes; none if None.
        backend_name: the ``backend`` label of those metrics.
        worker: runs the batches (a :class:`~lutb_server.worker.BatchWorker`); default ``ComputeWorker(engine)``
            (started and closed with the scheduler).
        batches_in_flight: most batches handed to the worker and not yet answered (>= 1).
    """

    def __init__(
        self,
        engine: ForwardEngine,
        *,
        max_batch_tokens: int = 8192,
        max_wait_us: int = 0,
        max_queue_requests: int = 1024,
        metrics: ServerMetrics | None = None,
        backend_name: str = "",
        worker: BatchWorker | None = None,
        batches_in_flight: int = 1,
    ) -> None:
        if batches_in_flight < 1:
            raise ValueError(f"batches_in_flight must be >= 1, got {batches_in_flight}")
        self._engine = engine
        self.batches_in_flight = batches_in_flight
        self.worker = worker if worker is not None else ComputeWorker(engine)
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_us / 1e6
        self.max_queue_requests = max_queue_requests
        self._metrics = metrics
        self._backend = backend_name
        self._pending: deque[_Item] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: list[_Running] = []  # batches on the worker (or being rerun request by request), oldest first
        self._answered = 0.0  # time.monotonic() of the worker's last answer, or of a hand-over to it while it held none
        self._timer: asyncio.TimerHandle | None = None  # pooling wait (max_wait_us > 0) of the oldest request
        self._timer_due = 0.0
        self._closed = False
        self._by_layer: dict[int, _LayerMetrics] = {}

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind to the running loop and start the compute thread."""
        if self._loop is not None:
            return
        self.worker.start()
        self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        """Stop dispatching; waiting requests fail with UNAVAILABLE; wait for the running call."""
        self._closed = True
        self._cancel_timer()
        running, self._running = self._running, []
        for batch in running:  # their results are not awaited any more
            for item in batch.batch:
                _fail(item, Unavailable("server is shutting down; request not answered"))
            if batch.rerun is not None:
                batch.rerun.cancel()
                await asyncio.gather(batch.rerun, return_exceptions=True)
        while self._pending:
            item = self._pending.popleft()
            if not item.future.done():
                item.future.set_exception(Unavailable("server is shutting down; request not computed"))
        self._set_depth()
        if self._loop is not None:
            await asyncio.to_thread(self.worker.close, WORKER_CLOSE_TIMEOUT_S)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a batch."""
        return len(self._pending)

    @property
    def unanswered_s(self) -> float:
        """Seconds the compute worker has held batches without answering any (0.0 while it holds none): how long it
        has made no progress. The server's watchdog (``compute_stall_s``) reads it."""
        return time.monotonic() - self._answered if self._running else 0.0

    # -- submit ----------------------------------------------------------------------------

    async def submit(self, request: PreparedRequest, *, deadline: float | None = None) -> ForwardResult:
        """Queue ``request`` and wait for its result.

        With room on the worker (and no pooling wait) the request goes to the worker from
        here, on the caller's own task: no wake-up of a dispatcher in between.

        Args:
            deadline: ``time.monotonic()`` time after which the request is not worth computing.

        Raises:
            QueueFull: ``max_queue_requests`` requests are waiting already.
            DeadlineExpired: the deadline passed before the request's batch started.
            Unavailable: the scheduler is closed or closing.
        """
        if self._closed or self._loop is None:
            raise Unavailable("server is not accepting work (starting or shutting down)")
        if deadline is not None and deadline <= time.monotonic():
            raise DeadlineExpired("deadline expired before the request was queued; not computed")
        if len(self._pending) >= self.max_queue_requests:
            self._drop_dead()  # requests that expired while the worker was busy hold no place
        if len(self._pending) >= self.max_queue_requests:
            raise QueueFull(
                f"queue full: {len(self._pending)} requests waiting (max_queue_requests = {self.max_queue_requests}); retry later"
            )
        item = _Item(request, deadline, self._loop.create_future())
        self._pending.append(item)
        self._set_depth()
        if len(self._running) < self.batches_in_flight:
            self._dispatch()
        try:
            return await item.future
        except asyncio.CancelledError:  # the caller went away or its deadline passed (gRPC cancels it)
            self._withdraw(item)
            raise

    # -- dispatching -----------------------------------------------------------------------
    #
    # Event-driven, on the loop thread, with up to batches_in_flight batches on the worker: a batch
    # starts when a request arrives while the worker has room (from submit), when the worker finishes
    # one (_on_done), or when the oldest request's pooling wait ends (the timer). The worker's done-callback schedules
    # _on_done on the loop directly (one thread hop back per batch, no dispatcher task to wake).

    def _dispatch(self) -> None:
        """Start batches while the worker has room and one is due; arm the timer for the oldest request's wait if it is not."""
        while len(self._running) < self.batches_in_flight and not self._closed and self._start_batch():
            pass

    def _start_batch(self) -> bool:
        """Hand the next batch to the worker if one is due (True), else arm the timer for the oldest request's wait."""
        self._drop_dead()
        if not self._pending:
            self._cancel_timer()
            return False
        head = self._pending[0]
        due = head.enqueued + self.max_wait_s
        if due > time.monotonic():  # (never with max_wait_us = 0: no scan of the queue)
            due, full = self._wait_end(head, due)
            if not full and due > time.monotonic():
                if self._timer is None or self._timer_due != due:  # a new oldest request, or an earlier deadline
                    self._cancel_timer()
                    assert self._loop is not None
                    self._timer_due = due
                    self._timer = self._loop.call_later(max(0.0, due - time.monotonic()), self._on_timer)
                return False
        self._cancel_timer()
        batch = self._take_batch()
        if not batch:
            return False
        started = time.monotonic()  # the hand-over (a compute process's copies and message) counts as hand-off, not queue
        try:
            job = self.worker.submit([i.request for i in batch], _latest_deadline(batch))
        except Exception as exc:  # noqa: BLE001 - the worker is gone (closing): nothing will compute these
            for item in batch:
                _fail(item, Unavailable(f"compute worker unavailable ({exc}); request not computed"))
            return True
        running = _Running(batch, started, job)
        if not self._running:
            self._answered = started  # the worker's silence counts from here
        self._running.append(running)
        loop = self._loop
        assert loop is not None

        def done(_: Future[BatchOutput]) -> None:  # on the worker thread, or on the loop (a compute process's answer)
            try:
                if running_loop() is loop:  # no self-pipe write and wake-up needed
                    loop.call_soon(self._on_done, running)
                else:
                    loop.call_soon_threadsafe(self._on_done, running)
            except RuntimeError:  # the loop is closed: nobody waits for these results
                pass

        job.add_done_callback(done)
        return True

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_done(self, running: _Running) -> None:
        """The worker finished ``running`` (on the loop): next batch to the worker first, then hand out results."""
        returned = self._answered = time.monotonic()
        if running not in self._running:  # closed meanwhile: its requests were failed already
            return
        batch = running.batch
        try:
            try:
                result = running.job.result()
            except DeadlineExpired as exc:  # every deadline of the batch passed while it waited on the worker
                self._running.remove(running)
                self._dispatch()
                for item in batch:
                    self._expire(item, exc)
                return
            except Exception as exc:  # noqa: BLE001 - any failure of the call: rerun its requests alone (it keeps its place)
                assert self._loop is not None
                running.rerun = self._loop.create_task(self._rerun_alone(running, exc), name="lutb-rerun")
                return
            self._running.remove(running)
            self._dispatch()  # the device must not idle while this batch's results are handed out
            self._complete(batch, running.started, returned, result)
        except Exception:  # pragma: no cover - a scheduler bug must not stop serving
            log.exception("scheduler dispatch failed")
            for item in batch:
                _fail(item, RuntimeError("scheduler dispatch failed"))
            if running in self._running:
                self._running.remove(running)
            self._dispatch()

    def _wait_end(self, head: _Item, due: float) -> tuple[float, bool]:
        """When the pooling wait of ``head`` (the oldest request) ends, and whether a full batch is queued already.

        The wait ends at ``due`` (its arrival + ``max_wait_us``) or earlier, :data:`POOLING_DEADLINE_MARGIN_S`
        before the earliest deadline among all queued requests: those that would join its batch, and those of
        another pool key, whose batches can only go after it (one of its key with no room left in the batch makes
        it full). Waiting for company thus never holds a request until its deadline while the worker has room.
        Full: the queued requests of its pool key hold ``max_batch_tokens`` tokens or more.
        """
        key = head.request.pool_key
        pooled = 0
        for item in self._pending:  # head first
            if item.deadline is not None and item.deadline - POOLING_DEADLINE_MARGIN_S < due:
                due = item.deadline - POOLING_DEADLINE_MARGIN_S
            if item.request.pool_key == key:
                pooled += item.request.tokens
        return due, pooled >= self.max_batch_tokens

    def _withdraw(self, item: _Item) -> None:
        """Take a cancelled caller's request out of the queue at once (it holds no place in it any more)."""
        try:
            self._pending.remove(item)
        except ValueError:  # in a batch already, or dropped
            return
        self._set_depth()
        if deadline_reached(item.deadline):
            self._count_deadline_drop(item)

    def _expire(self, item: _Item, exc: DeadlineExpired) -> None:
        """Fail a request whose deadline passed before it ran with ``exc``, counted as dropped (unless its caller is
        gone already)."""
        if not item.future.done():
            item.future.set_exception(exc)
            self._count_deadline_drop(item)

    def _count_deadline_drop(self, item: _Item) -> None:
        if self._metrics is not None:
            self._metrics.deadline_dropped.labels(str(item.request.layer)).inc()

    def _drop_dead(self) -> None:
        """Remove requests whose caller is gone (future done) or whose deadline passed (fail them)."""
        if not self._pending:
            return
        now = time.monotonic()
        keep: deque[_Item] = deque()
        for item in self._pending:
            if item.future.done():
                continue
            if item.deadline is not None and item.deadline <= now:
                waited = (now - item.enqueued) * 1e3
                self._expire(item, DeadlineExpired(f"deadline expired after {waited:.1f} ms in the queue; not computed"))
                continue
            keep.append(item)
        self._pending = keep
        self._set_depth()

    def _take_batch(self) -> list[_Item]:
        if not self._pending:
            return []
        head = self._pending.popleft()
        batch, tokens, key = [head], head.request.tokens, head.request.pool_key
        rest: deque[_Item] = deque()
        for item in self._pending:
            if item.request.pool_key == key and tokens + item.request.tokens <= self.max_batch_tokens:
                batch.append(item)
                tokens += item.request.tokens
            else:
                rest.append(item)
        self._pending = rest
        self._set_depth()
        return batch

    async def _rerun_alone(self, running: _Running, exc: Exception) -> None:
        """A batch failed: fail a lone request; rerun each of a pooled batch alone so only the culprit fails.

        The batch keeps its place on the worker meanwhile; the next batch is dispatched when this is done.
        """
        batch, started = running.batch, running.started
        try:
            if len(batch) == 1:
                _fail(batch[0], exc)
                return
            log.warning("pooled call of %d requests failed (%s); rerunning each alone", len(batch), exc)
            for item in batch:
                if item.future.done():
                    continue
                try:
                    sent = time.monotonic()
                    try:
                        single = await asyncio.wrap_future(self.worker.submit([item.request], item.deadline))
                    finally:
                        self._answered = time.monotonic()
                    (output,), compute_s, call_tokens = single.outputs, single.seconds, single.call_tokens
                    handoff_s, wait_s = _handoff(single, sent, self._answered)
                except asyncio.CancelledError:
                    raise
                except DeadlineExpired as single_exc:  # the worker found its deadline passed
                    self._expire(item, single_exc)
                except Exception as single_exc:  # noqa: BLE001 - handed to that request
                    _fail(item, single_exc)
                else:
                    self._finish(item, output, started, compute_s, handoff_s, wait_s, call_tokens, 1)
                    self._record_call(item.request.layer, compute_s, call_tokens, 1, item.request.tokens, single.path,
                                      handoff_s, wait_s)
        finally:
            if running in self._running:
                self._running.remove(running)
                self._dispatch()

    def _complete(self, batch: list[_Item], started: float, returned: float, result: BatchOutput) -> None:
        """Hand out a batch's results; ``started``/``returned``: ``time.monotonic()`` when it went to the worker and
        when its end reached the loop."""
        handoff_s, wait_s = _handoff(result, started, returned)
        for item, output in zip(batch, result.outputs):
            self._finish(item, output, started, result.seconds, handoff_s, wait_s, result.call_tokens, len(batch))
        self._record_call(batch[0].request.layer, result.seconds, result.call_tokens, len(batch),
                          sum(item.request.tokens for item in batch), result.path, handoff_s, wait_s)

    def _record_call(self, layer: int, seconds: float, call_tokens: int, requests: int, tokens: int, path: str,
                     handoff_s: float, wait_s: float) -> None:
        """Metrics of one experts call that answered ``requests`` requests of ``tokens`` tokens (``path``: how it ran;
        ``handoff_s``, ``wait_s``: this batch's hand-off and its part before the call, as in :class:`ForwardResult`)."""
        if self._metrics is not None:
            m = self._layer_metrics(layer)
            m.compute.observe(seconds)
            m.to_call.observe(wait_s)
            m.back.observe(handoff_s - wait_s)
            m.batch_tokens.observe(call_tokens)
            m.batch_requests.observe(requests)
            m.tokens.inc(tokens)
            m.batches[path].inc()

    def _layer_metrics(self, layer: int) -> _LayerMetrics:
        """The metrics' children labelled (backend, layer), looked up once per layer (``labels()`` costs a lock and a dict)."""
        m = self._by_layer.get(layer)
        if m is None:
            assert self._metrics is not None
            labels = (self._backend, str(layer))
            metrics = self._metrics
            m = self._by_layer[layer] = _LayerMetrics(
                metrics.queue_wait.labels(*labels), metrics.compute.labels(*labels), metrics.handoff.labels(*labels, "to_call"),
                metrics.handoff.labels(*labels, "back"), metrics.batch_tokens.labels(*labels),
                metrics.batch_requests.labels(*labels), metrics.tokens.labels(*labels),
                {path: metrics.batches.labels(*labels, path) for path in BATCH_PATHS},
            )
        return m

    def _finish(self, item: _Item, output: torch.Tensor | WireTensor, started: float, compute_s: float, handoff_s: float, wait_s: float,
                tokens: int, requests: int) -> None:
        queue_s = started - item.enqueued
        if self._metrics is not None:
            self._layer_metrics(item.request.layer).queue_wait.observe(queue_s)
        if not item.future.done():
            item.future.set_result(ForwardResult(output, queue_s, compute_s, handoff_s, wait_s, tokens, requests))

    def _set_depth(self) -> None:
        if self._metrics is not None:
            self._metrics.queue_depth.set(len(self._pending))


def _handoff(result: BatchOutput, handed: float, returned: float) -> tuple[float, float]:
    """A batch's hand-off and its part before the call (``ForwardResult.handoff_s``, ``wait_s``), from the
    ``time.monotonic()`` times it was handed to the worker and its result reached the loop: the hand-off at least 0,
    the wait within ``0 .. hand-off`` (0 when the worker did not say when the call started)."""
    handoff = max(0.0, returned - handed - result.seconds)
    if result.started is None:
        return handoff, 0.0
    return handoff, min(max(0.0, result.started - handed), handoff)


def _latest_deadline(batch: list[_Item]) -> float | None:
    """The time after which no request of ``batch`` wants its answer (None when one of them has no deadline)."""
    deadlines = [item.deadline for item in batch]
    return None if None in deadlines else max(deadlines)  # type: ignore[type-var]


def _fail(item: _Item, exc: BaseException) -> None:
    if not item.future.done():
        item.future.set_exception(exc)


__all__ = ["BatchScheduler", "ForwardEngine", "ForwardResult"]
