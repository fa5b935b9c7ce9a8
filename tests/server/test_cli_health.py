"""``lutb health``: exit codes and printed status against a real grpc.health.v1 server on loopback."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lutb_server.cli import health_cmd

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.UNKNOWN
EXPERT_SERVICE = "lutb.v1.ExpertService"


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    """A sync gRPC server on 127.0.0.1 (free port) running the standard HealthServicer."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lutb")
    health_cmd.register(parser.add_subparsers(required=True))
    return parser


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    args = _parser().parse_args(argv)
    code = args.run(args)
    return code, capsys.readouterr().out


@pytest.mark.parametrize(
    ("status", "want_code", "want_text"),
    [(SERVING, 0, "SERVING"), (NOT_SERVING, 1, "NOT_SERVING"), (UNKNOWN, 1, "UNKNOWN")],
)
@pytest.mark.parametrize("service", ["", EXPERT_SERVICE])
def test_status_maps_to_exit_code(health_server, capsys, status, want_code, want_text, service) -> None:
    target, servicer = health_server
    # Set the other service to the opposite status, so a mix-up of names shows.
    other = EXPERT_SERVICE if service == "" else ""
    servicer.set(other, NOT_SERVING if status == SERVING else SERVING)
    servicer.set(service, status)
    argv = ["health", target, "--timeout", "5"] + (["--service", service] if service else [])
    code, out = _run(argv, capsys)
    assert code == want_code
    assert out.strip().endswith(f": {want_text}")


def test_goes_not_serving_like_a_draining_server(health_server, capsys) -> None:
    target, servicer = health_server
    servicer.set("", SERVING)
    assert _run(["health", target], capsys)[0] == 0
    servicer.enter_graceful_shutdown()  # what the server does on SIGTERM: everything NOT_SERVING
    code, out = _run(["health", target], capsys)
    assert (code, out.strip().split(": ")[-1]) == (1, "NOT_SERVING")


def test_unregistered_service_is_not_serving(health_server, capsys) -> None:
    target, servicer = health_server
    servicer.set("", SERVING)
    code, out = _run(["health", target, "--service", "no.such.Service"], capsys)
    assert code == 1
    assert "SERVICE_UNKNOWN" in out


def test_unreachable_port_exits_2_within_timeout(capsys) -> None:
    target = f"127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    code, out = _run(["health", target, "--timeout", "0.5"], capsys)
    elapsed = time.monotonic() - start
    assert code == 2
    assert "DEADLINE_EXCEEDED" in out or "UNAVAILABLE" in out
    assert elapsed < 5.0


def test_server_without_health_service_exits_2(capsys) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code, out = _run(["health", f"127.0.0.1:{port}", "--timeout", "2"], capsys)
    finally:
        server.stop(grace=None)
    assert code == 2
    assert "UNIMPLEMENTED" in out


@pytest.mark.parametrize("bad", ["0", "-1", "soon"])
def test_timeout_must_be_positive(bad) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["health", "127.0.0.1:1", "--timeout", bad])


def test_console_entry_point_exit_code(health_server) -> None:
    """The real ``lutb`` entry point, as the Dockerfile HEALTHCHECK runs it, in a fresh process."""
    target, servicer = health_server
    servicer.set("", SERVING)
    code = (
        "import sys; from lutb_server.cli import health_cmd, main; "
        "import lutb_server.cli as cli; cli.SUBCOMMAND_MODULES = ('lutb_server.cli.health_cmd',); "
        "sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "health", target, "--timeout", "5"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f'{target} "": SERVING'


def test_registered_with_the_lutb_command() -> None:
    from lutb_server import cli

    assert "lutb_server.cli.health_cmd" in cli.SUBCOMMAND_MODULES


def test_a_bad_log_level_is_a_usage_error() -> None:
    """It used to raise from logging after parsing (exit 1, which `lutb health` means as 'not serving')."""
    from lutb_server.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--log-level", "bogus", "health", "127.0.0.1:1"])
    assert exc.value.code == 2


def test_python_m_runs_the_command() -> None:
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(root / d) for d in ("kernels", "client", "server")))
    proc = subprocess.run([sys.executable, "-m", "lutb_server.cli", "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and "health" in proc.stdout
