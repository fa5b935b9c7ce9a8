"""The compute worker in a child process: same outputs as the thread, errors and a dead child handled, a server on it."""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lutb_client import AsyncExpertClient, ExpertClient, ExpertServiceError, ShardedExpertClient
from lutb_client._proto.lutb.v1.expert_service_pb2 import GetModelInfoRequest
from lutb_client._proto.lutb.v1.expert_service_pb2_grpc import ExpertServiceStub
from lutb_client.codec import WireTensor, as_tensor, decode_tensor, encode_tensor
from lutb_kernels.checkpoint import Checkpoint
from lutb_kernels.experts import ReferenceExperts
from lutb_server.backends import choose_backend, resolve_device
from lutb_server.engine import ExpertEngine, PreparedRequest
from lutb_server.errors import to_status
from lutb_server.testing import SLEEP_EXPERTS_ENV, ServerThread, ServeProcess
from lutb_server.worker import ComputeWorker
from lutb_server.shared_arena import arena_supported
from lutb_server.worker_process import DEFAULT_ARENA_BYTES, ComputeWorkerGone, ProcessComputeWorker, WorkerSpec, spawn_compute_process


def _engines(path: Path) -> tuple[ExpertEngine, ExpertEngine]:
    """(the serving process's engine: expert ids only, a full engine to compare with)."""
    checkpoint = Checkpoint(path)
    choice = choose_backend("reference", checkpoint.config, resolve_device("cpu"))
    return ExpertEngine(checkpoint, choice, load_experts=False), ExpertEngine(checkpoint, choice)


def _requests(engine: ExpertEngine, layer: int, sizes: tuple[int, ...], seed: int,
              output_mode: str = "combined") -> list[PreparedRequest]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for tokens in sizes:
        x = torch.randn(tokens, 128, generator=gen).to(torch.bfloat16)
        ids = (torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)]) if tokens else torch.zeros(0, 2)).to(torch.int32)
        weights = torch.softmax(torch.randn(tokens, 2, generator=gen), dim=1)
        out.append(engine.prepare(layer, x, ids, weights, output_mode=output_mode))
    return out


# How batches travel: all through the shared arena, all inline through the socket, or an arena
# so small (16 KiB) that the larger batches and every second one in flight fall back inline.
TRANSPORTS = {"arena": DEFAULT_ARENA_BYTES, "inline": 0, "small arena": 16 << 10}


@pytest.fixture(scope="module", params=list(TRANSPORTS.values()), ids=list(TRANSPORTS))
def process_worker(tiny_checkpoint: Path, request: pytest.FixtureRequest):  # noqa: ANN201
    spec = WorkerSpec(str(tiny_checkpoint), "reference", "cpu", validate_tiles=False)
    worker = ProcessComputeWorker(spec, arena_bytes=request.param).start()
    yield worker
    worker.close(10)


def _poison_arena(worker: ProcessComputeWorker) -> None:
    """NaN bit patterns over the whole arena: an output the child did not write cannot pass for one."""
    if worker._arena is not None:
        worker._arena._bytes.fill_(0xFF)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32, torch.uint8])
