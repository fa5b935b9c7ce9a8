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

With several front ends (``front_ends`` = N > 1), front end 0's endpoint serves every front end's
metrics, each sample labelled ``front_end`` (0..N-1; :class:`FrontEndsCollector`), plus
``lutb_front_end_up{front_end}`` (1 when that front end's metrics could be read at the scrape).
The compute process merges their batches into shared experts calls, each recorded by every front end
with a batch in it: summed over ``front_end``, lutb_batches_total and lutb_compute_seconds count
front-end batches, not experts calls (docs/serving.md, Metrics).
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
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

_OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_READ_CHUNK = 1 << 16  # bytes per read of a front end's answer


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

    def serve(self, host: str, port: int, *, other_front_ends: list[int] | None = None) -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` in a daemon thread; returns the bound port.

        ``other_front_ends``: the loopback metrics ports of front ends 1..N-1, whose metrics
        this endpoint serves too (:class:`FrontEndsCollector`).
        """
        registry = self.registry
        if other_front_ends:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(FrontEndsCollector(self.registry, other_front_ends))
        try:
            self._http, self._http_thread = start_http_server(port, addr=host, registry=registry)
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


class FrontEndsCollector(Collector):
    """Front end 0's metrics and those of front ends 1..N-1 (read from their loopback endpoints at
    scrape time), merged family by family, every sample labelled ``front_end``.

    Args:
        own: front end 0's registry.
        ports: the loopback metrics ports of front ends 1..N-1, in order.
        timeout_s: how long the other front ends' answers may take, all together: the endpoints are read in
            parallel, each read whole by one deadline (every socket operation waits at most until then), so a
            scrape takes at most about this long however many front ends hang or answer slowly. A front end that
            is late, fails, answers broken HTTP, or whose answer is not valid OpenMetrics, shows as
            ``lutb_front_end_up{front_end="k"} 0`` and contributes no samples.

    The endpoints are read directly, never through a proxy of the environment, in OpenMetrics, the
    format that keeps every family's type (info, counter with its ``_created`` sample): the families
    yielded are those a registry of all front ends' metrics would hold, so the endpoint serving this
    collector writes valid Prometheus text or valid OpenMetrics, whichever the scraper asks for.
    """

    def __init__(self, own: CollectorRegistry, ports: list[int], timeout_s: float = 2.0) -> None:
        self.own, self.ports, self.timeout_s = own, list(ports), timeout_s

    def _read(self, port: int, deadline: float) -> list[Metric]:
        """The families of the front end whose metrics listen on loopback ``port``, read whole by ``deadline``
        (``time.monotonic()`` seconds); OSError if it does not answer in time (TimeoutError) or answers an HTTP error,
        ValueError if its answer is not OpenMetrics. Each socket operation waits at most until the deadline, so the
        read ends by then however the front end answers."""
        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"front end metrics on port {port} not read within {self.timeout_s:g} s")
            return left

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=remaining())  # loopback: no proxy to bypass
        try:
            conn.request("GET", "/metrics", headers={"Accept": _OPENMETRICS})
            sock = conn.sock  # the response reads it after the connection lets go of it (an answer that closes)
            sock.settimeout(remaining())
            response = conn.getresponse()
            if response.status != 200:
                raise OSError(f"front end metrics on port {port} answered HTTP {response.status}")
            body = bytearray()
            while not response.isclosed():  # closed once the whole answer is read
                sock.settimeout(remaining())
                chunk = response.read1(_READ_CHUNK)  # what one read brings: a trickle cannot hold it past the deadline
                if not chunk:
                    break
                body += chunk
            if response.length:  # the front end hung up before its Content-Length was read
                raise http.client.IncompleteRead(bytes(body), response.length)
        finally:
            conn.close()
        return list(parse_openmetrics(body.decode()))

    def _read_or_none(self, port: int, deadline: float) -> list[Metric] | None:
        """:meth:`_read`, None for a front end that is down, late, or answers anything but OpenMetrics over HTTP
        (one dying mid-answer: ``http.client.IncompleteRead``, not an OSError)."""
        try:
            return self._read(port, deadline)
        except (OSError, ValueError, http.client.HTTPException):
            return None

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        up = GaugeMetricFamily("lutb_front_end_up", "1 when this front end's metrics were read at this scrape", labels=["front_end"])
        # Front end 0's registry is read as is: it names and types its families as the OpenMetrics parser does.
        read: list[tuple[int, list[Metric]]] = [(0, list(self.own.collect()))]
        up.add_metric(["0"], 1.0)
        answers: list[list[Metric] | None] = []
        if self.ports:  # in parallel, under one deadline: late front ends cost one timeout together, not one each
            deadline = time.monotonic() + self.timeout_s
            with ThreadPoolExecutor(max_workers=len(self.ports), thread_name_prefix="lutb-scrape") as pool:
                answers = list(pool.map(lambda port: self._read_or_none(port, deadline), self.ports))
        for k, answer in enumerate(answers, 1):
            up.add_metric([str(k)], 0.0 if answer is None else 1.0)
            if answer is not None:
                read.append((k, answer))
        for k, metrics in read:
            for metric in metrics:
                family = families.get(metric.name)
                if family is None:
                    family = families[metric.name] = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                family.samples.extend(sample._replace(labels={**sample.labels, "front_end": str(k)}) for sample in metric.samples)
        yield from families.values()
        yield up


__all__ = ["COMPUTE_LOOP_PHASES", "FrontEndsCollector", "ServerMetrics"]
