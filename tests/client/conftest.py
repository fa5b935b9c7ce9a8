"""Fixtures of the client tests: a real server (lutb_server) on a loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lutb_server.testing import ServerThread, make_tiny_checkpoint


@pytest.fixture(scope="session")
def client_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers (0 and 3), 8 experts of which the server holds 6, H = I = 128, bfloat16."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "client", layers=(0, 3), num_experts=8, expert_ids=(0, 1, 2, 4, 5, 7)
    )


@pytest.fixture(scope="module")
def server(client_checkpoint: Path) -> Iterator[ServerThread]:
    with ServerThread(checkpoint=client_checkpoint, max_wait_us=1000) as running:
        yield running
