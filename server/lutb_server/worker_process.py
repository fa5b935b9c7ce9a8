"""The compute worker in a child process, so that no thread of the serving process waits for its GIL.

Why: a :class:`~lutb_server.worker.ComputeWorker` thread releases the GIL inside every torch
call and must take it back from the event loop each time. With the loop busy (a server under
load) a 0.3 ms batch took 2.8-4.7 ms on an H200 (``bench/worker_pacing.py``,
bench/results/2026-12-02-serving-5-h200.md). Here the child process loads the weights, owns the
device, captures the CUDA graphs and runs ``ComputeWorker.run`` on its own main thread; the
serving process keeps gRPC, validation and the batching scheduler
(:class:`~lutb_server.engine.ExpertEngine` with ``load_experts=False``) and pays one GIL hand-over
per batch (its receiver thread completing the batch's future).

Messages (one duplex ``multiprocessing`` pipe, pickled; tensors travel as ``lutb.v1.Tensor``
messages made by the wire codec, :mod:`lutb_client.codec`):

- child -> parent, once: ``("ready", info)`` (``weight_bytes``, ``backend``, ``graphs_s``,
  ``warm_up_s``, ``gpu_memory``) or ``("failed", exception)``;
- parent -> child: ``(job, requests)`` per batch, each request ``(layer, x, topk_ids,
  topk_weights, apply_router_weight_on_input, output_mode)``; ``None`` to stop;
- child -> parent: ``(job, outputs, seconds, gpu_memory)`` or ``(job, exception, 0.0, gpu_memory)``,
  ``gpu_memory`` the child's ``(allocated, reserved)`` CUDA allocator bytes after the batch.

In the serving process a sender thread packs and writes batches (the event loop only queues
them) and a receiver thread completes the futures. If the child dies, every pending and later
batch fails with :class:`ComputeWorkerGone`.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import queue
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from lutb_client.codec import decode_tensor, encode_tensor
from lutb_server.engine import PreparedRequest
from lutb_server.errors import Unavailable
from lutb_server.metrics import torch_gpu_memory
from lutb_server.worker import BatchOutput

log = logging.getLogger(__name__)

class ComputeWorkerGone(Unavailable):
    """The compute process exited or its pipe broke; nothing more will be computed (UNAVAILABLE:
    clients retry elsewhere)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What the child process needs to build its engine and worker (picklable)."""

    checkpoint: str
    backend: str
    """The resolved backend name (not ``auto``: the serving process chose it)."""
    device: str
    max_tokens_per_request: int = 4096
    validate_tiles: bool = True
    cuda_graph_max_tokens: int = 512
    cuda_graph_top_k: int = 8
    warm_up_tokens: int = 0
    """Eager batch sizes compiled before ready (``ComputeWorker.warm_up``); 0: none."""
    intra_op_threads: int = 0
    gil_switch_interval_us: int = 0


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError carrying its type and message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _gpu_memory(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) bytes of torch's allocator on ``device``; zeros off CUDA."""
    return torch_gpu_memory(str(device))() if device.type == "cuda" else (0, 0)


