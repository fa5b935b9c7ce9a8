"""The metrics endpoint, scraped over HTTP on loopback and parsed: counts match the calls made."""

from __future__ import annotations

import itertools
import os
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lutb_client import ExpertClient, ExpertServiceError
from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
from lutb_client.codec import encode_tensor
from lutb_server.metrics import ServerMetrics
from lutb_server.metrics_gateway import MetricsGateway
from lutb_server.testing import ServerThread, free_port

HIDDEN = 128


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _get(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _batch(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16),
            torch.randint(0, 8, (tokens, 2), generator=gen, dtype=torch.int32), torch.rand(tokens, 2, generator=gen))


def test_metrics_count_the_calls(tiny_checkpoint: Path) -> None:
    port = free_port()
    with ServerThread(checkpoint=tiny_checkpoint, metrics_port=port, max_wait_us=0) as server:
        assert server.server.metrics_port == port
        with ExpertClient(server.address) as client:
            client.model_info()
            token_counts = [3, 5, 7, 11]
            for i, tokens in enumerate(token_counts):
                client.forward(0, *_batch(tokens, i))
            x, ids, w = _batch(2, 9)
            for _ in range(2):
                with pytest.raises(ExpertServiceError):
                    client.forward(0, x, ids + 100, w)
            with pytest.raises(ExpertServiceError):
                client.forward(4, x, ids, w)
            with client.stream() as stream:
                futures = [stream.submit(1, *_batch(4, 20 + i)) for i in range(3)] + [stream.submit(0, x, ids - 100, w)]
            assert sum(1 for f in futures if f.exception() is None) == 3
        samples = _scrape(port)
    svc = "lutb.v1.ExpertService"
    assert _get(samples, "lutb_grpc_requests_total", service=svc, method="Forward", code="OK") == 4
    assert _get(samples, "lutb_grpc_requests_total", service=svc, method="Forward", code="INVALID_ARGUMENT") == 2
    assert _get(samples, "lutb_grpc_requests_total", service=svc, method="Forward", code="NOT_FOUND") == 1
    assert _get(samples, "lutb_grpc_requests_total", service=svc, method="GetModelInfo", code="OK") == 1
    assert _get(samples, "lutb_grpc_requests_total", service=svc, method="ForwardStream", code="OK") == 1
    assert _get(samples, "lutb_grpc_request_duration_seconds_count", service=svc, method="Forward") == 7
    assert _get(samples, "lutb_grpc_requests_in_flight", service=svc, method="Forward") == 0
    assert _get(samples, "lutb_forward_requests_total", rpc="Forward", code="OK") == 4
    assert _get(samples, "lutb_forward_requests_total", rpc="ForwardStream", code="OK") == 3
    assert _get(samples, "lutb_forward_requests_total", rpc="ForwardStream", code="INVALID_ARGUMENT") == 1
    assert _get(samples, "lutb_tokens_processed_total", backend="reference", layer="0") == sum(token_counts)
    assert _get(samples, "lutb_tokens_processed_total", backend="reference", layer="1") == 12
    assert _get(samples, "lutb_batch_tokens_sum", backend="reference", layer="0") == sum(token_counts)
    assert _get(samples, "lutb_batch_tokens_count", backend="reference", layer="0") == 4  # max_wait_us = 0, sequential calls
    assert _get(samples, "lutb_batches_total", backend="reference", layer="0", path="eager") == 4  # no CUDA graphs on the CPU
    assert _get(samples, "lutb_batches_total", backend="reference", layer="0", path="graph") == 0  # series exist from the start
    assert _get(samples, "lutb_batches_total", backend="reference", layer="0", path="chunks") == 0
    assert _get(samples, "lutb_compute_seconds_count", backend="reference", layer="1") >= 1
    for part in ("to_call", "back"):  # one observation per batch (4 sequential calls on layer 0), each part of its hand-off
        assert _get(samples, "lutb_handoff_seconds_count", backend="reference", layer="0", part=part) == 4
        assert _get(samples, "lutb_handoff_seconds_sum", backend="reference", layer="0", part=part) > 0
    assert _get(samples, "lutb_queue_wait_seconds_count", backend="reference", layer="0") == 4
    assert _get(samples, "lutb_queue_wait_seconds_count", backend="reference", layer="1") == 3
    assert _get(samples, "lutb_queue_depth") == 0
    assert _get(samples, "lutb_weight_bytes") > 0
    info = [labels for (name, labels) in samples if name == "lutb_backend_info"]
    assert len(info) == 1 and dict(info[0])["backend"] == "reference" and dict(info[0])["device"] == "cpu"
    assert not any(name.startswith("lutb_gpu_memory") for name, _ in samples)  # CPU: no GPU gauges
    assert not any(name.startswith("lutb_compute_batches_inline") for name, _ in samples)  # worker thread: no arena
    assert not any(name.startswith(("lutb_compute_calls", "lutb_compute_loop")) for name, _ in samples)  # nor a process
    if sys.platform.startswith("linux"):  # the serving process's own (ProcessCollector reads /proc)
        assert _get(samples, "process_cpu_seconds_total") > 0 and _get(samples, "process_resident_memory_bytes") > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shared arena needs memfd_create (Linux)")
