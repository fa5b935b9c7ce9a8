"""Spreading a client's connections evenly over a server's front ends.

``lutb serve --front-ends N`` runs N serving processes on one port. The kernel hands each new TCP
connection to one of them by a hash of its addresses, so connections land where they fall: 32 over
8 front ends commonly leave one front end 1 and another 7. Every call on a connection goes to the
front end it reached, so the busiest front end sets the pace of its callers while others idle.

A client with several connections therefore asks each one which front end it reached
(``ModelInfo.front_end`` of ``front_ends``), and replaces a connection on a front end that has two
or more of its connections than another, by a new connection, until no front end has two more than
any other (or the attempts or the time run out). Each client spreading its own connections spreads
the load of many clients too. Servers that do not say (``front_ends`` 0 or 1) are left as they are.

:func:`spread` (blocking) and :func:`spread_async` do this for any channels; the clients'
``spread_connections`` call them on their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc

ATTEMPTS_PER_CONNECTION = 8
"""New connections tried per connection held, at most (a new one lands on a random front end)."""


def loads(front_ends: Sequence[int], count: int) -> list[int]:
    """How many of the connections (each given by the front end it reached) each of ``count`` front ends holds."""
    per = [0] * count
    for f in front_ends:
        per[f] += 1
    return per


def is_even(front_ends: Sequence[int], count: int) -> bool:
    """Whether no front end holds two or more of the connections than another (those holding none count)."""
    per = loads(front_ends, count)
    return max(per) - min(per) <= 1


def busiest(front_ends: Sequence[int], count: int) -> int:
    """The index of a connection on the front end that holds the most."""
    per = loads(front_ends, count)
    return max(range(len(front_ends)), key=lambda i: per[front_ends[i]])


def improves(front_ends: Sequence[int], count: int, replaced: int, new_front_end: int) -> bool:
    """Whether moving connection ``replaced`` to ``new_front_end`` evens the load (takes one from a front end
    holding at least two more than the new one)."""
    per = loads(front_ends, count)
    return per[new_front_end] + 2 <= per[front_ends[replaced]]


def _front_end(info: pb.ModelInfo) -> tuple[int, int]:
    """(the front end that answered, how many there are); count 1 for servers that do not say."""
    count = int(info.front_ends)
    if count <= 1 or not 0 <= info.front_end < count:
        return 0, 1
    return int(info.front_end), count


class _Probe(NamedTuple):
    """A step: ask ``channel`` which front end it reached (the reply: ``(front end, count)``)."""

    channel: Any


class _Close(NamedTuple):
    """A step: close ``channel``."""

    channel: Any


def _steps(channels: list[Any], open_channel: Callable[[], Any], deadline: float) -> Generator[_Probe | _Close, Any, list[int]]:
    """The spreading, free of I/O: yields the probes and closes to do (a failed probe is thrown back in), swaps
    ``channels`` in place, returns each one's front end. :func:`spread` and :func:`spread_async` drive it."""
    found = []
    for channel in channels:
        found.append((yield _Probe(channel)))
    fronts, count = [f for f, _ in found], max(n for _, n in found)
    if count <= 1 or len(channels) < 2:
        return fronts
    for _ in range(ATTEMPTS_PER_CONNECTION * len(channels)):
        if is_even(fronts, count) or time.monotonic() >= deadline:
            break
        i, new = busiest(fronts, count), open_channel()
        try:
            f, _ = yield _Probe(new)
        except Exception:  # noqa: BLE001 - a new connection that cannot be probed is not kept
            yield _Close(new)
            continue
        if improves(fronts, count, i, f):
            yield _Close(channels[i])
            channels[i], fronts[i] = new, f
        else:
            yield _Close(new)
    return fronts


class _Run:
    """Drives :func:`_steps`: the caller does each step it gets, setting ``reply`` (a probe's answer) or ``error``."""

    def __init__(self, steps: Generator[_Probe | _Close, Any, list[int]]) -> None:
        self._steps = steps
        self.reply: Any = None
        self.error: Exception | None = None
        self.result: list[int] = []

    def next_step(self) -> _Probe | _Close | None:
        """The next step, given the last one's reply or error; None when done (``result`` then holds the front ends)."""
        try:
            step = self._steps.throw(self.error) if self.error is not None else self._steps.send(self.reply)
        except StopIteration as done:
            self.result = done.value
            return None
        self.reply, self.error = None, None
        return step


def _probe_call(channel: Any, deadline: float) -> Any:
    """The ``GetModelInfo`` call of a probe (its result, or its awaitable on a ``grpc.aio`` channel)."""
    stub = pb_grpc.ExpertServiceStub(channel)
    return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=max(deadline - time.monotonic(), 0.0), wait_for_ready=True)


def spread(channels: list[Any], open_channel: Callable[[], Any], *, timeout: float) -> list[int]:
    """Spread ``channels`` (``grpc`` channels to one server) over its front ends, in place.

    Args:
        channels: the connections; replaced ones are closed and swapped in the list.
        open_channel: opens one more channel like them (each on a connection of its own).
        timeout: seconds for the whole; each probe is one ``GetModelInfo`` (waiting for the server to be ready).

    Returns:
        The front end each channel reached, in order (all 0 for a server with one front end, or that does not say).

    Raises:
        grpc.RpcError: a probe of one of ``channels`` failed (a probe of a new channel that fails just drops it).
    """
    deadline = time.monotonic() + timeout
    run = _Run(_steps(channels, open_channel, deadline))
    while (step := run.next_step()) is not None:
        try:
            run.reply = _front_end(_probe_call(step.channel, deadline)) if isinstance(step, _Probe) else step.channel.close()
        except Exception as exc:  # noqa: BLE001 - thrown back into the steps, which decide
            run.error = exc
    return run.result


async def spread_async(channels: list[Any], open_channel: Callable[[], Any], *, timeout: float) -> list[int]:
    """:func:`spread` for ``grpc.aio`` channels (``open_channel`` returns one; closing is awaited)."""
    deadline = time.monotonic() + timeout
    run = _Run(_steps(channels, open_channel, deadline))
    while (step := run.next_step()) is not None:
        try:
            if isinstance(step, _Probe):
                run.reply = _front_end(await _probe_call(step.channel, deadline))
            else:
                await step.channel.close()
        except Exception as exc:  # noqa: BLE001 - thrown back into the steps, which decide
            run.error = exc
    return run.result


__all__ = ["ATTEMPTS_PER_CONNECTION", "busiest", "improves", "is_even", "loads", "spread", "spread_async"]
