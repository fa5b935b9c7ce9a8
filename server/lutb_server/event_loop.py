"""The asyncio event loop the serving processes run on: uvloop where it is installed.

Every request costs the serving process's one event-loop thread the same Python and gRPC work
(callbacks, decode, validation, encode), and under load that thread is what limits a front
end. uvloop (libuv under asyncio's API) runs the same coroutines with less of that thread's
time: on the 2-core development machine, with the fake backend of ``bench/serving_overhead.py``
(16 tokens per request), the server's CPU per request fell 5-10% and the event loop's 8-11% at
1, 8 and 64 concurrent callers, in each of three interleaved pairs
(bench/results/2026-12-04-uvloop-cpu.md). grpc.aio runs on any asyncio loop.

``lutb serve``, its extra front ends, :class:`~lutb_server.testing.ServerThread` and the
benchmarks' server and echo processes start their loops here. uvloop is a dependency on
Linux and macOS; where it is missing (Windows, a hand-made environment) asyncio's own loop
runs the same code. ``kind="asyncio"`` (the server setting ``event_loop``, ``LUTB_EVENT_LOOP``)
picks asyncio's own loop even where uvloop is installed: a way around an incompatibility
without uninstalling it, and the other half of an A/B (``bench/serving.py --event-loop``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar, get_args

T = TypeVar("T")
EventLoopKind = Literal["uvloop", "asyncio"]
"""``uvloop``: uvloop's loop where installed, else asyncio's; ``asyncio``: asyncio's own loop."""


def _uvloop(kind: EventLoopKind) -> Any | None:
    if kind not in get_args(EventLoopKind):
        raise ValueError(f"event loop must be {' or '.join(map(repr, get_args(EventLoopKind)))}, got {kind!r}")
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def new_event_loop(kind: EventLoopKind = "uvloop") -> asyncio.AbstractEventLoop:
    """A new event loop of ``kind`` (:data:`EventLoopKind`); the caller runs and closes it."""
    uvloop = _uvloop(kind)
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T], kind: EventLoopKind = "uvloop") -> T:
    """``asyncio.run(main)`` on a loop of ``kind`` (``uvloop.run`` for uvloop); returns ``main``'s result."""
    uvloop = _uvloop(kind)
    return uvloop.run(main) if uvloop is not None else asyncio.run(main)


__all__ = ["EventLoopKind", "new_event_loop", "run"]