def test_batches_the_arena_cannot_hold_are_counted(tiny_checkpoint: Path) -> None:
    """A compute process's batches go through its shared arena, sized for max_batch_tokens; a request larger than
    that runs alone and goes inline through the socket: counted, so an operator sees the slow path being taken."""
    port = free_port()
    with ServerThread(checkpoint=tiny_checkpoint, metrics_port=port, compute_worker="process", max_batch_tokens=4) as server:
        with ExpertClient(server.address) as client:
            client.forward(0, *_batch(2, 1))  # fits the arena
            assert _get(_scrape(port), "lutb_compute_batches_inline_total") == 0
            client.forward(0, *_batch(64, 2))  # 64 tokens > (1 + 1) x 4: inline
            client.forward(0, *_batch(3, 3))
            time.sleep(0.3)
            client.forward(0, *_batch(3, 4))  # its round waited through the sleep
            client.forward(0, *_batch(3, 5))  # its answer carries the totals at the end of the one before
        samples = _scrape(port)
    assert _get(samples, "lutb_compute_batches_inline_total") == 1
    calls = _get(samples, "lutb_compute_calls_total")
    assert calls == 4
    phases = {p: _get(samples, "lutb_compute_loop_seconds_total", phase=p) for p in ("calls", "answering", "reading_or_waiting", "other")}
    assert phases["calls"] > 0 and phases["reading_or_waiting"] >= 0.3  # it waited through the sleep
    assert all(v >= 0 for v in phases.values())


def _big_route_major(request_id: int) -> pb.ForwardRequest:
    """64 tokens, top-8, answered route-major: 128 KiB per response, so an unread stream fills flow control fast."""
    request = pb.ForwardRequest(request_id=request_id, layer=0, output_mode=pb.ROUTE_MAJOR)
    x, ids, w = _batch(64, request_id)
    encode_tensor(x, out=request.hidden_states)
    encode_tensor(torch.randint(0, 8, (64, 8), dtype=torch.int32), out=request.topk_ids)
    encode_tensor(torch.rand(64, 8), out=request.topk_weights)
    return request


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_stream_abandoned_while_the_server_writes_is_not_a_server_error(tiny_checkpoint: Path, how: str) -> None:
    """A client that stops reading, then cancels or lets its deadline pass: gRPC closes the handler blocked in its
    write (GeneratorExit, not CancelledError), which was counted as UNKNOWN, i.e. a server error.

    The requests never end: with a finite stream, gRPC's flow-control window (grown by its bandwidth probe on loopback)
    could take every response before the cancel, and the stream ended OK (4 runs in 12 on a busy 2-CPU machine)."""
    port = free_port()
    with ServerThread(checkpoint=tiny_checkpoint, metrics_port=port) as server:
        with grpc.insecure_channel(server.address) as channel:
            call = pb_grpc.ExpertServiceStub(channel).ForwardStream(
                (_big_route_major(i) for i in itertools.count()), timeout=2.0 if how == "deadline" else None)
            next(call)  # then stop reading: the server blocks writing
            time.sleep(0.5)
            if how == "cancel":
                call.cancel()
            end = time.monotonic() + 10
            codes: dict[str, float] = {}
            while time.monotonic() < end and not codes:
                codes = {dict(labels)["code"]: value for (name, labels), value in _scrape(port).items()
                         if name == "lutb_grpc_requests_total" and dict(labels)["method"] == "ForwardStream"}
                time.sleep(0.1)
    assert codes == {"CANCELLED" if how == "cancel" else "DEADLINE_EXCEEDED": 1.0}


