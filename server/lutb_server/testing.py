"""Helpers for tests, examples and benchmarks: tiny random checkpoints, a server on a background
thread, and a fake backend that only sleeps.

Not used by the server itself.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights, write_checkpoint
from lutb_kernels.experts.base import LayerExperts, Support
from lutb_kernels.reference import OutputMode
from lutb_kernels.tiles import TILE, TILE_BYTES, pack_tiles
from lutb_server import event_loop
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


SLEEP_EXPERTS_ENV = "LUTB_SLEEP_EXPERTS"
"""``base_us,per_token_us[,launches]`` of :class:`SleepExperts` (default ``350,4,0``), read when a layer is built."""


class SleepExperts(LayerExperts):
    """A fake backend for measuring the server itself: ``--backend lutb_server.testing:SleepExperts``.

    Each call runs ``launches`` small torch ops (GIL held, like kernel launches), then sleeps
    ``base_us + per_token_us * T`` microseconds (GIL released, like a wait on the GPU), and returns zeros of
    the output's shape and dtype. The timing comes from the environment (:data:`SLEEP_EXPERTS_ENV`), so that
    a compute process the server spawns sees it too. The default, 350 us + 4 us per token, is about the packed
    backend's time for one qwen3-30b-a3b layer on an H200 (bench/results/2026-12-02-serving-h200.md).
    """

    name: ClassVar[str] = "sleep"

    def __init__(self, config: CheckpointConfig, weights: LayerWeights, device: torch.device | str) -> None:
        super().__init__(config, weights, device)
        values = [float(v) for v in os.environ.get(SLEEP_EXPERTS_ENV, "350,4").split(",")]
        self.base_us, self.per_token_us = values[0], values[1]
        self.launches = int(values[2]) if len(values) > 2 else 0

    @classmethod
    def supports(cls, config: CheckpointConfig, device: torch.device) -> Support:
        return Support(device.type == "cpu", "a fake backend that sleeps (lutb_server.testing), CPU only")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                apply_router_weight_on_input: bool = False, output_mode: OutputMode = "combined") -> torch.Tensor:
        tokens = int(x.shape[0])
        t = torch.zeros(4)
        for _ in range(self.launches):
            t = t.add(1)
        time.sleep((self.base_us + self.per_token_us * tokens) / 1e6)
        shape = (tokens, x.shape[1]) if output_mode == "combined" else (tokens, topk_ids.shape[1], x.shape[1])
        return torch.zeros(shape, dtype=x.dtype)

    @property
    def weight_bytes(self) -> int:
        return 0


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
        self.loop = event_loop.new_event_loop(self.settings.event_loop)
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



class ServeProcess:
    """``lutb serve`` in a subprocess on loopback (for tests and benchmarks that need real processes).

    ``args`` are ``lutb serve`` flags; ``--host 127.0.0.1 --port 0 --metrics-port 0`` are added
    unless given. The gRPC port is read from the server's ``listening on`` line. Start several
    at once, then :meth:`wait_ready` each, so that they load in parallel.
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        import os
        import subprocess
        import sys

        flags = list(args)
        for flag, value in (("--host", "127.0.0.1"), ("--port", "0"), ("--metrics-port", "0")):
            if flag not in flags:
                flags += [flag, value]
        code = "import sys; from lutb_server.cli import main; sys.exit(main(sys.argv[1:]))"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self.port: int | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, name="lutb-serve-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.port is None and "listening on" in line:
                self.port = int(line.rsplit(":", 1)[1])
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 90.0) -> ServeProcess:
        """Wait for the ``listening on`` line (the server is SERVING); RuntimeError with its output if it never comes."""
        self._ready.wait(timeout)
        if self.port is None:
            self.kill()
            raise RuntimeError("lutb serve did not start:\n" + "".join(self.lines))
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (drain), wait, SIGKILL if it does not exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except Exception:
                self.kill()
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


__all__ = ["SLEEP_EXPERTS_ENV", "ServeProcess", "ServerThread", "SleepExperts", "free_port", "make_tiny_checkpoint", "random_tiles"]
