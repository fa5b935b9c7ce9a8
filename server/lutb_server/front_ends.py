"""Front ends 1..N-1 of a server with ``front_ends = N > 1``: spawn, wait until SERVING, watch, stop.

Front end 0 is the :class:`~lutb_server.app.ExpertServer` that started the compute process
(:func:`~lutb_server.worker_process.spawn_compute_process`); it owns a :class:`FrontEnds` for
the others. Each other front end is a spawned process running :func:`front_end_main`: an
``ExpertServer`` on its own connection to the compute process, bound to the same port
(``SO_REUSEPORT``), its metrics on loopback ``metrics_port + k`` (the metrics process serves them). It serves
the checkpoint front end 0 resolved and is handed front end 0's ``content_hash`` of it: a server
reads and hashes its checkpoint's bytes once, not once per process.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from lutb_server import event_loop
from lutb_server.settings import ServerSettings

log = logging.getLogger(__name__)

WATCH_S = 0.2
"""Seconds between checks that the other front ends still run."""
START_S = 300.0
"""Seconds front ends 1..N-1 get to report SERVING after the compute process is ready."""
STOP_SLACK_S = 10.0
"""Seconds past the shutdown grace that front ends get to exit before they are killed."""


class FrontEnds:
    """The processes of front ends 1..N-1, as front end 0 sees them."""

    def __init__(self) -> None:
        self.processes: list[BaseProcess] = []
        self._ready: list[Any] = []  # multiprocessing Events, set when each is SERVING
        self._watching: asyncio.Task[None] | None = None

    def __bool__(self) -> bool:
        return bool(self.processes)

    def spawn(self, settings: ServerSettings, port: int, connections: list[socket.socket], checkpoint: Path,
              content_hash: str, instance_id: str, checkpoint_identity: tuple | None = None) -> None:
        """Start front ends 1..len(connections), front end k on ``connections[k-1]`` (closed here: it holds its own copy).

        Each serves ``checkpoint``, the path front end 0 serves (resolved: the demo checkpoint when ``settings``
        name none), and takes ``content_hash``, front end 0's hash of that path, instead of hashing it again, and
        ``instance_id``, front end 0's (one server, one id); with ``checkpoint_identity`` (``Checkpoint.identity`` of
        the files front end 0 hashed) each refuses to start on other files. Each
        gets every setting as front end 0 resolved it, without ``config``: the file is not read again, so one edited
        or removed while front end 0 loaded the checkpoint changes nothing.
        """
        ctx = mp.get_context("spawn")
        for k, connection in enumerate(connections, 1):
            own = settings.model_copy(update={"port": port, "front_ends": 1, "checkpoint": checkpoint, "config": None,
                                              "metrics_port": settings.metrics_port + k if settings.metrics_port else 0})
            ready = ctx.Event()
            process = ctx.Process(target=front_end_main, args=(own.model_dump(), (k, settings.front_ends), connection, ready,
                                                               os.getpid(), content_hash, instance_id, checkpoint_identity),
                                  name=f"lutb-front-end-{k}", daemon=True)
            process.start()
            connection.close()
            self.processes.append(process)
            self._ready.append(ready)
        log.info("front ends 1-%d started (pids %s) on port %d", len(connections), [p.pid for p in self.processes], port)

    def wait_ready(self, timeout: float = START_S) -> None:
        """Block until every front end is SERVING; RuntimeError if one exits first or ``timeout`` passes."""
        end = time.monotonic() + timeout
        for k, (process, ready) in enumerate(zip(self.processes, self._ready), 1):
            while not ready.wait(0.1):
                if process.exitcode is not None:
                    raise RuntimeError(f"front end {k} (pid {process.pid}) exited with code {process.exitcode} while starting")
                if time.monotonic() > end:
                    raise RuntimeError(f"front end {k} (pid {process.pid}) did not start within {timeout:.0f}s")

    def watch(self, on_exit: Callable[[Exception], None]) -> None:
        """Call ``on_exit(error)`` on the running loop once a front end exits (then stop watching)."""

        async def watch() -> None:
            while True:
                await asyncio.sleep(WATCH_S)
                for k, process in enumerate(self.processes, 1):
                    if process.exitcode is not None:
                        on_exit(RuntimeError(f"front end {k} (pid {process.pid}) exited with code {process.exitcode}"))
                        return

        self._watching = asyncio.ensure_future(watch())

    def terminate(self) -> None:
        """Stop watching; SIGTERM to the front ends still running (each drains as a server does on SIGTERM)."""
        if self._watching is not None:
            self._watching.cancel()
            self._watching = None
        for process in self.processes:
            if process.exitcode is None and process.pid is not None:
                try:
                    os.kill(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    async def join(self, grace: float) -> None:
        """Wait up to ``grace`` + STOP_SLACK_S s in all for the front ends to exit; kill the ones that do not."""
        timeout = grace + STOP_SLACK_S

        def join() -> None:
            end = time.monotonic() + timeout
            for process in self.processes:
                process.join(max(0.0, end - time.monotonic()))
                if process.exitcode is None:
                    log.warning("front end pid %d did not stop within %.0fs; killing it", process.pid, timeout)
                    process.kill()
                    process.join(5)

        await asyncio.to_thread(join)


def front_end_main(settings: dict, front_end: tuple[int, int], connection: socket.socket, ready: Any, parent: int,
                   content_hash: str, instance_id: str, checkpoint_identity: tuple | None = None) -> None:
    """Front end k > 0 of N (``front_end = (k, N)``; a spawned process): serve until SIGTERM, set ``ready`` (a
    multiprocessing Event) once SERVING, exit with :func:`~lutb_server.app.serve`'s code.

    ``content_hash`` is front end 0's hash of ``settings["checkpoint"]``, served as this front end's own, and
    ``instance_id`` front end 0's (ModelInfo says one id for the whole server); ``checkpoint_identity`` which files
    front end 0 hashed (this front end refuses to start on others).

    It drains and exits when front end 0 (``parent``) dies, even by SIGKILL: otherwise it would
    keep serving the port, and keep the compute process alive through its connection.
    """
    from lutb_server.app import serve  # app imports this module

    index = front_end[0]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s [front end {index}]: %(message)s")
    terminate_with_parent(parent)
    own = ServerSettings(**settings)
    sys.exit(event_loop.run(serve(own, compute_connection=connection, front_end=front_end, content_hash=content_hash,
                                  instance_id=instance_id, checkpoint_identity=checkpoint_identity,
                                  on_ready=lambda _: ready.set()), own.event_loop))


def terminate_with_parent(parent: int) -> None:
    """SIGTERM this process when ``parent`` exits (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


__all__ = ["FrontEnds", "front_end_main", "terminate_with_parent"]
