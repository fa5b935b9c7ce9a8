"""CUDA graphs for decode-sized batches: pad a routed batch to a token bucket and replay.

A decode step sends a few tokens; launching the experts' ~10 kernels one by one costs
more CPU time than the GPU spends on them. :class:`CudaGraphExperts` wraps any
capture-safe backend (``LayerExperts.capture_safe``; its ``forward_unchecked`` does no
host sync) and keeps, per *variant* ``(bucket, top_k, apply_router_weight_on_input,
output_mode)``, one captured graph of ``forward_unchecked`` on static input rows, one set per
``(bucket, top_k)``, into a static output, one per bucket for ``combined`` output (route-major
outputs are the graph's own). The wrappers given one :class:`StaticBuffers` share those rows and
outputs: a worker's layers, whose graphs replay one at a time. A batch of ``T`` tokens runs the graph of the smallest
bucket ``B >= T`` (buckets: powers of two up to ``max_tokens``, and ``max_tokens``
itself): rows ``T..B-1`` are *padding* (hidden state 0, router weight 0, every route
:data:`PAD_ROUTE`) and the output is sliced to ``T`` rows. A batch above
the largest bucket runs in *chunks*, up to ``max_chunked_tokens`` tokens (by default
:data:`CHUNK_FACTOR` times the largest bucket): consecutive replays of the largest bucket's
graph and one smaller for the rest, their outputs copied into one tensor, all on the stream
without a host sync. Larger batches run the wrapped backend eagerly.

Why chunks: an eager call launches ~10 Triton kernels and, above 16384 routes (4096 before 2026-12-05),
~25 torch ops for the routing. On the H200 qwen3 batches of 528-1024 tokens took 2.6-6.0 ms eagerly against
~1 ms for 480 tokens in a graph, the eager time barely growing from 640 to 1024 tokens as a
launch-bound call's does, and eager caught up with 512-token graphs per token only at ~8192
tokens (bench/results/2026-12-04-eager-compiles-h200.md, 2026-12-04-worker-calls-h200.md).

MXFP8 input. A batch may come as MXFP8 (``x`` float8_e4m3fn codes, ``x_scales`` uint8 E8M0 bytes, what a client
sent on the wire): it lands in two more static rows of its shape, the codes and the scales, and a small graph of
those rows (one per set of rows, so shared by every layer, like the rows) dequantizes them into the ``x`` rows
before the model-dtype graph replays. A batch of MXFP8 input thus crosses to the device at half the bytes and costs
the thread that feeds the GPU one replay more than a model-dtype batch, not a dequantization's launches; and the
layers keep one graph per variant and bucket whichever input comes. Padding rows of codes and scales are zero,
which dequantizes to ``x = 0``.

Padding never changes a real row: a capture-safe backend computes each token from its
own row and routes only. Nor does it cost GEMM work: a padding route's id, :data:`PAD_ROUTE` (-1), is no expert,
so the routing gives it no rows (``LayerExperts.capture_safe``). Until 2026-12-06 a layer holding every expert
padded with its first expert instead, whose rows then came to the bucket's unused tokens times top-k: a qwen3 batch
of 272 tokens, in the 512-token graph, ran 1920 padding rows through that expert.

Which graphs exist: :meth:`CudaGraphExperts.capture` captures one variant for every
bucket at start-up (the server captures ``combined`` output, weights on the output, its
configured top-k); any other variant is captured the first time a batch needs it (one
capture per bucket, a few milliseconds), up to ``max_variants`` variants per layer,
beyond which such batches run eagerly.

On a CPU device (or with ``use_graphs=False``) the same buffers and padding run without
capturing: each "replay" calls ``forward_unchecked`` on the static buffers. The CPU tests
use that to check the padding logic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from lutb_kernels.checkpoint import CheckpointConfig
from lutb_kernels.errors import NonFiniteInputError
from lutb_kernels.experts.base import LayerExperts, Support
from lutb_kernels.mxfp8 import BLOCK
from lutb_kernels.mxfp8_triton import NONFINITE_MESSAGE, dequantize_into_op
from lutb_kernels.reference import OutputMode

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 512
"""Largest token bucket captured by default (``--cuda-graph-max-tokens``)."""
DEFAULT_MAX_VARIANTS = 8
"""Most (top_k, weighting, output mode) variants one layer captures graphs for."""
CHUNK_FACTOR = 8
"""Batches of up to this many times the largest bucket run as chunks of graph replays (see the module docstring)."""
PAD_ROUTE = -1
"""The expert id of every route of a padding row: no expert, so it gets no GEMM rows and adds nothing."""


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token buckets up to ``max_tokens``: 1, 2, 4, ... (powers of two), plus ``max_tokens`` itself; () for 0."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    buckets = []
    b = 1
    while b <= max_tokens:
        buckets.append(b)
        b *= 2
    if max_tokens and buckets[-1] != max_tokens:
        buckets.append(max_tokens)
    return tuple(buckets)


def bucket_for(tokens: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``tokens`` tokens; None for 0 tokens or more than the largest bucket."""
    if tokens <= 0:
        return None
    for b in buckets:
        if b >= tokens:
            return b
    return None


