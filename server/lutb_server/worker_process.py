"""The compute worker in a child process, so that no thread of the serving process waits for its GIL.

Why: a :class:`~lutb_server.worker.ComputeWorker` thread releases the GIL inside every torch
call and must take it back from the event loop each time. With the loop busy (a server under
load) a 0.3 ms batch took 2.8-4.7 ms on an H200 (``bench/worker_pacing.py``,
bench/results/2026-12-02-serving-5-h200.md). Here the child process loads the weights, owns the
device, captures the CUDA graphs and runs ``ComputeWorker.run`` on its own main thread; the
serving process keeps gRPC, validation and the batching scheduler
(:class:`~lutb_server.engine.ExpertEngine` with ``load_experts=False``).

The serving process's side lives on an asyncio event loop (the server's own, or a private one on
a thread when none is given): a batch is packed and written to the child's socket on the loop,
and the answer is read, unpacked and handed to the batch's future there too. So a batch costs the
serving process no thread hand-over and no GIL hand-over; an earlier version with sender and
receiver threads lost 1-3 ms a batch to them under load (bench/results/2026-12-03-worker-h200.md).

Tensors travel through a :class:`~lutb_server.shared_arena.SharedArena` (shared memory the
serving process creates and hands to the child as a file descriptor): the serving process copies
a batch's inputs into a span of it and names the span where the child writes the outputs; the
socket carries only :class:`~lutb_server.shared_arena.Slot` descriptors (as plain ``(offset, dtype,
shape)`` tuples: cheaper to pickle), and the child's worker writes each batch's output into the batch's
output slot: on a GPU with the device's copy engine (the child page-locks each arena with
``ComputeWorker.register_host_memory`` at the handshake), else from its pinned staging with one CPU
copy. A batch that does not fit
the arena's free room (or any batch when ``arena_bytes`` is 0, or off Linux) travels inline, as
``lutb.v1.Tensor`` messages made by the wire codec, :mod:`lutb_client.codec`.

Frames on one Unix stream socket, each an 8-byte little-endian length and a pickle (the child reads a
batch's frame in one ``recv``); a tensor is a slot tuple or a codec message:

- parent -> child, before any frame: one byte, ``A`` with the arena's descriptor attached
  (``socket.send_fds``) or ``N`` for none;
- child -> parent, once: ``("ready", info)`` (``weight_bytes``, ``backend``, ``graphs_s``,
  ``warm_up_s``, ``gpu_memory``) or ``("failed", exception)``;
- parent -> child: ``(job, (layer, x, topk_ids, topk_weights, apply_router_weight_on_input,
  output_mode, x_scales, x_dtype), output_slot, deadline)`` per batch, its requests concatenated (they share the pool key),
  ``x_scales`` and ``x_dtype`` (a dtype's name) None unless the batch is MXFP8 carried to the device
  (:class:`~lutb_server.engine.PreparedRequest`), ``output_slot`` where the child writes the batch's output
  (None: send it inline), and ``deadline`` the ``time.monotonic()`` time after which none of its requests wants an
  answer (None: never; the child answers a batch found past it with ``DeadlineExpired`` instead of running it);
  ``None`` to stop;
- child -> parent: ``(job, output, seconds, call_tokens, path, started, status)`` or ``(job, exception, 0.0,
  0, "", None, status)``, ``output`` None when it is in the output slot, else a codec message (the serving
  process splits it back per request), ``call_tokens`` the tokens of the call that ran the batch
  (more than its own when merged with other front ends' batches), ``path`` how it ran
  (:attr:`~lutb_server.worker.BatchOutput.path`), ``started`` the call's ``time.monotonic()`` start;
  ``status`` the child's figures for the metrics: ``(allocated, reserved)`` CUDA allocator bytes as last read (at
  most every :data:`GPU_MEMORY_PERIOD_S`, after answering, off the batch's critical path: a reading builds two
  ``torch.cuda.memory_stats`` dictionaries), then its experts calls and its loop's seconds (:class:`LoopTotals`) as
  of the end of the previous round of calls.

One compute process can serve several serving processes (front ends, each its own event loop and
gRPC server): :func:`spawn_compute_process` gives one socket per front end, and the child runs
the batches that reach it together from several front ends as one call when they share a pool key.
While a call runs on the device (after its work is queued, before the wait) the child reads the batches that
have arrived meanwhile, the next call's, so reading and unpacking them is off the path between two calls
(``ComputeWorker.run(..., overlap=)``; bench/results/2026-12-06-receive-during-call.md).

If the child dies, every pending and later batch fails with :class:`ComputeWorkerGone`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import multiprocessing as mp
import multiprocessing.util
import pickle
import select
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

import torch

from lutb_client.codec import WireTensor, decode_tensor, encode_tensor, host_bytes
from lutb_server.engine import PreparedRequest
from lutb_server.errors import EXPIRED_IN_WORKER, DeadlineExpired, Unavailable
from lutb_server.metrics import torch_gpu_memory
from lutb_server.shared_arena import SharedArena, Slot, arena_supported, dtype_name
from lutb_server.worker import BatchOutput, running_loop

log = logging.getLogger(__name__)

GPU_MEMORY_PERIOD_S = 1.0
"""Seconds between the child's readings of its allocator (what the metrics show, at most this old while batches
flow)."""

DEFAULT_ARENA_BYTES = 64 << 20
"""Shared memory for batches in flight when the caller does not size it (the server does:
:func:`lutb_server.app.arena_bytes`)."""

_HEADER = 8  # bytes of a frame's length prefix
_JOIN_BYTES = 64 << 10  # frames up to this size are written as one buffer (header and body joined)
_RECV_BYTES = 64 << 10  # what the compute process asks of a socket per read


class ComputeWorkerGone(Unavailable):
    """The compute process exited or its socket broke; nothing more will be computed (UNAVAILABLE:
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
    max_batch_tokens: int = 0
    """Most tokens of one merged call over several serving processes' batches (the server's
    ``max_batch_tokens``); 0: no limit."""
    intra_op_threads: int = 0
    gil_switch_interval_us: int = 0
    compute_cpu: int | None = None
    """The CPU the child pins itself to (``lutb_server.cpu_placement``); None: wherever the kernel places it."""
    spin_s: float = 0.0
    """How long the child polls its sockets after each call before it blocks (the server's ``compute_spin_us``)."""
    content_hash: str | None = None
    """``Checkpoint(checkpoint).content_hash()``, as the serving process that spawns the child computed it (the
    child's engine then does not read every byte again); None: the child computes it."""
    checkpoint_identity: tuple | None = None
    """``Checkpoint.identity`` of the files that ``content_hash`` was computed from: the child refuses to load other
    files (the path overwritten meanwhile); None: not checked."""


# -- framing ---------------------------------------------------------------------------------------


def _frame(message: object) -> list[bytes]:
    """``message`` pickled behind its 8-byte length, as the buffers to write in order: one for a small
    message (a batch's slots, an answer: header and body joined, one write), header and body apart for
    a large one (an inline tensor: its bytes are not copied again to join them)."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = len(body).to_bytes(_HEADER, "little")
    return [header + body] if len(body) <= _JOIN_BYTES else [header, body]


def _send(sock: socket.socket, message: object) -> None:
    for part in _frame(message):
        sock.sendall(part)


def _recv_exactly(sock: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the socket closed mid-frame" if got else "the socket closed")
        got += n
    return data


def _recv(sock: socket.socket) -> Any:
    """The next frame's message (blocking); EOFError when the other side closed."""
    size = int.from_bytes(_recv_exactly(sock, _HEADER), "little")
    return pickle.loads(_recv_exactly(sock, size))


class _FrameReader(asyncio.Protocol):
    """The serving process's end of the socket, on the event loop: bytes in, messages out."""

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[Exception | None], None]) -> None:
        self._on_message, self._on_lost = on_message, on_lost
        self._buf = bytearray()
        self._need = _HEADER  # bytes the next step waits for
        self._size: int | None = None  # the current frame's length, once its header is in

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while len(self._buf) >= self._need:
            if self._size is None:
                self._size = int.from_bytes(self._buf[:_HEADER], "little")
                self._need = _HEADER + self._size
                continue
            body = memoryview(self._buf)[_HEADER:self._need]
            try:
                message = pickle.loads(body)
            finally:
                body.release()
            del self._buf[:self._need]
            self._size, self._need = None, _HEADER
            self._on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(exc)