def test_two_servers_in_one_process_keep_separate_metrics(tiny_checkpoint: Path) -> None:
    with ServerThread(checkpoint=tiny_checkpoint) as a, ServerThread(checkpoint=tiny_checkpoint) as b:
        with ExpertClient(a.address) as client:
            client.forward(0, *_batch(2, 0))
        ra, rb = a.server.metrics.registry, b.server.metrics.registry
        labels = {"service": "lutb.v1.ExpertService", "method": "Forward", "code": "OK"}
        assert ra.get_sample_value("lutb_grpc_requests_total", labels) == 1
        assert rb.get_sample_value("lutb_grpc_requests_total", labels) is None


def test_metrics_port_zero_disables_serving(tiny_checkpoint: Path) -> None:
    with ServerThread(checkpoint=tiny_checkpoint, metrics_port=0) as server:
        assert server.server.metrics_port is None
        with grpc.insecure_channel(server.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=10)


def test_a_second_server_on_a_taken_port_fails_to_bind(tiny_checkpoint: Path) -> None:
    """No SO_REUSEPORT: two servers on one port would split each other's connections silently."""
    with ServerThread(checkpoint=tiny_checkpoint) as first:
        port = int(first.address.rsplit(":", 1)[1])
        second = ServerThread(checkpoint=tiny_checkpoint, port=port)
        with pytest.raises(OSError, match="cannot bind"):
            second.start()
        second.stop()


def test_a_taken_metrics_port_is_named_in_the_error(tiny_checkpoint: Path) -> None:
    port = free_port()
    with ServerThread(checkpoint=tiny_checkpoint, metrics_port=port):
        second = ServerThread(checkpoint=tiny_checkpoint, metrics_port=port)
        with pytest.raises(OSError, match=f"cannot bind metrics to 127.0.0.1:{port}"):
            second.start()
        second.stop()


def test_gpu_memory_gauges_read_where_the_device_is_used() -> None:
    """On a CUDA device the gauges read a given source (a compute process's last report) at scrape time."""
    from lutb_server.metrics import ServerMetrics

    reported = [(5, 7)]
    metrics = ServerMetrics()
    metrics.describe_backend(backend="packed", device="cuda:0", compute_capability="9.0", dtype="bfloat16", activation="silu",
                             content_hash="sha256:0", weight_bytes=3, gpu_memory=lambda: reported[-1])
    sample = metrics.registry.get_sample_value
    assert sample("lutb_gpu_memory_allocated_bytes", {"device": "cuda:0"}) == 5
    reported.append((11, 13))
    assert sample("lutb_gpu_memory_reserved_bytes", {"device": "cuda:0"}) == 13
    assert sample("lutb_weight_bytes") == 3
    cpu = ServerMetrics()
    cpu.describe_backend(backend="reference", device="cpu", compute_capability="", dtype="bfloat16", activation="silu",
                         content_hash="sha256:0", weight_bytes=3)
    assert cpu.registry.get_sample_value("lutb_gpu_memory_allocated_bytes", {"device": "cpu"}) is None


