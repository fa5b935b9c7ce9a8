"""Every Prometheus metric the server exports, on a per-server registry (no global state).

======================================== ========= ===================================== ===========================================
name                                     type      labels                                what
======================================== ========= ===================================== ===========================================
lutb_grpc_requests_total                 counter   service, method, code                 finished gRPC calls
lutb_grpc_request_duration_seconds       histogram service, method                       server-side call latency
lutb_grpc_requests_in_flight             gauge     service, method                       calls being handled
lutb_forward_requests_total              counter   rpc, code                             forward requests the servicer handled (unary
                                                                                         and each stream message; not calls, unary or
                                                                                         stream, the gate refused while loading or
                                                                                         draining: lutb_grpc_requests_total has those)
lutb_queue_wait_seconds                  histogram backend, layer                        time from enqueue to the start of its batch
lutb_compute_seconds                     histogram backend, layer                        per batch this process handed over: the
                                                                                         experts call that ran it (a call merging
                                                                                         several batches: once per batch)
lutb_batch_tokens                        histogram backend, layer                        tokens per experts call
lutb_batch_requests                      histogram backend, layer                        this process's requests in each batch it
                                                                                         handed over (not the merged call's)
lutb_handoff_seconds                     histogram backend, layer, part                  per batch: its trip to the compute worker
                                                                                         and back less compute, split to_call / back
lutb_batches_total                       counter   backend, layer, path                  this process's batches by how the call that
                                                                                         ran them ran: graph, chunks, eager
lutb_tokens_processed_total              counter   backend, layer                        tokens computed
lutb_deadline_dropped_total              counter   layer                                 requests dropped unrun: deadline passed in the
                                                                                         queue or at the compute worker
lutb_queue_depth                         gauge                                           requests waiting in the scheduler
lutb_stream_held_bytes                   gauge                                           bytes of ForwardStream responses held: read,
                                                                                         computing, or computed and not yet taken by
                                                                                         gRPC (bounded by stream_budget_bytes)
lutb_backend_info                        info      backend, device, compute_capability,  what runs the experts
                                                   dtype, activation, content_hash
lutb_weight_bytes                        gauge                                           weight bytes held on the device
lutb_gpu_memory_allocated_bytes          gauge     device                                torch.cuda.memory_allocated (GPU only)
lutb_gpu_memory_reserved_bytes           gauge     device                                torch.cuda.memory_reserved (GPU only)
lutb_expert_tokens_total                 counter   layer, expert                         tokens per held expert (only with expert_metrics)
lutb_compute_batches_inline_total        counter                                         batches sent to the compute process through its
                                                                                         socket: the shared arena had no room (process
                                                                                         worker only; should stay near 0)
lutb_compute_calls_total                 counter                                         experts calls the compute process completed
                                                                                         (process worker only; as its last answer said)
lutb_compute_loop_seconds_total          counter   phase                                 the compute process's time: calls, answering,
                                                                                         reading_or_waiting, other (process worker only;
                                                                                         as its last answer said)
process_cpu_seconds_total, process_*     (various)                                       this serving process: CPU, memory, open files
                                                                                         (prometheus_client's ProcessCollector; Linux)
======================================== ========= ===================================== ===========================================

Label sets are bounded: methods are the registered ones, codes the gRPC codes,
layers those of the checkpoint.

With several front ends (``front_ends`` = N > 1), the server's endpoint serves every front end's
metrics, each sample labelled ``front_end`` (0..N-1; :mod:`lutb_server.metrics_gateway`), plus
``lutb_front_end_up{front_end}`` (1 when that front end's metrics could be read at the scrape).
The compute process merges their batches into shared experts calls, each recorded by every front end
with a batch in it: summed over ``front_end``, lutb_batches_total and lutb_compute_seconds count
front-end batches, not experts calls (docs/serving.md, Metrics).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lutb_server.expert_load import ExpertLoad

LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)
"""Bucket bounds (seconds) of the server-internal latencies: ``lutb_queue_wait_seconds``, ``lutb_handoff_seconds`` and
``lutb_compute_seconds``, which run from a few microseconds to milliseconds on a GPU (medians on an H100 host,
qwen3-30b-a3b, bench/results/2026-12-07-serving-235a722-h100.md: queue 6-11 us for a lone caller, 174-1107 us with 64;
hand-off 123-2189 us; compute 130-1631 us), so the lowest bound is 25 us."""
GRPC_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Bucket bounds (seconds) of ``lutb_grpc_request_duration_seconds``: a whole gRPC call, from 0.5 ms."""
TOKEN_BUCKETS = tuple(float(2**i) for i in range(0, 16))
REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _GpuMemoryCollector(Collector):
    """Reports the CUDA allocator counters at scrape time: ``read() -> (allocated, reserved)`` bytes."""

    def __init__(self, device: str, read: Callable[[], tuple[int, int]]) -> None:
        self.device = device
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        allocated_bytes, reserved_bytes = self.read()
        allocated = GaugeMetricFamily("lutb_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated on the serving device", labels=["device"])
        reserved = GaugeMetricFamily("lutb_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved on the serving device", labels=["device"])
        allocated.add_metric([self.device], float(allocated_bytes))
        reserved.add_metric([self.device], float(reserved_bytes))
        yield allocated
        yield reserved


