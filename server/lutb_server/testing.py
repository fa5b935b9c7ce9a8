"""Helpers for tests and examples: tiny random checkpoints and a server on a background thread.

Not used by the server itself.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from typing import Any

import torch

from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights, write_checkpoint
from lutb_kernels.tiles import TILE, TILE_BYTES, pack_tiles
from lutb_server.app import ExpertServer
from lutb_server.settings import ServerSettings


def random_tiles(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """uint8 ``[*shape, 6672]`` of valid random tiles: codes 0..7, scales 115..125, a N(0, 1) bf16 LUT."""
    codes = torch.randint(0, 8, (*shape, TILE, TILE), generator=generator, dtype=torch.uint8)
    scales = torch.randint(115, 126, (*shape, TILE, 4), generator=generator, dtype=torch.uint8)
    lut = torch.randn((*shape, 8), generator=generator).to(torch.bfloat16)
    tiles = pack_tiles(codes, scales, lut)
    assert tiles.shape[-1] == TILE_BYTES
    return tiles


def make_tiny_checkpoint(
    path: str | Path,
    *,
    layers: tuple[int, ...] = (0, 1),
    num_experts: int = 8,
    expert_ids: tuple[int, ...] | None = None,
    hidden: int = 128,
    intermediate: int = 128,
    activation: str = "silu",
    dtype: str = "bfloat16",
    scale_mode: str = "rceil",
    seed: int = 0,
) -> Path:
    """Write a checkpoint of random tiles (fast: no quantizer) and return its directory.

    Args:
        expert_ids: global ids held in every layer (all ``num_experts`` if None).
    """
    config = CheckpointConfig(hidden, intermediate, num_experts, activation, dtype, scale_mode)
    ids = torch.tensor(expert_ids if expert_ids is not None else range(num_experts), dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    weights = {
        layer: LayerWeights(
            random_tiles(config.w13_tiles_shape(ids.numel()), gen), random_tiles(config.w2_tiles_shape(ids.numel()), gen), ids
        )
        for layer in layers
    }
    write_checkpoint(path, config, weights)
    return Path(path)


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerThread:
    """An :class:`ExpertServer` on its own event loop in a daemon thread (for blocking tests).

    ``with ServerThread(checkpoint=..., port=0) as server: ExpertClient(server.address)``.
    Keyword arguments are :class:`ServerSettings` fields (host defaults to 127.0.0.1,
    port and metrics port to 0); ``engine_loader`` is passed to :class:`ExpertServer`.
    """

    def __init__(self, *, engine_loader: Any = None, **settings: Any) -> None:
        settings.setdefault("host", "127.0.0.1")
        settings.setdefault("port", 0)
        settings.setdefault("metrics_port", 0)
        self.settings = ServerSettings(**settings)
        self._engine_loader = engine_loader
        self.loop = asyncio.new_event_loop()
        self.server: ExpertServer | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="lutb-test-server", daemon=True)

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()

        async def make_and_start() -> None:
            self.server = ExpertServer(self.settings, engine_loader=self._engine_loader)
            await self.server.start()

        asyncio.run_coroutine_threadsafe(make_and_start(), self.loop).result(timeout)
        return self

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    def stop(self, grace: float = 0.0) -> None:
        if self.server is not None and self._thread.is_alive():
            self.run(self.server.stop(grace))
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        if not self.loop.is_running():
            self.loop.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["ServerThread", "free_port", "make_tiny_checkpoint", "random_tiles"]