def test_compute_loop_counters_read_the_compute_process_report() -> None:
    """With a compute process the calls and loop-seconds counters read its last report at scrape time; without one
    they are absent."""
    from lutb_server.metrics import ServerMetrics

    reported = [(3, 0.5, 0.01, 1.25, 0.02)]
    metrics = ServerMetrics()
    metrics.describe_backend(backend="packed", device="cuda:0", compute_capability="9.0", dtype="bfloat16", activation="silu",
                             content_hash="sha256:0", weight_bytes=3, gpu_memory=lambda: (0, 0), compute_loop=lambda: reported[-1])
    sample = metrics.registry.get_sample_value
    assert sample("lutb_compute_calls_total") == 3
    assert sample("lutb_compute_loop_seconds_total", {"phase": "reading_or_waiting"}) == 1.25
    reported.append((9, 1.5, 0.03, 2.0, 0.05))
    assert sample("lutb_compute_calls_total") == 9
    assert [sample("lutb_compute_loop_seconds_total", {"phase": p}) for p in ("calls", "answering", "reading_or_waiting", "other")] == [1.5, 0.03, 2.0, 0.05]
    bare = ServerMetrics()
    bare.describe_backend(backend="packed", device="cuda:0", compute_capability="9.0", dtype="bfloat16", activation="silu",
                          content_hash="sha256:0", weight_bytes=3, gpu_memory=lambda: (0, 0))
    assert bare.registry.get_sample_value("lutb_compute_calls_total") is None


def test_the_metrics_process_serves_every_front_ends_metrics() -> None:
    """MetricsGateway: one process serving the front ends' metrics merged by name, each sample labelled with its front
    end; a front end whose endpoint does not answer shows as down and adds no samples; closed, the process is gone."""
    zero, one = ServerMetrics(), ServerMetrics()
    zero.forward_requests.labels("Forward", "OK").inc(3)
    one.forward_requests.labels("Forward", "OK").inc(5)
    one.forward_requests.labels("ForwardStream", "OK").inc(2)
    gateway = MetricsGateway.start("127.0.0.1", 0, [zero.serve("127.0.0.1", 0), one.serve("127.0.0.1", 0), free_port()])
    try:
        samples = _scrape(gateway.port)
        assert _get(samples, "lutb_forward_requests_total", rpc="Forward", code="OK", front_end="0") == 3
        assert _get(samples, "lutb_forward_requests_total", rpc="Forward", code="OK", front_end="1") == 5
        assert _get(samples, "lutb_forward_requests_total", rpc="ForwardStream", code="OK", front_end="1") == 2
        assert _get(samples, "lutb_front_end_up", front_end="0") == 1
        assert _get(samples, "lutb_front_end_up", front_end="1") == 1
        assert _get(samples, "lutb_front_end_up", front_end="2") == 0
        assert not any(dict(labels).get("front_end") == "2" for name, labels in samples if name != "lutb_front_end_up")
        if sys.platform.startswith("linux"):  # each front end's process metrics, under its label
            assert _get(samples, "process_cpu_seconds_total", front_end="0") > 0
            assert _get(samples, "process_cpu_seconds_total", front_end="1") > 0
        assert not any(name.startswith("process_") for name, labels in samples if "front_end" not in dict(labels))
    finally:
        gateway.close()
        zero.close()
        one.close()
    assert gateway.process.poll() is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_metrics_process_outlasts_the_process_groups_signals() -> None:
    """Ctrl-C (SIGINT) and a SIGTERM to the whole process group reach the metrics process too: it goes on serving while
    front end 0 drains, instead of dying at once (with a traceback, for SIGINT); front end 0 then closes its stdin."""
    import signal

    zero = ServerMetrics()
    gateway = MetricsGateway.start("127.0.0.1", 0, [zero.serve("127.0.0.1", 0)])
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(gateway.process.pid, sig)
        time.sleep(0.3)
        assert gateway.running
        assert _get(_scrape(gateway.port), "lutb_front_end_up", front_end="0") == 1
    finally:
        gateway.close()
        zero.close()
    assert gateway.process.returncode == 0  # it ended at its stdin's end, not killed


