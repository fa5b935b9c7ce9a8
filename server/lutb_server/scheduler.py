"""The batching scheduler: pools concurrent requests into experts calls run off the event loop.

Requests arrive validated (:class:`~lutb_server.engine.PreparedRequest`). The
dispatcher keeps one batch in flight on the compute worker
(:class:`~lutb_server.worker.ComputeWorker`: staging buffers, device copies, CUDA
graphs) and takes the next one the moment the worker is free (continuous batching):
every waiting request with the oldest one's
:attr:`~lutb_server.engine.PreparedRequest.pool_key` (layer, top-k, weighting, output
mode), oldest first, up to ``max_batch_tokens`` (a larger request runs alone),
concatenated along the token axis into one experts call, the output split back. While
a call runs, new requests queue up and form the next batch, which goes to the worker
before the finished batch's results are handed out.

``max_wait_us`` (default 0): when the worker is idle, how long the oldest request may
wait for company (from its arrival; cut short once a full batch is queued). Under load
the worker is busy and requests pool while they wait for it anyway, so a wait only adds
latency to lone requests; it can help bursty open-loop traffic whose requests arrive
microseconds apart.

Isolation: every request was validated before it was queued; should a pooled call
fail anyway, each of its requests is rerun alone so that only the culprit fails.
Requests whose deadline passed or whose caller went away are dropped before
computing. The queue holds at most ``max_queue_requests`` waiting requests;
beyond that :meth:`BatchScheduler.submit` raises :class:`~lutb_server.errors.QueueFull`.
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

from lutb_kernels.reference import OutputMode
from lutb_server.engine import PreparedRequest
from lutb_server.errors import DeadlineExpired, QueueFull, Unavailable
from lutb_server.metrics import ServerMetrics
from lutb_server.worker import BatchOutput, ComputeWorker

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

    output: torch.Tensor
    queue_s: float
    compute_s: float
    batch_tokens: int
    batch_requests: int


class _LayerMetrics(NamedTuple):
    queue_wait: Any
    compute: Any
    batch_tokens: Any
    batch_requests: Any
    tokens: Any


@dataclass(eq=False)
class _Item:
    request: PreparedRequest
    deadline: float | None  # time.monotonic() seconds
    future: asyncio.Future[ForwardResult]
    enqueued: float = field(default_factory=time.monotonic)


class BatchScheduler:
    """Pools requests into experts calls (see the module docstring).

    Args:
        engine: runs one (pooled) experts call, blocking.
        max_batch_tokens: most tokens per pooled call.
        max_wait_us: how long the oldest request waits for company when the worker is idle (0: never).
        max_queue_requests: most requests waiting (not yet in a batch).
        metrics: where to record queue wait, compute, batch sizes; none if None.
        backend_name: the ``backend`` label of those metrics.
        worker: runs the batches; default ``ComputeWorker(engine)`` (started and closed with the scheduler).
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
        worker: ComputeWorker | None = None,
    ) -> None:
        self._engine = engine
        self.worker = worker if worker is not None else ComputeWorker(engine)
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_us / 1e6
        self.max_queue_requests = max_queue_requests
        self._metrics = metrics
        self._backend = backend_name
        self._pending: deque[_Item] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._by_layer: dict[int, _LayerMetrics] = {}

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the dispatcher on the running loop and the compute thread."""
        if self._task is not None:
            return
        self.worker.start()
        self._task = asyncio.create_task(self._dispatch_forever(), name="lutb-scheduler")

    async def close(self) -> None:
        """Stop dispatching; waiting requests fail with UNAVAILABLE; wait for the running call."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        while self._pending:
            item = self._pending.popleft()
            if not item.future.done():
                item.future.set_exception(Unavailable("server is shutting down; request not computed"))
        self._set_depth()
        await asyncio.to_thread(self.worker.close)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a batch."""
        return len(self._pending)

    # -- submit ----------------------------------------------------------------------------

    async def submit(self, request: PreparedRequest, *, deadline: float | None = None) -> ForwardResult:
        """Queue ``request`` and wait for its result.

        Args:
            deadline: ``time.monotonic()`` time after which the request is not worth computing.

        Raises:
            QueueFull: ``max_queue_requests`` requests are waiting already.
            DeadlineExpired: the deadline passed before the request's batch started.
            Unavailable: the scheduler is closed or closing.
        """
        if self._closed or self._task is None:
            raise Unavailable("server is not accepting work (starting or shutting down)")
        if deadline is not None and deadline <= time.monotonic():
            raise DeadlineExpired("deadline expired before the request was queued; not computed")
        if len(self._pending) >= self.max_queue_requests:
            raise QueueFull(
                f"queue full: {len(self._pending)} requests waiting (max_queue_requests = {self.max_queue_requests}); retry later"
            )
        item = _Item(request, deadline, asyncio.get_running_loop().create_future())
        self._pending.append(item)
        self._set_depth()
        self._wake.set()
        return await item.future  # cancelling the caller cancels the future; the dispatcher skips it

    # -- dispatcher ------------------------------------------------------------------------

    async def _dispatch_forever(self) -> None:
        # One batch in flight: the next one is taken when the worker becomes free, so everything
        # that arrived meanwhile pools into it. It is handed to the worker *before* the finished
        # batch's results are delivered (futures, metrics: a few us per request, ~0.5 ms for 64),
        # so the device does not sit idle during that bookkeeping.
        running: tuple[list[_Item], float, Future[BatchOutput]] | None = None
        while True:
            batch: list[_Item] = []
            try:
                if running is None:
                    batch = await self._next_batch()
                    if not batch:
                        continue
                    running = (batch, time.monotonic(), self.worker.submit([i.request for i in batch]))
                batch, started, job = running
                try:
                    outputs, compute_s = await asyncio.wrap_future(job)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    running = None
                    await self._rerun_alone(batch, started, exc)
                    continue
                running = self._submit_next() if self._ready_now() else None
                self._complete(batch, started, outputs, compute_s)
            except asyncio.CancelledError:
                if running is not None:  # closing: the computed results are not awaited any more
                    for item in running[0]:
                        _fail(item, Unavailable("server is shutting down; request not answered"))
                raise
            except Exception:  # pragma: no cover - a scheduler bug must not stop serving
                log.exception("scheduler dispatch failed")
                for item in batch:
                    _fail(item, RuntimeError("scheduler dispatch failed"))
                if running is not None and running[0] is batch:
                    running = None  # else it is the next batch, already on the worker: await it

    def _ready_now(self) -> bool:
        """Take the next batch right away? Yes if anything is queued and needs no pooling wait (see :meth:`_next_batch`)."""
        if not self._pending:
            return False
        head = self._pending[0]
        return head.enqueued + self.max_wait_s <= time.monotonic() or self._pooled_tokens(head) >= self.max_batch_tokens

    def _submit_next(self) -> tuple[list[_Item], float, Future[BatchOutput]] | None:
        self._drop_dead()
        batch = self._take_batch()
        if not batch:
            return None
        return batch, time.monotonic(), self.worker.submit([i.request for i in batch])

    async def _next_batch(self) -> list[_Item]:
        while not self._pending:
            self._wake.clear()
            await self._wake.wait()
        self._drop_dead()
        if not self._pending:
            return []
        head = self._pending[0]
        wait_until = head.enqueued + self.max_wait_s
        while self._pooled_tokens(head) < self.max_batch_tokens:
            remaining = wait_until - time.monotonic()
            if remaining <= 0:
                break
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:
                break
        self._drop_dead()
        return self._take_batch()

    def _pooled_tokens(self, head: _Item) -> int:
        key = head.request.pool_key
        return sum(item.request.tokens for item in self._pending if item.request.pool_key == key)

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
                item.future.set_exception(DeadlineExpired(f"deadline expired after {waited:.1f} ms in the queue; not computed"))
                if self._metrics is not None:
                    self._metrics.deadline_dropped.labels(str(item.request.layer)).inc()
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

    async def _rerun_alone(self, batch: list[_Item], started: float, exc: Exception) -> None:
        """A batch failed: fail a lone request; rerun each of a pooled batch alone so only the culprit fails."""
        if len(batch) == 1:
            _fail(batch[0], exc)
            return
        log.warning("pooled call of %d requests failed (%s); rerunning each alone", len(batch), exc)
        for item in batch:
            if item.future.done():
                continue
            try:
                (output,), compute_s = await asyncio.wrap_future(self.worker.submit([item.request]))
            except Exception as single_exc:
                _fail(item, single_exc)
            else:
                self._finish(item, output, started, compute_s, item.request.tokens, 1)

    def _complete(self, batch: list[_Item], started: float, outputs: list[torch.Tensor], compute_s: float) -> None:
        tokens = sum(item.request.tokens for item in batch)
        for item, output in zip(batch, outputs):
            self._finish(item, output, started, compute_s, tokens, len(batch))
        if self._metrics is not None:
            m = self._layer_metrics(batch[0].request.layer)
            m.compute.observe(compute_s)
            m.batch_tokens.observe(tokens)
            m.batch_requests.observe(len(batch))
            m.tokens.inc(tokens)

    def _layer_metrics(self, layer: int) -> _LayerMetrics:
        """The metrics' children labelled (backend, layer), looked up once per layer (``labels()`` costs a lock and a dict)."""
        m = self._by_layer.get(layer)
        if m is None:
            assert self._metrics is not None
            labels = (self._backend, str(layer))
            metrics = self._metrics
            m = self._by_layer[layer] = _LayerMetrics(
                metrics.queue_wait.labels(*labels), metrics.compute.labels(*labels), metrics.batch_tokens.labels(*labels),
                metrics.batch_requests.labels(*labels), metrics.tokens.labels(*labels),
            )
        return m

    def _finish(self, item: _Item, output: torch.Tensor, started: float, compute_s: float, tokens: int, requests: int) -> None:
        queue_s = started - item.enqueued
        if self._metrics is not None:
            self._layer_metrics(item.request.layer).queue_wait.observe(queue_s)
        if not item.future.done():
            item.future.set_result(ForwardResult(output, queue_s, compute_s, tokens, requests))

    def _set_depth(self) -> None:
        if self._metrics is not None:
            self._metrics.queue_depth.set(len(self._pending))


def _fail(item: _Item, exc: BaseException) -> None:
    if not item.future.done():
        item.future.set_exception(exc)


__all__ = ["BatchScheduler", "ForwardEngine", "ForwardResult"]
