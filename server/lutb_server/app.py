"""Wiring: settings -> engine -> scheduler -> grpc.aio server (+ health, reflection, metrics).

Life of a server (:class:`ExpertServer`):

1. ``start()``: resolve the checkpoint (the demo one when none is given), device and
   backend (a forced backend this machine cannot run fails here, before binding);
   serve metrics; bind and start gRPC with health NOT_SERVING and ExpertService
   answering UNAVAILABLE; load the layers in a worker thread; start the scheduler;
   health SERVING.
2. ``stop(grace)`` (on SIGTERM/SIGINT in :func:`serve`): health NOT_SERVING, new
   ExpertService calls get UNAVAILABLE, calls in flight get up to ``grace`` seconds
   to finish (then they are cancelled), then the scheduler and metrics stop.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import shutil
import signal
import socket
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client.allocator import tune_malloc
from lutb_kernels.checkpoint import Checkpoint
from lutb_server.backends import BackendChoice, choose_backend, compute_capability, resolve_device
from lutb_server.cpu_placement import CpuPlacement, set_compute_cpu_aside
from lutb_server.cpu_wakeup import CpuWakeupHold, hold_cpu_wakeup_latency
from lutb_server.engine import ExpertEngine
from lutb_server.errors import ComputeStalled
from lutb_server.front_ends import FrontEnds
from lutb_server.interceptors import Gate, GateInterceptor, MetricsInterceptor
from lutb_server.metrics import ServerMetrics
from lutb_server.metrics_gateway import MetricsGateway
from lutb_server.scheduler import BatchScheduler
from lutb_server.servicer import ExpertServicer, add_to_server
from lutb_server.settings import ServerSettings
from lutb_server.worker import BatchWorker, ComputeWorker
from lutb_server.worker_process import ProcessComputeWorker, WorkerSpec, spawn_compute_process

log = logging.getLogger(__name__)

RESPONSE_FLUSH_S = 1.0
"""Seconds a draining server waits, once every ExpertService handler has returned, for their responses to go out."""

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["ExpertService"].full_name
"""``lutb.v1.ExpertService``: also the health service name probes can ask about."""

DEMO_SHAPE = {"layers": 2, "experts": 8, "hidden": 256, "intermediate": 256, "activation": "silu",
              "dtype": "bfloat16", "scale_mode": "rceil", "seed": 0}
DEMO_NAME = "demo-v2-l2-e8-h256-i256-silu-bf16-rceil-s0"
"""The demo's folder under ``demo_dir``: a new name whenever what the writer puts there changes (v2: SHA256SUMS), so
that a demo an earlier version made is not reused (it would be served with a warning that its files go unchecked)."""


def ensure_demo_checkpoint(demo_dir: Path) -> Path:
    """The built-in demo checkpoint under ``demo_dir``, made on first use (atomically) and reused after."""
    target = demo_dir / DEMO_NAME
    if any(target.glob("*.safetensors")):
        return target
    try:
        from lutb_kernels.synth import make_synthetic_checkpoint
    except ImportError as exc:
        raise RuntimeError(f"cannot make the demo checkpoint ({exc}); pass --checkpoint DIR") from None
    demo_dir.mkdir(parents=True, exist_ok=True)
    tmp = demo_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log.info("making the demo checkpoint in %s (once)", target)
    try:
        made = Path(make_synthetic_checkpoint(tmp, **DEMO_SHAPE))
        try:
            os.rename(made, target)
        except OSError:
            if not any(target.glob("*.safetensors")):  # not a concurrent maker winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@dataclass(frozen=True)
class EnginePlan:
    """What will be loaded, decided cheaply before binding: the checkpoint and the backend."""

    checkpoint: Checkpoint
    backend: BackendChoice


def plan_engine(settings: ServerSettings) -> EnginePlan:
    """Resolve checkpoint (or demo), device and backend.

    Raises:
        BackendUnavailableError: the backend or device asked for cannot run here.
        LutBFormatError: the checkpoint's files are not a LUT-B v1 checkpoint.
    """
    path = settings.checkpoint if settings.checkpoint is not None else ensure_demo_checkpoint(settings.demo_dir)
    checkpoint = Checkpoint(path)
    device = resolve_device(settings.device)
    choice = choose_backend(settings.backend, checkpoint.config, device)
    return EnginePlan(checkpoint, choice)


def load_engine(plan: EnginePlan, settings: ServerSettings, content_hash: str | None = None) -> ExpertEngine:
    """Load every layer of the planned checkpoint on the planned backend (slow; call off the event loop).

    With ``compute_worker = "process"`` only the held experts' ids are read: the compute process
    loads the weights (:func:`worker_spec`). ``content_hash``: the planned checkpoint's, as front end 0
    computed it (see :class:`ExpertServer`); None: hashed here.
    """
    return ExpertEngine(
        plan.checkpoint, plan.backend,
        max_tokens_per_request=settings.max_tokens_per_request, max_top_k=settings.max_top_k,
        validate_tiles=settings.validate_checkpoint, load_experts=settings.compute_worker == "thread",
        content_hash=content_hash,
    )


def warm_up_limit(settings: ServerSettings) -> int:
    """Tokens of the largest batch the compute worker can be handed, up to which it warms up: a pooled
    batch of ``max_batch_tokens``, or one larger request (up to ``max_tokens_per_request``) run alone."""
    return max(settings.max_batch_tokens, settings.max_tokens_per_request)


def worker_spec(plan: EnginePlan, settings: ServerSettings) -> WorkerSpec:
    """What the compute process of ``compute_worker = "process"`` loads, and how."""
    return WorkerSpec(
        checkpoint=str(plan.checkpoint.path), backend=plan.backend.name, device=str(plan.backend.device),
        max_tokens_per_request=settings.max_tokens_per_request, validate_tiles=settings.validate_checkpoint,
        cuda_graph_max_tokens=settings.cuda_graph_max_tokens, cuda_graph_top_k=settings.cuda_graph_top_k,
        warm_up_tokens=warm_up_limit(settings), max_batch_tokens=settings.max_batch_tokens,
        intra_op_threads=settings.intra_op_threads,
        gil_switch_interval_us=settings.gil_switch_interval_us, spin_s=settings.compute_spin_us / 1e6,
    )


def arena_bytes(plan: EnginePlan, settings: ServerSettings) -> int:
    """Shared memory between the serving process and the compute process, in bytes: ``batches_in_flight + 1``
    batches of ``max_batch_tokens`` tokens, hidden states in and combined outputs back (a batch that does not fit,
    e.g. a large route-major one, travels through the socket instead).

    Each batch takes one unbroken span of the ring (:class:`~lutb_server.shared_arena.SharedArena`). With N batches
    in flight, N - 1 of them may hold spans anywhere when the next full one comes, so the ring needs one full batch
    of room beyond N to always find it contiguous space (with N = 1 the ring is empty then and the spare is unused).
    """
    config = plan.checkpoint.config
    per_token = 2 * config.hidden_size * config.torch_dtype.itemsize + 8 * max(settings.cuda_graph_top_k, 8)
    return (settings.batches_in_flight + 1) * settings.max_batch_tokens * per_token


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def apply_intra_op_threads(threads: int, device: torch.device) -> int:
    """Set torch's CPU thread count for the serving process (``intra_op_threads``); returns the count in effect.

    0 means 1 on a CUDA device and torch's default on the CPU. On a CUDA server the CPU
    tensor work is per-request validation on the event loop and the worker's staging copies:
    from 32K elements on, torch runs them on an OpenMP team per calling thread whose threads
    spin after each region, taking cores from the event loop, gRPC and the compute worker.
    Call it on the event loop before the compute worker starts (threads created later
    inherit the count; OpenMP keeps it per thread).
    """
    if threads == 0 and device.type == "cuda":
        threads = 1
    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


CUDA_GIL_SWITCH_INTERVAL_US = 200


def apply_gil_switch_interval(interval_us: int, device: torch.device) -> float:
    """Set the process's GIL switch interval (``gil_switch_interval_us``); returns the interval in effect, in seconds.

    0 means ``CUDA_GIL_SWITCH_INTERVAL_US`` on a CUDA device and Python's default on the CPU.
    The compute worker releases the GIL inside every torch call (copies, launches, the wait
    for the GPU) and must take it back from the event loop thread, which under load runs
    Python almost without pause: the interpreter then hands the GIL over only after the
    switch interval. The H200 serving run showed a batch's compute, as the worker measured
    it, at 4-9x its in-process time at concurrency 64 (bench/results/2026-12-02-serving-3-h200.md);
    ``bench/gil_handover.py`` shows the mechanism on the CPU (bench/results/2026-12-02-mxfp8-wire-cpu.md).
    """
    if interval_us == 0 and device.type == "cuda":
        interval_us = CUDA_GIL_SWITCH_INTERVAL_US
    if interval_us > 0:
        sys.setswitchinterval(interval_us / 1e6)
    return sys.getswitchinterval()


GC_YOUNG_THRESHOLD = 10_000
"""Container allocations between collections of the youngest generation, once serving (Python's default is 700)."""


def settle_gc() -> str:
    """Call once a process has started up (everything loaded, compiled, warmed up): collect, move every object
    alive then into the collector's permanent generation (``gc.freeze``), and collect the youngest generation
    every ``GC_YOUNG_THRESHOLD`` allocations; returns what was done, for the log.

    A serving process allocates a few dozen container objects per request (tasks, futures, messages,
    tensors), a few of them in reference cycles, so with Python's defaults the cyclic collector runs every
    ~700 allocations, every 10th run also over the middle generation and from time to time over everything:
    after start-up ~190k objects of torch, grpc and our modules, 40-100 ms with the GIL held, a pause every
    request of the process waits through. Frozen, those objects are never scanned again; the rarer young
    collections cost less in all. On the CPU sandbox at 64 callers (bench/results/2026-12-05-gc-cpu.md) native
    profiles put 10-13% of the serving process's samples in the collector before and 2-6% after.
    """
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)
    return f"gc: {gc.get_freeze_count()} start-up objects frozen, young-generation threshold {GC_YOUNG_THRESHOLD}"