def test_a_metrics_process_that_cannot_start_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """One that exits before serving (here: at once, with status 1) fails the start with its exit code, not after the
    timeout; PYTHON* variables of the environment (here -OO, which strips docstrings) do not reach it."""
    import subprocess

    monkeypatch.setenv("PYTHONOPTIMIZE", "2")
    gateway = MetricsGateway.start("127.0.0.1", 0, [free_port()], timeout_s=20)  # PYTHONOPTIMIZE ignored: it serves
    gateway.close()
    real = subprocess.Popen

    def failing(command, **kwargs):
        return real([*command[:-1], command[-1].replace("from lutb_server", "sys.exit(1); from lutb_server")], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", failing)
    start = time.monotonic()
    with pytest.raises(OSError, match="exited with code 1 before serving"):
        MetricsGateway.start("127.0.0.1", 0, [free_port()], timeout_s=20)
    assert time.monotonic() - start < 10


def test_the_metrics_process_reports_a_taken_port() -> None:
    import socket

    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind metrics to 127.0.0.1:{port}"):
            MetricsGateway.start("127.0.0.1", port, [free_port()])
    finally:
        taken.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_metrics_process_exits_when_front_end_0_is_killed() -> None:
    """Front end 0 killed (SIGKILL: nothing of it runs to stop the metrics process) takes the metrics process with it:
    it would otherwise keep the server's metrics port, and a restarted server could not bind it."""
    import signal
    import subprocess

    script = (
        "import sys, time\n"
        "from lutb_server.metrics_gateway import MetricsGateway\n"
        "gateway = MetricsGateway.start('127.0.0.1', 0, [1])\n"
        "print(gateway.process.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())  # type: ignore[union-attr]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the metrics process outlived front end 0"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited and not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_internal_latencies_are_resolved_from_25_us() -> None:
    """Queue wait, hand-off and compute are tens to hundreds of microseconds (docs/performance.md: queue ~25 us, hand-off
    ~30-80 us, calls of 0.2-0.7 ms): their histograms' buckets start at 25 us, so such values land in distinct
    buckets; the gRPC call duration keeps its buckets from 0.5 ms."""
    from prometheus_client.utils import floatToGoString

    from lutb_server.metrics import LATENCY_BUCKETS, ServerMetrics

    metrics = ServerMetrics()

    def first_bucket(name: str, labels: dict[str, str]) -> float:
        """Upper bound of the lowest bucket holding the one observation made on ``labels``."""
        for le in LATENCY_BUCKETS:
            if metrics.registry.get_sample_value(f"{name}_bucket", {**labels, "le": floatToGoString(le)}) == 1.0:
                return le
        return float("inf")

    assert LATENCY_BUCKETS[0] == 25e-6 and list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS) and LATENCY_BUCKETS[-1] == 30.0
    metrics.queue_wait.labels("b", "0").observe(25e-6)
    metrics.handoff.labels("b", "0", "to_call").observe(30e-6)
    metrics.handoff.labels("b", "1", "to_call").observe(80e-6)
    metrics.handoff.labels("b", "2", "to_call").observe(450e-6)
    metrics.compute.labels("b", "0").observe(200e-6)
    metrics.compute.labels("b", "1").observe(700e-6)
    where = [
        first_bucket("lutb_queue_wait_seconds", {"backend": "b", "layer": "0"}),
        *(first_bucket("lutb_handoff_seconds", {"backend": "b", "layer": str(layer), "part": "to_call"}) for layer in range(3)),
        *(first_bucket("lutb_compute_seconds", {"backend": "b", "layer": str(layer)}) for layer in range(2)),
    ]
    assert where == [25e-6, 50e-6, 100e-6, 500e-6, 250e-6, 0.001]
    metrics.grpc_duration.labels("lutb.v1.ExpertService", "Forward").observe(30e-6)
    labels = {"service": "lutb.v1.ExpertService", "method": "Forward"}
    assert metrics.registry.get_sample_value("lutb_grpc_request_duration_seconds_bucket", {**labels, "le": "0.0005"}) == 1.0
    assert metrics.registry.get_sample_value("lutb_grpc_request_duration_seconds_bucket", {**labels, "le": "2.5e-05"}) is None


def test_front_ends_are_read_on_loopback_past_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy in the environment (http_proxy, as in many pods) is not used for the loopback reads of front ends
    1..N-1: through it every scrape reported lutb_front_end_up 0 for running front ends and dropped their samples."""
    from lutb_server.metrics import ServerMetrics
    from lutb_server.metrics_gateway import FrontEndsCollector

    def up(collector: FrontEndsCollector) -> dict[str, float]:
        family = next(f for f in collector.collect() if f.name == "lutb_front_end_up")
        return {s.labels["front_end"]: s.value for s in family.samples}

    zero, one = ServerMetrics(), ServerMetrics()
    try:
        collector = FrontEndsCollector([zero.serve("127.0.0.1", 0), one.serve("127.0.0.1", 0)], timeout_s=2.0)
        assert up(collector) == {"0": 1.0, "1": 1.0}
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        for name in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")  # a proxy that is not there
        monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen reads the variables once, into this opener
        assert up(collector) == {"0": 1.0, "1": 1.0}
    finally:
        zero.close()
        one.close()


class _RawEndpoint:
    """A loopback port that answers every connection with ``reply`` and closes it; with ``reply`` None it accepts
    and never answers (a hung front end)."""

    def __init__(self, reply: bytes | None) -> None:
        import socket
        import threading

        self.reply, self.held = reply, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            if self.reply is None:
                self.held.append(conn)
            else:
                conn.sendall(self.reply)
                conn.close()

    def close(self) -> None:
        for conn in self.held:
            conn.close()
        self.sock.close()


def _up(collector) -> dict[str, float]:  # type: ignore[no-untyped-def]
    family = next(f for f in collector.collect() if f.name == "lutb_front_end_up")
    return {s.labels["front_end"]: s.value for s in family.samples}


@pytest.mark.parametrize("reply", [
    b"HTTP/1.0 200 OK\r\nContent-Length: 5000\r\n\r\n# TYPE a counter\n",  # dies mid-answer: IncompleteRead
    b"garbage\r\n",  # not HTTP: BadStatusLine
], ids=["truncated", "not-http"])
def test_a_front_end_answering_broken_http_is_down_not_a_failed_scrape(reply: bytes) -> None:
    """A front end dying mid-answer made front end 0's whole endpoint answer 500 (http.client's errors are not
    OSErrors); it must show as down, the others' metrics intact."""
    from lutb_server.metrics import ServerMetrics
    from lutb_server.metrics_gateway import FrontEndsCollector

    broken, one = _RawEndpoint(reply), ServerMetrics()
    try:
        collector = FrontEndsCollector([one.serve("127.0.0.1", 0), broken.port], timeout_s=2.0)
        assert _up(collector) == {"0": 1.0, "1": 0.0}
    finally:
        broken.close()
        one.close()