# -- the child -------------------------------------------------------------------------------------


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _gpu_memory(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) bytes of torch's allocator on ``device``; zeros off CUDA."""
    return torch_gpu_memory(str(device))() if device.type == "cuda" else (0, 0)


class _Connection:
    """The child's end of one serving process's socket, with that process's arena."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.arena: SharedArena | None = None
        self._buf = bytearray()  # bytes received and not yet taken as a message

    def fileno(self) -> int:  # for select
        return self.sock.fileno()

    def close(self) -> None:
        """Unmap the arena (if any) and close the socket: the serving process is gone."""
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.sock.close()

    def handshake(self) -> None:
        """Receive the serving process's arena (its first message: one byte, the descriptor attached)."""
        kind, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        if not kind:
            raise EOFError("the serving process closed its socket before the handshake")
        if kind == b"A" and fds:
            self.arena = SharedArena.attach(fds[0])

    def _frame_end(self) -> int:
        """Where the first buffered frame ends (0: its header is not in yet)."""
        buf = self._buf
        return _HEADER + int.from_bytes(buf[:_HEADER], "little") if len(buf) >= _HEADER else 0

    @property
    def buffered(self) -> bool:
        """Whether a whole message is in already (so :meth:`receive` will not block; select cannot tell)."""
        end = self._frame_end()
        return 0 < end <= len(self._buf)

    def receive(self) -> Any:
        """The next message (blocking): one read of up to :data:`_RECV_BYTES` for a batch's frame, where a
        header read and a body read took two; a larger frame (an inline tensor) is read into memory of its
        own size. EOFError when the serving process closed the socket."""
        buf = self._buf
        while True:
            end = self._frame_end()
            if 0 < end <= len(buf):
                with memoryview(buf) as view, view[_HEADER:end] as body:
                    message = pickle.loads(body)
                del buf[:end]
                return message
            if end - len(buf) > _RECV_BYTES:
                return self._receive_large(end)
            chunk = self.sock.recv(_RECV_BYTES)
            if not chunk:
                raise EOFError("the socket closed mid-frame" if buf else "the socket closed")
            buf += chunk

    def _receive_large(self, end: int) -> Any:
        """The rest of a frame of ``end`` bytes whose start is buffered: read in place (``recv_into``), no
        chunk allocated and appended per read."""
        frame = bytearray(end)
        got = len(self._buf)
        frame[:got] = self._buf
        self._buf = bytearray()  # nothing beyond the frame is read: each read stops at its end
        with memoryview(frame) as view:
            while got < end:
                n = self.sock.recv_into(view[got:])
                if n == 0:
                    raise EOFError("the socket closed mid-frame")
                got += n
            with view[_HEADER:] as body:
                return pickle.loads(body)

    def tensor(self, item: Any) -> torch.Tensor:
        """A request tensor: a view of this connection's arena (``item`` a slot), or decoded from its inline message."""
        return self.arena.view(item) if isinstance(item, tuple) and self.arena is not None else decode_tensor(item)

    def destination(self, slot: Slot | None, request: PreparedRequest) -> torch.Tensor | None:
        """Where the request's output goes: the view of ``slot`` in this connection's arena, when it holds exactly
        that output; None (send it inline) otherwise."""
        if slot is None or self.arena is None or list(slot[2]) != request.output_shape or slot[1] != dtype_name(request.dtype):
            return None
        return self.arena.view(slot)

    def answer(self, job: int, output: torch.Tensor | BaseException, call: BatchOutput | None, written: bool,
               status: tuple) -> None:
        """Send ``output``: this batch's part of ``call`` (the merged call that ran it; ``written``: it is in the
        batch's output slot already), or, with ``call`` None, its exception; ``status`` as the module docstring says."""
        if call is None:
            message = (job, _picklable(output), 0.0, 0, "", None, status)  # type: ignore[arg-type]
        else:
            message = (job, None if written else encode_tensor(output), call.seconds, call.call_tokens, call.path,  # type: ignore[arg-type]
                       call.started, status)
        _send(self.sock, message)