@pytest.mark.parametrize("shape", [(0, 4), (1,), (3, 5)])
def test_tensors_cross_the_pipe_unchanged(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Tensors travel between the processes as the wire codec's messages, pickled."""
    t = (torch.randn(shape) * 100).to(dtype)
    back = decode_tensor(pickle.loads(pickle.dumps(encode_tensor(t))))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    if back.numel():
        back.view(-1)[0] = 1  # writable, and not the original's memory
        assert back.data_ptr() != t.data_ptr()


def _connection_pair():  # noqa: ANN202
    import socket

    from lutb_server.worker_process import _Connection

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return ours, _Connection(theirs)


# messages sent back to back (their frames coalesce in the child's reads): small, empty, one larger than a read
FRAME_CASES = {
    "one small": [("batch", 1, (0, "bfloat16", (16, 2048)))],
    "two in one read": [("batch", 1), None],  # a batch and the stop right behind it
    "large between small": [1, b"\x5a" * (200 << 10), 2],
    "many": list(range(50)),
}


@pytest.mark.parametrize("messages", FRAME_CASES.values(), ids=FRAME_CASES.keys())
def test_the_child_reads_each_frame_whole_however_reads_split_them(messages: list[object]) -> None:
    from lutb_server.worker_process import _frame

    ours, conn = _connection_pair()
    try:
        wire = b"".join(part for m in messages for part in _frame(m))
        with ThreadPoolExecutor(1) as pool:  # drip-fed in odd pieces, so headers and bodies straddle reads
            sent = pool.submit(lambda: [ours.sendall(wire[i:i + 7777]) for i in range(0, len(wire), 7777)])
            got = [conn.receive() for _ in messages]
            sent.result(10)
        assert got == messages and not conn.buffered
        ours.sendall(b"".join(part for m in messages[:2] for part in _frame(m)))
        assert conn.receive() == messages[0]
        if len(messages) > 1:  # the next one came in with the first read: select cannot see it, buffered says so
            deadline = time.monotonic() + 5
            while not conn.buffered and time.monotonic() < deadline:
                conn._buf += conn.sock.recv(1 << 20)
            assert conn.buffered and conn.receive() == messages[1]
        ours.sendall(_frame(("half",))[0][:5])
        ours.close()
        with pytest.raises(EOFError, match="mid-frame"):
            conn.receive()
    finally:
        conn.sock.close()


def test_the_child_sees_a_closed_socket_as_eof() -> None:
    ours, conn = _connection_pair()
    ours.close()
    with pytest.raises(EOFError, match="closed"):
        conn.receive()
    conn.sock.close()


def test_a_large_frame_cut_short_is_eof_mid_frame() -> None:
    """A frame larger than one read (an inline tensor) is read in place; the socket closing inside it is an error."""
    from lutb_server.worker_process import _frame

    ours, conn = _connection_pair()
    try:
        header, body = _frame(b"\x01" * (1 << 20))
        ours.sendall(header + body[: 100 << 10])  # within the socket buffer: nobody reads yet
        ours.close()
        with pytest.raises(EOFError, match="mid-frame"):
            conn.receive()
    finally:
        conn.sock.close()


@pytest.mark.skipif(not arena_supported(), reason="needs os.memfd_create (Linux)")
def test_an_output_slot_is_used_only_when_it_holds_exactly_the_output(tiny_checkpoint: Path) -> None:
    from lutb_server.shared_arena import SharedArena

    _, conn = _connection_pair()
    conn.arena = SharedArena.create(1 << 20)
    try:
        engine, _ = _engines(tiny_checkpoint)
        (request,) = _requests(engine, 0, (3,), seed=0)
        route_major = _requests(engine, 0, (3,), seed=0, output_mode="route_major")[0]
        view = conn.destination((512, "bfloat16", (3, 128)), request)
        assert view is not None and view.shape == (3, 128) and view.dtype == torch.bfloat16
        assert conn.destination((512, "bfloat16", (3, 128)), route_major) is None  # [3, 2, 128] wanted
        assert conn.destination((512, "float32", (3, 128)), request) is None
        assert conn.destination(None, request) is None
        conn.arena, arena = None, conn.arena  # inline transport: no arena, no destination
        assert conn.destination((512, "bfloat16", (3, 128)), request) is None
        conn.arena = arena
    finally:
        conn.arena.close()
        conn.sock.close()


def test_outputs_equal_the_thread_worker(process_worker: ProcessComputeWorker, tiny_checkpoint: Path) -> None:
    catalog, full = _engines(tiny_checkpoint)
    assert process_worker.weight_bytes == full.weight_bytes > 0
    assert process_worker.gpu_memory() == (0, 0)  # a CPU child has no CUDA allocator
    assert catalog.layer_ids == full.layer_ids and catalog.expert_ids(1) == full.expert_ids(1)
    inline_before = process_worker.inline_batches
    cases = ((0, (3, 5), "combined"), (1, (1,), "combined"), (1, (7, 2, 4), "combined"), (0, (2, 3), "route_major"),
             (1, (40,), "combined"), (0, (0,), "combined"), (1, (0, 3, 0), "combined"))
    for layer, sizes, mode in cases:
        requests = _requests(catalog, layer, sizes, seed=layer * 10 + len(sizes), output_mode=mode)
        _poison_arena(process_worker)
        handed = time.monotonic()
        got, seconds, call_tokens, path, started = process_worker.submit(requests).result(60)
        answered = time.monotonic()
        want = ComputeWorker(full).run(requests).outputs
        assert seconds > 0 and len(got) == len(sizes) and call_tokens == sum(sizes)
        # the child's call start crosses the socket, on the clock the serving process reads (CLOCK_MONOTONIC)
        assert started is not None and handed <= started and started + seconds <= answered + 1e-3
        assert path == "eager"  # the child's BatchOutput.path crosses the socket (no CUDA graphs on the CPU)
        for g, w in zip(got, want):  # the bytes read out of the arena (or the inline message), no tensor made
            assert isinstance(g, WireTensor) and g.dtype == w.dtype and g.shape == tuple(w.shape)
            assert torch.equal(g.tensor(), w)
    inline = process_worker.inline_batches - inline_before
    if process_worker.arena_bytes == DEFAULT_ARENA_BYTES:
        assert inline == 0
    elif process_worker.arena_bytes == 0:
        assert inline == len(cases)
    else:  # 16 KiB: the 40-token batch (10 KiB in, 10 KiB out) does not fit; the others do
        assert inline == 1


def test_mxfp8_carried_as_sent_crosses_to_the_child(process_worker: ProcessComputeWorker, tiny_checkpoint: Path) -> None:
    """A batch of MXFP8 input carried as sent (as a CUDA engine prepares it) reaches the child with its scales and
    the model dtype, through the arena or inline; its results are those of the dequantized input."""
    from lutb_kernels.mxfp8 import mxfp8_quantize

    catalog, full = _engines(tiny_checkpoint)
    for sizes in ((3, 5), (6,), (40,)):
        dense = _requests(catalog, 1, sizes, seed=len(sizes) + 20)
        carried = []
        for r in dense:
            q, scales = mxfp8_quantize(r.x, full.config.mxfp8_scale_mode)
            carried.append(PreparedRequest(1, q, r.topk_ids, r.topk_weights, False, "combined", scales, torch.bfloat16))
        _poison_arena(process_worker)
        got = process_worker.submit(carried).result(60).outputs
        want = ComputeWorker(full).run([full.prepare(1, r.x, r.topk_ids, r.topk_weights, hidden_scales=r.x_scales)
                                        for r in carried]).outputs
        for g, w in zip(got, want):
            assert g.dtype == torch.bfloat16 and torch.equal(as_tensor(g), w)


def test_a_failing_batch_fails_alone(process_worker: ProcessComputeWorker, tiny_checkpoint: Path) -> None:
    catalog, _ = _engines(tiny_checkpoint)
    good = _requests(catalog, 0, (2,), seed=3)
    r = good[0]
    unknown_layer = PreparedRequest(9, r.x, r.topk_ids, r.topk_weights, False, "combined")  # bypasses validation
    failed = process_worker.submit([unknown_layer])
    assert isinstance(failed.exception(60), KeyError)
    outputs = process_worker.submit(good).result(60).outputs  # the child carries on
    assert outputs[0].shape == (2, 128)


def test_many_batches_in_flight_complete_in_any_interleaving(process_worker: ProcessComputeWorker, tiny_checkpoint: Path) -> None:
    catalog, full = _engines(tiny_checkpoint)
    batches = [_requests(catalog, i % 2, (1 + i % 5,), seed=100 + i) for i in range(24)]
    with ThreadPoolExecutor(4) as pool:
        futures = list(pool.map(process_worker.submit, batches))
    merged = 0
    for batch, future in zip(batches, futures):
        result = future.result(60)
        merged += result.call_tokens > batch[0].tokens
        # The child merges the batches it finds queued together (same layer): a merged call may round differently.
        torch.testing.assert_close(as_tensor(result.outputs[0]), ComputeWorker(full).run(batch)[0][0])
    assert merged, "no two queued batches of this connection ever ran as one call"


def test_the_child_polls_for_the_next_batch_only_within_the_spin() -> None:
    """compute_spin_us: after a call the child's inbox polls its sockets (a batch arriving then is read without
    sleeping in the kernel) until the spin is over, then reports nothing readable, so that the caller blocks."""
    import socket

    from lutb_server.worker_process import _Inbox

    ours, theirs = socket.socketpair()
    try:
        inbox = _Inbox([], worker=None, ready=None, spin_s=0.5)
        inbox.open = [ours]  # anything with a fileno() serves select
        assert inbox._poll() == []  # no call yet: no poll
        inbox.called()
        threading.Timer(0.05, theirs.send, (b"x",)).start()
        start = time.monotonic()
        assert inbox._poll() == [ours]  # found while polling
        assert time.monotonic() - start < 0.45
        ours.recv(1)
        assert inbox._poll() == []  # nothing came: the poll ends with the spin, not before
        assert inbox._spun_until <= time.monotonic() < inbox._spun_until + 0.4
        inbox._spin_s = 0.0
        inbox.called()
        assert inbox._poll() == []  # compute_spin_us 0: never polls
    finally:
        ours.close()
        theirs.close()


def test_a_spinning_child_answers_batches_near_and_far_apart(tiny_checkpoint: Path) -> None:
    catalog, full = _engines(tiny_checkpoint)
    worker = ProcessComputeWorker(WorkerSpec(str(tiny_checkpoint), "reference", "cpu", validate_tiles=False, spin_s=0.05)).start()
    try:
        for i, gap in enumerate((0.0, 0.01, 0.2, 0.0, 0.1)):  # inside the 50 ms poll and after it
            time.sleep(gap)
            batch = _requests(catalog, i % 2, (1 + i,), seed=300 + i)
            assert torch.equal(as_tensor(worker.submit(batch).result(60).outputs[0]), ComputeWorker(full).run(batch).outputs[0])
    finally:
        worker.close(10)


def test_a_dead_child_fails_pending_and_later_batches(tiny_checkpoint: Path) -> None:
    catalog, _ = _engines(tiny_checkpoint)
    worker = ProcessComputeWorker(WorkerSpec(str(tiny_checkpoint), "reference", "cpu", validate_tiles=False)).start()
    try:
        worker.submit(_requests(catalog, 0, (2,), seed=1)).result(60)
        worker._process.kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                worker.submit(_requests(catalog, 0, (2,), seed=2)).result(10)
            except ComputeWorkerGone as exc:
                assert "exited" in str(exc) or "gone" in str(exc)
                break
        else:
            pytest.fail("batches kept succeeding after the compute process was killed")
        with pytest.raises(ComputeWorkerGone):
            worker.submit(_requests(catalog, 0, (2,), seed=3))
        assert to_status(ComputeWorkerGone("x"))[0] == grpc.StatusCode.UNAVAILABLE  # clients fail over
    finally:
        worker.close(5)


def test_a_child_that_cannot_start_raises_its_error(tmp_path: Path) -> None:
    worker = ProcessComputeWorker(WorkerSpec(str(tmp_path / "missing"), "reference", "cpu"))
    with pytest.raises(Exception, match="missing"):
        worker.start()


def test_server_on_a_compute_process(tiny_checkpoint: Path) -> None:
    ckpt = Checkpoint(tiny_checkpoint)
    local = ReferenceExperts(ckpt.config, ckpt.layer(1), "cpu")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 128, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(6)]).to(torch.int32)
    weights = torch.softmax(torch.randn(6, 2, generator=gen), dim=1)
    with ServerThread(checkpoint=tiny_checkpoint, compute_worker="process", validate_checkpoint=False) as server:
        with ExpertClient(server.address) as client:
            info = client.model_info()
            assert [layer.layer for layer in info.layers] == [0, 1] and list(info.layers[1].expert_ids) == list(range(8))
            results = [functools.partial(client.forward_detailed, 1, x, ids, weights)() for _ in range(3)]
        running = server.server
        assert running is not None and running.engine is not None
        assert running.engine.weight_bytes == 0  # the serving process holds no weights; the child does
        assert running.scheduler.worker.arena_bytes > 0 and running.scheduler.worker.inline_batches == 0  # shared memory
        assert running.metrics.registry.get_sample_value("lutb_weight_bytes") == _engines(tiny_checkpoint)[1].weight_bytes
        # The compute process dies: the server takes itself out of service (health NOT_SERVING, requests
        # UNAVAILABLE so clients fail over) and flags the failure, on which `serve()` drains and exits 1.
        running.scheduler.worker._process.kill()
        deadline = time.monotonic() + 10
        while not running.failed.is_set():
            assert time.monotonic() < deadline, "the server did not notice its compute process die"
            time.sleep(0.05)
        with grpc.insecure_channel(server.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with ExpertClient(server.address, retries=0) as client, pytest.raises(ExpertServiceError) as refused:
            client.forward(1, x, ids, weights)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    for result in results:
        assert result.timing.compute_us > 0
        assert 0 < result.timing.wait_us <= result.timing.handoff_us  # the batch's message to the child takes time
        assert torch.equal(as_tensor(result.output), local.forward(x, ids, weights))


def _compute_pid(serving: ServeProcess) -> int:
    """From the first front end's log (the others report the shared process without a pid)."""
    found = [m for m in (re.search(r"compute process (\d+) ready", line) for line in serving.lines) if m]
    assert found, "".join(serving.lines)
    return int(found[0].group(1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


def test_lutb_serve_exits_1_when_its_compute_process_dies(tiny_checkpoint: Path) -> None:
    """So that a supervisor (Kubernetes) restarts a server that can no longer compute."""
    serving = ServeProcess("--checkpoint", str(tiny_checkpoint), "--compute-worker", "process", "--no-validate-checkpoint").wait_ready()
    try:
        os.kill(_compute_pid(serving), signal.SIGKILL)
        assert serving.proc.wait(60) == 1, "".join(serving.lines)
    finally:
        serving.kill()


def test_lutb_serve_stops_its_compute_process_on_sigterm(tiny_checkpoint: Path) -> None:
    serving = ServeProcess("--checkpoint", str(tiny_checkpoint), "--compute-worker", "process", "--no-validate-checkpoint").wait_ready()
    try:
        child = _compute_pid(serving)
        assert _alive(child)
        assert serving.stop(60) == 0, "".join(serving.lines)
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the compute process outlived its server"
            time.sleep(0.05)
    finally:
        serving.kill()
    # both processes set (or left, saying why) their malloc thresholds at start-up (lutb_client.allocator)
    said = [line for line in serving.lines if "malloc thresholds:" in line]
    assert len(said) == 2 and sum("[compute]" in line for line in said) == 1, said


def test_an_engine_without_experts_validates_but_does_not_compute(tiny_checkpoint: Path) -> None:
    catalog, full = _engines(tiny_checkpoint)
    assert catalog.layer_ids == full.layer_ids and catalog.weight_bytes == 0
    request = _requests(catalog, 0, (2,), seed=5)[0]
    with pytest.raises(RuntimeError, match="load_experts=False"):
        catalog.forward_prepared(request)
    with pytest.raises(RuntimeError, match="load_experts=False"):
        ComputeWorker(catalog)


def test_one_compute_process_serves_several_front_ends(tiny_checkpoint: Path) -> None:
    """Two connections to one child (two front ends): batches that meet in the child run as one call (each
    reports that call's tokens), each gets its own outputs, a failing batch fails only its own future, and the
    child exits once both disconnect."""
    catalog, full = _engines(tiny_checkpoint)
    spec = WorkerSpec(str(tiny_checkpoint), "reference", "cpu", validate_tiles=False)
    process, (first, second) = spawn_compute_process(spec, 2)
    owner = ProcessComputeWorker(spec, connection=first, process=process)
    other = ProcessComputeWorker(spec, connection=second, arena_bytes=0)  # one inline, one through its arena
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda w: w.start(), (owner, other)))
    try:
        merged = 0
        for round_ in range(6):
            busy = owner.submit(_requests(catalog, 0, (300,), seed=round_))  # keeps the child busy while the next two queue
            a = _requests(catalog, 1, (3, 4), seed=50 + round_)
            b = _requests(catalog, 1, (5,), seed=80 + round_)
            got_a, got_b = owner.submit(a), other.submit(b)
            assert torch.equal(as_tensor(busy.result(60)[0][0]), ComputeWorker(full).run(_requests(catalog, 0, (300,), seed=round_))[0][0])
            for got, batch in ((got_a, a), (got_b, b)):
                outputs, call_tokens = got.result(60).outputs, got.result().call_tokens
                assert call_tokens in (sum(r.tokens for r in batch), 12)  # alone, or merged with the other front end's
                for g, w in zip(outputs, ComputeWorker(full).run(batch).outputs):
                    assert torch.equal(as_tensor(g), w)
            assert got_a.result().call_tokens == got_b.result().call_tokens or 12 not in (
                got_a.result().call_tokens, got_b.result().call_tokens)
            merged += got_a.result().call_tokens == 12
        assert merged, "the two front ends' batches never met in one call (the child runs a 300-token batch first)"
        r = _requests(catalog, 1, (2,), seed=7)[0]
        bad = PreparedRequest(9, r.x, r.topk_ids, r.topk_weights, False, "combined")  # an unknown layer, past validation
        busy = owner.submit(_requests(catalog, 0, (300,), seed=99))
        failed, good = owner.submit([bad]), other.submit([r])
        assert isinstance(failed.exception(60), KeyError)
        assert torch.equal(as_tensor(good.result(60)[0][0]), ComputeWorker(full).run([r])[0][0])
        busy.result(60)
    finally:
        other.close(10)
        owner.close(30)
    assert process.exitcode == 0


def _two_free_ports() -> int:
    """A port p with p + 1 free too (the front ends' metrics ports)."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
        return base
    raise RuntimeError("no two consecutive free ports")


def _forward_requests_by_front_end(metrics_port: int) -> dict[str, float]:
    """Front end 0's endpoint: OK forward requests per ``front_end`` label, and which front ends it could read."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "lutb_forward_requests_total" and sample.labels.get("code") == "OK":
                counts[sample.labels["front_end"]] = counts.get(sample.labels["front_end"], 0.0) + sample.value
            if sample.name == "lutb_front_end_up":
                assert sample.value == 1.0, sample
    return counts


def test_lutb_serve_with_two_front_ends(tiny_checkpoint: Path) -> None:
    """Two serving processes on one port and one compute process: clients on separate connections reach both
    (front end 0's metrics endpoint counts each front end's requests under its label), every answer is right,
    the checkpoint is hashed once for the three processes (each front end reports the hash), and SIGTERM stops
    all of them and the metrics process."""
    ckpt = Checkpoint(tiny_checkpoint)
    local = ReferenceExperts(ckpt.config, ckpt.layer(0), "cpu")
    metrics = _two_free_ports()
    serving = ServeProcess("--checkpoint", str(tiny_checkpoint), "--compute-worker", "process", "--front-ends", "2",
                           "--metrics-port", str(metrics), "--no-validate-checkpoint").wait_ready()
    try:
        front_end = [line for line in serving.lines if "front ends 1-1 started" in line]
        assert front_end, "".join(serving.lines)
        pids = [int(p) for p in re.search(r"pids \[([\d, ]+)\]", front_end[0]).group(1).split(",")]  # type: ignore[union-attr]
        child = _compute_pid(serving)
        gateway = [m for m in (re.search(r"metrics process (\d+) serves the 2 front ends", line) for line in serving.lines) if m]
        assert len(gateway) == 1, "".join(serving.lines)
        hashed = [line for line in serving.lines if "lutb_server.engine" in line and " hashed " in line]
        assert len(hashed) == 1 and not re.search(r"\[(front end \d+|compute)\]", hashed[0]), hashed  # front end 0's
        gen = torch.Generator().manual_seed(3)
        with ExpertClient(serving.address, connections=12) as client:  # the kernel spreads connections over front ends
            fronts = client.spread_connections()  # then the client evens them out: 6 on each
            assert sorted(fronts) == [0] * 6 + [1] * 6, fronts
            for call in range(12):  # one call per connection, in turn
                x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
                ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(3)]).to(torch.int32)
                weights = torch.softmax(torch.randn(3, 2, generator=gen), dim=1)
                assert torch.equal(client.forward(0, x, ids, weights), local.forward(x, ids, weights)), call
        counts = _forward_requests_by_front_end(metrics)
        assert counts == {"0": 6, "1": 6}, counts

        async def spread_async_client() -> tuple[list[int], list[int], set[str], set[str]]:
            async with AsyncExpertClient(serving.address, connections=4) as aclient:
                fronts = await aclient.spread_connections()
                infos = [await aclient.model_info() for _ in range(4)]  # calls take the connections in turn
                return (fronts, [info.front_end for info in infos], {info.content_hash for info in infos},
                        {info.instance_id for info in infos})

        fronts, seen, hashes, instances = asyncio.run(spread_async_client())
        assert sorted(fronts) == [0, 0, 1, 1] and seen == fronts, (fronts, seen)
        assert hashes == {ckpt.content_hash()}, hashes
        assert len(instances) == 1 and len(next(iter(instances))) == 16, instances  # one server, one id
        assert serving.stop(60) == 0, "".join(serving.lines)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in (*pids, child, int(gateway[0].group(1)))):
            assert time.monotonic() < deadline, "a front end, the compute process or the metrics process outlived the server"
            time.sleep(0.05)
        done = [line for line in serving.lines if "[compute]: done:" in line]  # its summary: batches per experts call
        assert len(done) == 1 and re.search(r"\d+ experts call\(s\) ran 12 batch\(es\) of 2 serving process\(es\)", done[0]), done
        settled = [line for line in serving.lines if "start-up objects frozen" in line]  # each process, once started
        assert len(settled) == 3 and sum("[compute]" in line for line in settled) == 1, settled
        assert sum("[front end 1]" in line for line in settled) == 1, settled
    finally:
        serving.kill()


