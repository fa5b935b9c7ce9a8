#!/usr/bin/env python
"""Serving benchmark: end-to-end latency and throughput of one expert server over loopback gRPC.

For each model shape (one MoE layer of random LUT-B tiles, or ``--layers`` of them, written once as a checkpoint),
wire format (``bf16``: hidden states in the model dtype; ``mxfp8``: quantized by the client),
tokens per request and concurrency, it measures, in one run and on one machine:

- **server**: ``lutb serve`` in its own process; closed-loop load (each of ``C`` concurrent
  callers sends its next unary ``Forward`` as soon as the last one returns) from separate
  load-generator processes (up to ``--load-procs``), so client Python never shares the
  server's GIL: p50/p99 latency, tokens/s, the batch sizes the server formed
  (``timing.batch_tokens``) and its compute time; with ``--compute-worker process``, also the compute process's
  experts calls and the shares of its loop's time (calls, answering, reading or waiting, other) over each cell, from
  the server's metrics (``server.compute_loop`` in serving.json);
- **in-process**: the same experts, loaded in this process with the same compute worker
  (staging buffers, CUDA graphs), called on batches of the formed size made of the same
  requests: what the GPU work costs without gRPC and asyncio. The formed size is the experts calls' mean size
  (the harmonic mean of ``timing.batch_tokens`` over requests: a call of s tokens answers s / T requests, so the
  plain median over requests leans to the larger calls, whose in-process rate is higher); the requests' median is
  measured and shown beside it (it was the baseline until 2026-12-07);
- **echo**: a bare grpc.aio echo service (generic handler, no proto) answering the same
  request and response sizes with the same API (unary, or one stream per caller) at the same
  concurrency, on ``--echo-procs`` processes sharing one port (default: as many as the server's
  ``--front-ends``): the transport floor, and at high concurrency the transport's own ceiling.

``--layers N`` (default 1): each shape's checkpoint holds N layers of their own random tiles, and the load spans
them as a deployment's does: each caller sends layer 0, 1, .., N-1, 0, .. in turn (an attention node's decode steps),
callers starting at different layers, so the server forms each batch (one layer's) from fewer than C callers. The
in-process baseline stays one layer (layer 0, from the single-layer checkpoint, whose tiles are layer 0's) at the
formed batch size. The server captures its CUDA graphs per layer at start-up, so start-up takes longer (the capture
about N times as long).

Targets (shown, not asserted): concurrency 1 and 16 tokens: server p50 <= in-process + echo
p50 + 150 us; concurrency 64: server tokens/s >= 80% of in-process tokens/s at the formed
batch size (the calls' mean); tokens/s grows with concurrency until the GPU is busy (the table says where).

    python bench/serving.py --out /tmp/serving                         # the device run (packed, cuda)
    python bench/serving.py --smoke --out /tmp/smoke                   # tiny CPU run, reference backend, < 60 s
    python bench/serving.py --out /tmp/s --shapes qwen3-30b-a3b --concurrency 1,64 --tokens 16 --profile

Writes ``serving.json`` (every number), ``serving.md`` (tables) and, with ``--profile``, the
server's top functions (py-spy when installed, else cProfile of its event-loop and compute
threads) under ``--out``, the server's and echo servers' logs under ``--out``/logs; prints the short table last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from repo_state import git_state  # bench/, on the path of a script run from it

SHAPES: dict[str, dict[str, int]] = {
    "qwen3-30b-a3b": {"experts": 128, "hidden": 2048, "intermediate": 768, "top_k": 8},
    "deepseek-v3": {"experts": 256, "hidden": 7168, "intermediate": 2048, "top_k": 8},
    "mixtral-8x7b": {"experts": 8, "hidden": 4096, "intermediate": 14336, "top_k": 2},
    "smoke": {"experts": 8, "hidden": 128, "intermediate": 128, "top_k": 2},
}
FORWARD_METHOD = "/lutb.v1.ExpertService/Forward"
FORWARD_STREAM_METHOD = "/lutb.v1.ExpertService/ForwardStream"
# the response Timing fields (lutb.v1.Timing) whose medians a cell reports as server_<field>_p50
SERVER_TIMING_FIELDS = ("compute_us", "queue_us", "handoff_us", "wait_us", "prepare_us", "encode_us", "total_us")
APIS = ("unary", "stream")
ECHO_METHOD = "/bench.Echo/Echo"
ECHO_STREAM_METHOD = "/bench.Echo/EchoStream"
ECHO_READY = "echo server ready"
TARGET_SLACK_US = 150.0
TARGET_THROUGHPUT = 0.8
COMPUTE_BUSY = 0.9
"""Busy share (CPU over wall time) from which the thread running the experts calls counts as saturated: it waits on
the GPU (a CUDA synchronize spins) or works the rest of the time, so more callers add tokens/s only through larger
batches."""
DISTINCT_REQUESTS = 8  # distinct request payloads per cell (cycled)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_ports(count: int, avoid: int) -> int:
    """A port ``p`` with ``p .. p + count - 1`` free now and none of them ``avoid`` (a port picked for another use and
    not bound yet): a server's metrics ports (front end k listens on ``p + k``)."""
    for _ in range(100):
        base = _free_port()
        if base + count <= 65536 and not base <= avoid < base + count and all(_port_is_free(base + k) for k in range(1, count)):
            return base
    raise RuntimeError(f"found no {count} consecutive free ports for the server's metrics")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


# ----------------------------------------------------------------------------- CPU accounting (/proc)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a server's front ends and compute process), from /proc; ``[pid]`` where
    /proc has no ``children`` lists."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
    return pids