def _child_main(spec: WorkerSpec, socks: list[socket.socket]) -> None:
    """The compute process: build, shake hands with each serving process, then run their batches.

    Batches that arrive together from several serving processes (front ends) and share a pool key
    run as one ``ComputeWorker.run`` (up to ``spec.max_batch_tokens`` tokens): the GPU sees their union. A failing merged batch is run again
    one batch at a time, so that one front end's bad batch fails only its own. The child exits
    when every serving process has said stop or closed its socket.
    """
    # Ctrl-C (SIGINT) and a SIGTERM to the whole process group (systemd's KillMode=control-group, `kill -- -PGID`, a
    # shell job) reach this process too: the serving processes drain first, and it exits when the last of them has
    # said stop or closed its socket (ProcessComputeWorker.close kills it if that does not come in time).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [compute]: %(message)s")
    connections = [_Connection(sock) for sock in socks]
    try:
        if spec.compute_cpu is not None:  # before CUDA and torch start threads of their own: they inherit it
            from lutb_server.cpu_placement import pin_process

            pin_process({spec.compute_cpu})
            log.info("pinned to CPU %d", spec.compute_cpu)
        from lutb_client.allocator import tune_malloc
        from lutb_kernels.checkpoint import Checkpoint
        from lutb_server.app import apply_gil_switch_interval, apply_intra_op_threads, settle_gc
        from lutb_server.backends import choose_backend, resolve_device
        from lutb_server.engine import ExpertEngine
        from lutb_server.worker import ComputeWorker

        log.info("%s", tune_malloc())  # inline batches (no shared arena) are large messages
        checkpoint = Checkpoint(spec.checkpoint)
        if spec.checkpoint_identity is not None:
            checkpoint.expect_identity(spec.checkpoint_identity, "the serving process that hashed it")
        device = resolve_device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        engine = ExpertEngine(checkpoint, choose_backend(spec.backend, checkpoint.config, device),
                              max_tokens_per_request=spec.max_tokens_per_request, validate_tiles=spec.validate_tiles,
                              content_hash=spec.content_hash)
        # after loading, as the worker thread's server does: the tile check of a large checkpoint runs on every
        # CPU torch has, not on the one thread the compute loop wants
        apply_intra_op_threads(spec.intra_op_threads, device)
        apply_gil_switch_interval(spec.gil_switch_interval_us, device)
        worker = ComputeWorker(engine, cuda_graph_max_tokens=spec.cuda_graph_max_tokens, cuda_graph_top_k=spec.cuda_graph_top_k)
        graphs_s = worker.capture_graphs()
        warm_up_s = worker.warm_up(spec.warm_up_tokens) if spec.warm_up_tokens else 0.0
        log.info("%s", settle_gc())
        memory, status_read = _gpu_memory(device), time.monotonic()
        ready = ("ready", {"weight_bytes": engine.weight_bytes, "backend": engine.backend.name,
                           "graphs_s": graphs_s, "warm_up_s": warm_up_s, "gpu_memory": memory})
    except BaseException as exc:  # noqa: BLE001 - reported to the serving processes, which raise it
        for c in connections:
            try:
                _send(c.sock, ("failed", _picklable(exc)))
            except OSError:
                pass
        return
    times = LoopTimes()
    inbox = _Inbox(connections, worker, ready, memory + times.totals(0), spin_s=spec.spin_s)
    while inbox:
        began = time.monotonic()
        inbox.read()
        times.reading_s += time.monotonic() - began
        batches = inbox.pop()
        _run_merged(worker, batches, inbox.status, spec.max_batch_tokens, during=inbox.read_arrived, times=times)
        if batches:
            inbox.called()
        inbox.release_closed()  # after the call that may have written their arenas
        if time.monotonic() - status_read >= GPU_MEMORY_PERIOD_S:  # after answering: off the batches' latency
            memory, status_read = _gpu_memory(device), time.monotonic()
        if batches:
            inbox.status = memory + times.totals(worker.batches)
    inbox.release_closed()
    log.info("done: %d experts call(s) ran %d batch(es) of %d serving process(es), %.2f a call; %s",
             worker.batches, inbox.received, len(connections), inbox.received / max(worker.batches, 1), times.summary())