def _spawn_front_ends(settings: object, checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """``FrontEnds.spawn`` of front ends 1..N-1 with ``multiprocessing`` faked: the args each process was started with."""
    import socket
    from types import SimpleNamespace

    from lutb_server import front_ends

    started: list[SimpleNamespace] = []

    def process(**kwargs: object) -> SimpleNamespace:
        made = SimpleNamespace(**kwargs, pid=None, exitcode=None)
        made.start = lambda: started.append(made)
        return made

    context = SimpleNamespace(Process=process, Event=threading.Event)
    monkeypatch.setattr(front_ends, "mp", SimpleNamespace(get_context=lambda method: context))
    pairs = [socket.socketpair() for _ in range(settings.front_ends - 1)]  # type: ignore[attr-defined]
    try:
        front_ends.FrontEnds().spawn(settings, 50051, [ours for ours, _ in pairs], checkpoint, "sha256:f0", "0123abcd",
                                     (("layer-00000.safetensors", 1, 2, 3, 4),))
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
    assert all(made.target is front_ends.front_end_main for made in started)
    return [made.args for made in started]


def test_front_ends_are_handed_the_checkpoint_and_hash_of_front_end_0(tiny_checkpoint: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Front ends k > 0 serve the path front end 0 resolved (here the demo checkpoint's stand-in: the settings name
    none) and take front end 0's hash of it and which files it hashed: none of them reads the checkpoint's bytes again
    to hash them, and each refuses other files."""
    from lutb_server.settings import ServerSettings

    settings = ServerSettings(compute_worker="process", front_ends=3, metrics_port=9400)
    assert settings.checkpoint is None
    started = _spawn_front_ends(settings, tiny_checkpoint, monkeypatch)
    assert len(started) == 2
    for k, (own, front_end, _, _, _, content_hash, instance_id, identity) in enumerate(started, 1):
        assert front_end == (k, 3) and content_hash == "sha256:f0" and instance_id == "0123abcd"
        assert identity == (("layer-00000.safetensors", 1, 2, 3, 4),)
        assert ServerSettings(**own).checkpoint == tiny_checkpoint


@pytest.mark.parametrize("change", ["edited", "removed"])
def test_front_ends_do_not_read_the_config_file_again(change: str, tiny_checkpoint: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Front ends k > 0 start from front end 0's resolved settings: a config file edited (a key this release does not
    know) or removed while front end 0 loaded the checkpoint neither fails them nor changes what they serve."""
    from lutb_server.settings import ServerSettings

    config = tmp_path / "lutb.yaml"
    config.write_text("compute_worker: process\nfront_ends: 2\nmax_wait_us: 100\n")
    settings = ServerSettings(config=config)
    [(own, *_)] = _spawn_front_ends(settings, tiny_checkpoint, monkeypatch)
    if change == "edited":
        config.write_text("compute_worker: process\nfront_ends: 2\nmax_wait_us: 7\nnext_release_option: 1\n")
    else:
        config.unlink()
    resolved = ServerSettings(**own)  # what front_end_main does
    assert resolved.max_wait_us == 100 and resolved.front_ends == 1 and resolved.compute_worker == "process"


def test_only_a_front_end_of_front_end_0_takes_a_hash(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine handed the hash does not compute it (Checkpoint.content_hash is not called); a server refuses a
    hash unless it is a front end k > 0 (it has a compute connection) serving a named checkpoint path."""
    import socket

    from lutb_server.app import ExpertServer
    from lutb_server.settings import ServerSettings

    hashed: list[Path] = []
    content_hash = Checkpoint.content_hash
    monkeypatch.setattr(Checkpoint, "content_hash", lambda self: hashed.append(self.path) or content_hash(self))
    checkpoint = Checkpoint(tiny_checkpoint)
    choice = choose_backend("reference", checkpoint.config, resolve_device("cpu"))
    own = ExpertEngine(checkpoint, choice, load_experts=False)
    assert hashed == [tiny_checkpoint]
    handed = ExpertEngine(Checkpoint(tiny_checkpoint), choice, load_experts=False, content_hash=own.content_hash)
    assert handed.content_hash == own.content_hash and hashed == [tiny_checkpoint]

    async def start(checkpoint: Path | None, connection: socket.socket | None) -> None:
        settings = ServerSettings(checkpoint=checkpoint, compute_worker="process", port=0, metrics_port=0)
        await ExpertServer(settings, compute_connection=connection, content_hash=own.content_hash).start()

    with pytest.raises(ValueError, match="front end k > 0"):  # front end 0 hashes
        asyncio.run(start(tiny_checkpoint, None))
    ours, theirs = socket.socketpair()
    with ours, theirs, pytest.raises(ValueError, match="that serves that path"):  # no path named: a hash of what?
        asyncio.run(start(None, ours))


def test_lutb_bench_and_the_sharded_client_use_every_front_end(tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``lutb bench`` opens one connection per front end by default and evens them out: unary calls taking the
    connections in turn reach both front ends equally. So does a sharded client with two connections per shard."""
    import argparse

    from lutb_server.cli import client_cmds

    metrics = _two_free_ports()
    serving = ServeProcess("--checkpoint", str(tiny_checkpoint), "--compute-worker", "process", "--front-ends", "2",
                           "--metrics-port", str(metrics), "--no-validate-checkpoint").wait_ready()
    try:
        parser = argparse.ArgumentParser(prog="lutb")
        client_cmds.register(parser.add_subparsers(required=True))
        args = parser.parse_args(["bench", serving.address, "--count", "8", "--concurrency", "1", "--tokens", "2"])
        assert args.run(args) == 0
        out = capsys.readouterr().out
        assert re.search(r"connections: 2, on front end\(s\) (0 1|1 0) of 2", out), out
        assert _forward_requests_by_front_end(metrics) == {"0": 4, "1": 4}
        with ShardedExpertClient([serving.address], connections=2) as sharded:
            fronts = [ExpertServiceStub(c).GetModelInfo(GetModelInfoRequest()).front_end for c in sharded._channels[0]]
            assert sorted(fronts) == [0, 1]  # spread when it connected
            gen = torch.Generator().manual_seed(5)
            for _ in range(4):
                x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
                ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(3)]).to(torch.int32)
                sharded.forward(0, x, ids, torch.full((3, 2), 0.5))
        assert _forward_requests_by_front_end(metrics) == {"0": 6, "1": 6}
    finally:
        serving.kill()


def test_lutb_serve_exits_1_when_a_front_end_dies(tiny_checkpoint: Path) -> None:
    serving = ServeProcess("--checkpoint", str(tiny_checkpoint), "--compute-worker", "process", "--front-ends", "2",
                           "--no-validate-checkpoint").wait_ready()
    try:
        line = next(line for line in serving.lines if "front ends 1-1 started" in line)
        pid = int(re.search(r"pids \[(\d+)\]", line).group(1))  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        assert serving.proc.wait(60) == 1, "".join(serving.lines)
    finally:
        serving.kill()


def test_front_ends_need_the_compute_process() -> None:
    from pydantic import ValidationError

    from lutb_server.settings import ServerSettings

    with pytest.raises(ValidationError, match="needs compute_worker = process"):
        ServerSettings(front_ends=2)
    assert ServerSettings(front_ends=2, compute_worker="process").front_ends == 2
    with pytest.raises(ValidationError, match="compute_spin_us = 100 needs compute_worker = process"):
        ServerSettings(compute_spin_us=100)
    with pytest.raises(ValidationError):
        ServerSettings(compute_spin_us=-1, compute_worker="process")


MERGE_CASES = {
    # batches as (pool key layer, tokens); max tokens; expected groups as indexes into the batches
    "one key": ([(0, 3), (0, 4), (0, 5)], 0, [[0, 1, 2]]),
    "two keys keep arrival order": ([(0, 3), (1, 4), (0, 5)], 0, [[0, 2], [1]]),
    "capped": ([(0, 3), (0, 4), (0, 5)], 8, [[0, 1], [2]]),
    "a batch above the cap runs alone": ([(0, 10), (0, 2), (0, 3)], 8, [[0], [1, 2]]),
    "exactly the cap": ([(0, 4), (0, 4), (0, 1)], 8, [[0, 1], [2]]),
    "none": ([], 8, []),
}


@pytest.mark.parametrize("batches, cap, want", MERGE_CASES.values(), ids=MERGE_CASES.keys())
def test_merge_groups(batches: list[tuple[int, int]], cap: int, want: list[list[int]]) -> None:
    from lutb_server.worker_process import merge_groups

    requests = [PreparedRequest(layer, torch.zeros(tokens, 4), torch.zeros(tokens, 2, dtype=torch.int32),
                                torch.zeros(tokens, 2), False, "combined") for layer, tokens in batches]
    assert merge_groups(requests, cap) == want


def test_lutb_serve_fails_to_start_when_a_front_end_cannot(tiny_checkpoint: Path) -> None:
    """Front end 1's loopback metrics port is taken: it exits while starting, and so does the server (status 2)."""
    import socket

    metrics = _two_free_ports()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", metrics + 1))
        taken.listen()
        serving = ServeProcess("--checkpoint", str(tiny_checkpoint), "--compute-worker", "process", "--front-ends", "2",
                               "--metrics-port", str(metrics), "--no-validate-checkpoint")
        try:
            assert serving.proc.wait(90) == 2, "".join(serving.lines)
            assert any("front end 1" in line and "exited" in line for line in serving.lines), "".join(serving.lines)
        finally:
            serving.kill()


def test_a_metrics_process_that_dies_is_started_again(tiny_checkpoint: Path) -> None:
    """The metrics of a server with several front ends outlive their process: killed, another serves the same port."""
    metrics = _two_free_ports()
    serving = ServeProcess("--checkpoint", str(tiny_checkpoint), "--compute-worker", "process", "--front-ends", "2",
                           "--metrics-port", str(metrics), "--no-validate-checkpoint").wait_ready()

    def gateways() -> list[int]:
        return [int(m.group(1)) for m in (re.search(r"metrics process (\d+) serves", line) for line in serving.lines) if m]

    try:
        (first,) = gateways()
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while len(gateways()) < 2:
            assert time.monotonic() < deadline, "".join(serving.lines)
            time.sleep(0.05)
        assert gateways()[1] != first and any("the metrics process exited" in line for line in serving.lines)
        assert _forward_requests_by_front_end(metrics) == {}  # served again, every front end up (no request yet)
        assert serving.stop(60) == 0, "".join(serving.lines)
    finally:
        serving.kill()


def test_front_ends_and_compute_process_go_when_the_server_is_killed(tiny_checkpoint: Path) -> None:
    """SIGKILL of front end 0 (no drain): front end 1 must not keep serving the port, nor keep the compute process
    alive through its connection, nor the metrics process the metrics port."""
    serving = ServeProcess("--checkpoint", str(tiny_checkpoint), "--compute-worker", "process", "--front-ends", "2",
                           "--metrics-port", str(_two_free_ports()), "--no-validate-checkpoint").wait_ready()
    try:
        line = next(line for line in serving.lines if "front ends 1-1 started" in line)
        front_end = int(re.search(r"pids \[(\d+)\]", line).group(1))  # type: ignore[union-attr]
        child = _compute_pid(serving)
        metrics = int(next(m for m in (re.search(r"metrics process (\d+) serves", line) for line in serving.lines) if m).group(1))
        assert _alive(front_end) and _alive(child) and _alive(metrics)
        serving.proc.kill()
        serving.proc.wait(10)
        deadline = time.monotonic() + 30
        while _alive(front_end) or _alive(child) or _alive(metrics):
            assert time.monotonic() < deadline, "front end 1, the compute process or the metrics process outlived a killed server"
            time.sleep(0.05)
    finally:
        serving.kill()


def _batch_of(job: int, layer: int, deadline: float | None = None) -> tuple:
    """A batch as the compute process holds one (``worker_process._Batch``): a stand-in connection, its job, a 2-token
    request of ``layer``, no output slot, ``deadline``."""
    from lutb_server.worker_process import _Batch

    request = PreparedRequest(layer, torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1),
                              False, "combined")
    return _Batch(f"front end {job}", job, request, None, deadline)  # type: ignore[arg-type]