def test_hung_front_ends_cost_one_timeout_together() -> None:
    """Front ends are read in parallel: four that never answer cost a scrape about one timeout, not four (read
    one after another, a few hung front ends took longer than Prometheus's 10 s scrape timeout, losing all)."""
    from lutb_server.metrics_gateway import FrontEndsCollector

    hung = [_RawEndpoint(None) for _ in range(4)]
    try:
        collector = FrontEndsCollector([h.port for h in hung], timeout_s=1.0)
        start = time.monotonic()
        assert _up(collector) == {"0": 0.0, "1": 0.0, "2": 0.0, "3": 0.0}
        assert time.monotonic() - start < 3.0  # one after another: >= 4 s
    finally:
        for h in hung:
            h.close()


def test_a_front_end_answering_slowly_but_steadily_costs_one_timeout() -> None:
    """The timeout bounds the whole scrape, not each socket read: a front end that trickles its answer a byte at a time,
    never silent for a whole timeout, used to hold the scrape for as long as it kept going."""
    import socket
    import threading

    from lutb_server.metrics import ServerMetrics
    from lutb_server.metrics_gateway import FrontEndsCollector

    stop = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))

    def trickle() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 100000\r\n\r\n")
        end = time.monotonic() + 6.0  # then it hangs up: a scrape without the bound fails the timing below
        while not stop.wait(0.05) and time.monotonic() < end:
            try:
                conn.sendall(b"#")
            except OSError:
                break
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    one = ServerMetrics()
    try:
        collector = FrontEndsCollector([one.serve("127.0.0.1", 0), server.getsockname()[1]], timeout_s=1.0)
        for _ in range(2):
            start = time.monotonic()
            assert _up(collector) == {"0": 1.0, "1": 0.0}
            assert time.monotonic() - start < 2.5  # bounded per socket read only: until it hangs up, 6 s
        # and the late reads ended with the scrape: none is left reading (one a scrape, each holding a connection)
        assert not [t for t in threading.enumerate() if t.name.startswith("lutb-scrape")]
    finally:
        stop.set()
        server.close()
        one.close()