class LoopTotals(NamedTuple):
    """A compute process's experts calls so far and its loop's seconds by phase (:class:`LoopTimes`), as the serving
    processes export them (``lutb_compute_calls_total``, ``lutb_compute_loop_seconds_total``). It travels inside an
    answer's ``status`` as its last five numbers (a NamedTuple is a tuple: ``memory + totals`` is a plain one)."""

    calls: int
    """Experts calls that completed (a failed one is not counted; its seconds are in ``calls_s``)."""
    calls_s: float
    answering_s: float
    reading_or_waiting_s: float
    other_s: float


_NO_STATUS = (0, 0) + LoopTotals(0, 0.0, 0.0, 0.0, 0.0)
"""An answer's ``status`` before the child has read anything: no GPU memory, no calls (a plain tuple)."""


@dataclass
class LoopTimes:
    """Where the compute process's serving loop spent its time (seconds since the loop started): in experts calls
    (``ComputeWorker.run``, its overlapped reading included), answering, and reading or waiting for batches between
    calls; the rest (``other_s``) is the loop's own work. Logged when the process exits: the share outside calls
    while batches were waiting is time the device idled between calls."""

    calls_s: float = 0.0
    answering_s: float = 0.0
    reading_s: float = 0.0
    started: float = field(default_factory=time.monotonic)

    @property
    def other_s(self) -> float:
        return max(0.0, time.monotonic() - self.started - self.calls_s - self.answering_s - self.reading_s)

    def totals(self, calls: int) -> LoopTotals:
        """The loop's figures now, with ``calls`` experts calls run (what the metrics export)."""
        return LoopTotals(calls, self.calls_s, self.answering_s, self.reading_s, self.other_s)

    def summary(self) -> str:
        """``loop: calls 81.0%, answering 3.2%, reading or waiting 14.1%, other 1.7% of 12.3 s``."""
        wall = max(time.monotonic() - self.started, 1e-9)
        shares = ", ".join(f"{name} {100 * seconds / wall:.1f}%" for name, seconds in (
            ("calls", self.calls_s), ("answering", self.answering_s), ("reading or waiting", self.reading_s),
            ("other", self.other_s)))
        return f"loop: {shares} of {wall:.1f} s"


class _Batch(NamedTuple):
    """A batch in the compute process."""

    connection: _Connection
    job: int
    request: PreparedRequest
    destination: torch.Tensor | None  # where its output goes (None: inline)
    deadline: float | None  # time.monotonic() seconds after which none of its requests wants an answer (None: never)


class _Inbox:
    """The compute process's reading of the serving processes' sockets: handshakes, the batches read and not yet
    run (in arrival order), and the connections that are gone, whose arenas stay page-locked until no call of
    theirs can still be writing there.

    Each round: :meth:`read` (blocks while nothing is ready), :meth:`pop` the batches, run them with
    :meth:`read_arrived` as the call's ``overlap`` (the next round's batches, read while the device works), then
    :meth:`release_closed`. Each read of a connection takes every whole message it brought (a serving process may
    have several batches in flight: ``batches_in_flight``).
    """

    def __init__(self, connections: list[_Connection], worker: Any, ready: object, status: tuple = _NO_STATUS,
                 spin_s: float = 0.0) -> None:
        self.waiting = list(connections)  # before the handshake: front ends start in any order
        self.open: list[_Connection] = []
        self.ahead: list[_Batch] = []
        self.closed: list[_Connection] = []
        self.received = 0  # batches read (worker.batches counts the calls that ran them)
        self.status = status  # the figures every answer carries, as last read (the loop updates them)
        self._worker = worker
        self._ready = ready
        self._spin_s = spin_s
        self._spun_until = 0.0  # the end of the poll after the last call (monotonic seconds)

    def __bool__(self) -> bool:
        """Whether anything is left to do: a connection to serve or a batch to run."""
        return bool(self.waiting or self.open or self.ahead)

    def read(self) -> None:
        """Shake hands with the serving processes that have connected, and read one message from each open
        connection that has one; wait for one only when no batch is ready to run (polling first, for up to
        ``spin_s`` after the last call, then sleeping in the kernel)."""
        buffered = [c for c in self.open if c.buffered]  # a whole message in already: select would not report it
        if buffered or self.ahead:
            readable = buffered + [c for c in select.select(self.waiting + self.open, [], [], 0)[0] if c not in buffered]
        else:
            readable = self._poll() or self._wait()
        for c in readable:
            if c in self.waiting:
                self._handshake(c)
            else:
                self._take_all(c)

    def called(self) -> None:
        """A call has run: the next :meth:`read` polls for up to ``spin_s`` from now before it sleeps."""
        if self._spin_s:
            self._spun_until = time.monotonic() + self._spin_s

    def _poll(self) -> list[_Connection]:
        """The connections readable before the poll's end (none once it is over: the caller then blocks)."""
        sockets = self.waiting + self.open
        while time.monotonic() < self._spun_until:
            readable = select.select(sockets, [], [], 0)[0]
            if readable:
                return readable
        return []

    def _wait(self) -> list[_Connection]:
        """The connections to read, waiting in the kernel until one has something."""
        if len(self.open) == 1 and not self.waiting:
            return list(self.open)  # a lone serving process: its socket, read blocking, without a select
        return select.select(self.waiting + self.open, [], [])[0]

    def read_arrived(self) -> None:
        """While a call runs on the device: read the batches that have arrived (never waits for one)."""
        buffered = [c for c in self.open if c.buffered]
        for c in buffered + [c for c in select.select(self.open, [], [], 0)[0] if c not in buffered]:
            self._take_all(c)

    def pop(self) -> list[_Batch]:
        """The batches read so far, to run now."""
        batches, self.ahead = self.ahead, []
        return batches

    def release_closed(self) -> None:
        """Let go of the connections that are gone and have no batch left to run: un-page-lock their arenas, unmap
        them and close their sockets."""
        for c in [c for c in self.closed if all(batch.connection is not c for batch in self.ahead)]:
            self.closed.remove(c)
            self._let_go(c)

    def _let_go(self, c: _Connection) -> None:
        if c.arena is not None:
            self._worker.unregister_host_memory(c.arena.memory)
        c.close()

    def _handshake(self, c: _Connection) -> None:
        self.waiting.remove(c)
        try:
            c.handshake()
            if c.arena is not None and self._worker.register_host_memory(c.arena.memory):
                log.info("page-locked a serving process's arena (%.0f MB): the GPU copies its outputs there",
                         c.arena.size / 1e6)
            _send(c.sock, self._ready)
            self.open.append(c)
        except (EOFError, OSError) as exc:
            log.warning("a serving process left before its handshake (%s)", exc)
            self._let_go(c)

    def _take_all(self, c: _Connection) -> None:
        """One message of ``c`` (its read may wait for the rest of a frame), then every whole one already buffered."""
        self._take(c)
        while c in self.open and c.buffered:
            self._take(c)

    def _take(self, c: _Connection) -> None:
        """Read ``c``'s next message: a batch joins ``ahead``; EOF (or the stop) closes the connection. A batch read
        before it still runs and is answered (a closing serving process waits for its answers)."""
        try:
            message = c.receive()
        except (EOFError, OSError):
            message = None  # that serving process is gone
        if message is None:
            self.open.remove(c)
            self.closed.append(c)  # a call running now may still be copying into its arena
            return
        job, (layer, x, ids, w, on_input, mode, scales, dtype), out_slot, deadline = message
        try:  # a batch arrives concatenated: one request
            request = PreparedRequest(layer, c.tensor(x), c.tensor(ids), c.tensor(w), on_input, mode,
                                      None if scales is None else c.tensor(scales), None if dtype is None else getattr(torch, dtype))
            destination = c.destination(out_slot, request)
        except Exception as exc:  # noqa: BLE001 - the batch's error, handed to its future
            _answer(c, job, exc, None, False, self.status)
            return
        self.ahead.append(_Batch(c, job, request, destination, deadline))
        self.received += 1