class ExpertServer:
    """One serving process's worth of state; several can live in one process (tests).

    With ``front_ends = N > 1`` this server is front end 0: it spawns the compute process with N
    connections and front ends 1..N-1 (:class:`~lutb_server.front_ends.FrontEnds`, each an
    ``ExpertServer`` on its connection, bound to the same port), watches them (one that exits
    takes the whole server out of service, as a dead compute process does), and stops them
    before itself.

    Args:
        settings: the configuration.
        engine_loader: builds the engine (blocking; run in a worker thread). Default:
            :func:`plan_engine` (in :meth:`start`, before binding) then :func:`load_engine`.
        compute_connection: this server is front end k > 0 of a shared compute process: its
            socket (from :func:`~lutb_server.worker_process.spawn_compute_process`). Its metrics
            then listen on loopback only (``metrics_port``, which front end 0 sets to its own
            + k): the metrics process front end 0 starts (:mod:`lutb_server.metrics_gateway`) serves them with
            front end 0's, labelled ``front_end``.
        front_end: ``(k, N)``: this server is front end k of N on its port (``ModelInfo`` says so, for
            clients that spread their connections). None: front end 0 of ``settings.front_ends``.
        content_hash: with ``compute_connection``: the content hash of ``settings.checkpoint`` (which must be
            set), as front end 0 computed it from that path before spawning this front end with it; it is not
            computed again. Front end 0 hashes the checkpoint once per server start and hands the hash to the
            compute process and the other front ends. None: hashed here.
        checkpoint_identity: with ``content_hash``: ``Checkpoint.identity`` of the files front end 0 hashed; the
            checkpoint opened here must be those files (not a copy swapped in by an overwrite meanwhile).
        instance_id: front end 0's :attr:`instance_id`, handed to front ends k > 0. None: drawn here.
    """

    def __init__(self, settings: ServerSettings, *, engine_loader: Callable[[], ExpertEngine] | None = None,
                 compute_connection: socket.socket | None = None, front_end: tuple[int, int] | None = None,
                 content_hash: str | None = None, instance_id: str | None = None,
                 checkpoint_identity: tuple | None = None) -> None:
        self.settings = settings
        self._checkpoint_identity = checkpoint_identity
        self.instance_id = instance_id or uuid.uuid4().hex[:16]
        """This server's random id (``ModelInfo.instance_id``): the same from every front end, new at each start."""
        self.front_end = front_end if front_end is not None else (0, settings.front_ends)
        self.metrics = ServerMetrics(expert_metrics=settings.expert_metrics)
        self.gate = Gate()
        self.health = health.aio.HealthServicer()
        self.servicer = ExpertServicer(metrics=self.metrics, accepting=lambda: self.gate.open, draining=self.gate.draining,
                                       max_response_bytes=settings.max_message_bytes,
                                       stream_budget_bytes=settings.stream_budget_bytes, max_streams=settings.max_streams)
        self.engine: ExpertEngine | None = None
        self.scheduler: BatchScheduler | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._engine_loader = engine_loader
        self._compute_connection = compute_connection
        self._content_hash = content_hash
        self.front_ends = FrontEnds()
        """Front ends 1..N-1, where this is front end 0 of several."""
        self._cpu_placement = CpuPlacement(None)
        """The CPU set aside for the compute process this server starts (``compute_cpu``)."""
        self._cpu_wakeup = CpuWakeupHold(None, "")
        """The machine's CPU wake-up bound this server holds (``cpu_wakeup_latency_us``; front end 0 only)."""
        self._watchdog: asyncio.Task[None] | None = None
        """Watches the compute worker for a stall (``compute_stall_s``) while serving."""
        self._metrics_gateway: MetricsGateway | None = None
        """The process serving every front end's metrics, where this is front end 0 of several."""
        self._metrics_ports: list[int] = []
        """The loopback metrics ports of front ends 0..N-1, which the metrics process reads."""
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self.failed = asyncio.Event()
        """Set when the server can no longer compute (its compute process died); :func:`serve` then stops it."""

    @property
    def address(self) -> str:
        """``host:port`` clients can dial (loopback when bound to every interface)."""
        host = self.settings.host
        if host in ("0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        return _address(host, self.port or 0)

    async def start(self) -> None:
        """Bind, start, load; returns once the server is SERVING (see the module docstring)."""
        s = self.settings
        loader = self._engine_loader
        plan: EnginePlan | None = None
        if self._content_hash is not None and (self._compute_connection is None or s.checkpoint is None):
            raise ValueError("a content_hash is front end 0's hash of settings.checkpoint, handed to a front end k > 0 "
                             "(compute_connection) that serves that path")
        if loader is None:
            plan = await asyncio.to_thread(plan_engine, s)
            if self._checkpoint_identity is not None:
                plan.checkpoint.expect_identity(self._checkpoint_identity, "front end 0")
            log.info("backend %s on %s: %s", plan.backend.name, plan.backend.device, plan.backend.reason)
            loader = functools.partial(load_engine, plan, s, self._content_hash)
        elif s.compute_worker == "process":
            raise ValueError("compute_worker = 'process' loads the checkpoint in the compute process; it takes no engine_loader")
        worker: BatchWorker | None = None
        try:  # from here on a failure goes through stop(): metrics closed, CPU placement and wake-up bound given back
            if s.compute_worker == "process" and self._compute_connection is None:  # front end 0 starts the processes
                self._cpu_placement = set_compute_cpu_aside(s.compute_cpu)  # before this process starts threads: they inherit it
            if self._compute_connection is None and s.cpu_wakeup_latency_us is not None:  # the whole machine's: one hold
                self._cpu_wakeup = hold_cpu_wakeup_latency(s.cpu_wakeup_latency_us)
                (log.info if self._cpu_wakeup.held else log.warning)("%s", self._cpu_wakeup.note)
            shared_port = s.front_ends > 1 or self._compute_connection is not None
            if s.front_ends > 1 and s.port:
                _check_port_free(s.host, s.port)  # SO_REUSEPORT would let us share a port someone else holds
            if s.metrics_port and self._compute_connection is not None:  # front end k > 0: read by the metrics process
                self.metrics_port = self.metrics.serve("127.0.0.1", s.metrics_port)
            elif s.metrics_port and s.front_ends > 1:  # every front end's, merged by a process of its own
                ports = [s.metrics_port + k for k in range(1, s.front_ends)]
                ports.insert(0, self._serve_own_metrics(ports))
                self._metrics_ports = ports
                self.metrics_port = await self._start_metrics_process()
            elif s.metrics_port:
                self.metrics_port = self.metrics.serve(s.host, s.metrics_port)
            options = [
                ("grpc.max_receive_message_length", s.max_message_bytes),
                ("grpc.max_send_message_length", s.max_message_bytes),
                # gRPC sets SO_REUSEPORT by default: a second server on a taken port would bind and
                # silently receive part of the first one's connections. Fail the bind instead, unless
                # this is one of several front ends, which share the port on purpose.
                ("grpc.so_reuseport", 1 if shared_port else 0),
                # Clients ping every 20 s (lutb_client.client.KEEPALIVE_OPTIONS) to find a vanished server: accept
                # pings every second, with or without calls (500 ms apart at least: jitter; gRPC's default answers a
                # client pinging more often than every 5 minutes without data with GOAWAY, too_many_pings, ending its
                # streams; the key is GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS's), and ping idle
                # clients every 60 s to let go of the connections and streams of vanished ones.
                ("grpc.http2.min_ping_interval_without_data_ms", 500),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.keepalive_time_ms", 60_000),
                ("grpc.keepalive_timeout_ms", 20_000),
                ("grpc.http2.ping_timeout_ms", 20_000),
            ]
            server = grpc.aio.server(
                interceptors=[MetricsInterceptor(self.metrics), GateInterceptor(self.gate, (SERVICE_NAME,))],
                options=options,
            )
            add_to_server(self.servicer, server)  # the generated registration, but a request that is not protobuf is INVALID_ARGUMENT
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            try:
                port = server.add_insecure_port(_address(s.host, s.port))
            except RuntimeError:  # newer grpcio raises where older ones return 0
                port = 0
            if port == 0:
                raise OSError(f"cannot bind gRPC to {_address(s.host, s.port)}")
            self.port = port
            self._server = server
            await server.start()
            loop_type = type(asyncio.get_running_loop())
            log.info("gRPC on %s (NOT_SERVING while loading)%s; event loop %s.%s", _address(s.host, port),
                     f", metrics on http://{_address(s.host, self.metrics_port)}/metrics" if self.metrics_port else ", metrics off",
                     loop_type.__module__, loop_type.__qualname__)
            engine = await asyncio.to_thread(loader)
            threads = apply_intra_op_threads(s.intra_op_threads, engine.device)
            switch = apply_gil_switch_interval(s.gil_switch_interval_us, engine.device)
            log.info("torch intra-op threads: %d; GIL switch interval %.0f us", threads, switch * 1e6)
            if s.compute_worker == "process":
                assert plan is not None  # an engine_loader was refused above
                loop = asyncio.get_running_loop()
                # the engine hashed plan.checkpoint, the very path the compute process and the front ends load
                spec = replace(worker_spec(plan, s), compute_cpu=self._cpu_placement.cpu, content_hash=engine.content_hash,
                               checkpoint_identity=plan.checkpoint.identity)
                connection, process = self._compute_connection, None
                if connection is None and s.front_ends > 1:
                    process, connections = spawn_compute_process(spec, s.front_ends)
                    connection = connections[0]
                    self.front_ends.spawn(s, self.port, connections[1:], plan.checkpoint.path, engine.content_hash,
                                          self.instance_id, plan.checkpoint.identity)
                    self.front_ends.watch(self._front_end_exited)
                worker = ProcessComputeWorker(spec, connection=connection, process=process, loop=loop,
                                              on_gone=self._compute_gone, arena_bytes=arena_bytes(plan, s))
                await asyncio.to_thread(worker.start)  # loads, captures graphs, warms up: before SERVING
                if self.front_ends:  # SERVING only when every front end serves: clients stay on the one they reach
                    await asyncio.to_thread(self.front_ends.wait_ready)
                weight_bytes, gpu_memory = worker.weight_bytes, worker.gpu_memory
            else:
                worker = ComputeWorker(engine, cuda_graph_max_tokens=s.cuda_graph_max_tokens, cuda_graph_top_k=s.cuda_graph_top_k)
                worker.start()
                await asyncio.wrap_future(worker.call(worker.capture_graphs))  # logs the time; before SERVING
                await asyncio.wrap_future(worker.call(worker.warm_up, warm_up_limit(s)))  # compiles, before SERVING
                weight_bytes, gpu_memory = engine.weight_bytes, None
            scheduler = BatchScheduler(
                engine, max_batch_tokens=s.max_batch_tokens, max_wait_us=s.max_wait_us, batches_in_flight=s.batches_in_flight,
                max_queue_requests=s.max_queue_requests, metrics=self.metrics, backend_name=engine.backend.name,
                worker=worker,
            )
            await scheduler.start()
        except BaseException:
            self.front_ends.terminate()
            if worker is not None:  # the scheduler that would close it is not running
                await asyncio.to_thread(worker.close, 10)
            await self.stop(0)
            raise
        self.engine, self.scheduler = engine, scheduler
        self.metrics.describe_backend(
            backend=engine.backend.name, device=str(engine.device), compute_capability=compute_capability(engine.device),
            dtype=engine.config.dtype, activation=engine.config.activation, content_hash=engine.content_hash,
            weight_bytes=weight_bytes, gpu_memory=gpu_memory,
            inline_batches=(lambda: worker.inline_batches) if isinstance(worker, ProcessComputeWorker) else None,
            compute_loop=worker.loop_totals if isinstance(worker, ProcessComputeWorker) else None,
        )
        self.servicer.bind(engine, scheduler, front_end=self.front_end[0], front_ends=self.front_end[1],
                           instance_id=self.instance_id)
        if self.gate.state == "loading":
            self.gate.state = "serving"
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("SERVING %s (%d layer(s), %s, backend %s on %s)", engine.checkpoint.path, len(engine.layer_ids),
                 engine.content_hash[:19], engine.backend.name, engine.device)
        if s.compute_stall_s or self._metrics_gateway is not None:
            self._watchdog = asyncio.create_task(self._watch(scheduler), name="lutb-watchdog")

    def _serve_own_metrics(self, reserved: list[int]) -> int:
        """Serve front end 0's metrics on a free loopback port that is none of ``reserved`` (the other front ends'
        fixed ports: where ``metrics_port`` lies in the ephemeral range, the kernel could hand one of them out)."""
        for _ in range(16):
            port = self.metrics.serve("127.0.0.1", 0)
            if port not in reserved:
                return port
            self.metrics.close()
        raise OSError(f"no free loopback port for front end 0's metrics outside {reserved[0]}..{reserved[-1]}")

    async def _start_metrics_process(self) -> int:
        """Start the process that serves every front end's metrics on ``metrics_port`` (kept in ``_metrics_gateway``
        from its spawn on, so that a stop meanwhile ends it); returns the port it serves."""
        s = self.settings
        self._metrics_gateway = MetricsGateway.spawn(s.host, s.metrics_port, self._metrics_ports)
        await asyncio.to_thread(self._metrics_gateway.wait_serving)
        log.info("metrics process %d serves the %d front ends' metrics (theirs on loopback ports %s)",
                 self._metrics_gateway.process.pid, s.front_ends, ", ".join(map(str, self._metrics_ports)))
        return self._metrics_gateway.port

    async def _watch(self, scheduler: BatchScheduler) -> None:
        """While serving: take the server out of service, as for a dead compute process, once the compute worker has
        held batches without answering any for ``compute_stall_s`` seconds (a hung device or compute process: nothing
        else would tell); start the metrics process again should it exit (if that fails, the metrics are off)."""
        stall_s = self.settings.compute_stall_s
        period = max(0.05, min(1.0, stall_s / 4)) if stall_s else 1.0
        while self.gate.state == "serving":
            await asyncio.sleep(period)
            silent = scheduler.unanswered_s
            if stall_s and silent > stall_s:
                self._compute_gone(ComputeStalled(
                    f"the compute worker has answered no batch for {silent:.1f} s (compute_stall_s = {stall_s:g})"))
                return
            gateway = self._metrics_gateway
            if gateway is not None and not gateway.running and self.gate.state == "serving":
                log.error("the metrics process exited (code %s); starting another", gateway.process.returncode)
                try:
                    self.metrics_port = await self._start_metrics_process()
                except OSError as exc:
                    log.error("metrics off: the metrics process did not start again (%s)", exc)
                    self._metrics_gateway = None

    def _front_end_exited(self, error: Exception) -> None:
        """A front end exited (on the loop): unless draining anyway, out of service as for a dead compute process."""
        if self.gate.state != "draining":
            self._compute_gone(error)

    def _compute_gone(self, error: Exception) -> None:
        """The compute process died (on the loop): out of service now; :func:`serve` drains and exits 1."""
        if self.gate.state == "serving":
            self.gate.state = "draining"
            for name in ("", SERVICE_NAME):
                asyncio.ensure_future(self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING))
        log.error("out of service: %s", error)
        self.failed.set()

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop: NOT_SERVING, UNAVAILABLE for new calls, ``grace`` s for calls in flight."""
        grace = self.settings.shutdown_grace_s if grace is None else grace
        self.gate.state = "draining"
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.front_ends.terminate()  # they drain alongside this one
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            loop = asyncio.get_running_loop()
            start = loop.time()
            idle = await self.gate.wait_idle(grace)
            # ExpertService handlers have returned (or the grace ran out). A returned handler's
            # response may still be on its way out, so the server gets a short flush period, not
            # zero; long-lived streams (health Watch) are cut after it instead of holding the grace.
            remaining = max(0.0, grace - (loop.time() - start))
            await self._server.stop(min(remaining, RESPONSE_FLUSH_S) if idle else remaining)
            self._server = None
        if self.front_ends:  # disconnected from the compute process before this one's worker closes it
            await self.front_ends.join(grace)
        if self.scheduler is not None:
            await self.scheduler.close()
        if self._metrics_gateway is not None:
            await asyncio.to_thread(self._metrics_gateway.close)
            self._metrics_gateway = None
        self.metrics.close()
        self._cpu_placement.release()
        self._cpu_wakeup.release()
        self._stopped.set()
        log.info("stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(
    settings: ServerSettings,
    *,
    on_ready: Callable[[ExpertServer], None] | None = None,
    engine_loader: Callable[[], ExpertEngine] | None = None,
    compute_connection: socket.socket | None = None,
    front_end: tuple[int, int] | None = None,
    content_hash: str | None = None,
    instance_id: str | None = None,
    checkpoint_identity: tuple | None = None,
) -> int:
    """Run a server until SIGTERM or SIGINT, then drain within ``settings.shutdown_grace_s``; returns 0.

    Returns 1 instead when the server stopped because it could no longer compute (its compute
    process died), so that a supervisor (Kubernetes) restarts it.

    ``engine_loader``, ``compute_connection``, ``front_end``, ``content_hash``, ``instance_id`` and
    ``checkpoint_identity`` are passed to :class:`ExpertServer` (benchmarks serve fake backends with the first; front
    ends k > 0 run on the second, say which they are with the third and are handed front end 0's hash of the
    checkpoint, its instance id and which files it hashed with the last three).
    """
    log.info("%s", tune_malloc())  # this process moves large messages (lutb_client.allocator)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    server = ExpertServer(settings, engine_loader=engine_loader, compute_connection=compute_connection, front_end=front_end,
                          content_hash=content_hash, instance_id=instance_id, checkpoint_identity=checkpoint_identity)
    starting = asyncio.create_task(server.start())
    stop_wait = asyncio.create_task(stop_requested.wait())
    failed_wait = asyncio.create_task(server.failed.wait())
    done, _ = await asyncio.wait({starting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if starting in done:
        starting.result()  # raise startup errors
        log.info("%s", settle_gc())
        if on_ready is not None:
            on_ready(server)
        await asyncio.wait({stop_wait, failed_wait}, return_when=asyncio.FIRST_COMPLETED)
        if server.failed.is_set():
            stop_wait.cancel()
            log.error("stopping: the server can no longer compute")
            await server.stop(settings.shutdown_grace_s)
            return 1
    else:
        starting.cancel()
        try:
            await starting
        except (asyncio.CancelledError, Exception):
            pass
    failed_wait.cancel()
    log.info("signal received: draining (grace %.1fs)", settings.shutdown_grace_s)
    await server.stop(settings.shutdown_grace_s)
    return 0


def _check_port_free(host: str, port: int) -> None:
    """Raise OSError when ``host:port`` is taken (bound without SO_REUSEPORT, as no sharing process binds)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            raise OSError(f"cannot bind gRPC to {_address(host, port)}: {exc.strerror or exc}") from None


__all__ = ["DEMO_NAME", "SERVICE_NAME", "EnginePlan", "ExpertServer", "apply_gil_switch_interval", "arena_bytes", "apply_intra_op_threads", "ensure_demo_checkpoint", "load_engine", "plan_engine", "serve", "settle_gc", "warm_up_limit", "worker_spec"]
