"""The compute worker: one thread that owns the experts' device, fed pooled batches by the scheduler.

The asyncio loop never touches the device: the scheduler hands a batch (a list of
validated :class:`~lutb_server.engine.PreparedRequest`) to :meth:`ComputeWorker.submit`
and awaits the returned ``concurrent.futures.Future``. On the worker thread, per batch:

1. the requests' tensors are concatenated straight into reusable host staging buffers
   (page-locked on a CUDA device; grown on demand, never shrunk, so after the first few
   batches nothing is allocated per request or per batch on the way in);
2. one non-blocking host-to-device copy per tensor (x, topk_ids, topk_weights) on the
   worker's own CUDA stream (x that already lies in memory given to :meth:`ComputeWorker.register_host_memory`,
   a compute process's views of its serving processes' arenas, skips the staging: one copy per request from
   there), into the static input buffers of the CUDA graph the batch will
   replay (:class:`~lutb_kernels.experts.graphs.CudaGraphExperts`) or into reusable device
   buffers when it runs eagerly; MXFP8 input carried as sent (``PreparedRequest.x_scales``)
   crosses as its bytes and scales, half the bytes, into the graphs' static rows for it, whose
   own small graph dequantizes them into x before the replay (a backend without graphs:
   dequantized on the device before the call);
3. the experts: ``forward_unchecked`` (no host sync; the engine validated the request on
   the CPU already) with a device-side NaN/Inf flag, or ``forward`` for backends without it;
4. one device-to-host copy of the whole batch's output into a pinned buffer (plus the
   4-byte flag), one stream synchronisation, then one host copy out of the pinned buffer:
   per request into the destination the caller gave (``run(..., into=)``: a compute process
   passes its serving processes' shared-memory output slots), else into the batch's own
   result tensor, split into per-request views. A destination inside memory registered with
   :meth:`ComputeWorker.register_host_memory` (a compute process registers each serving
   process's arena) is written by the device's copy engine instead, before the one
   synchronisation: no pinned staging and no CPU copy for it.

Few torch calls per batch: under load each one may hand the GIL to the event loop and wait
to get it back (docs/performance.md, "The compute worker"), so staging views are cached per shape,
the NaN/Inf flag is reset only after a batch that set it, and the graph path reuses its views.

On a CPU device the same steps run without pinning, streams or copies to a device.

CUDA graphs: with ``cuda_graph_max_tokens > 0`` on a CUDA device, every layer whose
backend is capture-safe is wrapped in ``CudaGraphExperts``; :meth:`ComputeWorker.capture_graphs`
captures the ``combined`` / weights-on-output / ``cuda_graph_top_k`` variant for every
bucket at start-up, and each bucket's dequantization of MXFP8 input (the server calls it
before it reports SERVING); other variants are
captured on first use. Batches above the largest bucket run as chunks of graph replays up to
``CudaGraphExperts.max_chunked_tokens``, and eagerly above it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
import torch

from lutb_client.codec import WireTensor, as_tensor, pack_bytes
from lutb_kernels.errors import NonFiniteInputError
from lutb_kernels.experts.base import LayerExperts
from lutb_kernels.experts.graphs import DEFAULT_MAX_TOKENS, CudaGraphExperts, GraphInputs, StaticBuffers, is_capture_safe
from lutb_kernels.mxfp8 import BLOCK, mxfp8_dequantize_fast
from lutb_kernels.mxfp8_triton import NONFINITE_MESSAGE, dequantize_into_op
from lutb_kernels.reference import OutputMode
from lutb_server.engine import PreparedRequest
from lutb_server.errors import EXPIRED_IN_WORKER, DeadlineExpired

log = logging.getLogger(__name__)

T = TypeVar("T")


BATCH_PATHS = ("graph", "chunks", "eager")
"""How an experts call can run (:attr:`BatchOutput.path`)."""


class BatchOutput(NamedTuple):
    """What a worker returns for one batch."""

    outputs: list[torch.Tensor | WireTensor]
    """Per-request outputs (CPU, model dtype), in the batch's order: torch tensors from a :class:`ComputeWorker`,
    :class:`~lutb_client.codec.WireTensor` (bytes copied out of shared memory) from a compute process."""
    seconds: float
    """Seconds the experts call took on the worker."""
    call_tokens: int
    """Tokens of the experts call that ran the batch: the batch's own, or more when the compute process merged it
    with other front ends' batches (what the GPU actually saw)."""
    path: str = "eager"
    """How the call ran: ``"graph"`` (one CUDA-graph replay), ``"chunks"`` (graph replays chunk by chunk) or
    ``"eager"`` (the backend called directly; always off CUDA graphs). See ``CudaGraphExperts.path_for``."""
    started: float | None = None
    """``time.monotonic()`` when the experts call began (one clock for every process of the machine, so a compute
    process's reading compares with its serving process's); None where unknown."""


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop the calling thread is running, or None (a worker's future may complete on either side)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class BatchWorker(Protocol):
    """What the scheduler needs of a compute worker: :class:`ComputeWorker` (a thread) or
    :class:`~lutb_server.worker_process.ProcessComputeWorker` (a child process)."""

    def start(self) -> Any: ...
    def submit(self, requests: list[PreparedRequest], deadline: float | None = None) -> Future[BatchOutput]: ...
    def close(self, timeout: float | None = None) -> None: ...


class ForwardEngine(Protocol):
    """The least a worker needs of an engine: one blocking experts call on CPU tensors."""

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
        apply_router_weight_on_input: bool = False, output_mode: OutputMode = "combined",
    ) -> torch.Tensor: ...


