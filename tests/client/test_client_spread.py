"""Spreading a client's connections over a server's front ends (lutb_client.spread), against scripted channels."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client.spread import ATTEMPTS_PER_CONNECTION, busiest, improves, is_even, loads, spread, spread_async


class _Channel:
    """A channel whose every unary call answers ``ModelInfo(front_end, front_ends)`` (raises with a negative
    ``front_end``); ``aio``: awaitably."""

    def __init__(self, front_end: int, front_ends: int, *, aio: bool = False) -> None:
        self.front_end, self.front_ends, self.aio, self.closed = front_end, front_ends, aio, False

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        def call(request: Any, **kw: Any) -> Any:
            assert not self.closed and kw.get("wait_for_ready") and kw["timeout"] > 0
            if self.front_end < 0:
                raise RuntimeError("connection refused")  # what a failed probe raises, as far as spread cares
            info = pb.ModelInfo(front_end=self.front_end, front_ends=self.front_ends)
            if not self.aio:
                return info

            async def answer() -> pb.ModelInfo:
                return info

            return answer()

        return call

    unary_stream = stream_unary = stream_stream = unary_unary

    def close(self) -> Any:
        self.closed = True
        if self.aio:
            return asyncio.sleep(0)
        return None


def _opener(landings: list[int], front_ends: int, opened: list[_Channel], *, aio: bool = False) -> Any:
    """Opens channels that land on ``landings`` in turn (then front end 0 forever), recording them in ``opened``."""
    lands: Iterator[int] = iter(landings)

    def open_channel() -> _Channel:
        channel = _Channel(next(lands, 0), front_ends, aio=aio)
        opened.append(channel)
        return channel

    return open_channel


LOAD_CASES = {
    # front end of each connection, front ends: loads, even, a busiest connection's front end
    "all on one": ([0, 0, 0], 3, [3, 0, 0], False, 0),
    "even": ([0, 1, 2, 0], 3, [2, 1, 1], True, 0),
    "one apart everywhere": ([2, 2, 1], 4, [0, 1, 2, 0], False, 2),
    "fewer connections than front ends, spread": ([3, 1], 4, [0, 1, 0, 1], True, 3),
}


@pytest.mark.parametrize("fronts, count, want_loads, even, busy", LOAD_CASES.values(), ids=LOAD_CASES.keys())
def test_loads_evenness_and_the_busiest(fronts: list[int], count: int, want_loads: list[int], even: bool, busy: int) -> None:
    assert loads(fronts, count) == want_loads
    assert is_even(fronts, count) is even
    assert fronts[busiest(fronts, count)] == busy


def test_a_move_improves_only_from_two_above() -> None:
    assert improves([0, 0, 1], 2, 0, 1) is False  # 2 and 1: moving one gives 1 and 2
    assert improves([0, 0, 0, 1], 2, 0, 1) is True  # 3 and 1 -> 2 and 2
    assert improves([0, 0], 3, 1, 2) is True


SPREAD_CASES = {
    # initial front ends, front ends, where new connections land, final front ends (sorted), connections opened
    "all on one, new ones land everywhere": ([0, 0, 0, 0], 4, [0, 1, 1, 2, 3], [0, 1, 2, 3], 5),
    "eight over four": ([1] * 8, 4, [1, 0, 2, 0, 3, 2, 3, 0], [0, 0, 1, 1, 2, 2, 3, 3], 7),  # even after 7
    "even already": ([0, 1, 0, 1], 2, [], [0, 0, 1, 1], 0),
    "one front end": ([0, 0, 0], 1, [], [0, 0, 0], 0),
    "a server that does not say": ([0, 0, 0], 0, [], [0, 0, 0], 0),
    "one connection": ([2], 4, [], [2], 0),
    "a new connection that cannot be probed is dropped": ([0, 0], 2, [-1, 1], [0, 1], 2),
}


@pytest.mark.parametrize("initial, count, landings, want, opened_n", SPREAD_CASES.values(), ids=SPREAD_CASES.keys())
@pytest.mark.parametrize("aio", [False, True], ids=["sync", "aio"])
def test_spread_evens_the_connections_and_closes_what_it_drops(initial: list[int], count: int, landings: list[int],
                                                               want: list[int], opened_n: int, aio: bool) -> None:
    channels = [_Channel(f, count, aio=aio) for f in initial]
    before = list(channels)
    opened: list[_Channel] = []
    opener = _opener(landings, count, opened, aio=aio)
    if aio:
        fronts = asyncio.run(spread_async(channels, opener, timeout=5))
    else:
        fronts = spread(channels, opener, timeout=5)
    assert sorted(fronts) == want and fronts == [c.front_end for c in channels]
    assert len(opened) == opened_n
    assert all(not c.closed for c in channels)  # what the client keeps is open
    dropped = [c for c in before + opened if c not in channels]
    assert all(c.closed for c in dropped)  # replaced and rejected ones are closed


def test_spread_gives_up_after_its_attempts() -> None:
    """New connections that all land on the busy front end are closed; the client keeps what it had."""
    channels = [_Channel(0, 2) for _ in range(4)]
    opened: list[_Channel] = []
    fronts = spread(channels, _opener([], 2, opened), timeout=5)
    assert fronts == [0, 0, 0, 0] and len(opened) == ATTEMPTS_PER_CONNECTION * 4 and all(c.closed for c in opened)


def test_a_held_connection_that_cannot_be_probed_fails_the_spread() -> None:
    channels = [_Channel(0, 2), _Channel(-1, 2)]
    with pytest.raises(RuntimeError, match="refused"):
        spread(channels, _opener([1], 2, []), timeout=5)
    with pytest.raises(RuntimeError, match="refused"):
        asyncio.run(spread_async([_Channel(0, 2, aio=True), _Channel(-1, 2, aio=True)], _opener([1], 2, [], aio=True), timeout=5))


def test_clients_report_an_unreachable_server_as_their_error() -> None:
    from lutb_client import AsyncExpertClient, ExpertClient, ExpertServiceError
    from lutb_server.testing import free_port

    target = f"127.0.0.1:{free_port()}"
    with ExpertClient(target, connections=2) as client, pytest.raises(ExpertServiceError):
        client.spread_connections(timeout=0.3)

    async def spread_async_client() -> None:
        async with AsyncExpertClient(target, connections=2) as aclient:
            await aclient.spread_connections(timeout=0.3)

    with pytest.raises(ExpertServiceError):
        asyncio.run(spread_async_client())
