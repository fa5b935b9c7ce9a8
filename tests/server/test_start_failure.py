"""A server whose start fails gives back what it took for the whole machine: the CPU wake-up bound (a file of the
test's own stands for /dev/cpu_dma_latency), the compute CPU's lock and the process's pinning. An embedding process
(ServerThread, a benchmark) goes on after the failure."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lutb_server import cpu_placement, cpu_wakeup
from lutb_server.cpu_placement import LOCK_NAME
from lutb_server.settings import ServerSettings





@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port someone else listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


FAILURES = {
    # settings beyond the holds' (the taken port goes where "taken" stands), the start-up error (a pattern)
    "gRPC port taken": ({"port": "taken"}, "cannot bind gRPC"),
    "gRPC port taken, compute process": ({"port": "taken", "compute_worker": "process"}, "cannot bind gRPC"),
    "gRPC port taken, front ends": ({"port": "taken", "compute_worker": "process", "front_ends": 2},
                                    r"cannot bind gRPC to \S+: "),  # the check before binding (SO_REUSEPORT)
    "metrics port taken": ({"metrics_port": "taken", "compute_worker": "process"}, "cannot bind metrics"),
}


@pytest.mark.parametrize(("extra", "error"), FAILURES.values(), ids=FAILURES.keys())
def test_a_failed_start_gives_back_the_machine_holds(tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     taken_port: int, extra: dict[str, object], error: str,
                                                     open_here: Callable[[Path], int]) -> None:
    from lutb_server.app import serve

    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    monkeypatch.setattr(cpu_wakeup, "DEVICE", device)
    process = extra.get("compute_worker") == "process"
    pinned: list[set[int]] = []
    if process:  # compute_cpu auto: CPU 3 of 0-3, its lock in a directory of the test's own; this process stays put
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        monkeypatch.setattr(cpu_placement, "allowed_cpus", lambda: {0, 1, 2, 3})
        monkeypatch.setattr(cpu_placement, "pin_process", pinned.append)
    fields = {k: taken_port if v == "taken" else v for k, v in extra.items()}
    settings = ServerSettings(**{"host": "127.0.0.1", "port": 0, "metrics_port": 0, "cpu_wakeup_latency_us": 0,
                                 "checkpoint": tiny_checkpoint, "compute_cpu": "auto" if process else "none", **fields})
    loader = None if process else (lambda: pytest.fail("the engine is loaded only once bound"))
    with pytest.raises(OSError, match=error):
        asyncio.run(serve(settings, engine_loader=loader))
    assert open_here(device) == 0, "the failed server still bounds the machine's CPU wake-up latency"
    if process:
        lock = tmp_path / LOCK_NAME.format(cpu=3)
        assert open_here(lock) == 0, "the failed server still claims the compute CPU"
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another server's auto may take it
        finally:
            os.close(fd)
        assert pinned == [{0, 1, 2}, {0, 1, 2, 3}], "the process was not moved back onto its CPUs"