def merge_groups(requests: Sequence[PreparedRequest], max_tokens: int) -> list[list[int]]:
    """Indexes of ``requests`` grouped to run together: equal pool keys, in arrival order, at most
    ``max_tokens`` tokens a group (a larger request alone; 0: no limit), so that a merged call stays
    within the batch sizes the compute process compiled and sized its buffers for."""
    groups: list[list[int]] = []
    open_groups: dict[tuple, tuple[list[int], int]] = {}
    for i, r in enumerate(requests):
        group, tokens = open_groups.get(r.pool_key, (None, 0))
        if group is None or (max_tokens and tokens + r.tokens > max_tokens):
            group, tokens = [], 0
            groups.append(group)
        group.append(i)
        open_groups[r.pool_key] = (group, tokens + r.tokens)
    return groups


def _run_merged(worker: Any, batches: list[_Batch], status: tuple, max_tokens: int,
                during: Callable[[], None] | None = None, times: LoopTimes | None = None) -> None:
    """Run ``batches`` (up to ``batches_in_flight`` per serving process), merged by :func:`merge_groups`, and answer each;
    ``during`` runs while each call's device work runs (``ComputeWorker.run``'s ``overlap``).

    Outputs are written by the worker straight into their serving processes' output slots
    (``ComputeWorker.run(..., into=)``: a device copy into the page-locked arena, or one copy out of the pinned
    staging); a batch without one is sent inline. ``times`` (if given) gets the seconds spent in calls and answering.
    """
    for indexes in merge_groups([batch.request for batch in batches], max_tokens):
        group = _unexpired([batches[i] for i in indexes], status)
        if not group:
            continue
        call: BatchOutput | None
        began = time.monotonic()
        try:
            call = worker.run([batch.request for batch in group], [batch.destination for batch in group], overlap=during)
            outputs: list[torch.Tensor | BaseException] = list(call.outputs)
        except Exception as exc:  # noqa: BLE001 - alone, each batch gets its own result or error
            if times is not None:
                times.calls_s += time.monotonic() - began
            if len(group) > 1:
                for batch in group:
                    _run_merged(worker, [batch], status, max_tokens, during, times)
                continue
            call, outputs = None, [exc]
        answering = time.monotonic()
        for batch, output in zip(group, outputs):
            _answer(batch.connection, batch.job, output, call, batch.destination is not None, status)
        if times is not None:
            if call is not None:
                times.calls_s += answering - began
            times.answering_s += time.monotonic() - answering


def _unexpired(group: list[_Batch], status: tuple) -> list[_Batch]:
    """The batches of ``group`` still worth running; the others, whose deadline passed while they waited here, are
    answered with :class:`~lutb_server.errors.DeadlineExpired` (their serving process fails their requests)."""
    now = time.monotonic()
    live: list[_Batch] = []
    for batch in group:
        if batch.deadline is None or batch.deadline > now:
            live.append(batch)
        else:
            _answer(batch.connection, batch.job, DeadlineExpired(EXPIRED_IN_WORKER), None, False, status)
    return live