@pytest.mark.parametrize("others", [0, 1, 3])
def test_merged_front_ends_endpoint_is_valid_in_either_format(others: int) -> None:
    """Front end 0's endpoint with ``others`` more front ends answers a scraper asking for OpenMetrics (Prometheus
    negotiates it first) with valid OpenMetrics, and one asking for nothing with valid Prometheus text, each family
    keeping its type. Front ends' metrics once went through the Prometheus text parser, after which each counter's
    `_created` line became a gauge family of its own clashing with the counter and the info metric a gauge: the
    OpenMetrics parser refused the merged output."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

    from lutb_server.metrics import ServerMetrics

    def front_end(k: int) -> ServerMetrics:
        m = ServerMetrics(expert_metrics=True)  # every kind of family a front end exports
        m.describe_backend(backend="reference", device="cuda:0", compute_capability="9.0", dtype="bfloat16",
                           activation="silu", content_hash="sha256:0", weight_bytes=3, gpu_memory=lambda: (5, 7),
                           inline_batches=lambda: 2)
        m.forward_requests.labels("Forward", "OK").inc(3 + k)
        m.compute.labels("reference", "0").observe(0.002)
        return m

    zero, rest = front_end(0), [front_end(k) for k in range(1, others + 1)]
    gateway = None
    try:
        if others:  # as the server serves them: every front end on loopback, merged by the metrics process
            gateway = MetricsGateway.start("127.0.0.1", 0, [m.serve("127.0.0.1", 0) for m in [zero, *rest]])
            port = gateway.port
        else:
            port = zero.serve("127.0.0.1", 0)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                         headers={"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("application/openmetrics-text")
            families = {f.name: f for f in parse_openmetrics(response.read().decode())}  # strict: raises on a clash
        assert {name: families[name].type for name in ("lutb_backend", "lutb_forward_requests", "lutb_compute_seconds")} == {
            "lutb_backend": "info", "lutb_forward_requests": "counter", "lutb_compute_seconds": "histogram"}
        assert not any(name.endswith("_created") for name in families)
        labels = [{"front_end": str(k)} if others else {} for k in range(others + 1)]
        totals = {s.labels.get("front_end"): s.value for s in families["lutb_forward_requests"].samples if s.name.endswith("_total")}
        assert totals == {lab.get("front_end"): 3.0 + k for k, lab in enumerate(labels)}
        info = [s for s in families["lutb_backend"].samples if s.name == "lutb_backend_info"]
        assert len(info) == others + 1 and all(s.labels["backend"] == "reference" for s in info)

        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        typed = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(typed) == len(set(typed))
        parsed = {f.name: f.type for f in text_string_to_metric_families(text)}
        assert parsed["lutb_backend_info"] == "gauge" and parsed["lutb_forward_requests"] == "counter"
        assert parsed["lutb_compute_seconds"] == "histogram"
        assert _get(_scrape(port), "lutb_forward_requests_total", rpc="Forward", code="OK", **labels[-1]) == 3.0 + others
    finally:
        if gateway is not None:
            gateway.close()
        zero.close()
        for m in rest:
            m.close()


def test_front_end_0_does_not_take_another_front_ends_metrics_port() -> None:
    """Front end 0's own loopback port is the kernel's pick: where metrics_port lies in the ephemeral range, that pick
    could be metrics_port + k, and front end k would then fail to bind it. Such a pick is given back."""
    from lutb_server.app import ExpertServer

    class Picks:
        def __init__(self, ports: list[int]) -> None:
            self.ports, self.closed = ports, 0

        def serve(self, host: str, port: int) -> int:
            assert (host, port) == ("127.0.0.1", 0)
            return self.ports.pop(0)

        def close(self) -> None:
            self.closed += 1

    server = ExpertServer.__new__(ExpertServer)  # only its metrics matter here
    server.metrics = Picks([40002, 40001, 51234])  # type: ignore[assignment]
    assert server._serve_own_metrics([40001, 40002, 40003]) == 51234 and server.metrics.closed == 2
    server.metrics = Picks([40001] * 16)  # type: ignore[assignment]
    with pytest.raises(OSError, match="no free loopback port"):
        server._serve_own_metrics([40001, 40002])