def test_the_next_batches_are_read_while_a_call_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_run_merged(during=)`` hands ``during`` to every ``ComputeWorker.run`` as its ``overlap`` (the child reads the
    batches that arrived while a call runs on the device), the retry of a failed merged call included, and each
    batch is answered after its call returns."""
    from lutb_server import worker_process
    from lutb_server.worker import BatchOutput

    events: list[str] = []
    monkeypatch.setattr(worker_process, "_answer",
                        lambda c, job, output, call, written, memory: events.append(f"answer {job}"))

    class Worker:
        def run(self, requests, into, *, overlap=None):
            events.append(f"call {len(requests)}")
            if overlap is not None:
                overlap()
            if len(requests) > 1 and any(r.layer == 9 for r in requests):
                raise ValueError("a bad batch in the merged call")
            return BatchOutput([torch.zeros(r.tokens, 4) for r in requests], 0.001, sum(r.tokens for r in requests))

    def during() -> None:
        events.append("read")

    worker_process._run_merged(Worker(), [_batch_of(1, 0), _batch_of(2, 0)], (0, 0), 0, during)
    assert events == ["call 2", "read", "answer 1", "answer 2"]
    events.clear()
    worker_process._run_merged(Worker(), [_batch_of(3, 9), _batch_of(4, 9)], (0, 0), 0, during)  # fails merged, then alone
    assert events == ["call 2", "read", "call 1", "read", "answer 3", "call 1", "read", "answer 4"]


def test_batches_whose_deadline_passed_in_the_compute_process_are_answered_unrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_run_merged``: a batch whose deadline passed while it waited in the compute process is answered with
    DeadlineExpired and left out of its merged call; a group with none left makes no call; batches with no deadline
    or a future one run."""
    from lutb_server import worker_process
    from lutb_server.errors import DeadlineExpired
    from lutb_server.worker import BatchOutput

    answers: dict[int, object] = {}
    monkeypatch.setattr(worker_process, "_answer",
                        lambda c, job, output, call, written, status: answers.__setitem__(job, output))
    calls: list[list[int]] = []

    class Worker:
        def run(self, requests, into, *, overlap=None):
            calls.append([r.layer for r in requests])
            return BatchOutput([torch.full((r.tokens, 4), float(r.layer)) for r in requests], 0.001,
                               sum(r.tokens for r in requests))

    now = time.monotonic()
    batches = [_batch_of(1, 0, now - 1), _batch_of(2, 0, None), _batch_of(3, 0, now + 60),  # layer 0: one expired
               _batch_of(4, 1, now - 0.001), _batch_of(5, 1, now - 5)]  # layer 1: all expired
    worker_process._run_merged(Worker(), batches, worker_process._NO_STATUS, 0)
    assert calls == [[0, 0]]  # the two live batches of layer 0 as one call; no call for layer 1
    assert sorted(answers) == [1, 2, 3, 4, 5]
    for job in (1, 4, 5):
        assert isinstance(answers[job], DeadlineExpired) and "not computed" in str(answers[job])
    for job in (2, 3):
        assert isinstance(answers[job], torch.Tensor) and answers[job].shape == (2, 4)


