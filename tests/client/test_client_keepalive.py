"""Keepalive: a client finds a server that vanished without closing its connections; the server accepts the pings."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from lutb_client import ExpertClient, ExpertServiceError
from lutb_client.client import KEEPALIVE_OPTIONS
from lutb_server.testing import ServeProcess, ServerThread

FAST_PINGS = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 1000), ("grpc.http2.ping_timeout_ms", 1000)]
"""A ping every second, given up after one: the tests' stand-in for the client's 20 s and 10 s."""


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([[0, 1], [2, 4], [5, 7]], dtype=torch.int32)
    return torch.randn(3, 128, generator=g).to(torch.bfloat16), ids, torch.full((3, 2), 0.5)


def test_clients_ping_by_default() -> None:
    options = dict(KEEPALIVE_OPTIONS)
    assert options["grpc.keepalive_time_ms"] == 20_000
    assert options["grpc.keepalive_timeout_ms"] == options["grpc.http2.ping_timeout_ms"] == 10_000
    assert options["grpc.keepalive_permit_without_calls"] == 1


def test_the_server_accepts_a_ping_every_second_on_an_idle_stream(client_checkpoint: Path) -> None:
    """gRPC's default server answers a client pinging an idle connection more often than every 5 minutes with GOAWAY
    (too_many_pings), which ends the streams open on it: lutb serve accepts pings down to 1 s apart."""
    with ServerThread(checkpoint=client_checkpoint) as server, \
            ExpertClient(server.address, channel_options=FAST_PINGS, retries=0) as client, client.stream() as stream:
        first = stream.submit(0, *_batch(1)).result(30)
        time.sleep(4.0)  # idle: four pings, each answered
        second = stream.submit(0, *_batch(1)).result(30)
        assert torch.equal(first, second)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="stops the server with SIGSTOP")
def test_a_vanished_server_fails_a_stream_instead_of_leaving_it_waiting(client_checkpoint: Path) -> None:
    """A server that stops answering without closing its connections (here: SIGSTOP; a lost node, a partition): the
    request on a stream with no deadline fails with UNAVAILABLE once a ping goes unanswered, instead of waiting for
    ever (the kernel keeps an idle TCP connection alive for minutes to hours)."""
    serving = ServeProcess("--checkpoint", str(client_checkpoint), "--no-validate-checkpoint").wait_ready()
    outcome: list[BaseException | torch.Tensor] = []
    try:
        with ExpertClient(serving.address, channel_options=FAST_PINGS, retries=0) as client, client.stream() as stream:
            stream.submit(0, *_batch(2)).result(30)
            os.kill(serving.proc.pid, signal.SIGSTOP)
            start = time.monotonic()

            def wait() -> None:
                try:
                    outcome.append(stream.submit(0, *_batch(3)).result(60))
                except BaseException as exc:  # noqa: BLE001 - examined below
                    outcome.append(exc)

            waiter = threading.Thread(target=wait, daemon=True)
            waiter.start()
            waiter.join(30)
            took = time.monotonic() - start
            os.kill(serving.proc.pid, signal.SIGCONT)
            assert outcome, "the request still waits 30 s after its server stopped answering"
            (error,) = outcome
            assert isinstance(error, ExpertServiceError) and error.code == grpc.StatusCode.UNAVAILABLE, error
            assert took < 15
    finally:
        os.kill(serving.proc.pid, signal.SIGCONT)
        serving.kill()