class _InlineBatchesCollector(Collector):
    """Reports at scrape time how many batches went to the compute process inline (``read()``: a running count)."""

    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("lutb_compute_batches_inline", "Batches sent to the compute process through its "
                                  "socket because the shared arena had no room", value=float(self.read()))


COMPUTE_LOOP_PHASES = ("calls", "answering", "reading_or_waiting", "other")
"""The ``phase`` label values of ``lutb_compute_loop_seconds_total``, in the order of ``LoopTotals``' seconds."""


class _ComputeLoopCollector(Collector):
    """Reports at scrape time the compute process's experts calls and its loop's seconds by phase, as its last answer
    carried them: ``read() -> (calls, calls_s, answering_s, reading_or_waiting_s, other_s)``
    (``lutb_server.worker_process.LoopTotals``)."""

    def __init__(self, read: Callable[[], tuple[int, float, float, float, float]]) -> None:
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        calls, *seconds = self.read()
        yield CounterMetricFamily("lutb_compute_calls", "Experts calls the compute process completed (as its last answer said)",
                                  value=float(calls))
        loop = CounterMetricFamily("lutb_compute_loop_seconds", "The compute process's time by phase of its loop: in "
                                   "experts calls, answering, reading or waiting for batches, other (as its last "
                                   "answer said)", labels=["phase"])
        for phase, value in zip(COMPUTE_LOOP_PHASES, seconds):
            loop.add_metric([phase], float(value))
        yield loop


def torch_gpu_memory(device: str) -> Callable[[], tuple[int, int]]:
    """``read()`` for :class:`_GpuMemoryCollector`: this process's torch allocator on ``device``."""

    def read() -> tuple[int, int]:
        import torch

        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)

    return read