def test_a_batch_past_its_deadline_fails_in_the_compute_process(process_worker: ProcessComputeWorker,
                                                                 tiny_checkpoint: Path) -> None:
    """Across the socket: a batch submitted with a deadline already past comes back DeadlineExpired (not computed:
    ``_run_merged``'s test above); the same batch with a deadline ahead, or none, is computed, and the child carries on."""
    from lutb_server.errors import DeadlineExpired

    catalog, full = _engines(tiny_checkpoint)
    requests = _requests(catalog, 0, (3,), seed=11)
    want = ComputeWorker(full).run(requests).outputs[0]
    before = process_worker.submit(requests).result(60)
    expired = process_worker.submit(requests, time.monotonic() - 0.001)
    with pytest.raises(DeadlineExpired, match="not computed"):
        expired.result(60)
    ahead = process_worker.submit(requests, time.monotonic() + 60).result(60)
    assert torch.equal(as_tensor(ahead.outputs[0]), want) and torch.equal(as_tensor(before.outputs[0]), want)


def test_loop_times_count_calls_and_answers_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_run_merged(times=)`` adds each call's seconds (a failed call's too, once) to ``calls_s`` and the answers'
    to ``answering_s``; the exit line's shares add up to the loop's time (a fake clock: exact figures)."""
    import types

    from lutb_server import worker_process
    from lutb_server.worker import BatchOutput

    now = [100.0]
    monkeypatch.setattr(worker_process, "time", types.SimpleNamespace(monotonic=lambda: now[0]))

    def answer(*args) -> None:
        now[0] += 0.02

    monkeypatch.setattr(worker_process, "_answer", answer)

    class Worker:
        def run(self, requests, into, *, overlap=None):
            now[0] += 0.05
            if any(r.layer == 9 for r in requests):
                raise ValueError("a bad batch")
            return BatchOutput([torch.zeros(r.tokens, 4) for r in requests], 0.05, sum(r.tokens for r in requests))

    cases = [
        ([_batch_of(1, 0), _batch_of(2, 0)], 0.05, 0.04),  # one call, two answers
        ([_batch_of(3, 9), _batch_of(4, 9)], 0.15, 0.04),  # the merged call fails, then each alone (and fails): three calls
        ([_batch_of(5, 9)], 0.05, 0.02),  # a lone failed call, counted once
    ]
    for batches, calls_s, answering_s in cases:
        times = worker_process.LoopTimes(started=now[0])
        worker_process._run_merged(Worker(), batches, worker_process._NO_STATUS, 0, None, times)
        assert times.calls_s == pytest.approx(calls_s) and times.answering_s == pytest.approx(answering_s)
    now[0] += 0.01  # the loop's own work
    times.reading_s = 0.02
    now[0] += 0.02
    assert times.other_s == pytest.approx(0.01)
    assert times.summary() == "loop: calls 50.0%, answering 20.0%, reading or waiting 20.0%, other 10.0% of 0.1 s"
    assert times.totals(7) == (7, pytest.approx(0.05), pytest.approx(0.02), 0.02, pytest.approx(0.01))


def _starting_thread(worker: ProcessComputeWorker, *, daemon: bool) -> tuple[threading.Thread, list[BaseException | None]]:
    """A thread (not started) that runs ``worker.start()``, and the list that gets its outcome: None, or what it raised."""
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            worker.start()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - examined by the caller
            outcome.append(exc)

    return threading.Thread(target=start, daemon=daemon), outcome


def test_close_while_start_waits_for_the_child_ends_the_wait() -> None:
    """A server stopped while its compute process loads (SIGTERM during start-up): ``close()`` from another thread
    ends ``start()``'s wait for "ready" at once (ComputeWorkerGone), the child sees its serving process go, and the
    worker does not start afterwards."""
    import socket

    from lutb_server import worker_process as wp

    ours, theirs = socket.socketpair()
    child_saw: list[bytes] = []

    def slow_child() -> None:  # shakes hands, then "loads" far longer than the test waits
        socket.recv_fds(theirs, 1, 1)
        theirs.settimeout(30)
        child_saw.append(theirs.recv(1))  # b"": the serving process went away

    child = threading.Thread(target=slow_child, daemon=True)
    child.start()
    worker = wp.ProcessComputeWorker(wp.WorkerSpec("unused", "reference", "cpu"), connection=ours, arena_bytes=1 << 20)
    starting, outcome = _starting_thread(worker, daemon=False)
    began = time.monotonic()
    starting.start()
    time.sleep(0.3)
    worker.close(10)
    starting.join(10)
    child.join(10)
    try:
        assert not starting.is_alive() and time.monotonic() - began < 5
        assert len(outcome) == 1 and isinstance(outcome[0], wp.ComputeWorkerGone), outcome
        assert child_saw == [b""] and not worker._started
        with pytest.raises(wp.ComputeWorkerGone):
            worker.start()  # closed: it does not start again
    finally:
        theirs.close()


def _sleeping_worker(checkpoint: Path, monkeypatch: pytest.MonkeyPatch, seconds: float) -> ProcessComputeWorker:
    """A started compute process whose every experts call takes ``seconds`` (``SleepExperts``, GIL released)."""
    monkeypatch.setenv(SLEEP_EXPERTS_ENV, f"{seconds * 1e6:.0f},0")  # the spawned child reads it when it builds a layer
    spec = WorkerSpec(str(checkpoint), "lutb_server.testing:SleepExperts", "cpu", validate_tiles=False)
    return ProcessComputeWorker(spec).start()


def _one_request(tokens: int = 3) -> PreparedRequest:
    return PreparedRequest(0, torch.randn(tokens, 128).to(torch.bfloat16), torch.zeros(tokens, 2, dtype=torch.int32),
                           torch.full((tokens, 2), 0.5), False, "combined")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_batch_in_flight_survives_a_signal_to_the_process_group(sig: int, tiny_checkpoint: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C, or a SIGTERM to the server's whole process group (systemd's KillMode=control-group, ``kill -- -PGID``,
    a shell job), reaches the compute process too: it ignores both and finishes the batch, the serving processes drain
    and close it (docs/serving.md: SIGTERM drains all front ends, then stops the compute process)."""
    worker = _sleeping_worker(tiny_checkpoint, monkeypatch, 1.0)
    try:
        in_flight = worker.submit([_one_request()])
        time.sleep(0.3)  # the call is running in the child
        os.kill(worker._process.pid, sig)
        out = in_flight.result(10)  # with SIGTERM at its default: ComputeWorkerGone (exit code -15)
        assert [tuple(o.shape) for o in out.outputs] == [(3, 128)]
        assert worker._process.is_alive()
    finally:
        worker.close(10)
    assert worker._process.exitcode == 0  # it left on the stop message, not on the signal