def _child_main(spec: WorkerSpec, conn: Connection) -> None:
    """The compute process: build, announce, then run batches until told to stop (or the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the serving process drains first
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [compute]: %(message)s")
    try:
        from lutb_kernels.checkpoint import Checkpoint
        from lutb_server.app import apply_gil_switch_interval, apply_intra_op_threads
        from lutb_server.backends import choose_backend, resolve_device
        from lutb_server.engine import ExpertEngine
        from lutb_server.worker import ComputeWorker

        checkpoint = Checkpoint(spec.checkpoint)
        device = resolve_device(spec.device)
        apply_intra_op_threads(spec.intra_op_threads, device)
        apply_gil_switch_interval(spec.gil_switch_interval_us, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        engine = ExpertEngine(checkpoint, choose_backend(spec.backend, checkpoint.config, device),
                              max_tokens_per_request=spec.max_tokens_per_request, validate_tiles=spec.validate_tiles)
        worker = ComputeWorker(engine, cuda_graph_max_tokens=spec.cuda_graph_max_tokens, cuda_graph_top_k=spec.cuda_graph_top_k)
        graphs_s = worker.capture_graphs()
        warm_up_s = worker.warm_up(spec.warm_up_tokens) if spec.warm_up_tokens else 0.0
        conn.send(("ready", {"weight_bytes": engine.weight_bytes, "backend": engine.backend.name,
                             "graphs_s": graphs_s, "warm_up_s": warm_up_s, "gpu_memory": _gpu_memory(device)}))
    except BaseException as exc:  # noqa: BLE001 - reported to the serving process, which raises it
        conn.send(("failed", _picklable(exc)))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the serving process is gone
        if message is None:
            return
        job, packed = message
        try:
            requests = [
                PreparedRequest(layer, decode_tensor(x), decode_tensor(ids), decode_tensor(w), on_input, mode)
                for layer, x, ids, w, on_input, mode in packed
            ]
            outputs, seconds = worker.run(requests)
            conn.send((job, [encode_tensor(o) for o in outputs], seconds, _gpu_memory(device)))
        except Exception as exc:  # noqa: BLE001 - the batch's error, handed to its future
            conn.send((job, _picklable(exc), 0.0, _gpu_memory(device)))


class ProcessComputeWorker:
    """:class:`~lutb_server.worker.ComputeWorker`'s ``start``/``submit``/``close`` with the compute in a child process.

    Args:
        spec: what the child loads and how (see :class:`WorkerSpec`).
        on_gone: called once, from one of this object's threads, if the child dies (or its pipe
            breaks) while the worker is not being closed: the server takes itself out of service.
    """

    def __init__(self, spec: WorkerSpec, *, on_gone: Callable[[ComputeWorkerGone], None] | None = None) -> None:
        self.spec = spec
        self._on_gone = on_gone
        self._closing = False
        self.info: dict[str, Any] = {}
        self.batches = 0
        self._process: Any = None
        self._conn: Connection | None = None
        self._outbox: queue.Queue[tuple[int, list[PreparedRequest]] | None] = queue.Queue()
        self._pending: dict[int, Future[BatchOutput]] = {}
        self._lock = threading.Lock()
        self._jobs = itertools.count()
        self._gone: ComputeWorkerGone | None = None
        self._threads: list[threading.Thread] = []
        self._gpu_memory: tuple[int, int] = (0, 0)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the child's backend holds on its device (after :meth:`start`)."""
        return int(self.info.get("weight_bytes", 0))

    def gpu_memory(self) -> tuple[int, int]:
        """The child's ``(allocated, reserved)`` CUDA allocator bytes, as of its last answer (for the metrics)."""
        return self._gpu_memory

    def start(self) -> ProcessComputeWorker:
        """Spawn the child and wait until it has loaded the weights, captured its graphs and warmed up.

        Blocking (seconds to minutes); idempotent. Raises what the child raised while starting.
        """
        if self._process is not None:
            return self
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=_child_main, args=(self.spec, child_conn), name="lutb-compute", daemon=True)
        process.start()
        child_conn.close()
        try:
            kind, payload = conn.recv()
        except EOFError:
            process.join(5)
            raise ComputeWorkerGone(f"the compute process exited while starting (exit code {process.exitcode})") from None
        if kind != "ready":
            process.join(5)
            raise payload
        self.info, self._process, self._conn = payload, process, conn
        self._gpu_memory = payload["gpu_memory"]
        log.info("compute process %d ready: backend %s, %.1f MB of weights, graphs %.2fs, warm-up %.2fs", process.pid,
                 payload["backend"], payload["weight_bytes"] / 1e6, payload["graphs_s"], payload["warm_up_s"])
        self._threads = [threading.Thread(target=self._send_loop, name="lutb-compute-send", daemon=True),
                         threading.Thread(target=self._receive_loop, name="lutb-compute-receive", daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def submit(self, requests: Sequence[PreparedRequest]) -> Future[BatchOutput]:
        """Queue one pooled batch; the future gives ``(per-request outputs, seconds in the child)``.

        Raises:
            ComputeWorkerGone: the child is gone (or not started).
        """
        future: Future[BatchOutput] = Future()
        with self._lock:
            if self._gone is not None:
                raise self._gone
            if self._conn is None:
                raise ComputeWorkerGone("the compute process is not started")
            job = next(self._jobs)
            self._pending[job] = future
        self._outbox.put((job, list(requests)))
        return future

    def close(self, timeout: float | None = None) -> None:
        """Let the child finish the queued batches, then stop it (terminated after ``timeout`` seconds)."""
        if self._process is None:
            return
        self._closing = True
        self._outbox.put(None)
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("compute process %d did not stop within %ss; terminating it", self._process.pid, timeout)
            self._process.terminate()
            self._process.join(5)
        for thread in self._threads:
            thread.join(5)
        self._fail_pending(ComputeWorkerGone("the compute worker is closed"))
        self._process = None

    def _send_loop(self) -> None:
        assert self._conn is not None
        while True:
            item = self._outbox.get()
            try:
                if item is None:
                    self._conn.send(None)
                    return
                job, requests = item
                self._conn.send((job, [
                    (r.layer, encode_tensor(r.x), encode_tensor(r.topk_ids), encode_tensor(r.topk_weights),
                     r.apply_router_weight_on_input, r.output_mode)
                    for r in requests
                ]))
            except (OSError, ValueError) as exc:  # broken pipe: the child is gone
                self._fail_pending(ComputeWorkerGone(f"the compute process is gone ({exc})"))
                return

    def _receive_loop(self) -> None:
        assert self._conn is not None
        while True:
            try:
                job, result, seconds, self._gpu_memory = self._conn.recv()
            except (EOFError, OSError) as exc:
                code = self._process.exitcode if self._process is not None else None
                self._fail_pending(ComputeWorkerGone(f"the compute process exited (exit code {code}): {type(exc).__name__}"))
                return
            with self._lock:
                future = self._pending.pop(job, None)
            if future is None or not future.set_running_or_notify_cancel():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                self.batches += 1
                future.set_result(([decode_tensor(o) for o in result], seconds))

    def _fail_pending(self, error: ComputeWorkerGone) -> None:
        with self._lock:
            first = self._gone is None
            if first:
                self._gone = error
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        if first and not self._closing:
            log.error("%s", error)
            if self._on_gone is not None:
                self._on_gone(error)


__all__ = ["ComputeWorkerGone", "ProcessComputeWorker", "WorkerSpec"]