class _Buffers:
    """Named reusable flat byte buffers on one device (pinned when asked), viewed as any shape and dtype.

    Views are cached per (name, shape, dtype): under load every torch call on the compute
    worker thread may hand the GIL to the event loop and wait to get it back (docs/performance.md,
    "The compute worker"), so a batch should make as few of them as it can.
    """

    MAX_VIEWS = 4096
    """Cached views beyond which the cache starts over (one per batch size and name seen)."""

    def __init__(self, device: torch.device, *, pin: bool) -> None:
        self.device = device
        self.pin = pin
        self._bufs: dict[str, torch.Tensor] = {}
        self._views: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._bytes: dict[str, np.ndarray] = {}  # name -> a numpy uint8 view of the whole buffer (host buffers)
        self.grown = 0

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        key = (name, tuple(int(s) for s in shape), dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        numel = 1
        for s in key[1]:
            numel *= s
        nbytes = numel * dtype.itemsize
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * buf.numel() if buf is not None else 0, 4096)
            buf = torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=self.pin)
            self._bufs[name] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != name}  # views of the old buffer
            self._bytes.pop(name, None)
            self.grown += 1
            log.debug("staging buffer %s on %s grown to %d bytes", name, self.device, size)
        if len(self._views) >= self.MAX_VIEWS:
            self._views.clear()
        view = self._views[key] = buf[:nbytes].view(dtype).view(key[1])
        return view

    def fill(self, name: str, shape: Sequence[int], dtype: torch.dtype, parts: Sequence[torch.Tensor | WireTensor]) -> torch.Tensor:
        """:meth:`get`'s view holding ``parts`` concatenated along dim 0 (host buffers). WireTensors' bytes are copied
        in through a cached numpy view of the buffer: no torch call per part or per batch."""
        view = self.get(name, shape, dtype)
        if not any(isinstance(p, WireTensor) for p in parts):
            return concat_into(parts, view)
        flat = self._bytes.get(name)
        if flat is None:
            flat = self._bytes[name] = self._bufs[name].numpy()
        pack_bytes(parts, flat[:view.numel() * view.element_size()])
        return view

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())