def _answer(c: _Connection, job: int, output: torch.Tensor | BaseException, call: BatchOutput | None, written: bool,
            status: tuple) -> None:
    try:
        c.answer(job, output, call, written, status)
    except OSError:
        pass  # that serving process is gone; its socket reads EOF next round


# -- the serving process's side --------------------------------------------------------------------


def spawn_compute_process(spec: WorkerSpec, connections: int = 1) -> tuple[BaseProcess, list[socket.socket]]:
    """Start the compute process (it loads in the background) with ``connections`` sockets to it.

    Returns the process and the serving processes' ends of the sockets, one per front end; each
    goes to one :class:`ProcessComputeWorker` (``connection=``), in this or another process
    (a spawned process inherits a socket passed in its arguments).

    The child ignores SIGTERM, so this process's exit no longer ends it through multiprocessing's ``terminate()`` of
    daemonic children (after which it joins them, for ever while this process still holds a socket to the child): a
    child still running when this process exits without having closed its worker is killed first.
    """
    if connections < 1:
        raise ValueError(f"connections must be >= 1, got {connections}")
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(connections)]
    process = ctx.Process(target=_child_main, args=(spec, [theirs for _, theirs in pairs]), name="lutb-compute", daemon=True)
    try:
        process.start()
    finally:
        for _, theirs in pairs:
            theirs.close()
    # exitpriority >= 0: run at exit before multiprocessing terminates (a no-op here) and joins its children
    multiprocessing.util.Finalize(None, _kill_at_exit, args=(weakref.ref(process),), exitpriority=0)
    return process, [ours for ours, _ in pairs]


def _kill_at_exit(ref: weakref.ref[BaseProcess]) -> None:
    """At exit of the process that spawned it: kill the compute process if it still runs (nobody closed its worker;
    it ignores the SIGTERM that multiprocessing would send it and would keep this process's exit waiting for it)."""
    process = ref()
    if process is None or process.exitcode is not None:
        return
    log.warning("compute process %d still running at exit (its worker was not closed); killing it", process.pid)
    process.kill()
    process.join(5)