def thread_cpu_s(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far (user + system) per thread of processes ``pids``, keyed ``"<process>/<thread>"``: the
    process ``root`` for ``pids[0]``, else ``pid <n>``; the thread ``main`` for a process's main thread (a serving
    process's event loop), else the thread's name (threads of one name summed)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for index, pid in enumerate(pids):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                name = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            key = f"{'root' if index == 0 else f'pid {pid}'}/{name}"
            out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class CpuMeter:
    """CPU used by a process tree's threads between :meth:`start` and :meth:`stop` (/proc: robust on a busy machine)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._before: dict[str, float] = {}
        self._began = 0.0

    def start(self) -> None:
        self._before, self._began = thread_cpu_s(process_tree(self.pid)), time.perf_counter()

    def stop(self, answered: int) -> dict[str, Any]:
        """``answered``: requests answered meanwhile. Returns CPU us per request (all threads), each thread's busy
        fraction of the wall time, and the busiest thread."""
        wall = time.perf_counter() - self._began
        pids = process_tree(self.pid)
        now = thread_cpu_s(pids)
        used = {k: v - self._before.get(k, 0.0) for k, v in now.items()}
        busy = {k: round(v / wall, 3) for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0}
        top = next(iter(busy.items()), ("-", 0.0))
        return {"cpu_us_per_request": sum(used.values()) * 1e6 / max(1, answered), "thread_busy": busy,
                "busiest_thread": top[0], "busiest_thread_busy": top[1], "wall_s": wall, "processes": len(pids)}


def compute_loop_totals(text: str) -> dict[str, float] | None:
    """From a server's metrics (Prometheus text, the server's endpoint), the compute process's experts calls and loop
    seconds by phase (``lutb_compute_calls_total``, ``lutb_compute_loop_seconds_total``); None without a compute
    process. Every front end reports the same process as of the last answer it got, so each figure is the largest any
    front end reports (the freshest: they only grow)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("lutb_compute_calls", "lutb_compute_loop_seconds"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = "calls" if family.name == "lutb_compute_calls" else f"{sample.labels['phase']}_s"
                totals[key] = max(totals.get(key, 0.0), sample.value)
    return totals if "calls" in totals else None


class ComputeLoopMeter:
    """The compute process's experts calls and loop time shares over a cell, from the server's metrics endpoint
    (``--compute-worker process``).

    The figures are those the compute process's answers carried: its totals at the end of the round before. A wait
    for batches is counted when it ends, so the idle time before a cell (the echo's run) lands in the cell's first
    round and reaches the metrics with its second: the first reading is therefore taken ``delay_s`` after
    :meth:`start` (mid-warm-up, on a thread), by when it includes that wait.
    """

    def __init__(self, url: str | None) -> None:
        self.url = url
        self._first: tuple[dict[str, float] | None, float] | None = None
        self._timer: threading.Timer | None = None

    def _read(self) -> dict[str, float] | None:
        import http.client
        import urllib.request

        if self.url is None:
            return None
        try:
            with urllib.request.urlopen(self.url, timeout=10) as response:
                return compute_loop_totals(response.read().decode())
        except (OSError, http.client.HTTPException, ValueError):  # unreachable, cut short, unparsable: no figures
            return None

    def start(self, delay_s: float) -> None:
        self._first = None
        if self.url is None:
            return

        def first() -> None:
            self._first = (self._read(), time.perf_counter())

        self._timer = threading.Timer(delay_s, first)
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> dict[str, Any] | None:
        """Calls, calls per second of wall time, and each phase's share of the loop's time (fractions) since the first
        reading; None where the server has no compute process (or its metrics could not be read)."""
        if self._timer is None:
            return None
        self._timer.join()
        self._timer = None
        after, end = self._read(), time.perf_counter()
        if after is None or self._first is None or self._first[0] is None:
            return None
        before, began = self._first
        wall = end - began
        from lutb_server.metrics import COMPUTE_LOOP_PHASES

        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        loop_s = sum(delta.get(f"{phase}_s", 0.0) for phase in COMPUTE_LOOP_PHASES)
        return {"calls": int(delta["calls"]), "calls_per_s": round(delta["calls"] / wall, 1),
                "shares": {phase: round(delta.get(f"{phase}_s", 0.0) / loop_s, 3) if loop_s > 0 else None
                           for phase in COMPUTE_LOOP_PHASES}}


# ----------------------------------------------------------------------------- checkpoint


def make_checkpoint(root: Path, shape_name: str, *, dtype: str, scale_mode: str, device: str, held: int | None = None,
                    layers: int = 1) -> Path:
    """Layers ``0 .. layers - 1`` of random valid tiles, generated on ``device`` (no quantizer); cached under ``root``.

    ``held``: a shard holding experts ``0 .. held - 1`` of the shape's experts (default: all of them).
    ``layers``: MoE layers in the checkpoint, each of its own random tiles (drawn one after another from one seeded
    generator, so layer 0 is the single-layer checkpoint's layer 0), written and freed a layer at a time. The cache
    name gains ``-L{layers}`` when ``layers > 1`` (single-layer names are unchanged).
    """
    import torch

    from lutb_kernels.checkpoint import CheckpointConfig, CheckpointWriter, LayerWeights
    from lutb_kernels.lut_b_gemm import random_tiles

    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    shape = SHAPES[shape_name]
    e = shape["experts"] if held is None else held
    path = root / (f"{shape_name}-{dtype}-{scale_mode}" + ("" if held is None else f"-held{held}")
                   + ("" if layers == 1 else f"-L{layers}"))
    if any(path.glob("*.safetensors")):
        return path
    config = CheckpointConfig(shape["hidden"], shape["intermediate"], shape["experts"], "silu", dtype, scale_mode)
    gen = torch.Generator(device=device).manual_seed(0)
    start = time.perf_counter()
    tmp = root / f".tmp-{path.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    written = 0
    with CheckpointWriter(tmp, config) as writer:
        for layer in range(layers):
            w13 = random_tiles(config.w13_tiles_shape(e), k=shape["hidden"], device=device, generator=gen).cpu()
            w2 = random_tiles(config.w2_tiles_shape(e), k=shape["intermediate"], device=device, generator=gen).cpu()
            writer.write_layer(layer, LayerWeights(w13, w2, torch.arange(e, dtype=torch.int32)))
            written += w13.numel() + w2.numel()
            del w13, w2
    if device == "cuda":
        torch.cuda.empty_cache()  # the server process needs the memory, not this one
    os.rename(tmp, path)
    print(f"[bench] wrote checkpoint {path} ({layers} layer(s), {written / 2**20:.0f} MiB) in "
          f"{time.perf_counter() - start:.1f}s", flush=True)
    return path


# ----------------------------------------------------------------------------- requests


def prepared_requests(engine: Any, shape: dict[str, int], tokens: int, gen: Any, *, request_tokens: int = 16,
                      layer: int = 0) -> list[Any]:
    """``tokens // request_tokens`` (at least one) validated requests of ``request_tokens`` tokens for ``layer`` of
    ``engine``: normal hidden states, uniform random routing at the shape's top-k, equal weights (the in-process
    benches' batches)."""
    import torch

    requests = []
    for _ in range(max(1, tokens // request_tokens)):
        x = torch.randn(request_tokens, shape["hidden"], generator=gen).to(torch.bfloat16)
        ids = torch.rand(request_tokens, shape["experts"], generator=gen).argsort(dim=1)[:, :shape["top_k"]].to(torch.int32)
        w = torch.full((request_tokens, shape["top_k"]), 1.0 / shape["top_k"])
        requests.append(engine.prepare(layer, x, ids, w))
    return requests


@dataclass
class CellRequests:
    """The distinct requests of one (shape, wire, tokens) cell: tensors for in-process, bytes for the wire.

    ``payloads[p]``, ``tensors[p]`` and ``mx[p]`` are one request; ``payloads[p]`` targets layer ``p % layers``
    (:func:`make_requests`).
    """

    tokens: int
    top_k: int
    wire: str
    payloads: list[bytes]
    tensors: list[tuple[Any, Any, Any]]  # (x model dtype, ids int32, weights f32) as the client would send before encoding
    mx: list[tuple[Any, Any] | None]  # (q, scales) for the mxfp8 wire


def make_requests(shape: dict[str, int], tokens: int, wire: str, *, dtype: Any, scale_mode: str, seed: int,
                  layers: int = 1) -> CellRequests:
    """``DISTINCT_REQUESTS * layers`` serialized ``ForwardRequest`` payloads of ``tokens`` tokens: normal hidden
    states, random routing at the shape's top-k, softmax weights; request ids ``1 ..``.

    Payload ``p`` targets layer ``p % layers``, so ``DISTINCT_REQUESTS`` payloads per layer. A load-generator caller
    sends ``payloads[i % len(payloads)]`` for ``i = caller index, caller index + 1, ...`` (:func:`_run_load`):
    since ``layers`` divides ``len(payloads)``, each caller walks the layers in order, 0, 1, .., layers - 1, 0, ..,
    as an attention node does over a decode step, and callers start at different layers (caller ``c`` at
    ``c % layers``). With ``layers=1`` the payloads are those of before the option (same seed, same draws).
    """
    import torch

    from lutb_client.client import build_request
    from lutb_kernels.mxfp8 import mxfp8_quantize

    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    gen = torch.Generator().manual_seed(seed)
    payloads, tensors, mx = [], [], []
    for i in range(DISTINCT_REQUESTS * layers):
        layer = i % layers
        x = torch.randn(tokens, shape["hidden"], generator=gen).to(dtype)
        ids = torch.rand(tokens, shape["experts"], generator=gen).topk(shape["top_k"], dim=1).indices.to(torch.int32)
        w = torch.softmax(torch.randn(tokens, shape["top_k"], generator=gen), dim=1)
        if wire == "mxfp8":
            q, s = mxfp8_quantize(x, scale_mode)  # type: ignore[arg-type]
            request = build_request(layer, q, ids, w, request_id=i + 1, hidden_scales=s)
            mx.append((q, s))
        else:
            request = build_request(layer, x, ids, w, request_id=i + 1)
            mx.append(None)
        payloads.append(request.SerializeToString())
        tensors.append((x, ids, w))
    return CellRequests(tokens, shape["top_k"], wire, payloads, tensors, mx)


# ----------------------------------------------------------------------------- load generator (separate processes)


async def _close_all(channels: list[Any]) -> None:
    for channel in channels:
        await channel.close()


async def _run_load(spec: dict[str, Any]) -> dict[str, Any]:
    import grpc

    from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb

    # Each channel its own TCP connection (a local subchannel pool): with several server front ends
    # on one port the kernel spreads connections, not calls, so a process opens one per front end.
    options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30),
               ("grpc.use_local_subchannel_pool", 1)]
    async with contextlib.AsyncExitStack() as stack:
        def open_channel() -> Any:
            return grpc.aio.insecure_channel(spec["target"], options=options)

        channels = [open_channel() for _ in range(max(1, spec.get("connections", 1)))]
        stack.push_async_callback(_close_all, channels)  # the list, as it stands after spreading
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), 60)
        front_ends: list[int] = []
        if spec["kind"] == "expert":  # as lutb_client's clients do; the echo servers do not say which front end they are
            from lutb_client.spread import spread_async

            front_ends = await spread_async(channels, open_channel, timeout=60)
        stream = spec.get("api", "unary") == "stream"
        echo = spec["kind"] == "echo"
        method = ECHO_METHOD if echo else FORWARD_METHOD
        stream_method = ECHO_STREAM_METHOD if echo else FORWARD_STREAM_METHOD
        payloads: list[bytes] = spec["payloads"]
        # every successful response: (t0, t1, caller, batch_tokens, server timing values); the window is applied
        # after the run, once it can no longer move (counting as responses came in double-counted a moved window's
        # earlier responses)
        samples: list[tuple[float, float, int, int, tuple[int, ...]]] = []
        sizes = {"request": len(payloads[0]), "response": 0}
        errors: list[str] = []
        error_count = 0  # failed requests, warm-up included (errors keeps the first few messages)
        answered_all = 0  # responses, warm-up included (CPU is measured over the whole run)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        # the measured window: after warmup_s, and after every caller's first answer (a first call that is slow,
        # e.g. a cold server path on a busy machine, must not swallow a short window); moved when that comes later
        t_start = time.perf_counter() + spec["warmup_s"]
        t_end = t_start + spec["duration_s"]
        unanswered = spec["concurrency"]  # callers still waiting for their first answer

        window_moved = False

        def first_answer() -> None:
            nonlocal t_start, t_end, unanswered, window_moved
            unanswered -= 1
            now = time.perf_counter()
            if unanswered == 0 and now > t_start:
                t_start, t_end, window_moved = now, now + spec["duration_s"], True

        async def caller(index: int) -> None:
            # api "stream": one ForwardStream per caller for the whole cell, one request in
            # flight on it (what an attention node keeping a stream open per expert server does)
            nonlocal answered_all, error_count
            i = index
            channel = channels[index % len(channels)]
            call = channel.unary_unary(method)  # bytes in, bytes out: no (de)serialization cost on this side
            duplex = channel.stream_stream(stream_method)(timeout=600) if stream else None
            answered = False
            while True:
                now = time.perf_counter()
                if now >= t_end:
                    break
                # callers' indices run 0 .. C-1 over all load processes (first_index): with make_requests' payloads
                # of several layers, caller `index` sends layer (index + k) % layers as its k-th request
                payload = payloads[i % len(payloads)]
                i += 1
                t0 = time.perf_counter()
                try:
                    if duplex is not None:
                        await duplex.write(payload)
                        raw = await duplex.read()
                        if raw is grpc.aio.EOF:
                            errors.append("stream ended early")
                            error_count += 1
                            return
                    else:
                        raw = await call(payload, timeout=60)
                except grpc.RpcError as err:
                    errors.append(f"{err.code().name}: {err.details()}")
                    error_count += 1
                    if len(errors) > 20 or duplex is not None:
                        return
                    continue
                t1 = time.perf_counter()
                sizes["response"] = len(raw)
                batch, timing = 0, ()
                if spec["kind"] == "expert":
                    response = pb.ForwardResponse.FromString(raw)
                    if response.status.code:  # a stream's request failed in-band: an error, not an answer
                        errors.append(f"in-band {response.status.code}: {response.status.message}")
                        error_count += 1
                        if len(errors) > 20:
                            return
                        continue
                    batch = int(response.timing.batch_tokens)
                    timing = tuple(int(getattr(response.timing, name)) for name in SERVER_TIMING_FIELDS)
                answered_all += 1
                if not answered:
                    answered = True
                    first_answer()
                samples.append((t0, t1, index - spec["first_index"], batch, timing))
            if duplex is not None:
                await duplex.done_writing()
                await duplex.wait_for_connection()
                if await duplex.read() is not grpc.aio.EOF:
                    errors.append("stream: a response after the last request")
                    error_count += 1

        await asyncio.gather(*(caller(spec["first_index"] + j) for j in range(spec["concurrency"])))
        # where this process's window sat on the wall clock (the processes' windows can differ: each starts after
        # its own callers' first answers)
        window_wall = time.time() - (time.perf_counter() - t_start)
        busy = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    measured = window_samples(samples, t_start, t_end)
    measured_per_caller = [0] * spec["concurrency"]  # responses inside the window, per caller
    for _t0, _t1, who, _batch, _timing in measured:
        measured_per_caller[who] += 1
    server_times = {name: [m[4][j] for m in measured if m[4]] for j, name in enumerate(SERVER_TIMING_FIELDS)}
    return {"latencies": [t1 - t0 for t0, t1, *_ in measured], "tokens": len(measured) * spec["tokens"],
            "window_s": spec["duration_s"], "batch_tokens": [m[3] for m in measured if spec["kind"] == "expert"],
            "answered": answered_all, "busy": busy, "window_moved": window_moved, "error_count": error_count,
            "measured_per_caller": measured_per_caller, "window_wall_start": window_wall, **server_times, "sizes": sizes,
            "errors": errors[:5], "front_ends": front_ends}