def test_close_kills_a_child_that_does_not_stop_in_time(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child ignores SIGTERM, so a compute process still busy (or wedged) when ``close(timeout)`` runs out is
    killed (SIGKILL): a stuck child cannot hold the server's shutdown for ever."""
    worker = _sleeping_worker(tiny_checkpoint, monkeypatch, 30.0)
    in_flight = worker.submit([_one_request()])
    time.sleep(0.3)  # the 30 s call is running in the child
    began = time.monotonic()
    worker.close(0.5)
    assert time.monotonic() - began < 5
    assert worker._process.exitcode == -signal.SIGKILL
    with pytest.raises(ComputeWorkerGone):
        in_flight.result(0)


def _ignores_sigterm(pid: int) -> bool:
    """Whether ``pid`` has SIGTERM set to SIG_IGN (Linux: the SigIgn mask of /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"^SigIgn:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_close_while_the_child_loads_kills_it(tmp_path: Path) -> None:
    """A server stopped while its compute process loads: the child, which ignores SIGTERM, is killed, and ``start()``
    raises ComputeWorkerGone at once instead of waiting for a load that may take minutes."""

    stuck = tmp_path / "stuck"
    stuck.mkdir()
    os.mkfifo(stuck / "a.safetensors")  # opening it blocks until a writer comes: a load that never ends
    worker = ProcessComputeWorker(WorkerSpec(str(stuck), "reference", "cpu"))
    starting, outcome = _starting_thread(worker, daemon=True)
    starting.start()
    try:
        deadline = time.monotonic() + 30
        while worker._process is None or not _ignores_sigterm(worker._process.pid):  # in _child_main, loading
            assert time.monotonic() < deadline and starting.is_alive(), f"the child did not start loading: {outcome}"
            time.sleep(0.05)
        began = time.monotonic()
        worker.close(10)
        starting.join(10)
        took = time.monotonic() - began
    finally:  # a failed test leaves no child stuck on the FIFO
        if worker._process is not None and worker._process.exitcode is None:
            worker._process.kill()
        starting.join(10)
    assert not starting.is_alive() and took < 5
    assert len(outcome) == 1 and isinstance(outcome[0], ComputeWorkerGone), outcome
    assert worker._process.exitcode == -signal.SIGKILL


def test_an_unclosed_compute_process_does_not_hold_up_its_parents_exit(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A script that exits without closing its worker: multiprocessing's SIGTERM to its daemonic children no longer
    ends the compute process, and its join at exit would wait for ever (this process still holds the socket the
    child waits on); the child is killed at exit instead."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from lutb_server.worker_process import ProcessComputeWorker, WorkerSpec\n"
        "if __name__ == '__main__':\n"
        "    worker = ProcessComputeWorker(WorkerSpec(sys.argv[1], 'reference', 'cpu', validate_tiles=False)).start()\n"
        "    print(worker._process.pid, flush=True)\n"
    )
    path = tmp_path / "exits_without_close.py"  # a file: spawn re-imports the parent's __main__ in the child
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path), str(tiny_checkpoint)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    child = int(done.stdout.split()[0])
    assert not _alive(child) and "still running at exit" in done.stderr


def test_a_serving_process_gone_during_the_handshake_leaves_nothing_page_locked() -> None:
    """A serving process that sent its arena and left before the child said ready (killed while the child loaded):
    the child un-page-locks and unmaps that arena and closes the socket, instead of holding them until it exits."""
    import socket

    from lutb_server import worker_process as wp
    from lutb_server.shared_arena import SharedArena

    class Worker:
        def __init__(self) -> None:
            self.registered: set[int] = set()

        def register_host_memory(self, memory) -> bool:
            self.registered.add(memory.data_ptr())
            return True

        def unregister_host_memory(self, memory) -> None:
            self.registered.discard(memory.data_ptr())

    front, child = socket.socketpair()
    arena = SharedArena.create(1 << 20)
    try:
        socket.send_fds(front, [b"A"], [arena.fd])
        front.close()  # gone before the child's "ready"
        worker = Worker()
        c = wp._Connection(child)
        inbox = wp._Inbox([c], worker, ("ready", {}))
        inbox.read()  # the handshake: attached and page-locked, then the "ready" cannot be sent
        assert not inbox and not inbox.waiting and not inbox.open and not inbox.closed
        assert worker.registered == set() and c.arena is None and child.fileno() == -1
    finally:
        arena.close()


def test_a_read_takes_every_batch_a_serving_process_sent() -> None:
    """_Inbox with batches_in_flight > 1: one read of a connection takes every whole batch that arrived on it (they
    ride the same call), and a batch split across reads is taken once it is whole."""
    import socket

    from lutb_server import worker_process as wp

    front, child = socket.socketpair()
    try:
        c = wp._Connection(child)
        inbox = wp._Inbox([], None, None)
        inbox.open.append(c)

        def batch(job: int) -> list[bytes]:
            x, ids, w = torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)
            return wp._frame((job, (0, encode_tensor(x), encode_tensor(ids), encode_tensor(w), False, "combined", None,
                                    None), None, None))

        frames = b"".join(batch(1) + batch(2) + batch(3))
        third = len(b"".join(batch(1) + batch(2)))
        front.sendall(frames[:third + 5])  # two whole batches and the start of a third
        inbox.read_arrived()
        assert [batch.job for batch in inbox.pop()] == [1, 2]
        front.sendall(frames[third + 5:])
        inbox.read_arrived()
        assert [batch.job for batch in inbox.pop()] == [3] and inbox.received == 3
    finally:
        front.close()
        child.close()


def test_a_closed_connections_arena_stays_page_locked_until_its_last_batch_ran() -> None:
    """_Inbox: a batch and then the stop, both read while calls run (two calls of one round): the batch still runs
    (the inbox is not done while it waits), and the arena is un-page-locked only after the call that ran it, never
    while a call may still be copying into it."""
    import socket
    from types import SimpleNamespace

    from lutb_server import worker_process as wp

    events: list[tuple[str, str]] = []

    class Worker:
        def unregister_host_memory(self, memory) -> None:
            events.append(("unregister", memory))

    front, child = socket.socketpair()
    try:
        c = wp._Connection(child)
        c.arena = SimpleNamespace(memory="arena A", size=0, close=lambda: events.append(("unmap", "arena A")))  # type: ignore[assignment]
        inbox = wp._Inbox([], Worker(), None)
        inbox.open.append(c)
        x, ids, w = torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)
        wp._send(front, (7, (0, encode_tensor(x), encode_tensor(ids), encode_tensor(w), False, "combined", None, None), None, None))
        wp._send(front, None)
        inbox.read_arrived()  # during a call: the batch
        inbox.read_arrived()  # during the round's next call: the stop
        assert [batch.job for batch in inbox.ahead] == [7] and inbox.closed == [c] and not inbox.open and inbox
        assert events == []  # the running call may still be writing into the arena
        inbox.release_closed()
        assert events == []  # its batch has not run yet
        (batch,) = inbox.pop()
        assert batch.connection is c and torch.equal(batch.request.x, x) and batch.destination is None and batch.deadline is None
        inbox.release_closed()  # after the call that ran it
        assert events == [("unregister", "arena A"), ("unmap", "arena A")] and not inbox and inbox.received == 1
        assert c.arena is None and c.sock.fileno() == -1  # its mapping and socket are let go too
    finally:
        front.close()
        child.close()


@pytest.mark.parametrize("splice_from", [0, None])
def test_answers_whose_output_is_joined_at_serialization_are_right(tiny_checkpoint: Path, splice_from: int | None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With a compute process the outputs come back as bytes, and those of SPLICE_OUTPUT_BYTES or more are joined to
    their response when gRPC serializes it (SplicedResponse). Every output spliced (threshold 0) or only the large
    ones (the default): each caller gets its own right answer, unary and streaming, combined and route-major."""
    from lutb_server import servicer

    if splice_from is not None:
        monkeypatch.setattr(servicer, "SPLICE_OUTPUT_BYTES", splice_from)
    spliced = []
    serialize = servicer.serialize_response

    def counting(response):  # which responses went out spliced
        spliced.append(isinstance(response, servicer.SplicedResponse))
        return serialize(response)

    monkeypatch.setattr(servicer, "serialize_response", counting)
    ckpt = Checkpoint(tiny_checkpoint)
    local = {layer: ReferenceExperts(ckpt.config, ckpt.layer(layer), "cpu") for layer in (0, 1)}
    gen = torch.Generator().manual_seed(12)
    calls = []
    for i, tokens in enumerate((1, 3, 200, 130)):  # 200 and 130 tokens: 51 and 33 KB combined outputs
        calls.append((i % 2, torch.randn(tokens, 128, generator=gen).to(torch.bfloat16),
                      torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)]).to(torch.int32),
                      torch.softmax(torch.randn(tokens, 2, generator=gen), dim=1)))
    with ServerThread(checkpoint=tiny_checkpoint, compute_worker="process", validate_checkpoint=False) as server:
        with ExpertClient(server.address) as client:
            unary = [client.forward(*c) for c in calls]
            route_major = [client.forward(*c, output_mode="route_major") for c in calls]
            with client.stream() as stream:
                streamed = [f.result(60) for f in [stream.submit(*c) for c in calls]]
    for (layer, x, ids, weights), *outs in zip(calls, unary, streamed, route_major):
        want = local[layer].forward(x, ids, weights).float()
        for out in outs[:2]:
            assert float((out.float() - want).norm() / want.norm()) <= 1e-2
        want_rm = local[layer].forward(x, ids, weights, output_mode="route_major").float()
        assert float((outs[2].float() - want_rm).norm() / want_rm.norm()) <= 1e-2
    assert len(spliced) == 3 * len(calls)
    if splice_from == 0:
        assert all(spliced)
    else:  # 32 KB: the 130- and 200-token outputs (combined 33 and 51 KB, route-major 67 and 102 KB), whichever the RPC
        assert spliced.count(True) == 3 * 2