class ServerMetrics:
    """The server's metrics, registered on :attr:`registry` (a fresh one unless given)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, expert_metrics: bool = False) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # per serving process: with front ends, which of them is short of CPU
        self.grpc_requests = Counter("lutb_grpc_requests", "Finished gRPC calls", ["service", "method", "code"], registry=r)
        self.grpc_duration = Histogram(
            "lutb_grpc_request_duration_seconds", "Server-side gRPC call latency", ["service", "method"],
            buckets=GRPC_LATENCY_BUCKETS, registry=r,
        )
        self.grpc_in_flight = Gauge("lutb_grpc_requests_in_flight", "gRPC calls being handled", ["service", "method"], registry=r)
        self.forward_requests = Counter(
            "lutb_forward_requests", "Forward requests by RPC (each stream message counts) and status code", ["rpc", "code"], registry=r
        )
        self.queue_wait = Histogram(
            "lutb_queue_wait_seconds", "Time from enqueue to the start of the request's batch", ["backend", "layer"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.compute = Histogram(
            "lutb_compute_seconds", "Duration of the experts call that ran one of this serving process's batches (a call "
            "merging several batches is observed once per batch)", ["backend", "layer"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.handoff = Histogram(
            "lutb_handoff_seconds", "A batch's trip to the compute worker and back, less compute, in two parts: to_call "
            "(hand-over to the start of the experts call that ran it) and back (the call's end to the event loop taking "
            "the result)", ["backend", "layer", "part"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_tokens = Histogram(
            "lutb_batch_tokens", "Tokens per experts call", ["backend", "layer"], buckets=TOKEN_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "lutb_batch_requests", "This serving process's requests in each batch it handed to the compute worker", ["backend", "layer"], buckets=REQUEST_BUCKETS, registry=r
        )
        self.batches = Counter(
            "lutb_batches", "This serving process's batches by how the experts call that ran them ran (a call merging "
            "several batches counts once per batch): graph (one CUDA-graph replay), chunks (graph replays chunk by "
            "chunk), eager (the backend called directly)", ["backend", "layer", "path"], registry=r,
        )
        self.tokens = Counter("lutb_tokens_processed", "Tokens computed", ["backend", "layer"], registry=r)
        self.deadline_dropped = Counter(
            "lutb_deadline_dropped", "Requests dropped without computing: their deadline passed in the queue or at the compute worker", ["layer"], registry=r
        )
        self.queue_depth = Gauge("lutb_queue_depth", "Requests waiting in the scheduler", registry=r)
        self.stream_held_bytes = Gauge(
            "lutb_stream_held_bytes", "Bytes of ForwardStream responses held: from the request's read to gRPC taking the "
            "response (bounded by stream_budget_bytes; near it, streams pause reading)", registry=r,
        )
        self.backend_info = Info("lutb_backend", "What runs the experts", registry=r)
        self.weight_bytes = Gauge("lutb_weight_bytes", "Weight bytes the backend holds on its device", registry=r)
        self.expert_load: ExpertLoad | None = ExpertLoad() if expert_metrics else None
        if self.expert_load is not None:
            r.register(self.expert_load)
        self._http: Any = None
        self._http_thread: threading.Thread | None = None
        self.port: int | None = None

    def describe_backend(self, *, backend: str, device: str, compute_capability: str, dtype: str, activation: str,
                         content_hash: str, weight_bytes: int, gpu_memory: Callable[[], tuple[int, int]] | None = None,
                         inline_batches: Callable[[], int] | None = None,
                         compute_loop: Callable[[], tuple[int, float, float, float, float]] | None = None) -> None:
        """Set the backend info and weight gauge; add the GPU memory gauges on a CUDA device.

        ``gpu_memory() -> (allocated, reserved)`` bytes: where the device's memory is counted
        (default: this process's torch allocator; a compute process reports its own).
        ``inline_batches()``: the compute process worker's count of batches sent inline
        (``lutb_compute_batches_inline_total``); None: no such worker, no metric.
        ``compute_loop()``: the compute process's ``(calls, calls_s, answering_s, reading_or_waiting_s, other_s)``
        (``lutb_compute_calls_total``, ``lutb_compute_loop_seconds_total``); None: no compute process, no metrics.
        """
        self.backend_info.info({
            "backend": backend, "device": device, "compute_capability": compute_capability or "none",
            "dtype": dtype, "activation": activation, "content_hash": content_hash,
        })
        self.weight_bytes.set(weight_bytes)
        if device.startswith("cuda"):
            self.registry.register(_GpuMemoryCollector(device, gpu_memory or torch_gpu_memory(device)))
        if inline_batches is not None:
            self.registry.register(_InlineBatchesCollector(inline_batches))
        if compute_loop is not None:
            self.registry.register(_ComputeLoopCollector(compute_loop))

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` in a daemon thread; returns the bound port."""
        try:
            self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise OSError(f"cannot bind metrics to {where}: {exc.strerror or exc}") from None
        self.port = int(self._http.server_port)
        return self.port

    def close(self) -> None:
        """Stop the HTTP server, if any."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


__all__ = ["COMPUTE_LOOP_PHASES", "ServerMetrics"]