class ComputeWorker:
    """The thread that runs experts calls (see the module docstring).

    Args:
        engine: an :class:`~lutb_server.engine.ExpertEngine` (or any object with a blocking
            ``forward``; then batches just go through it, without staging or graphs).
        cuda_graph_max_tokens: largest CUDA-graph token bucket; 0 disables graphs.
        cuda_graph_top_k: the top-k whose graphs :meth:`capture_graphs` captures at start-up
            (0: capture nothing up front; every variant on first use).
        name: the thread's name.
    """

    def __init__(
        self,
        engine: Any,
        *,
        cuda_graph_max_tokens: int = DEFAULT_MAX_TOKENS,
        cuda_graph_top_k: int = 8,
        name: str = "lutb-compute",
    ) -> None:
        self.engine = engine
        self.name = name
        self.cuda_graph_top_k = cuda_graph_top_k
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._experts: dict[int, LayerExperts] | None = None
        self.device = torch.device(getattr(engine, "device", "cpu"))
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # torch.cuda.set_device refuses a bare "cuda"
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._stream: Any = None
        self._host = _Buffers(torch.device("cpu"), pin=self.cuda)
        self._dev = _Buffers(self.device, pin=False)
        self._flag: tuple[torch.Tensor, torch.Tensor, Any] | None = None
        self._dequantize = dequantize_into_op(self.device)
        """MXFP8 input carried to the device, into x, for a backend without CUDA graphs (the graphs dequantize it
        themselves): one Triton launch where triton is installed, else torch ops."""
        self._registered: dict[int, int] = {}
        """Host memory the device copies outputs into directly: start address -> end address."""
        self.batches = 0
        if hasattr(engine, "layer_experts") and hasattr(engine, "layer_ids"):
            self._experts = {layer: engine.layer_experts(layer) for layer in engine.layer_ids}
            if self.cuda:
                self._stream = torch.cuda.Stream(self.device)
                if cuda_graph_max_tokens > 0:
                    # One pool, one set of input rows and outputs: the graphs replay one at a time on one stream.
                    pool, buffers = torch.cuda.graph_pool_handle(), StaticBuffers()
                    for layer, experts in self._experts.items():
                        if is_capture_safe(experts):
                            self._experts[layer] = CudaGraphExperts(experts, max_tokens=cuda_graph_max_tokens, pool=pool,
                                                                    buffers=buffers)
                        else:
                            log.info("layer %d: backend %s is not capture-safe; no CUDA graphs", layer, experts.name)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ComputeWorker:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued jobs, then stop the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        name_os_thread(self.name)
        broken: BaseException | None = None
        if self.cuda:
            try:
                torch.cuda.set_device(self.device)
            except BaseException as exc:  # noqa: BLE001 - every job fails with it instead of waiting forever
                log.error("compute worker cannot use %s: %s", self.device, exc)
                broken = exc
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, future = job
            if not future.set_running_or_notify_cancel():
                continue
            if broken is not None:
                future.set_exception(broken)
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
                future.set_exception(exc)

    def call(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on the worker thread; returns its future."""
        if self._thread is None:
            raise RuntimeError("the compute worker is not started")
        future: Future[T] = Future()
        self._jobs.put((fn, args, future))
        return future

    def submit(self, requests: list[PreparedRequest], deadline: float | None = None) -> Future[BatchOutput]:
        """Queue one pooled batch (same pool key); the future gives :meth:`run`'s result.

        ``deadline``: ``time.monotonic()`` seconds after which the batch is not worth computing (the latest of its
        requests' deadlines; None: always compute). A batch whose deadline passed while it waited behind others
        fails with :class:`~lutb_server.errors.DeadlineExpired` instead of running.
        """
        if deadline is None:
            return self.call(self.run, requests)
        return self.call(self._run_before, deadline, requests)

    def _run_before(self, deadline: float, requests: list[PreparedRequest]) -> BatchOutput:
        if time.monotonic() >= deadline:
            raise DeadlineExpired(EXPIRED_IN_WORKER)
        return self.run(requests)

    # -- graphs ------------------------------------------------------------------------------

    @property
    def graph_layers(self) -> list[int]:
        """Layers whose experts run through CUDA graphs."""
        return [layer for layer, e in (self._experts or {}).items() if isinstance(e, CudaGraphExperts)]

    def capture_graphs(self) -> float:
        """Capture the start-up graphs of every graph layer (see the class docstring); returns the seconds taken.

        Call it on the worker thread (``worker.call(worker.capture_graphs)``) before serving.
        """
        layers = self.graph_layers
        if not layers or self.cuda_graph_top_k <= 0:
            return 0.0
        start = time.perf_counter()
        count = 0
        with torch.cuda.stream(self._stream):
            for layer in layers:
                experts = self._experts[layer]  # type: ignore[index]
                assert isinstance(experts, CudaGraphExperts)
                count += experts.capture(self.cuda_graph_top_k, mxfp8_input=True)
        seconds = time.perf_counter() - start
        buckets = self._experts[layers[0]].buckets  # type: ignore[index,union-attr]
        log.info("captured %d CUDA graph(s) in %.2fs: %d layer(s) x buckets %s, top-k %d, combined output, and the "
                 "buckets' dequantization of MXFP8 input", count, seconds, len(layers), list(buckets), self.cuda_graph_top_k)
        return seconds

    def warm_up(self, max_tokens: int) -> float:
        """Run one batch per eager kernel configuration so Triton compiles them all before serving.

        Batches above the CUDA graphs and their chunks (``CudaGraphExperts.eager_above``) run eagerly,
        and the experts pick their routing
        block and GEMM configs (each a kernel specialisation) from the batch size; a
        configuration first met under load would stall that batch for the seconds a compile
        takes. This runs one layer (all layers share shapes, hence kernels) at every power of two
        from above ``eager_above`` up to ``max_tokens``, and at the smallest size of every
        other launch key the experts report (``launch_key``; powers of two miss those whose
        config changes inside their range, e.g. split-K or MXFP8 rows per program), with uniform random routing at
        ``cuda_graph_top_k`` (8 when 0) over all the model's experts, as clients route; and the dequantization of
        MXFP8 input carried to the device once. Call it on the worker thread before serving; returns the seconds taken.
        """
        if not self.cuda or not self._experts:
            return 0.0
        experts = next(iter(self._experts.values()))
        eager_above = experts.eager_above if isinstance(experts, CudaGraphExperts) else 0
        inner = experts.inner if isinstance(experts, CudaGraphExperts) else experts
        num_experts = inner.config.num_experts
        k = min(self.cuda_graph_top_k or 8, num_experts)
        sizes = warm_up_sizes(eager_above, max_tokens, getattr(inner, "launch_key", None), k)
        gen = torch.Generator(device=self.device).manual_seed(0)
        start = time.perf_counter()
        with torch.cuda.stream(self._stream):
            hidden = inner.config.hidden_size  # MXFP8 input's dequantization: one kernel for every batch size
            self._dequantize(torch.zeros(1, hidden, dtype=torch.float8_e4m3fn, device=self.device),
                             torch.zeros(1, hidden // BLOCK, dtype=torch.uint8, device=self.device),
                             torch.empty(1, hidden, dtype=inner.config.torch_dtype, device=self.device))
            for tokens in sizes:
                x = torch.randn(tokens, inner.config.hidden_size, device=self.device, generator=gen).to(inner.config.torch_dtype)
                ids = torch.rand(tokens, num_experts, device=self.device, generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
                weights = torch.full((tokens, k), 1.0 / k, device=self.device)
                inner.forward(x, ids, weights)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        log.info("warmed up eager batch sizes %s (top-k %d) and MXFP8 input's dequantization in %.2fs", sizes, k, seconds)
        return seconds

    # -- one batch ---------------------------------------------------------------------------

    def run(self, requests: list[PreparedRequest], into: Sequence[torch.Tensor | None] | None = None, *,
            overlap: Callable[[], None] | None = None) -> BatchOutput:
        """One experts call over ``requests`` (same pool key), outputs split back per request.

        Args:
            requests: the batch, same pool key.
            into: per request, where to write its output (a CPU tensor of exactly its ``output_shape`` and the
                model dtype, e.g. a view of shared memory; that tensor is then its entry in
                ``BatchOutput.outputs``), or None for a tensor of its own. None: every output its own tensor.
                On a CUDA device an output is copied once: by the device's copy engine when its destination
                lies in memory given to :meth:`register_host_memory`, else from the pinned staging straight into
                its destination (a compute process answers either way without a second copy).
            overlap: called once while the call's device work runs (after it is queued, before the wait for it;
                off CUDA before the call), e.g. a compute process reading the next batches meanwhile.

        Blocking; runs on the worker thread via :meth:`submit`, or on any single thread
        that owns the worker (tests, ``bench/serving.py``'s in-process baseline).

        Raises:
            ValueError: ``into`` does not have one entry per request, or a destination's shape or dtype
                differs from its output's (checked before the experts run).
        """
        began = time.monotonic()
        if into is not None:
            _check_destinations(requests, into)
        path = "eager"
        if self.cuda and self._experts is not None:
            outputs, path = self._run_cuda(requests, into, overlap)
        else:
            if overlap is not None:
                overlap()
            if self._experts is None:
                outputs = _deliver(_generic_forward(self.engine, requests), requests, into, owned=True)
            else:
                outputs = self._run_cpu(requests, into)
        self.batches += 1
        return BatchOutput(outputs, time.monotonic() - began, sum(r.tokens for r in requests), path, began)

    def register_host_memory(self, memory: torch.Tensor) -> bool:
        """Page-lock ``memory`` for the device's copy engine, so that :meth:`run` writes the outputs whose
        destination lies inside it straight from the device (``cudaHostRegister``; no pinned staging, no CPU copy).

        Args:
            memory: a contiguous CPU tensor (a compute process passes each serving process's shared arena,
                ``SharedArena.memory``); every page of it becomes resident and stays so until
                :meth:`unregister_host_memory`.

        Returns:
            True when registered (or already), False off CUDA, for an empty tensor, or when the driver refuses;
            outputs into it then go through the pinned staging as before.
        """
        start, nbytes = memory.data_ptr(), memory.numel() * memory.element_size()
        if not self.cuda or nbytes == 0 or memory.device.type != "cpu" or not memory.is_contiguous():
            return False
        if start in self._registered:
            return True
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device):
            err = int(cudart.cudaHostRegister(start, nbytes, 0))
            if err != 0:
                if hasattr(cudart, "cudaGetLastError"):
                    cudart.cudaGetLastError()  # clear it: the runtime's sticky last error would surface in a later call
                log.warning("cannot page-lock %.1f MB of host memory for device copies (cudaError %d); "
                            "its outputs go through the pinned staging", nbytes / 1e6, err)
                return False
        self._registered[start] = start + nbytes
        return True

    def unregister_host_memory(self, memory: torch.Tensor) -> None:
        """Undo :meth:`register_host_memory` (no-op for memory not registered); call it before ``memory`` is freed."""
        start = memory.data_ptr()
        if self._registered.pop(start, None) is not None:
            with torch.cuda.device(self.device):
                err = int(torch.cuda.cudart().cudaHostUnregister(start))
            if err != 0:
                log.warning("cudaHostUnregister failed (cudaError %d)", err)

    def _in_registered(self, t: object) -> bool:
        """Whether ``t`` is a contiguous CPU tensor lying wholly inside memory given to :meth:`register_host_memory`
        (a compute process's views of its serving processes' arenas): the device's copy engine reads and writes it
        there."""
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            return False
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        return any(a <= start and end <= b for a, b in self._registered.items())

    def _by_dma(self, into: Sequence[torch.Tensor | None] | None) -> list[bool] | None:
        """Per destination, whether it lies inside registered memory (the device writes it); None when none does."""
        if into is None or not self._registered:
            return None
        direct = [self._in_registered(dest) for dest in into]
        return direct if any(direct) else None

    def _registered_sources(self, requests: list[PreparedRequest]) -> bool:
        """Whether every request's ``x`` lies in registered memory (:meth:`_in_registered`), so that the device copies
        it from there: no gathering into the pinned staging first."""
        return bool(self._registered) and all(self._in_registered(r.x) for r in requests)

    def _gather(self, requests: list[PreparedRequest], buffers: _Buffers, *, with_x: bool = True
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The batch's ``x`` (None without ``with_x``), ``topk_ids``, ``topk_weights`` and (MXFP8 carried to the
        device) ``x_scales``, concatenated into ``buffers``."""
        first = requests[0]
        tokens = sum(r.tokens for r in requests)
        k = int(first.topk_ids.shape[1])
        ids = buffers.fill("ids", (tokens, k), torch.int32, [r.topk_ids for r in requests])
        w = buffers.fill("w", (tokens, k), torch.float32, [r.topk_weights for r in requests])
        x = buffers.fill("x", (tokens, first.x.shape[1]), first.x.dtype, [r.x for r in requests]) if with_x else None
        scales = None
        if first.x_scales is not None:
            scales = buffers.fill("xs", (tokens, first.x_scales.shape[1]), torch.uint8, [r.x_scales for r in requests])
        return x, ids, w, scales

    def _run_cpu(self, requests: list[PreparedRequest], into: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor]:
        first = requests[0]
        experts = self._experts[first.layer]  # type: ignore[index]
        if len(requests) == 1:  # nothing to pool: the request's own tensors
            x, ids, w = first.dense_x(), as_tensor(first.topk_ids), as_tensor(first.topk_weights)
        else:
            x, ids, w, scales = self._gather(requests, self._host)
            if scales is not None:
                x = mxfp8_dequantize_fast(x, scales, first.dtype)
        out = experts.forward(x, ids, w, apply_router_weight_on_input=first.apply_router_weight_on_input,
                              output_mode=first.output_mode)
        return _deliver(out, requests, into, owned=True)

    def _run_cuda(self, requests: list[PreparedRequest], into: Sequence[torch.Tensor | None] | None,
                  overlap: Callable[[], None] | None = None) -> tuple[list[torch.Tensor], str]:
        """The batch on the device: its per-request outputs, and how the experts ran it (``BatchOutput.path``)."""
        first = requests[0]
        experts = self._experts[first.layer]  # type: ignore[index]
        on_input, mode = first.apply_router_weight_on_input, first.output_mode
        unchecked = callable(getattr(experts, "forward_unchecked", None))
        with torch.cuda.stream(self._stream):
            # x already in page-locked shared memory (a compute process's arenas) goes to the device from there
            x_direct = self._registered_sources(requests)
            xh, idsh, wh, sh = self._gather(requests, self._host, with_x=not x_direct)
            tokens, k = idsh.shape
            x_shape, x_dtype = (tokens, int(first.x.shape[1])), first.x.dtype
            mxfp8 = sh is not None  # MXFP8 as sent: half the bytes to copy, dequantized on the device
            graphs = experts if isinstance(experts, CudaGraphExperts) else None
            inputs, path = None, "eager"
            if graphs is not None:
                path = graphs.path_for(tokens, k, on_input, mode)
                if path == "graph":  # written straight into the graph's static inputs
                    inputs = graphs.static_inputs(tokens, k, apply_router_weight_on_input=on_input, output_mode=mode,
                                                  mxfp8_input=mxfp8)
            if inputs is None:
                inputs = GraphInputs(self._dev.get("xq" if mxfp8 else "x", x_shape, x_dtype),
                                     self._dev.get("ids", idsh.shape, torch.int32), self._dev.get("w", wh.shape, torch.float32),
                                     self._dev.get("xs", sh.shape, torch.uint8) if sh is not None else None)
            for host, device in zip((xh, idsh, wh, sh), inputs):
                if host is not None:
                    device.copy_(host, non_blocking=True)
            if x_direct:  # one copy per request, each from its own place in shared memory
                row = 0
                for r in requests:
                    inputs.x[row:row + r.tokens].copy_(r.x, non_blocking=True)
                    row += r.tokens
            xd, idsd, wd, xsd = inputs
            if xsd is not None and graphs is None:  # a backend without graphs takes the model dtype: dequantize first
                xd = self._dequantize(xd, xsd, self._dev.get("x", x_shape, first.dtype))
                xsd = None
            if unchecked:
                flag, flag_h, flag_np = self._nonfinite_flag()
                # MXFP8 input: the graphs dequantize it (their rows' graph, or before an eager call)
                scales = {} if xsd is None else {"x_scales": xsd}
                out = experts.forward_unchecked(  # type: ignore[attr-defined]
                    xd, idsd, wd, apply_router_weight_on_input=on_input, output_mode=mode, nonfinite=flag, **scales)
            else:
                out = experts.forward(xd, idsd, wd, apply_router_weight_on_input=on_input, output_mode=mode)
            direct = self._by_dma(into)
            if direct is not None:  # registered destinations: the copy engine writes them
                for part, dest, dma in zip(_split(out, requests), into, direct):  # type: ignore[arg-type]
                    if dma:
                        dest.copy_(part, non_blocking=True)
            out_h = None
            if direct is None or not all(direct):
                out_h = self._host.get("out", out.shape, out.dtype)
                out_h.copy_(out, non_blocking=True)
            if unchecked:
                flag_h.copy_(flag, non_blocking=True)
            if overlap is not None:  # while the device works
                overlap()
            self._stream.synchronize()
            if unchecked and flag_np[0]:
                flag.zero_()  # on the worker's stream, ahead of the next batch; only a batch that set the flag pays for this
                if tokens:
                    raise NonFiniteInputError(NONFINITE_MESSAGE)
        if out_h is None:
            return list(into), path  # type: ignore[arg-type]
        return _deliver(out_h, requests, into, owned=False, written=direct), path  # the pinned buffer is reused

    def _nonfinite_flag(self) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The device NaN/Inf flag (zero between batches), its pinned host copy, and a numpy view of that copy
        (read without a torch call)."""
        if self._flag is None:
            flag = torch.zeros(1, dtype=torch.int32, device=self.device)
            flag_h = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            self._flag = (flag, flag_h, flag_h.numpy())
        return self._flag

    @property
    def staging_bytes(self) -> dict[str, int]:
        """Bytes held by the host and device staging buffers."""
        return {"host": self._host.nbytes, "device": self._dev.nbytes}


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (up to 15 bytes) in the operating system too (Linux ``PR_SET_NAME``; elsewhere
    nothing), so that ``top -H``, ``/proc/<pid>/task/<tid>/comm`` and the benchmarks' per-thread CPU figures tell it
    from the other threads, which Python before 3.14 leaves all named after the process."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_name = 15
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15])


def warm_up_sizes(above: int, limit: int, launch_key: Callable[[int, int], Hashable] | None, top_k: int) -> list[int]:
    """Batch sizes in ``(above, limit]`` that :meth:`ComputeWorker.warm_up` runs, ascending: every power
    of two and ``limit``, then, for each ``launch_key(tokens, top_k)`` none of those has, its smallest size."""
    sizes = [t for t in _powers_of_two_upto(limit) if t > above]
    if launch_key is None or not sizes:
        return sizes
    seen = {launch_key(t, top_k) for t in sizes}
    for tokens in range(above + 1, limit + 1):
        key = launch_key(tokens, top_k)
        if key not in seen:
            seen.add(key)
            sizes.append(tokens)
    return sorted(sizes)


def _powers_of_two_upto(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``, and ``limit`` itself when it is not a power of two."""
    sizes, t = [], 1
    while t < limit:
        sizes.append(t)
        t *= 2
    return sizes + [limit] if limit >= 1 else sizes


def concat_into(parts: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``parts`` concatenated along dim 0 into ``out`` (a copy when there is one part); returns ``out``."""
    if len(parts) == 1:
        out.copy_(parts[0])
    else:
        torch.cat(parts, out=out)  # type: ignore[arg-type]
    return out


def _split(out: torch.Tensor, requests: list[PreparedRequest]) -> list[torch.Tensor]:
    return list(torch.split(out, [r.tokens for r in requests])) if len(requests) > 1 else [out]


def _check_destinations(requests: list[PreparedRequest], into: Sequence[torch.Tensor | None]) -> None:
    """Refuse ``into`` unless it has one entry per request, each None or a tensor of that request's output shape and
    dtype (``copy_`` would broadcast a wrong shape silently)."""
    if len(into) != len(requests):
        raise ValueError(f"into: {len(into)} destinations for {len(requests)} requests")
    for i, (r, dest) in enumerate(zip(requests, into)):
        if dest is not None and (list(dest.shape) != r.output_shape or dest.dtype != r.dtype):
            raise ValueError(f"into[{i}]: {tuple(dest.shape)} {dest.dtype}, the output is {tuple(r.output_shape)} {r.dtype}")


def _deliver(out: torch.Tensor, requests: list[PreparedRequest], into: Sequence[torch.Tensor | None] | None, *,
             owned: bool, written: Sequence[bool] | None = None) -> list[torch.Tensor]:
    """The batch's output ``out`` split per request: copied into ``into[i]`` where given (unless ``written[i]``:
    it holds the output already), elsewhere a view of ``out`` when ``owned`` (memory of its own), else a copy (one
    for the whole batch when nothing has a destination)."""
    if into is None or all(dest is None for dest in into):
        return _split(out if owned else out.clone(), requests)
    outputs = []
    for i, (part, dest) in enumerate(zip(_split(out, requests), into)):
        if dest is None:
            outputs.append(part if owned else part.clone())
        else:
            if written is None or not written[i]:
                dest.copy_(part)
            outputs.append(dest)
    return outputs


def _generic_forward(engine: ForwardEngine, requests: list[PreparedRequest]) -> torch.Tensor:
    """An engine without ``layer_experts``: the batch's output (its requests concatenated, ``engine.forward``)."""
    first = requests[0]
    if len(requests) == 1:
        x, ids, w = first.dense_x(), as_tensor(first.topk_ids), as_tensor(first.topk_weights)
    else:
        x = torch.cat([r.dense_x() for r in requests])
        ids = torch.cat([as_tensor(r.topk_ids) for r in requests])
        w = torch.cat([as_tensor(r.topk_weights) for r in requests])
    out = engine.forward(first.layer, x, ids, w, apply_router_weight_on_input=first.apply_router_weight_on_input,
                         output_mode=first.output_mode)
    return out


__all__ = ["BATCH_PATHS", "BatchOutput", "BatchWorker", "ComputeWorker", "ForwardEngine", "concat_into", "name_os_thread",
           "running_loop", "warm_up_sizes"]