def is_capture_safe(experts: LayerExperts) -> bool:
    """Does ``experts`` declare a CUDA-graph-capturable ``forward_unchecked``?"""
    return bool(getattr(type(experts), "capture_safe", False)) and callable(getattr(experts, "forward_unchecked", None))


@dataclass(frozen=True)
class GraphKey:
    """One captured graph: batch bucket and the forward's static arguments."""

    bucket: int
    top_k: int
    apply_router_weight_on_input: bool
    output_mode: str

    @property
    def variant(self) -> tuple[int, bool, str]:
        return (self.top_k, self.apply_router_weight_on_input, self.output_mode)


class GraphInputs(NamedTuple):
    """Where a graph-sized batch's inputs go (:meth:`CudaGraphExperts.static_inputs`): views of its first ``T``
    static rows."""

    x: torch.Tensor
    """``[T, H]``: the model dtype, or float8_e4m3fn codes for MXFP8 input."""
    topk_ids: torch.Tensor
    """int32 ``[T, k]``."""
    topk_weights: torch.Tensor
    """float32 ``[T, k]``."""
    x_scales: torch.Tensor | None = None
    """uint8 ``[T, H/32]`` E8M0 scales of MXFP8 input; None for input in the model dtype."""


class _InputRows:
    """The static input rows of the graphs of one ``(bucket, top_k)`` shape: ``x [B, H]``, ``ids [B, k]``, ``w [B, k]``,
    and for MXFP8 input (made on first use) its codes ``xq [B, H]`` and scales ``xs [B, H/32]``, which
    :meth:`dequantize` turns into ``x``."""

    def __init__(self, bucket: int, top_k: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        self.x = torch.zeros((bucket, hidden), dtype=dtype, device=device)
        self.ids = torch.full((bucket, top_k), PAD_ROUTE, dtype=torch.int32, device=device)
        self.w = torch.zeros((bucket, top_k), dtype=torch.float32, device=device)
        self._codes: torch.Tensor | None = None  # uint8 [B, H]: xq's bytes (zeroed as bytes)
        self.xq: torch.Tensor | None = None
        self.xs: torch.Tensor | None = None
        self.dequantize_graph: Any = None  # torch.cuda.CUDAGraph of xq, xs -> x, once captured
        self.dequantized = 0  # times :meth:`dequantize` ran (replays, or calls without graphs)
        self.real_rows = 0  # rows [0, real_rows) may hold a previous batch's data; the rest hold padding
        self._views: dict[tuple[int, bool], GraphInputs] = {}

    @property
    def nbytes(self) -> int:
        scaled = 0 if self.xq is None or self.xs is None else self.xq.nbytes + self.xs.nbytes
        return self.x.nbytes + self.ids.nbytes + self.w.nbytes + scaled

    def mxfp8_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(xq, xs)``, made (all padding) on first use."""
        if self.xq is None or self.xs is None:
            bucket, hidden = self.x.shape
            self._codes = torch.zeros((bucket, hidden), dtype=torch.uint8, device=self.x.device)
            self.xq = self._codes.view(torch.float8_e4m3fn)
            self.xs = torch.zeros((bucket, hidden // BLOCK), dtype=torch.uint8, device=self.x.device)
        return self.xq, self.xs

    def dequantize(self, op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], *, use_graphs: bool,
                   pool: Any) -> None:
        """Every row's MXFP8 codes and scales into ``x`` (padding rows give zeros) with ``op``
        (``lutb_kernels.mxfp8_triton.dequantize_into_op``): with ``use_graphs``, a replay of these rows' own graph,
        captured into ``pool`` on first use; else ``op`` called directly."""
        xq, xs = self.mxfp8_rows()
        self.dequantized += 1
        if not use_graphs:
            op(xq, xs, self.x)
            return
        if self.dequantize_graph is None:
            current = torch.cuda.current_stream(self.x.device)
            side = torch.cuda.Stream(self.x.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):  # compile outside the capture
                op(xq, xs, self.x)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                op(xq, xs, self.x)
            torch.cuda.synchronize(self.x.device)
            self.dequantize_graph = graph
        self.dequantize_graph.replay()

    def inputs(self, tokens: int, mxfp8_input: bool = False) -> GraphInputs:
        """Views of the first ``tokens`` rows (``x`` the codes for MXFP8 input), made once per size (each torch call on
        a serving thread may cost a GIL hand-over)."""
        views = self._views.get((tokens, mxfp8_input))
        if views is None:
            if mxfp8_input:
                xq, xs = self.mxfp8_rows()
                views = GraphInputs(xq[:tokens], self.ids[:tokens], self.w[:tokens], xs[:tokens])
            else:
                views = GraphInputs(self.x[:tokens], self.ids[:tokens], self.w[:tokens])
            self._views[(tokens, mxfp8_input)] = views
        return views

    def reset_padding(self, tokens: int) -> None:
        """Make rows ``tokens..`` padding again (only those a previous, larger batch wrote), in every row set."""
        if self.real_rows > tokens:
            self.x[tokens:self.real_rows].zero_()
            self.ids[tokens:self.real_rows].fill_(PAD_ROUTE)
            self.w[tokens:self.real_rows].zero_()
            if self._codes is not None and self.xs is not None:
                self._codes[tokens:self.real_rows].zero_()
                self.xs[tokens:self.real_rows].zero_()
        self.real_rows = tokens


class StaticBuffers:
    """Static input rows and ``combined`` outputs of CUDA graphs, one set per shape, shared by the
    :class:`CudaGraphExperts` given the same instance: the layers of one worker, whose graphs replay one at a
    time on one stream (a batch's inputs are written, replayed, and its output copied out, before the next
    batch's inputs are written).

    For a model of L layers this saves ``L - 1`` copies of every bucket's rows and outputs; what stays is
    one set (``deploy/sizing.py`` counts it). Route-major outputs (``[B, k, H]``) are not shared.
    """

    def __init__(self) -> None:
        self._rows: dict[tuple[int, int, int, torch.dtype, str], _InputRows] = {}
        self._outputs: dict[tuple[int, int, torch.dtype, str], torch.Tensor] = {}

    def rows(self, bucket: int, top_k: int, hidden: int, dtype: torch.dtype, device: torch.device) -> _InputRows:
        """The rows of this shape (made on first use)."""
        key = (bucket, top_k, hidden, dtype, str(device))
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = _InputRows(bucket, top_k, hidden, dtype, device)
        return rows

    def output(self, bucket: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The ``[bucket, hidden]`` combined output the graphs of this bucket write (made on first use)."""
        key = (bucket, hidden, dtype, str(device))
        out = self._outputs.get(key)
        if out is None:
            out = self._outputs[key] = torch.zeros((bucket, hidden), dtype=dtype, device=device)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every set of rows and every output made so far."""
        return sum(r.nbytes for r in self._rows.values()) + sum(o.nbytes for o in self._outputs.values())


class _Entry:
    """The graph of one :class:`GraphKey`: its input rows and (combined) output (maybe shared, :class:`StaticBuffers`),
    NaN flag, and the output it returns (``out_buffer``, or its own for route-major)."""

    def __init__(self, key: GraphKey, rows: _InputRows, out_buffer: torch.Tensor | None, device: torch.device) -> None:
        self.key = key
        self.rows = rows
        self.out_buffer = out_buffer
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.out: torch.Tensor | None = None
        self.graph: Any = None  # torch.cuda.CUDAGraph once captured
        self.prepared = False
        self.replays = 0
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def x(self) -> torch.Tensor:
        return self.rows.x

    @property
    def ids(self) -> torch.Tensor:
        return self.rows.ids

    @property
    def w(self) -> torch.Tensor:
        return self.rows.w

    def inputs(self, tokens: int, mxfp8_input: bool = False) -> GraphInputs:
        return self.rows.inputs(tokens, mxfp8_input)

    def reset_padding(self, tokens: int) -> None:
        self.rows.reset_padding(tokens)

    def output(self, tokens: int) -> torch.Tensor:
        """The first ``tokens`` rows of the static output (graph captured), made once per size."""
        view = self._outputs.get(tokens)
        if view is None:
            assert self.out is not None
            view = self._outputs[tokens] = self.out[:tokens]
        return view


class CudaGraphExperts(LayerExperts):
    """A capture-safe ``LayerExperts`` run through per-bucket CUDA graphs (see the module docstring).

    Args:
        inner: the backend to wrap; ``is_capture_safe(inner)`` must hold.
        max_tokens: largest bucket (0: no buckets, everything eager).
        use_graphs: capture and replay CUDA graphs; default: ``inner`` is on a CUDA device.
            False keeps the buffers and padding but calls ``forward_unchecked`` each time.
        pool: a ``torch.cuda.graph_pool_handle()`` shared by the graphs (several wrappers may
            share one: graphs are replayed one at a time on one stream); a new one if None.
        max_variants: most distinct (top_k, weighting, output mode) variants captured.
        max_chunked_tokens: largest batch run as chunks of graph replays (None: ``CHUNK_FACTOR``
            times the largest bucket; 0, or at most the largest bucket: never); larger ones run eagerly.
        buffers: the graphs' input rows and combined outputs, shared by the wrappers given the same
            :class:`StaticBuffers` (replayed one at a time on one stream, like ``pool``); private ones if None.

    ``forward_unchecked`` returns a view of a static output buffer (a graph-sized batch) or a new
    tensor (chunks, eager): read (copy) it before the next call on this wrapper or on any wrapper
    sharing its ``buffers``. ``forward`` validates and returns a copy.
    """

    capture_safe: ClassVar[bool] = False  # it replays graphs; it is not itself capturable

    def __init__(
        self,
        inner: LayerExperts,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        use_graphs: bool | None = None,
        pool: Any = None,
        max_variants: int = DEFAULT_MAX_VARIANTS,
        max_chunked_tokens: int | None = None,
        buffers: StaticBuffers | None = None,
    ) -> None:
        if not is_capture_safe(inner):
            raise ValueError(f"{type(inner).__name__} is not capture-safe (capture_safe is False or it has no forward_unchecked)")
        # No LayerExperts.__init__: the wrapper shares the inner backend's state.
        self.inner = inner
        self.config: CheckpointConfig = inner.config
        self.device = inner.device
        self.expert_ids = inner.expert_ids
        self.num_local_experts = inner.num_local_experts
        self.name = inner.name  # type: ignore[misc]
        self.buckets = token_buckets(max_tokens)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the experts are on {self.device}")
        self._pool = pool if pool is not None or not self.use_graphs else torch.cuda.graph_pool_handle()
        self.max_variants = max_variants
        if max_chunked_tokens is not None and max_chunked_tokens < 0:
            raise ValueError(f"max_chunked_tokens must be >= 0 or None, got {max_chunked_tokens}")
        largest = self.buckets[-1] if self.buckets else 0
        # Chunks replay the largest bucket's graph: without buckets there are none, whatever the limit says.
        self.max_chunked_tokens = 0 if not largest else CHUNK_FACTOR * largest if max_chunked_tokens is None else max_chunked_tokens
        self._buffers = StaticBuffers() if buffers is None else buffers
        self._entries: dict[GraphKey, _Entry] = {}
        self._variants: set[tuple[int, bool, str]] = set()
        self._dequantize = dequantize_into_op(self.device)  # MXFP8 input: the rows' dequantization graphs, or eagerly
        self.capture_seconds = 0.0

    # -- LayerExperts ------------------------------------------------------------------------

    @classmethod
    def supports(cls, config: CheckpointConfig, device: torch.device) -> Support:
        return Support(False, "CudaGraphExperts wraps a loaded backend; it is not a backend of its own")

    @property
    def weight_bytes(self) -> int:
        return self.inner.weight_bytes

    @property
    def eager_above(self) -> int:
        """Batches of more tokens than this run the wrapped backend eagerly (the largest bucket, or the chunk limit)."""
        return max(self.buckets[-1] if self.buckets else 0, self.max_chunked_tokens)

    @property
    def graphs(self) -> dict[GraphKey, bool]:
        """Every variant with buffers, and whether its graph is captured."""
        return {key: entry.graph is not None for key, entry in self._entries.items()}

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: OutputMode = "combined",
    ) -> torch.Tensor:
        """Validate (host syncs), run :meth:`forward_unchecked`, refuse NaN/Inf; returns a new tensor.

        Raises:
            ValueError: what every backend's ``forward`` refuses (``LayerExperts._check_inputs``).
        """
        self._check_inputs(x, topk_ids, topk_weights, apply_router_weight_on_input, output_mode)
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        out = self.forward_unchecked(x, topk_ids, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input,
                                     output_mode=output_mode, nonfinite=flag)
        if x.shape[0] and bool(flag.item()):
            raise NonFiniteInputError(NONFINITE_MESSAGE)
        return out.clone()

    # -- graphs ------------------------------------------------------------------------------

    def key_for(self, tokens: int, top_k: int, apply_router_weight_on_input: bool, output_mode: str) -> GraphKey | None:
        """The graph a batch runs in, or None when it runs eagerly (0 tokens, above the largest bucket, too many variants)."""
        bucket = bucket_for(tokens, self.buckets)
        if bucket is None:
            return None
        variant = (int(top_k), bool(apply_router_weight_on_input), str(output_mode))
        if variant not in self._variants and len(self._variants) >= self.max_variants:
            return None
        return GraphKey(bucket, *variant)

    def path_for(self, tokens: int, top_k: int, apply_router_weight_on_input: bool, output_mode: str) -> str:
        """How :meth:`forward_unchecked` runs such a batch: ``"graph"`` (one replay; MXFP8 input: after its rows'
        dequantization), ``"chunks"`` (replays of the largest bucket's graph and one smaller) or ``"eager"`` (the
        wrapped backend: 0 tokens, above ``eager_above``, or a variant beyond ``max_variants``). Sizes only;
        captures nothing."""
        return self._plan(tokens, top_k, apply_router_weight_on_input, output_mode)[0]

    def _plan(self, tokens: int, top_k: int, apply_router_weight_on_input: bool, output_mode: str) -> tuple[str, GraphKey | None]:
        """:meth:`path_for`, with the graph's key when the path is ``"graph"``."""
        key = self.key_for(tokens, top_k, apply_router_weight_on_input, output_mode)
        if key is not None:
            return "graph", key
        largest = self.buckets[-1] if self.buckets else 0
        if largest < tokens <= self.max_chunked_tokens and self.key_for(largest, top_k, apply_router_weight_on_input, output_mode):
            return "chunks", None
        return "eager", None

    def _entry(self, key: GraphKey) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            hidden, dtype = self.config.hidden_size, self.config.torch_dtype
            rows = self._buffers.rows(key.bucket, key.top_k, hidden, dtype, self.device)
            out = self._buffers.output(key.bucket, hidden, dtype, self.device) if key.output_mode == "combined" else None
            entry = _Entry(key, rows, out, self.device)
            self._entries[key] = entry
            self._variants.add(key.variant)
        if not entry.prepared:
            self._prepare(entry)
            entry.prepared = True
        return entry

    def _run_inner(self, entry: _Entry) -> torch.Tensor:
        key = entry.key
        return self.inner.forward_unchecked(  # type: ignore[attr-defined]
            entry.x, entry.ids, entry.w, apply_router_weight_on_input=key.apply_router_weight_on_input,
            output_mode=key.output_mode, nonfinite=entry.flag, out=entry.out_buffer,
        )

    def _prepare(self, entry: _Entry) -> None:
        """Capture ``entry``'s graph (CUDA); without graphs there is nothing to prepare."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        entry.reset_padding(0)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up: compile the kernels outside the capture
            for _ in range(2):
                self._run_inner(entry)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            entry.flag.zero_()
            out = self._run_inner(entry)
        torch.cuda.synchronize(self.device)
        entry.out, entry.graph = out, graph
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        log.debug("captured %s graph %s in %.1f ms", self.name, entry.key, seconds * 1e3)

    def capture(
        self,
        top_k: int,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: OutputMode = "combined",
        buckets: tuple[int, ...] | None = None,
        mxfp8_input: bool = False,
    ) -> int:
        """Capture (or, without graphs, prepare) the graphs of one variant for every bucket (or for the buckets of the
        sizes in ``buckets``; sizes no bucket holds are skipped), and with ``mxfp8_input`` the dequantization graphs of
        their rows (shared: those another layer captured count once); returns how many graphs were captured. Nothing
        when the variant is one beyond ``max_variants``."""
        done = 0
        for bucket in self.buckets if buckets is None else buckets:
            key = self.key_for(bucket, top_k, apply_router_weight_on_input, output_mode)
            if key is None:  # no bucket holds it (0 or above the largest), or a variant beyond max_variants
                continue
            if key not in self._entries:
                self._entry(key)
                done += 1
            rows = self._entries[key].rows
            if mxfp8_input:
                rows.mxfp8_rows()
                if self.use_graphs and rows.dequantize_graph is None:
                    rows.dequantize(self._dequantize, use_graphs=True, pool=self._pool)
                    done += 1
        return done

    def static_inputs(
        self, tokens: int, top_k: int, *, apply_router_weight_on_input: bool = False, output_mode: str = "combined",
        mxfp8_input: bool = False,
    ) -> GraphInputs | None:
        """Where to write a batch's inputs to skip a copy: views of the static rows of the graph that batch runs
        in (:class:`GraphInputs`: ``x [T, H]``, the codes for MXFP8 input, ``topk_ids`` int32 ``[T, k]``,
        ``topk_weights`` float32 ``[T, k]``, and for MXFP8 input ``x_scales`` uint8 ``[T, H/32]``), or None when it
        does not run in one graph (chunks, eager).

        Pass the views to :meth:`forward_unchecked` after filling them. Captures the graph if needed.
        """
        key = self.key_for(tokens, top_k, apply_router_weight_on_input, output_mode)
        if key is None:
            return None
        return self._entry(key).inputs(tokens, mxfp8_input)

    def forward_unchecked(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: OutputMode = "combined",
        nonfinite: torch.Tensor | None = None,
        x_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay the bucket's graph on the batch (in chunks above the largest bucket, or run eagerly);
        the caller vouches for the arguments.

        ``x_scales``: uint8 ``[T, H/32]`` E8M0 scales when ``x`` is MXFP8 input (float8_e4m3fn codes ``[T, H]``, no
        NaN codes, every scale at most ``lutb_kernels.mxfp8.FAST_DEQUANTIZE_MAX_SCALE``): it is dequantized to the
        model dtype by its rows' dequantization graph before each replay (eagerly before the backend's call above
        ``eager_above``), bit for bit ``lutb_kernels.mxfp8.mxfp8_dequantize``.

        Returns ``[T, H]`` (combined) or ``[T, k, H]`` (route-major) in the model dtype: a view of
        the static output when one graph ran, valid until the next call (of any wrapper sharing the
        ``buffers``). ``nonfinite``: as for the
        wrapped backend (set to 1 when an MXFP8 quantization met NaN/Inf).
        """
        tokens, top_k = topk_ids.shape
        mxfp8_input = x_scales is not None
        path, key = self._plan(tokens, top_k, apply_router_weight_on_input, output_mode)
        if key is not None:
            return self._replay(self._entry(key), x, topk_ids, topk_weights, nonfinite, x_scales)
        if path == "eager":
            if x_scales is not None:
                x = self._dequantize(x, x_scales, torch.empty(x.shape, dtype=self.config.torch_dtype, device=x.device))
            return self.inner.forward_unchecked(  # type: ignore[attr-defined]
                x, topk_ids, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input,
                output_mode=output_mode, nonfinite=nonfinite,
            )
        largest = self.buckets[-1]
        hidden = self.config.hidden_size
        out = torch.empty((tokens, top_k, hidden) if output_mode == "route_major" else (tokens, hidden),
                          dtype=self.config.torch_dtype if mxfp8_input else x.dtype, device=x.device)
        for start in range(0, tokens, largest):
            stop = min(start + largest, tokens)
            key = self.key_for(stop - start, top_k, apply_router_weight_on_input, output_mode)
            assert key is not None  # a bucket holds every chunk, and the variant is known (chunk_key)
            out[start:stop].copy_(self._replay(self._entry(key), x[start:stop], topk_ids[start:stop],
                                               topk_weights[start:stop], nonfinite,
                                               None if x_scales is None else x_scales[start:stop]))
        return out

    def _replay(self, entry: _Entry, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                nonfinite: torch.Tensor | None, x_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Run one graph-sized batch in ``entry``'s graph (MXFP8 input: after its rows' dequantization): a view of its
        static output (first ``T`` rows)."""
        tokens = topk_ids.shape[0]
        for src, dst in zip((x, topk_ids, topk_weights, x_scales), entry.inputs(tokens, x_scales is not None)):
            if src is not None and dst is not None and src.data_ptr() != dst.data_ptr():  # not written through static_inputs()
                dst.copy_(src, non_blocking=True)
        entry.reset_padding(tokens)
        if x_scales is not None:
            entry.rows.dequantize(self._dequantize, use_graphs=self.use_graphs, pool=self._pool)
        entry.replays += 1
        if entry.graph is None:
            entry.flag.zero_()
            entry.out = self._run_inner(entry)
            out = entry.out[:tokens]
        else:
            entry.graph.replay()
            out = entry.output(tokens)
        if nonfinite is not None:
            nonfinite.bitwise_or_(entry.flag)
        return out


__all__ = [
    "CHUNK_FACTOR",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_VARIANTS",
    "CudaGraphExperts",
    "GraphInputs",
    "GraphKey",
    "PAD_ROUTE",
    "StaticBuffers",
    "bucket_for",
    "is_capture_safe",
    "token_buckets",
]