class ProcessComputeWorker:
    """:class:`~lutb_server.worker.ComputeWorker`'s ``start``/``submit``/``close`` with the compute in a child process.

    Args:
        spec: what the child loads and how (see :class:`WorkerSpec`).
        connection: a socket from :func:`spawn_compute_process` when the compute process is
            shared by several serving processes (front ends); None: :meth:`start` spawns a
            compute process of this worker's own.
        process: the compute process, where this process started it (it is joined on
            :meth:`close` and its exit code reported); None for a front end that did not.
        loop: the event loop that does this worker's socket I/O: the server's own loop, so a
            batch submitted from it is written and its answer read with no thread hand-over.
            None: a private loop on a daemon thread (for callers without a loop: benchmarks,
            tests, scripts).
        on_gone: called once, on the I/O loop, if the child dies (or its socket breaks) while
            the worker is not being closed: the server takes itself out of service.
        arena_bytes: shared memory for the batches in flight (inputs and outputs); a batch that
            does not fit travels inline through the socket. 0: always inline.
    """

    def __init__(self, spec: WorkerSpec, *, connection: socket.socket | None = None, process: BaseProcess | None = None,
                 loop: asyncio.AbstractEventLoop | None = None, on_gone: Callable[[ComputeWorkerGone], None] | None = None,
                 arena_bytes: int = DEFAULT_ARENA_BYTES) -> None:
        self.spec = spec
        self._connection = connection
        self._started = False
        self.arena_bytes = arena_bytes if arena_supported() else 0
        self._arena: SharedArena | None = None
        self._loop = loop
        self._loop_thread: threading.Thread | None = None  # only for a private loop
        self._on_gone = on_gone
        self._closing = False
        self._starting: socket.socket | None = None  # the socket start() waits on for the child's "ready"
        self.info: dict[str, Any] = {}
        self.batches = 0
        self._process: BaseProcess | None = process
        self._transport: asyncio.Transport | None = None
        self._pending: dict[int, tuple[Future[BatchOutput], list[Slot] | None, list[int]]] = {}
        """job -> (its future, its arena slots (x, ids, weights, output; None when inline), its requests' tokens)."""
        self._lock = threading.Lock()  # _pending, _gone and the arena's spans: submit may come from any thread
        self.inline_batches = 0
        """Batches that travelled through the socket because the arena had no room (or is off)."""
        self._jobs = itertools.count()
        self._gone: ComputeWorkerGone | None = None
        self._status: tuple = _NO_STATUS

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the child's backend holds on its device (after :meth:`start`)."""
        return int(self.info.get("weight_bytes", 0))

    def gpu_memory(self) -> tuple[int, int]:
        """The child's ``(allocated, reserved)`` CUDA allocator bytes, at most ~1 s old while batches flow (for the
        metrics)."""
        status = self._status  # one answer's figures
        return status[0], status[1]

    def loop_totals(self) -> LoopTotals:
        """The child's experts calls and its loop's seconds by phase, as its last answer carried them (as of the end of
        the round of calls before that answer's; unchanged while none is answered; for the metrics)."""
        return LoopTotals(*self._status[2:])

    def start(self) -> ProcessComputeWorker:
        """Connect (spawning the compute process unless given a connection) and wait until the child
        has loaded the weights, captured its graphs and warmed up.

        Blocking (seconds to minutes), so call it off the I/O loop (``asyncio.to_thread``);
        idempotent. Raises what the child raised while starting.
        """
        if self._started:
            return self
        if self._loop is not None and self._loop.is_running() and running_loop() is self._loop:
            raise RuntimeError("ProcessComputeWorker.start() blocks: call it off its event loop (asyncio.to_thread)")
        if self._connection is None:
            self._process, (ours,) = spawn_compute_process(self.spec)
        else:
            ours = self._connection
        process = self._process
        arena = SharedArena.create(self.arena_bytes) if self.arena_bytes else None
        with self._lock:
            self._starting = ours  # close() meanwhile shuts it: the wait below ends
            closed = self._closing
        try:
            if closed:
                raise EOFError("closed before it started")
            if arena is not None:
                socket.send_fds(ours, [b"A"], [arena.fd])
            else:
                ours.sendall(b"N")
            kind, payload = _recv(ours)
        except (EOFError, OSError):
            kind, payload = "failed", None
        with self._lock:
            self._starting = None
            closed = self._closing
        if kind != "ready" or closed:
            ours.close()
            if arena is not None:
                arena.close()
            if process is not None:
                if closed:  # it was loading (it ignores SIGTERM): nothing of it to keep
                    process.kill()
                process.join(5)
            if closed:
                raise ComputeWorkerGone("the compute worker is closed (it was closed before or while it started)")
            if payload is None:
                code = process.exitcode if process is not None else "unknown"
                raise ComputeWorkerGone(f"the compute process exited while starting (exit code {code})")
            raise payload
        self.info, self._arena, self._started = payload, arena, True
        self._status = tuple(payload["gpu_memory"]) + _NO_STATUS[2:]
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="lutb-compute-io", daemon=True)
            self._loop_thread.start()
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._connect(ours), self._loop).result()
        else:  # a loop its owner runs later
            self._loop.run_until_complete(self._connect(ours))
        log.info("compute process %s ready: backend %s, %.1f MB of weights, graphs %.2fs, warm-up %.2fs, %.0f MB shared arena",
                 process.pid if process is not None else "(shared)", payload["backend"], payload["weight_bytes"] / 1e6, payload["graphs_s"], payload["warm_up_s"],
                 (arena.size if arena is not None else 0) / 1e6)
        return self

    async def _connect(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_unix_connection(
            lambda: _FrameReader(self._on_answer, self._on_lost), sock=sock)

    def submit(self, requests: Sequence[PreparedRequest], deadline: float | None = None) -> Future[BatchOutput]:
        """Queue one pooled batch; the future gives its :class:`~lutb_server.worker.BatchOutput` (seconds in the child).

        ``deadline``: ``time.monotonic()`` seconds after which the batch is not worth computing (None: always compute);
        the child does not run a batch whose deadline passed while it waited there, and the future fails with
        :class:`~lutb_server.errors.DeadlineExpired` (``time.monotonic()`` is one clock for all processes of a host:
        ``CLOCK_MONOTONIC`` on Linux).

        Thread-safe; cheapest from the I/O loop (the batch is written at once). The future
        completes on the I/O loop.

        Raises:
            ComputeWorkerGone: the child is gone (or not started).
        """
        future: Future[BatchOutput] = Future()
        first = requests[0]
        tokens = [r.tokens for r in requests]
        shapes = _batch_shapes(first, sum(tokens))
        with self._lock:
            if self._gone is not None:
                raise self._gone
            if self._transport is None:
                raise ComputeWorkerGone("the compute process is not started")
            job = next(self._jobs)
            slots = self._arena.place(shapes) if self._arena is not None else None
            self._pending[job] = (future, slots, tokens)
        inputs = [[r.x for r in requests], [r.topk_ids for r in requests], [r.topk_weights for r in requests]]
        if first.x_scales is not None:  # MXFP8 carried to the device
            inputs.append([r.x_scales for r in requests])  # type: ignore[misc]
        try:
            if slots is not None:  # concatenated straight into the shared memory: the requests' bytes, one copy each
                assert self._arena is not None
                *placed, out = (tuple(slot) for slot in slots)  # plain tuples pickle ~3x cheaper than Slots
                for parts, slot in zip(inputs, placed):
                    self._arena.write(slot, parts)
                x, ids, w, *scales = placed
            else:
                self.inline_batches += 1
                x, ids, w, *scales = (encode_tensor(_joined(parts, shape)) for parts, (_, shape) in zip(inputs, shapes))
                out = None
        except BaseException:  # nothing was sent: the job and its span are given back (the span would stay taken)
            with self._lock:
                self._pending.pop(job, None)
            self._release(slots)
            raise
        dtype = None if first.x_dtype is None else dtype_name(first.x_dtype)
        batch = (job, (first.layer, x, ids, w, first.apply_router_weight_on_input, first.output_mode,
                       scales[0] if scales else None, dtype), out, deadline)
        assert self._loop is not None
        if running_loop() is self._loop:
            self._write(batch)
        else:
            self._loop.call_soon_threadsafe(self._write, batch)
        return future

    def close(self, timeout: float | None = None) -> None:
        """Let the child finish this worker's queued batches and disconnect; where this process
        started the child, wait for it to exit (it does once every front end has disconnected;
        killed (SIGKILL) after ``timeout`` seconds: it ignores SIGTERM, see :func:`_child_main`). While :meth:`start`
        still waits for the child on another thread (a server stopped while loading), this ends that wait at once:
        ``start`` raises :class:`ComputeWorkerGone` and the child it spawned is killed. A closed worker does not start
        again.

        Blocking: call it off the I/O loop.
        """
        with self._lock:
            self._closing = True
            starting = self._starting
        if not self._started:
            if starting is not None:  # start() is waiting for the child's "ready" on another thread: end that wait
                try:
                    starting.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                if self._process is not None:
                    self._process.kill()  # it was loading (it ignores SIGTERM); start() reaps it
            return
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._write, None)
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                log.warning("compute process %d did not stop within %ss; killing it", self._process.pid, timeout)
                self._process.kill()  # it ignores SIGTERM
                self._process.join(5)
        else:  # a shared child: our answers come before it reads the stop
            end = time.monotonic() + (timeout if timeout is not None else 60.0)
            while self._pending and self._gone is None and time.monotonic() < end:
                time.sleep(0.005)
        if not self._loop.is_closed():
            done = threading.Event()

            def shut() -> None:
                if self._transport is not None:
                    self._transport.close()
                done.set()

            self._loop.call_soon_threadsafe(shut)
            done.wait(5)
        if self._loop_thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(5)
            self._loop.close()
            self._loop_thread = None
        self._fail_pending(ComputeWorkerGone("the compute worker is closed"))
        self._started = False
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    # On the I/O loop:

    def _write(self, message: object) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            self._fail_pending(ComputeWorkerGone("the compute process is gone (its socket is closed)"))
            return
        for part in _frame(message):
            transport.write(part)

    def _on_answer(self, message: Any) -> None:
        job, result, seconds, call_tokens, path, started, self._status = message
        with self._lock:
            entry = self._pending.pop(job, None)
        if entry is None:
            return
        future, slots, tokens = entry
        outputs: list[WireTensor] = []
        if result is None:  # in the output slot: each request's bytes copied out before the span is given back
            assert self._arena is not None and slots is not None
            offset, dtype, shape = slots[-1]
            outputs = _split_rows(self._arena.read, offset, getattr(torch, dtype), shape, tokens)
        elif not isinstance(result, BaseException):
            whole = WireTensor.from_message(result)
            outputs = [whole] if len(tokens) == 1 else _split_rows(
                lambda at, n: whole.data[at:at + n], 0, whole.dtype, whole.shape, tokens)
        self._release(slots)
        if not future.set_running_or_notify_cancel():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            self.batches += 1
            future.set_result(BatchOutput(outputs, seconds, call_tokens, path, started))  # type: ignore[arg-type]

    def _release(self, slots: list[Slot] | None) -> None:
        """Give back the arena span of a batch's ``slots`` (None: it travelled inline); once the child is gone every
        span was given back at once."""
        if slots is not None:
            with self._lock:
                if self._arena is not None and self._gone is None:
                    self._arena.release(slots[0].offset)

    def _on_lost(self, exc: Exception | None) -> None:
        code = self._process.exitcode if self._process is not None else None
        reason = f"{type(exc).__name__}: {exc}" if exc is not None else "its socket closed"
        self._fail_pending(ComputeWorkerGone(f"the compute process is gone (exit code {code}; {reason})"))

    def _fail_pending(self, error: ComputeWorkerGone) -> None:
        with self._lock:
            first = self._gone is None
            if first:
                self._gone = error
            pending, self._pending = self._pending, {}
            if self._arena is not None:
                self._arena.release_all()
        for future, *_ in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        if first and not self._closing:
            log.error("%s", error)
            if self._on_gone is not None:
                self._on_gone(error)


