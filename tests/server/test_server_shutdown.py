"""`lutb serve` in a subprocess: SIGTERM with calls in flight drains them and exits 0 within the grace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lutb_client import ExpertClient, ExpertServiceError
from lutb_server.testing import SLEEP_EXPERTS_ENV, free_port

SERVE = "import sys; from lutb_server.cli import main; sys.exit(main(sys.argv[1:]))"
GRACE_S = 8


def _start(args: list[str], env: dict | None = None, *, new_session: bool = False) -> subprocess.Popen:
    """``lutb serve ARGS``; ``new_session``: in a session (and process group) of its own, as a service manager starts it."""
    return subprocess.Popen(
        [sys.executable, "-c", SERVE, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})}, start_new_session=new_session,
    )


def _wait_listening(proc: subprocess.Popen, timeout: float = 90) -> list[str]:
    """Wait for the ``listening on`` line; returns the output's lines, to which a thread adds the server's later lines
    as they come."""
    seen: list[str] = []
    listening = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if "listening on" in line:
                listening.set()
        listening.set()  # its output closed

    threading.Thread(target=read, daemon=True).start()
    if listening.wait(timeout) and any("listening on" in line for line in seen):
        return seen
    proc.kill()
    pytest.fail("server did not start:\n" + "".join(seen))


def test_sigterm_drains_in_flight_calls(tiny_checkpoint: Path) -> None:
    port = free_port()
    proc = _start(["--checkpoint", str(tiny_checkpoint), "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                   "--max-wait-us", "600000"], env={"LUTB_SHUTDOWN_GRACE_S": str(GRACE_S)})
    try:
        _wait_listening(proc)
        target = f"127.0.0.1:{port}"
        statuses: list[int] = []
        channel = grpc.insecure_channel(target)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="lutb.v1.ExpertService"))

        def follow() -> None:
            try:
                for response in watch:
                    statuses.append(response.status)
            except grpc.RpcError:
                pass

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        x = torch.randn(4, 128).to(torch.bfloat16)
        ids = torch.randint(0, 8, (4, 2), dtype=torch.int32)
        w = torch.rand(4, 2)

        def call() -> object:
            try:
                with ExpertClient(target, retries=0, timeout=30) as client:
                    return client.forward(0, x, ids, w)
            except ExpertServiceError as exc:
                return exc

        with ThreadPoolExecutor(8) as pool:
            first = [pool.submit(call) for _ in range(5)]
            time.sleep(0.3)  # in flight: waiting in the 0.6 s batch window
            sent_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            late = [pool.submit(call) for _ in range(3)]  # after the signal
            in_flight = [f.result(60) for f in first]
            turned_away = [f.result(60) for f in late]
        code = proc.wait(GRACE_S + 10)
        elapsed = time.monotonic() - sent_at
        watcher.join(5)
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0
    assert elapsed < GRACE_S
    for outcome in in_flight:  # none lost: every call in flight at SIGTERM finished
        assert isinstance(outcome, torch.Tensor) and outcome.shape == (4, 128), outcome
    for outcome in turned_away:  # calls after SIGTERM: UNAVAILABLE (draining, or the port already closed)
        assert isinstance(outcome, ExpertServiceError) and outcome.code == grpc.StatusCode.UNAVAILABLE, outcome
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert statuses[-2:] == [SERVING, NOT_SERVING], statuses


@pytest.mark.parametrize("group", [True, False], ids=["process group", "server alone"])
def test_sigterm_drains_a_call_in_flight_on_the_compute_process(tiny_checkpoint: Path, group: bool) -> None:
    """``--compute-worker process``, a 1 s experts call in flight, then SIGTERM: to the server's whole process group
    (systemd's KillMode=control-group, ``kill -- -PGID``, a shell job: the compute process gets it too and must not
    die of it) or to the server alone (Kubernetes signals the container's PID 1). Either way the call finishes, the
    compute process leaves when the server closes it, and the server exits 0."""
    port = free_port()
    proc = _start(["--checkpoint", str(tiny_checkpoint), "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                   "--compute-worker", "process", "--backend", "lutb_server.testing:SleepExperts", "--no-validate-checkpoint",
                   "--shutdown-grace-s", str(GRACE_S)], env={SLEEP_EXPERTS_ENV: "1000000,0"}, new_session=True)
    try:
        lines = _wait_listening(proc)
        x = torch.randn(3, 128).to(torch.bfloat16)

        def call() -> object:
            try:
                with ExpertClient(f"127.0.0.1:{port}", retries=0, timeout=30) as client:
                    return client.forward(0, x, torch.zeros(3, 2, dtype=torch.int32), torch.full((3, 2), 0.5))
            except ExpertServiceError as exc:
                return exc

        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(call)
            time.sleep(0.4)  # the 1 s call is running in the compute process
            if group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            outcome = in_flight.result(30)
        code = proc.wait(GRACE_S + 10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = "[compute]: done: 1 experts call(s)"  # it ran the call and left on the stop message
    deadline = time.monotonic() + 10
    while not any(done in line for line in lines) and time.monotonic() < deadline:  # the reader catches up
        time.sleep(0.05)
    log = "".join(lines)
    # with SIGTERM at its default in the compute process: UNAVAILABLE (the compute process is gone, exit code -15)
    assert isinstance(outcome, torch.Tensor) and outcome.shape == (3, 128), f"{outcome!r}\n{log[-2000:]}"
    assert code == 0, log[-2000:]
    assert done in log, log[-2000:]


def test_forcing_an_unavailable_backend_exits_with_a_reason(tiny_checkpoint: Path) -> None:
    proc = _start(["--checkpoint", str(tiny_checkpoint), "--backend", "native", "--port", "0", "--metrics-port", "0",
                   "--host", "127.0.0.1"])
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 2
    assert "backend 'native' cannot run" in out


def test_bad_setting_exits_with_a_reason() -> None:
    proc = _start(["--device", "tpu"])
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 2 and "device" in out


def test_an_open_stream_ends_when_the_server_drains(tiny_checkpoint: Path) -> None:
    """A client keeps its ForwardStream open between requests (a decode loop): draining used to wait for it to
    half-close, so every stop took the whole grace. Now the stream's requests read so far are answered, then it ends
    with UNAVAILABLE (the client opens its next stream elsewhere), and the server stops at once."""
    from lutb_server.testing import ServerThread

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    w = torch.full((3, 2), 0.5)
    server = ServerThread(checkpoint=tiny_checkpoint).start()
    try:
        with ExpertClient(server.address, retries=0) as client:
            stream = client.stream()
            stream.submit(0, x, ids, w).result(30)
            start = time.monotonic()
            server.run(server.server.stop(20.0), timeout=60)
            took = time.monotonic() - start
            deadline = time.monotonic() + 10
            while not stream.broken:
                assert time.monotonic() < deadline, "the stream did not end"
                time.sleep(0.02)
            with pytest.raises(ExpertServiceError) as ended:
                stream.submit(0, x, ids, w).result(10)
            assert ended.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in ended.value.message, ended.value
    finally:
        server.stop()
    assert took < 5, took
