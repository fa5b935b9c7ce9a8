"""Fixtures of the server tests: tiny random checkpoints and servers on loopback ports."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lutb_server.testing import ServerThread, make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers (0 and 1), 8 experts, H = I = 128, bfloat16, silu."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", layers=(0, 1), num_experts=8)


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerThread]:
    """A shared server on the tiny checkpoint: small limits so that tests can hit them."""
    with ServerThread(checkpoint=tiny_checkpoint, max_tokens_per_request=64, max_wait_us=2000) as running:
        yield running


@pytest.fixture
def open_here() -> Callable[[Path], int]:
    """How many descriptors of this process are open on a path (from /proc/self/fd; the test skips without it)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc")

    def count(path: Path) -> int:
        target = str(path.resolve())
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                found += os.readlink(f"/proc/self/fd/{fd}") == target
            except OSError:  # closed meanwhile (the listing's own descriptor)
                pass
        return found

    return count