def _joined(parts: list[torch.Tensor | WireTensor], shape: tuple[int, ...]) -> WireTensor:
    """``parts`` (one dtype) concatenated along dim 0 as one WireTensor of ``shape`` (a batch sent inline)."""
    return WireTensor(parts[0].dtype, shape, b"".join(host_bytes(part) for part in parts))


def _split_rows(read: Callable[[int, int], bytes], offset: int, dtype: torch.dtype, shape: Sequence[int],
                tokens: list[int]) -> list[WireTensor]:
    """A batch's output of ``shape`` (``dtype``, from ``offset`` of what ``read(offset, nbytes)`` copies out: the
    arena, or an inline message's bytes) as one WireTensor per request of ``tokens`` rows."""
    _, *row = shape
    row_bytes = dtype.itemsize * math.prod(row)
    parts = []
    for n in tokens:
        parts.append(WireTensor(dtype, (n, *row), read(offset, n * row_bytes)))
        offset += n * row_bytes
    return parts


def _batch_shapes(first: PreparedRequest, tokens: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of a batch of ``tokens`` pooled with ``first``: its inputs (x, topk_ids, topk_weights, and for
    MXFP8 carried to the device x's scales), then the output (``[T, H]`` combined, ``[T, k, H]`` route-major, in the
    model dtype)."""
    hidden, k = int(first.x.shape[1]), int(first.topk_ids.shape[1])
    shapes = [(first.x.dtype, (tokens, hidden)), (first.topk_ids.dtype, (tokens, k)), (first.topk_weights.dtype, (tokens, k))]
    if first.x_scales is not None:
        shapes.append((torch.uint8, (tokens, int(first.x_scales.shape[1]))))
    return shapes + [(first.dtype, (tokens, k, hidden) if first.output_mode == "route_major" else (tokens, hidden))]


__all__ = ["DEFAULT_ARENA_BYTES", "GPU_MEMORY_PERIOD_S", "ComputeWorkerGone", "LoopTimes", "LoopTotals", "ProcessComputeWorker", "WorkerSpec", "merge_groups",
           "spawn_compute_process"]