def window_samples(samples: list[tuple[float, float, Any, Any, Any]], t_start: float, t_end: float) -> list[Any]:
    """The samples ``(t0, t1, ...)`` of requests sent and answered inside the measured window ``[t_start, t_end]``
    (perf_counter seconds); those straddling an edge are left out."""
    return [s for s in samples if s[0] >= t_start and s[1] <= t_end]


def _load_worker(conn: Any) -> None:
    from lutb_client.allocator import tune_malloc

    tune_malloc()  # as the server does: the load side must not pay page faults the server does not
    while True:
        spec = conn.recv()
        if spec is None:
            return
        try:
            conn.send(asyncio.run(_run_load(spec)))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send({"fatal": f"{type(exc).__name__}: {exc}"})


class LoadPool:
    """Long-lived load-generator processes (spawned once; each runs its share of the callers with
    :func:`_run_load` per :meth:`gather`)."""

    def __init__(self, procs: int) -> None:
        ctx = mp.get_context("spawn")
        self.workers = []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_load_worker, args=(child,), daemon=True)
            proc.start()
            self.workers.append((proc, parent))

    def gather(self, concurrency: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
        """Split ``concurrency`` callers over the processes, run ``spec`` in each, return their parts."""
        procs = min(len(self.workers), concurrency)
        shares = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
        first = 0
        for (_, conn), share in zip(self.workers, shares):
            conn.send({**spec, "concurrency": share, "first_index": first})
            first += share
        parts = [conn.recv() for (_, conn), _ in zip(self.workers, shares)]
        fatal = [p["fatal"] for p in parts if "fatal" in p]
        if fatal:
            raise RuntimeError(f"load generator failed: {fatal[0]}")
        return parts

    def run(self, kind: str, target: str, payloads: list[bytes], tokens: int, concurrency: int,
            warmup_s: float, duration_s: float, api: str = "unary", connections: int = 1) -> dict[str, Any]:
        procs = min(len(self.workers), concurrency)
        parts = self.gather(concurrency, {"kind": kind, "target": target, "payloads": payloads, "tokens": tokens,
                                          "warmup_s": warmup_s, "duration_s": duration_s, "api": api,
                                          "connections": connections})
        from lutb_client.spread import loads

        latencies = [v for p in parts for v in p["latencies"]]
        batch = [v for p in parts for v in p["batch_tokens"]]
        fronts = [f for p in parts for f in p["front_ends"]]

        def median_of(key: str) -> float | None:  # a server-side timing, over every process's responses
            values = [float(v) for p in parts for v in p[key]]
            return _pct(values, 0.5) if values else None

        return {
            "requests": len(latencies),
            "p50_us": _pct(latencies, 0.5) * 1e6,
            "p99_us": _pct(latencies, 0.99) * 1e6,
            "tokens_per_s": sum(p["tokens"] for p in parts) / duration_s,
            "requests_per_s": len(latencies) / duration_s,
            "batch_tokens_p50": _pct([float(b) for b in batch], 0.5) if batch else None,
            "batch_tokens_mean": statistics.fmean(batch) if batch else None,
            # the calls' own mean size: a call of s tokens answered s / T requests of T tokens each, so averaging
            # timing.batch_tokens over requests counts it s / T times; the harmonic mean counts each call once
            "call_tokens_mean": statistics.harmonic_mean(batch) if batch else None,
            **{f"server_{field}_p50": median_of(field) for field in SERVER_TIMING_FIELDS},
            "request_bytes": parts[0]["sizes"]["request"],
            "response_bytes": max(p["sizes"]["response"] for p in parts),
            "errors": [e for p in parts for e in p["errors"]][:5],
            "error_count": sum(p["error_count"] for p in parts),  # failed requests, warm-up included
            "window_moved": any(p["window_moved"] for p in parts),  # a late first answer started the window later
            "load_procs": procs,
            "answered": sum(p["answered"] for p in parts),  # warm-up included
            # CPU / wall of the busiest load-generator process: near 1, the load side limits the cell
            "load_busy_max": max(p["busy"] for p in parts),
            # callers with at least one response in their process's window, and how far apart the windows started:
            # fewer callers than the concurrency, or windows far apart, mean the cell did not load the server as asked
            "callers_measured": sum(1 for p in parts for n in p["measured_per_caller"] if n),
            "window_start_spread_s": max(p["window_wall_start"] for p in parts) - min(p["window_wall_start"] for p in parts),
            # the load processes' connections per server front end, after spreading them (lutb_client.spread)
            "connections_per_front_end": loads(fronts, max(fronts) + 1) if fronts else None,
        }

    def close(self) -> None:
        for proc, conn in self.workers:
            with contextlib.suppress(Exception):
                conn.send(None)
        for proc, _ in self.workers:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()


# ----------------------------------------------------------------------------- children: server and echo


def _child_serve(config: dict[str, Any]) -> None:
    """Run ``lutb serve`` with these settings until SIGTERM (optionally under cProfile)."""
    import logging

    from lutb_server import event_loop
    from lutb_server.app import serve
    from lutb_server.settings import ServerSettings

    logging.basicConfig(level=logging.INFO, format="[server] %(asctime)s %(name)s %(message)s")
    profile_path = config.pop("_cprofile", None)
    settings = ServerSettings(**config)
    if profile_path is None:
        event_loop.run(serve(settings), settings.event_loop)
        return
    import cProfile
    import pstats

    main_prof, worker_prof = cProfile.Profile(), cProfile.Profile()
    holder: dict[str, Any] = {}

    def ready(server: Any) -> None:
        main_prof.enable()  # Python >= 3.12: cProfile uses sys.monitoring and sees every thread
        try:
            server.scheduler.worker.call(worker_prof.enable).result(30)  # older Pythons: one profiler per thread
            holder["worker"] = True
        except Exception:  # noqa: BLE001 - "another profiler is active": the main one covers the worker
            pass

    event_loop.run(serve(settings, on_ready=ready), settings.event_loop)
    main_prof.disable()
    with open(profile_path, "w") as fh:
        profiles = [("event-loop thread" + ("" if holder else " (all threads on Python >= 3.12)"), main_prof)]
        if holder:
            profiles.append(("compute worker thread", worker_prof))
        for title, prof in profiles:
            fh.write(f"== cProfile: server {title}, top 40 by own time ==\n")
            stats = pstats.Stats(prof, stream=fh)
            stats.sort_stats("tottime").print_stats(40)


def _child_echo(port: int, loop: str, shared_port: bool = False) -> None:
    """The transport floor: a bare grpc.aio echo on the event loop the server runs on (lutb_server.event_loop).

    Unary ``Echo`` and bidirectional ``EchoStream`` (one response per request message); the first 8 bytes of a
    request give the response's size. ``shared_port``: bind with SO_REUSEPORT, as the server's front ends do, so
    that several echo processes share one port (the kernel spreads connections over them).
    """
    import grpc

    from lutb_client.allocator import tune_malloc
    from lutb_server import event_loop

    print(tune_malloc(), flush=True)  # as the server does (lutb_client.allocator): the same footing for the floor
    cache: dict[int, bytes] = {}

    def answer(request: bytes) -> bytes:
        size = int.from_bytes(request[:8], "little")
        response = cache.get(size)
        if response is None:
            response = cache.setdefault(size, bytes(size))
        return response

    async def echo(request: bytes, context: Any) -> bytes:
        return answer(request)

    async def echo_stream(requests: Any, context: Any) -> Any:
        async for request in requests:
            yield answer(request)

    class Handler(grpc.GenericRpcHandler):
        def service(self, details: Any) -> Any:
            if details.method == ECHO_METHOD:
                return grpc.unary_unary_rpc_method_handler(echo)
            if details.method == ECHO_STREAM_METHOD:
                return grpc.stream_stream_rpc_method_handler(echo_stream)
            return None

    async def main() -> None:
        options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30),
                   ("grpc.so_reuseport", 1 if shared_port else 0)]
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((Handler(),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print(ECHO_READY, flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(0)

    event_loop.run(main(), loop)  # type: ignore[arg-type]


def echo_payloads(request_bytes: int, response_bytes: int) -> list[bytes]:
    return [response_bytes.to_bytes(8, "little") + bytes(max(0, request_bytes - 8))]


def _spawn_child(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *args], stdout=log, stderr=subprocess.STDOUT,
                            env=os.environ.copy())


def _stop_child(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_serving(address: str, proc: subprocess.Popen[bytes], timeout: float) -> Any:
    from lutb_client import ExpertClient

    deadline = time.monotonic() + timeout
    with ExpertClient(address, timeout=5, retries=0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before serving (see its log)")
            try:
                return client.model_info(timeout=2)
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)
    raise TimeoutError(f"the server at {address} did not serve within {timeout:.0f}s")


def _wait_ready(procs: list[subprocess.Popen[bytes]], logs: list[Path], line: str, timeout: float = 60) -> None:
    """Wait until every child wrote ``line`` to its log (a child that exits first fails the wait)."""
    deadline = time.monotonic() + timeout
    waiting = list(zip(procs, logs))
    while waiting and time.monotonic() < deadline:
        for proc, log in list(waiting):
            if proc.poll() is not None:
                raise RuntimeError(f"a child exited with status {proc.returncode} before it was ready (see {log})")
            if log.exists() and line in log.read_text(errors="replace"):
                waiting.remove((proc, log))
        time.sleep(0.05)
    if waiting:
        raise TimeoutError(f"{len(waiting)} child(ren) not ready within {timeout:.0f}s (see {waiting[0][1]})")


def _wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port}")


# ----------------------------------------------------------------------------- profiling


class Profiler:
    """py-spy attached to the server process when installed; otherwise the server runs under cProfile."""

    def __init__(self, out: Path, tag: str, *, native: bool = False) -> None:
        self.out, self.tag, self.native = out, tag, native
        self.py_spy = shutil.which("py-spy")
        self.proc: subprocess.Popen[bytes] | None = None
        self.raw = out / f"profile-{tag}.pyspy.txt"
        self.cprofile = out / f"profile-{tag}.cprofile.txt"

    def attach(self, pid: int) -> None:
        if self.py_spy:
            (self.out / "logs").mkdir(parents=True, exist_ok=True)  # also for bench/serving_overhead.py's own --out
            # unwinding C stacks is slow and needs the process stopped; Python stacks are read without stopping it
            native = ["--native", "--rate", "100"] if self.native else ["--nonblocking", "--rate", "250"]
            self.proc = subprocess.Popen([self.py_spy, "record", "--pid", str(pid), "--format", "raw", *native,
                                          "--threads", "--subprocesses", "--output", str(self.raw)],  # the compute process too
                                         stdout=subprocess.DEVNULL, stderr=open(self.out / "logs" / f"profile-{self.tag}.pyspy.log", "wb"))

    def detach(self) -> str | None:
        if self.proc is None:
            return str(self.cprofile) if self.cprofile.exists() else None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if not self.raw.exists():
            return None
        top = self.out / f"profile-{self.tag}.top.txt"
        top.write_text(summarize_py_spy(self.raw.read_text()))
        return str(top)


def _process_role(depth: int, frames: list[str]) -> str:
    """What a sampled process is: the profiled one (``depth`` 1) is the server's main process; a child is named by the
    functions on its stacks (the spawned processes share one command line)."""
    text = ";".join(frames)
    if depth == 1:
        return "server main (front end 0)"
    if "_child_main" in text:
        return "compute process"
    if "front_end_main" in text:
        return "front end"
    return "resource tracker" if "resource_tracker" in text else "other child"


# a process frame: its command line is quoted but not escaped (it may hold quotes and ';'); the next frame is
# another process or a thread
_PY_SPY_PROCESS = re.compile(r'process (\d+):".*?";(?=process \d+:|thread \()')


def _py_spy_function(frame: str) -> str:
    """``func (file:line)`` -> ``func (file)``; a native frame known only by address, ``0x7f.. (lib.so)`` -> ``? (lib.so)``."""
    if frame.startswith("0x"):
        return "?" + frame[frame.find(" "):]
    return frame.rsplit(":", 1)[0] + ")" if frame.endswith(")") and ":" in frame else frame


def summarize_py_spy(raw: str, top_n: int = 25) -> str:
    """py-spy ``--format raw --threads --subprocesses`` output -> per-process top functions, as text.

    Each raw line is ``process A:"cmd";[process B:"cmd";]thread (tid): name;func (file:line);... count``;
    a sample belongs to the innermost ``process`` frame. Functions are keyed without the line number.
    Per process: its share of all samples, then the top ``top_n`` functions by own samples and by
    inclusive samples (both as a share of that process's samples).
    """
    own: defaultdict[str, Counter[str]] = defaultdict(Counter)
    inclusive: defaultdict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    roles: dict[str, str] = {}
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        pids = _PY_SPY_PROCESS.findall(stack)  # command lines may hold ';': take the process frames out first
        owner = f"process {pids[-1]}" if pids else "process ?"
        funcs = [_py_spy_function(f) for f in _PY_SPY_PROCESS.sub("", stack).split(";") if f and not f.startswith("thread (")]
        count = int(n)
        totals[owner] += count
        if roles.get(owner, "other child") == "other child":  # until a stack says what it is
            roles[owner] = _process_role(len(pids), funcs)
        own[owner][funcs[-1] if funcs else "(no Python frame)"] += count
        inclusive[owner].update(dict.fromkeys(funcs, count))  # each function once per sample
    total = sum(totals.values())
    lines = [f"py-spy, the server's processes (server main, front ends, compute process), {total} samples", ""]
    lines += [f"{100 * c / max(total, 1):6.2f}%  {p}  {roles[p]}" for p, c in totals.most_common()]
    for p, c in totals.most_common():
        lines += ["", f"== {p} ({roles[p]}): {c} samples; top {top_n} by own samples =="]
        lines += [f"{100 * k / c:6.2f}%  {f}" for f, k in own[p].most_common(top_n)]
        lines += ["", f"== {p}: top {top_n} inclusive =="]
        lines += [f"{100 * k / c:6.2f}%  {f}" for f, k in inclusive[p].most_common(top_n)]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- in-process baseline


@contextlib.contextmanager
def _like_arenas(worker: Any, prepared: list[Any]) -> Any:
    """``prepared`` with each ``x`` copied into host memory registered with ``worker`` for its device copies, and one
    output destination per request in the same memory, as a compute process has them in its serving processes'
    shared arenas (``ComputeWorker.register_host_memory``): yields ``(requests, into)`` for ``worker.run``. Where
    the worker registers nothing (off CUDA, or the driver refuses) it yields ``(prepared, None)``: plain tensors."""
    import dataclasses
    import math

    import torch

    align = 256
    outputs = [(list(r.output_shape), r.dtype) for r in prepared]
    sizes = [r.x.numel() * r.x.element_size() for r in prepared]
    sizes += [math.prod(shape) * dtype.itemsize for shape, dtype in outputs]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // align) * align
    page = 4096  # page-aligned, as a compute process's arenas are (mmap)
    block = torch.empty(max(total, align) + page, dtype=torch.uint8)
    memory = block[-block.data_ptr() % page:][:max(total, align)]
    if not worker.register_host_memory(memory):
        yield prepared, None
        return
    try:
        views = [memory[at:at + n] for at, n in zip(offsets, sizes)]
        placed = []
        for r, view in zip(prepared, views):
            x = view.view(r.x.dtype).view(r.x.shape)
            x.copy_(r.x)
            placed.append(dataclasses.replace(r, x=x))
        into = [view.view(dtype).view(shape) for view, (shape, dtype) in zip(views[len(prepared):], outputs)]
        yield placed, into
    finally:
        worker.unregister_host_memory(memory)


def inprocess_times(ckpt: Path, args: argparse.Namespace, cells: list[tuple[CellRequests, int]]) -> dict[tuple[str, int, int], dict[str, float]]:
    """For each (requests, formed batch tokens): seconds per ``ComputeWorker.run`` on that many tokens of those requests.

    On a CUDA device each call's hidden states and outputs lie in host memory registered with the worker, as a
    compute process's shared arenas are (:func:`_like_arenas`): the device copies them there and back, with no
    host-side gather of ``x`` or copy of the outputs. The server's compute process does no such copies, so a
    baseline that counted them (one CPU thread, 2 x 42 MB at deepseek-v3's 2944-token batches) ran slower than the
    server's own calls and flattered the 80% target.
    """
    import torch

    from lutb_kernels.checkpoint import Checkpoint
    from lutb_server.app import apply_intra_op_threads
    from lutb_server.backends import choose_backend, resolve_device
    from lutb_server.engine import ExpertEngine
    from lutb_server.worker import ComputeWorker

    checkpoint = Checkpoint(ckpt)
    device = resolve_device(args.device)
    apply_intra_op_threads(0, device)  # torch's CPU threads as the server's default sets them (1 on a CUDA device)
    engine = ExpertEngine(checkpoint, choose_backend(args.backend, checkpoint.config, device), validate_tiles=False,
                          max_tokens_per_request=1 << 20)
    worker = ComputeWorker(engine, cuda_graph_max_tokens=args.cuda_graph_max_tokens, cuda_graph_top_k=SHAPES[args.shape_name]["top_k"])
    worker.capture_graphs()
    results: dict[tuple[str, int, int], dict[str, float]] = {}
    for reqs, formed in cells:
        key = (reqs.wire, reqs.tokens, formed)
        if key in results:
            continue
        count = max(1, round(formed / reqs.tokens))
        # layer 0 only, on the tensors of every layer's payloads: the server pools requests per layer (a batch holds
        # one layer's requests; `formed` is the size of such a batch) and every layer has the same shape, so a batch
        # of layer 0 costs what one of any layer does
        prepared = []
        for i in range(count):
            x, ids, w = reqs.tensors[i % len(reqs.tensors)]
            scales = None
            if reqs.wire == "mxfp8":  # as the server takes it: dequantized by the worker (on the device on CUDA)
                x, scales = reqs.mx[i % len(reqs.mx)]  # type: ignore[misc]
            prepared.append(engine.prepare(0, x, ids, w, hidden_scales=scales))
        with _like_arenas(worker, prepared) as (prepared, into):
            registered = into is not None
            for _ in range(3):
                worker.run(prepared, into)
            times = []
            deadline = time.perf_counter() + args.inproc_s
            while time.perf_counter() < deadline or len(times) < 5:
                times.append(worker.run(prepared, into).seconds)
                if len(times) >= 2000:
                    break
        per_call = statistics.median(times)
        results[key] = {"batch_tokens": count * reqs.tokens, "us": per_call * 1e6,
                        "tokens_per_s": count * reqs.tokens / per_call, "calls": len(times), "registered": registered}
    del worker, engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------------------- the run


@dataclass
class Row:
    shape: str
    wire: str
    api: str
    concurrency: int
    tokens: int
    server: dict[str, Any]
    echo: dict[str, Any] = field(default_factory=dict)
    inproc: dict[str, Any] = field(default_factory=dict)  # at the calls' mean size (``call_tokens_mean``)
    inproc_p50: dict[str, Any] = field(default_factory=dict)  # at the requests' median ``batch_tokens`` (before 2026-12-07)
    targets: dict[str, Any] = field(default_factory=dict)


def run_shape(shape_name: str, args: argparse.Namespace, pool: LoadPool, echo_target: str, out: Path) -> tuple[list[Row], dict[str, Any]]:
    import torch

    shape = SHAPES[shape_name]
    args.shape_name = shape_name
    gen_device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    ckpt = make_checkpoint(Path(args.work_dir), shape_name, dtype=args.dtype, scale_mode="rceil", device=gen_device,
                           layers=args.layers)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    metrics_port = _free_ports(args.front_ends, avoid=port) if args.compute_worker == "process" else 0  # ComputeLoopMeter
    config: dict[str, Any] = {
        "checkpoint": str(ckpt), "backend": args.backend, "device": args.device, "host": "127.0.0.1", "port": port,
        "metrics_port": metrics_port, "validate_checkpoint": False, "max_wait_us": args.max_wait_us,
        "max_batch_tokens": args.max_batch_tokens, "max_tokens_per_request": max(args.tokens),
        "cuda_graph_max_tokens": args.cuda_graph_max_tokens, "cuda_graph_top_k": shape["top_k"], "shutdown_grace_s": 5,
        "max_queue_requests": 4096, "gil_switch_interval_us": args.gil_switch_interval_us,
        "compute_worker": args.compute_worker, "front_ends": args.front_ends, "event_loop": args.event_loop,
        "cpu_wakeup_latency_us": args.cpu_wakeup_latency_us,
    }
    profiler = Profiler(out, shape_name, native=args.profile == "native") if args.profile else None
    if profiler is not None and not profiler.py_spy:
        config["_cprofile"] = str(profiler.cprofile)
    started = time.perf_counter()
    server_log = out / "logs" / f"server-{shape_name}.log"
    log_start = server_log.stat().st_size if server_log.exists() else 0  # a reused --out: this run's lines follow
    server = _spawn_child(["serve", json.dumps(config)], server_log)
    rows: list[Row] = []
    info: dict[str, Any] = {}
    requests: dict[tuple[str, int], CellRequests] = {}
    try:
        model = _wait_serving(address, server, args.start_timeout_s)
        info = {"backend": model.backend, "backend_reason": model.backend_reason, "device": model.device,
                "startup_s": round(time.perf_counter() - started, 2), "checkpoint": str(ckpt)}
        print(f"[bench] {shape_name}: server up in {info['startup_s']}s, backend {model.backend} on {model.device}, "
              f"{args.layers} layer(s)", flush=True)
        if profiler is not None:
            profiler.attach(server.pid)
        meter = CpuMeter(server.pid)
        loop_meter = ComputeLoopMeter(f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
        for wire in args.wires:
            for tokens in args.tokens:
                reqs = requests[(wire, tokens)] = make_requests(shape, tokens, wire, dtype=dtype, scale_mode="rceil",
                                                                 seed=tokens, layers=args.layers)
                for concurrency in args.concurrency:
                    for api in args.apis:
                        loop_meter.start(delay_s=args.warmup_s / 2)
                        meter.start()
                        result = pool.run("expert", address, reqs.payloads, tokens, concurrency, args.warmup_s, args.duration_s,
                                          api=api, connections=args.front_ends)
                        result["cpu"] = meter.stop(result["answered"])
                        result["compute_loop"] = loop_meter.stop()  # from mid-warm-up to the cell's end
                        # the transport floor: the bare echo of the same sizes, API and concurrency, on as many
                        # processes as the server has front ends (one connection per process, as for the server)
                        echo = pool.run("echo", echo_target, echo_payloads(result["request_bytes"], result["response_bytes"]),
                                        tokens, concurrency, args.warmup_s / 2, args.duration_s, api=api,
                                        connections=args.echo_procs)
                        rows.append(Row(shape_name, wire, api, concurrency, tokens, result, echo))
                        print(f"[bench] {shape_name} {wire} {api} C={concurrency} T={tokens}: p50 {result['p50_us']:.0f} us, "
                              f"{result['tokens_per_s']:.0f} tok/s, batch {result['batch_tokens_p50']}, echo p50 {echo['p50_us']:.0f} us"
                              + (f", compute process in calls {result['compute_loop']['shares']['calls']:.0%} of its time"
                                 if result["compute_loop"] and result["compute_loop"]["shares"]["calls"] is not None else "")
                              + (f", errors {result['errors']}" if result["errors"] else "")
                              + (f"; WARNING: only {result['callers_measured']} of {concurrency} callers answered in the "
                                 f"measured window (window starts {result['window_start_spread_s']:.3f} s apart)"
                                 if result["callers_measured"] < concurrency else ""), flush=True)
    finally:
        if profiler is not None:
            info["profile"] = profiler.detach() if server.poll() is None else None
        _stop_child(server)
        if profiler is not None and not profiler.py_spy:
            info["profile"] = str(profiler.cprofile) if profiler.cprofile.exists() else None
    merged = compute_process_calls(server_log, log_start)
    if merged is not None:
        info["compute_process"] = merged
    cells, cells_p50 = [], []
    for row in rows:
        reqs = requests[(row.wire, row.tokens)]
        cells.append((reqs, int(round(row.server["call_tokens_mean"] or row.tokens))))
        cells_p50.append((reqs, int(row.server["batch_tokens_p50"] or row.tokens)))
    # the in-process baseline runs layer 0 only: the single-layer checkpoint holds the same tiles (make_checkpoint draws
    # layer 0 first), without loading and capturing every layer's
    one_layer = ckpt if args.layers == 1 else make_checkpoint(Path(args.work_dir), shape_name, dtype=args.dtype,
                                                              scale_mode="rceil", device=gen_device)
    times = inprocess_times(one_layer, args, cells + cells_p50)
    for row, (reqs, formed), (_, formed_p50) in zip(rows, cells, cells_p50):
        row.inproc = times[(reqs.wire, reqs.tokens, formed)]
        row.inproc_p50 = times[(reqs.wire, reqs.tokens, formed_p50)]
        _targets(row)
    compute_thread = compute_thread_key(server_log, args.compute_worker, log_start)
    info["compute_thread"] = compute_thread  # its key in each row's cpu.thread_busy
    info["saturation"] = _saturation(rows, compute_thread)
    return rows, info


_COMPUTE_READY = re.compile(r"compute process (\d+) ready")
_COMPUTE_DONE = re.compile(r"\[compute\]: done: (\d+) experts call\(s\) ran (\d+) batch\(es\) of (\d+) serving process"
                           r"(?:.*?; loop: calls ([\d.]+)%, answering ([\d.]+)%, reading or waiting ([\d.]+)%, other ([\d.]+)%)?")


def _log_text(log: Path, start: int = 0) -> str | None:
    """``log``'s text from byte ``start`` (where this run's server began writing: a reused ``--out`` appends each run's
    server to the same log); None when it cannot be read."""
    try:
        with log.open("rb") as fh:
            fh.seek(start)
            return fh.read().decode(errors="replace")
    except OSError:
        return None


def compute_process_calls(log: Path, start: int = 0) -> dict[str, float] | None:
    """From a server's log (from byte ``start``: this run's part), the compute process's exit line
    (``--compute-worker process``): its experts calls, the front-end batches they ran and the batches a call, over the
    server's whole run (warm-ups and every cell), and where the line has them (``LoopTimes``), the shares of its loop's
    time in calls, answering, reading or waiting, and other work (``loop_shares``, percent); None where that part has
    no such line (a thread worker, or a server that did not stop cleanly)."""
    text = _log_text(log, start)
    if text is None:
        return None
    found = _COMPUTE_DONE.findall(text)
    if not found:
        return None
    last = found[-1]
    calls, batches, front_ends = (int(v) for v in last[:3])
    info: dict[str, Any] = {"calls": calls, "batches": batches, "front_ends": front_ends,
                            "batches_per_call": round(batches / max(calls, 1), 2)}
    if last[3]:
        from lutb_server.metrics import COMPUTE_LOOP_PHASES  # the exit line names them in this order

        info["loop_shares"] = dict(zip(COMPUTE_LOOP_PHASES, (float(v) for v in last[3:])))
    return info


def compute_thread_key(log: Path, compute_worker: str, start: int = 0) -> str | None:
    """The ``thread_busy`` key (:class:`CpuMeter`) of the thread that runs the experts calls: the thread worker
    (``root/lutb-compute``), or the compute process's main thread (``pid N/main``, N from the ready line of the server
    log's part from byte ``start``: this run's); None where that part does not say."""
    if compute_worker == "thread":
        return "root/lutb-compute"
    text = _log_text(log, start)
    found = _COMPUTE_READY.findall(text) if text is not None else []
    return f"pid {found[-1]}/main" if found else None


def _targets(row: Row) -> None:
    """Issue 5's targets for ``row``'s cell. A cell with failed requests, or with a caller that got no answer in
    the window, meets none: its numbers are not the server's under the load asked for."""
    s, e, i = row.server, row.echo, row.inproc
    clean = not s.get("error_count") and s.get("callers_measured", row.concurrency) >= row.concurrency
    if row.concurrency == 1 and row.tokens == 16:
        bound = i["us"] + e["p50_us"] + TARGET_SLACK_US
        row.targets["latency"] = {"bound_us": bound, "ok": bool(clean and s["p50_us"] <= bound)}
    if row.concurrency == 64:
        want = TARGET_THROUGHPUT * i["tokens_per_s"]
        # above_echo: the bare echo, at this concurrency and on as many processes, answered fewer tokens/s than the
        # target asks: the target then lies beyond what the transport alone carried on this host
        p50_rate = row.inproc_p50.get("tokens_per_s")
        row.targets["throughput"] = {"min_tokens_per_s": want, "ok": bool(clean and s["tokens_per_s"] >= want),
                                     "above_echo": bool(want > e["tokens_per_s"]),
                                     "ratio": s["tokens_per_s"] / i["tokens_per_s"],
                                     # the same ratio against the requests' median batch, which runs faster in-process
                                     "ratio_at_p50_batch": s["tokens_per_s"] / p50_rate if p50_rate else None}
    if not clean:
        for target in row.targets.values():
            target["unclean"] = f"{s.get('error_count', 0)} failed requests, {s.get('callers_measured')} of " \
                                f"{row.concurrency} callers answered in the window"


def _saturation(rows: list[Row], compute: str | None = None) -> dict[str, str]:
    """Per (wire, api, tokens): the concurrency beyond which tokens/s grows by less than 10%, and, given the
    ``thread_busy`` key of the thread that runs the experts calls (:func:`compute_thread_key`), from which concurrency
    that thread is at least :data:`COMPUTE_BUSY` busy (the compute side saturated: tokens/s that still grow then
    come from larger batches), or its largest busy share."""
    out = {}
    for key in sorted({(r.wire, r.api, r.tokens) for r in rows}):
        cells = sorted(((r.concurrency, r) for r in rows if (r.wire, r.api, r.tokens) == key), key=lambda cell: cell[0])
        series = [(c, r.server["tokens_per_s"]) for c, r in cells]
        where = f"still growing at C={series[-1][0]}"
        for (c0, t0), (_c1, t1) in zip(series, series[1:]):
            if t1 < 1.1 * t0:
                where = f"flat from C={c0} ({t0:.0f} tok/s)"
                break
        if compute is not None:
            busy = [(c, r.server.get("cpu", {}).get("thread_busy", {}).get(compute, 0.0)) for c, r in cells]
            first = next((c for c, b in busy if b >= COMPUTE_BUSY), None)
            where += (f"; compute busy >= {COMPUTE_BUSY} from C={first}" if first is not None
                      else f"; compute at most {max(b for _, b in busy):.2f} busy")
        out[f"{key[0]} {key[1]} T={key[2]}"] = where
    return out


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def short_table(rows: list[Row]) -> str:
    head = ("| shape | wire | api | C | T | p50 us | p99 us | tok/s | batch | in-proc us | in-proc tok/s | batch p50 "
            "| in-proc tok/s at p50 | echo p50 us | echo tok/s | target |")
    lines = [head, "|" + "|".join("---" for _ in range(16)) + "|"]
    for r in rows:
        target = []
        if "latency" in r.targets:
            t = r.targets["latency"]
            target.append(f"p50<={t['bound_us']:.0f}us {'OK' if t['ok'] else 'MISS'}")
        if "throughput" in r.targets:
            t = r.targets["throughput"]
            at_p50 = t.get("ratio_at_p50_batch")
            target.append(f"tok/s>={t['min_tokens_per_s']:.0f} {'OK' if t['ok'] else 'MISS'} ({t['ratio']:.2f}"
                          + (f"; {at_p50:.2f} at p50" if at_p50 is not None else "") + ")"
                          + (" (above the echo's tok/s)" if t["above_echo"] else ""))
        lines.append(f"| {r.shape} | {r.wire} | {r.api} | {r.concurrency} | {r.tokens} | {_fmt(r.server['p50_us'])} | {_fmt(r.server['p99_us'])} "
                     f"| {_fmt(r.server['tokens_per_s'])} | {_fmt(r.inproc.get('batch_tokens'))} | {_fmt(r.inproc.get('us'))} "
                     f"| {_fmt(r.inproc.get('tokens_per_s'))} | {_fmt(r.server['batch_tokens_p50'])} "
                     f"| {_fmt(r.inproc_p50.get('tokens_per_s'))} | {_fmt(r.echo.get('p50_us'))} | {_fmt(r.echo.get('tokens_per_s'))} "
                     f"| {'; '.join(target)} |")
    return "\n".join(lines)


TIME_SPLIT_NOTE = ("Medians in us, each column its own. server total: from the servicer receiving the request to its "
                   "response being ready; prepare: decode and validation; hand-off: the batch's trip to the compute worker "
                   "and back to the event loop less compute (wake-ups, a compute process's messages), and of it (wait) the "
                   "part before the call that ran the batch started; encode: the output "
                   "into the response; other: total - prepare - queue - compute - hand-off - encode (handing the request to "
                   "the scheduler, the loop turns that resume it); outside: the end-to-end p50 minus the server total (gRPC "
                   "on both sides, the transport, the load generator).")


def time_split_table(rows: list[Row]) -> str:
    """Where a request's time goes, from the responses' ``timing`` (see ``TIME_SPLIT_NOTE``)."""
    head = ("| shape | wire | api | C | T | p50 us | server total | prepare | queue | compute | hand-off (wait) | encode "
            "| other | outside | in-proc us |")
    lines = [head, "|" + "|".join("---" for _ in range(15)) + "|"]
    for r in rows:
        parts = [r.server.get(f"server_{k}_us_p50") for k in ("prepare", "queue", "compute", "handoff", "encode")]
        total = r.server.get("server_total_us_p50")
        other = total - sum(parts) if total is not None and None not in parts else None
        outside = r.server["p50_us"] - total if total is not None else None
        shown = [_fmt(v) for v in parts]
        shown[3] += f" ({_fmt(r.server.get('server_wait_us_p50'))})"
        lines.append(f"| {r.shape} | {r.wire} | {r.api} | {r.concurrency} | {r.tokens} | {_fmt(r.server['p50_us'])} | {_fmt(total)} | "
                     + " | ".join(shown)
                     + f" | {_fmt(other)} | {_fmt(outside)} | {_fmt(r.inproc.get('us'))} |")
    return "\n".join(lines)


BUSY_NOTE = ("Who limits a cell, from /proc over each run (warm-up included): the server's CPU per answered request "
             "(all its processes and threads), its busiest thread and that thread's CPU / wall time (root/main: the "
             "serving process's event loop; lutb-compute: the thread compute worker; pid N: a front end or the compute "
             "process), and the busiest load-generator process's CPU / wall time. A thread near 1.0 is saturated; "
             "serving.json holds every thread's figure. With a compute process: its experts calls per second and its "
             "loop's shares of time in calls and in reading or waiting for batches between them (from mid-warm-up to "
             "the cell's end; ``server.compute_loop``): waiting while callers are many is the GPU idle for want of batches; "
             "and from them the tokens and microseconds in calls per experts call (tok/s and the calls' share over calls/s), "
             "to hold against the in-process time at that size.")


def busy_table(rows: list[Row]) -> str:
    """Per cell: server CPU per request, its busiest thread, the load generators' busiest process (see ``BUSY_NOTE``)."""
    head = ("| shape | wire | api | C | T | tok/s | server CPU us/req | busiest server thread | its busy | load busy "
            "| echo tok/s | compute calls/s | in calls | reading or waiting | tokens per call | us per call |")
    lines = [head, "|" + "|".join("---" for _ in range(16)) + "|"]
    for r in rows:
        cpu = r.server.get("cpu", {})
        loop = r.server.get("compute_loop") or {}
        shares = loop.get("shares") or {}
        per_s, in_calls = loop.get("calls_per_s"), shares.get("calls")
        per_call = (r.server["tokens_per_s"] / per_s, 1e6 * in_calls / per_s) if per_s and in_calls is not None else (None, None)
        lines.append(f"| {r.shape} | {r.wire} | {r.api} | {r.concurrency} | {r.tokens} | {_fmt(r.server['tokens_per_s'])} "
                     f"| {_fmt(cpu.get('cpu_us_per_request'))} | {cpu.get('busiest_thread', '-')} "
                     f"| {_fmt(cpu.get('busiest_thread_busy'), 2)} | {_fmt(r.server.get('load_busy_max'), 2)} "
                     f"| {_fmt(r.echo.get('tokens_per_s'))} | {_fmt(loop.get('calls_per_s'))} "
                     f"| {_fmt(shares.get('calls'), 2)} | {_fmt(shares.get('reading_or_waiting'), 2)} "
                     f"| {_fmt(per_call[0])} | {_fmt(per_call[1])} |")
    return "\n".join(lines)


def provenance() -> dict[str, Any]:
    """When and from what a report was made: UTC date, the repository's commit and whether its tree had changes
    (:func:`repo_state.git_state`: a ``git archive`` copy gives its archived commit and None), and the command line."""
    commit, dirty = git_state(Path(__file__).resolve().parent)
    return {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit, "dirty": dirty,
            "argv": [sys.executable, *sys.argv]}


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (a cell without answers has no p50) as None: strict JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_report(out: Path, args: argparse.Namespace, infos: dict[str, Any], rows: list[Row], began: float) -> str:
    """Write serving.json and serving.md (after every shape, so a run cut short keeps what it measured); returns the short table."""
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "cpus": os.cpu_count()}
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "out")}
    settings["work_dir"] = str(settings["work_dir"])
    # server settings this process's environment hands the server (the bench sets the others itself): an A/B's
    # --new-env LUTB_X=... run is told apart from its pair only by these
    settings["server_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("LUTB_")}
    report = {"provenance": provenance(), "settings": settings, "environment": env, "servers": infos,
              "rows": [asdict(r) for r in rows], "seconds": round(time.perf_counter() - began, 1)}
    (out / "serving.json").write_text(json.dumps(_json_safe(report), indent=2, default=str, allow_nan=False))
    table = short_table(rows)
    md = [f"# Serving benchmark ({report['provenance']['date_utc']}, {args.layers} MoE layer(s) per shape)", "",
          f"Provenance: {json.dumps(report['provenance'])}", "",
          f"Environment: {json.dumps(env)}", "",
          f"Settings: {json.dumps(settings, default=str)}", ""]
    for name, info in infos.items():
        md += [f"## {name}", "", f"```\n{json.dumps(info, indent=2)}\n```", ""]
    md += ["## Results", "", "p50/p99: end-to-end latency of one request as the load generator sees it (api unary: a Forward call; "
           "stream: a message on the caller's open ForwardStream, one in flight); batch: the experts calls' mean "
           "size (the harmonic mean of `timing.batch_tokens` over requests: a call of s tokens answered s / T of them), "
           "rounded to whole requests; in-proc: the same experts and compute worker in-process on a batch of that size "
           "(of layer 0; the server's batches hold one layer's requests each); batch p50: the requests' median "
           "`timing.batch_tokens` (which counts a call once per request it answered, so it leans to the larger calls; "
           "the baseline until 2026-12-07), and in-proc tok/s at p50 the in-process rate there; "
           "echo: a bare gRPC echo of the same payload sizes, API and concurrency, on as many processes as the server "
           f"has front ends (--echo-procs). Targets: C=1, T=16: p50 <= in-proc + echo + {TARGET_SLACK_US:.0f} us; "
           f"C=64: tok/s >= {TARGET_THROUGHPUT:.0%} of in-proc tok/s (in brackets: tok/s over in-proc tok/s, and over "
           "in-proc tok/s at p50; \"above the echo's tok/s\": the bare transport answered fewer tokens/s than that).",
           "", table, "",
           "## Where the time goes", "", TIME_SPLIT_NOTE, "",
           time_split_table(rows), "",
           "## Who is busy", "", BUSY_NOTE, "", busy_table(rows), ""]
    (out / "serving.md").write_text("\n".join(md))
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from typing import get_args

    from lutb_server.event_loop import EventLoopKind

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for serving.json, serving.md, logs and profiles")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: smoke shape, reference backend, few requests (< 60 s)")
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--backend", default="packed", help="server backend (packed on the GPU; reference for CPU runs)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--tokens", default="1,16,128", help="tokens per request")
    p.add_argument("--layers", type=int, default=1,
                   help="MoE layers in each shape's checkpoint; each caller sends layer 0, 1, .., N-1, 0, .. in turn, "
                        "callers starting at different layers (see the module docstring)")
    p.add_argument("--wires", default="bf16,mxfp8", help="bf16 (model dtype) and/or mxfp8")
    p.add_argument("--apis", default="unary,stream",
                   help="unary (one Forward per request) and/or stream (one ForwardStream per caller, one request in flight)")
    p.add_argument("--duration-s", type=float, default=2.0, help="measured seconds per cell")
    p.add_argument("--warmup-s", type=float, default=0.5, help="unmeasured seconds before each cell")
    p.add_argument("--inproc-s", type=float, default=0.5, help="seconds of in-process calls per formed batch size")
    p.add_argument("--max-wait-us", type=int, default=0,
                   help="server pooling wait (0: never wait; closed-loop callers pool while a batch runs anyway)")
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--cuda-graph-max-tokens", type=int, default=512)
    p.add_argument("--event-loop", default="uvloop", choices=get_args(EventLoopKind),
                   help="the server's and the echo server's event loop (the server setting event_loop)")
    p.add_argument("--compute-worker", default="thread", choices=("thread", "process"),
                   help="the server's compute_worker: a thread of the serving process, or a child process")
    p.add_argument("--front-ends", type=int, default=1,
                   help="the server's front_ends (> 1 needs --compute-worker process); each load process then opens "
                        "that many connections")
    p.add_argument("--gil-switch-interval-us", type=int, default=0,
                   help="server setting (default 0: the server's default, 200 us on a CUDA device; 5000 is Python's)")
    wakeup = os.environ.get("LUTB_CPU_WAKEUP_LATENCY_US") or None
    p.add_argument("--cpu-wakeup-latency-us", type=int, default=int(wakeup) if wakeup is not None else None,
                   help="the server's cpu_wakeup_latency_us (default: the LUTB_CPU_WAKEUP_LATENCY_US the server would "
                        "read; unset: the machine's idle states); this process holds it too, for the whole run, so "
                        "that the echo and in-process baselines run on the same machine state")
    p.add_argument("--echo-procs", type=int, default=0,
                   help="echo server processes on one port (the transport floor); 0: as many as --front-ends")
    p.add_argument("--load-procs", type=int, default=4, help="most load-generator processes")
    p.add_argument("--start-timeout-s", type=float, default=420.0)
    p.add_argument("--work-dir", default=None, help="where checkpoints are made once (default: OUT/checkpoints)")
    p.add_argument("--profile", nargs="?", const="python", choices=["python", "native"], default=None,
                   help="profile the server under load: py-spy if installed (with 'native', C frames too: grpc core, "
                        "uvloop, torch; slower sampling), else cProfile")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        defaults = {"shapes": "smoke", "backend": "reference", "device": "cpu", "concurrency": "1,4", "tokens": "1,8",
                    "duration_s": 0.3, "warmup_s": 0.1, "inproc_s": 0.1, "load_procs": 2, "cuda_graph_max_tokens": 0}
        given = set(argv if argv is not None else sys.argv[1:])
        for name, value in defaults.items():
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
    args.shapes = [s for s in str(args.shapes).split(",") if s]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    args.wires = [w for w in str(args.wires).split(",") if w]
    if any(w not in ("bf16", "mxfp8") for w in args.wires):
        p.error("--wires takes bf16 and/or mxfp8")
    args.apis = [a for a in str(args.apis).split(",") if a]
    if not args.apis or any(a not in APIS for a in args.apis):
        p.error(f"--apis takes {' and/or '.join(APIS)}")
    if args.work_dir is None:
        args.work_dir = str(args.out / "checkpoints")
    if args.echo_procs < 0:
        p.error("--echo-procs must be >= 0")
    if args.layers < 1:
        p.error("--layers must be >= 1")
    args.echo_procs = args.echo_procs or args.front_ends
    return args


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["--child"]:
        kind = raw[1]
        if kind == "serve":
            _child_serve(json.loads(raw[2]))
        elif kind == "echo":
            _child_echo(int(raw[2]), raw[3], shared_port=raw[4:5] == ["shared-port"])
        return 0
    args = parse_args(argv)
    from lutb_client.allocator import tune_malloc
    from lutb_server.cpu_wakeup import hold_cpu_wakeup_latency

    args.malloc = tune_malloc()  # this process's; the server, echo and load processes each apply the same
    wakeup = hold_cpu_wakeup_latency(args.cpu_wakeup_latency_us)  # the whole machine's, until this process ends
    args.cpu_wakeup = wakeup.note
    print(f"[bench] {wakeup.note}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops us: still stop the children
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)  # the children's logs, apart from the report
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    echo_port = _free_port()
    echo_logs = [out / "logs" / f"echo-{i}.log" for i in range(args.echo_procs)]
    echoes = [_spawn_child(["echo", str(echo_port), args.event_loop] + (["shared-port"] if args.echo_procs > 1 else []), log)
              for log in echo_logs]
    pool = LoadPool(max(1, min(args.load_procs, max(args.concurrency))))
    all_rows: list[Row] = []
    infos: dict[str, Any] = {}
    try:
        _wait_ready(echoes, echo_logs, ECHO_READY)
        for shape_name in args.shapes:
            try:
                rows, info = run_shape(shape_name, args, pool, f"127.0.0.1:{echo_port}", out)
            except Exception as exc:  # noqa: BLE001 - a shape whose server fails is recorded; the others still run
                print(f"[bench] {shape_name} FAILED: {type(exc).__name__}: {exc}", flush=True)
                rows, info = [], {"failed": f"{type(exc).__name__}: {exc}"}
            all_rows += rows
            infos[shape_name] = info
            write_report(out, args, infos, all_rows, began)
    finally:
        pool.close()
        for echo in echoes:
            _stop_child(echo)
    table = write_report(out, args, infos, all_rows, began)
    print(f"\n[bench] wrote {out / 'serving.json'} and {out / 'serving.md'} in {time.perf_counter() - began:.1f}s")
    for name, info in infos.items():
        print(f"[bench] {name}: tokens/s vs concurrency: {info.get('saturation')}; profile: {info.get('profile')}")
    print()
    print(busy_table(all_rows))
    print()
    print(time_split_table(all_rows))
    print()
    print(table, flush=True)
    return 1 if any("failed" in info for info in infos.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