def test_server_with_several_batches_in_flight_to_a_compute_process(tiny_checkpoint: Path) -> None:
    """``batches_in_flight = 3``: the serving process hands batches over while earlier ones compute, the child takes
    every batch it finds queued (merging those of one layer), and each caller gets its own right answer."""
    ckpt = Checkpoint(tiny_checkpoint)
    local = {layer: ReferenceExperts(ckpt.config, ckpt.layer(layer), "cpu") for layer in (0, 1)}
    gen = torch.Generator().manual_seed(11)
    calls = []
    for i in range(48):
        tokens = 1 + i % 4
        calls.append((i % 2, torch.randn(tokens, 128, generator=gen).to(torch.bfloat16),
                      torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)]).to(torch.int32),
                      torch.softmax(torch.randn(tokens, 2, generator=gen), dim=1)))
    with ServerThread(checkpoint=tiny_checkpoint, compute_worker="process", validate_checkpoint=False,
                      batches_in_flight=3) as server:
        worker = server.server.scheduler.worker
        most_in_flight = []
        submit = worker.submit

        def counting_submit(requests, deadline=None):
            future = submit(requests, deadline)
            most_in_flight.append(len(worker._pending))
            return future

        worker.submit = counting_submit
        with ExpertClient(server.address, connections=4) as client, ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(lambda c: client.forward(*c), calls))
    for (layer, x, ids, weights), out in zip(calls, outputs):
        # merged calls may differ from one computed alone in the last bits (docs/format.md (j)); another caller's
        # answer would be ~1.4 away
        want = local[layer].forward(x, ids, weights).float()
        assert float((out.float() - want).norm() / want.norm()) <= 1e-2
    assert max(most_in_flight) > 1, most_in_flight  # batches did go over while others computed
    assert max(most_in_flight) <= 3, most_in_flight


def test_a_batch_that_cannot_be_copied_gives_its_job_and_span_back(process_worker: ProcessComputeWorker,
                                                                   tiny_checkpoint: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """submit() takes a job and an arena span before it copies the batch in: a copy that fails left both taken (the
    span for good, and a close() waiting for the job's answer). Then the next batch goes through as usual."""
    catalog, _ = _engines(tiny_checkpoint)
    requests = _requests(catalog, 0, (3, 2), seed=41)
    arena = process_worker._arena
    spans = arena.spans if arena is not None else 0
    jobs = len(process_worker._pending)

    def broken(*args, **kwargs):
        raise OSError("copy failed")

    if arena is not None:
        monkeypatch.setattr(arena, "write", broken)
    monkeypatch.setattr("lutb_server.worker_process.encode_tensor", broken)
    with pytest.raises(OSError, match="copy failed"):
        process_worker.submit(requests)
    assert len(process_worker._pending) == jobs and (arena.spans if arena is not None else 0) == spans
    monkeypatch.undo()
    out = process_worker.submit(requests).result(30)
    assert [tuple(o.shape) for o in out.outputs] == [(3, 128), (2, 128)]


def test_a_front_end_refuses_other_files_than_front_end_0_hashed(tiny_checkpoint: Path) -> None:
    """A front end k > 0 opens the path itself: one overwritten since front end 0 hashed it would have served the new
    checkpoint's experts under the old hash. It refuses to start instead."""
    import socket

    from lutb_kernels.errors import LutBFormatError
    from lutb_server.app import ExpertServer
    from lutb_server.settings import ServerSettings

    settings = ServerSettings(checkpoint=tiny_checkpoint, compute_worker="process", host="127.0.0.1", port=0, metrics_port=0)
    ours, theirs = socket.socketpair()
    try:
        server = ExpertServer(settings, compute_connection=ours, content_hash="sha256:f0",
                              checkpoint_identity=(("layer-00000.safetensors", 1, 2, 3, 4),))
        with pytest.raises(LutBFormatError, match="its files changed since front end 0 opened them"):
            asyncio.run(server.start())
    finally:
        ours.close()
        theirs.close()
