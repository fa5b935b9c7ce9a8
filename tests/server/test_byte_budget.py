"""ByteBudget and BudgetShare: grants in the order asked, one oversized ask alone, shares that cap an ask, and
cancellation and closing that leave nothing held."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from lutb_server.byte_budget import BudgetShare, ByteBudget

T = TypeVar("T")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _blocked(ask: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """``ask`` started, and found still waiting once the loop has settled."""
    future = asyncio.ensure_future(ask)
    await _settle()
    assert not future.done()
    return future


def test_asks_that_fit_are_granted_at_once() -> None:
    async def body() -> None:
        budget = ByteBudget(10)
        await budget.acquire(4)
        await budget.acquire(6)
        assert budget.held == 10 and budget.waiting == 0
        budget.release(4)
        budget.release(6)
        assert budget.held == 0

    asyncio.run(body())


def test_waiting_asks_are_granted_in_order_when_bytes_come_back() -> None:
    """A small ask behind a waiting larger one waits too (no overtaking), and both go once the bytes are back."""
    async def body() -> list[str]:
        budget = ByteBudget(10)
        await budget.acquire(8)
        order: list[str] = []

        async def ask(name: str, nbytes: int) -> None:
            await budget.acquire(nbytes)
            order.append(name)

        big = asyncio.ensure_future(ask("big", 5))
        small = asyncio.ensure_future(ask("small", 1))  # 8 + 1 fits, but "big" asked first
        await _settle()
        assert order == [] and budget.waiting == 2
        budget.release(8)
        await asyncio.gather(big, small)
        assert budget.held == 6
        return order

    assert asyncio.run(body()) == ["big", "small"]


@pytest.mark.parametrize("held_before", [0, 3])
def test_an_ask_above_the_limit_goes_alone(held_before: int) -> None:
    async def body() -> None:
        budget = ByteBudget(10)
        if held_before:
            await budget.acquire(held_before)
        large = asyncio.ensure_future(budget.acquire(25))
        await _settle()
        assert large.done() == (held_before == 0)
        if held_before:
            budget.release(held_before)
            await large
        assert budget.held == 25
        after = await _blocked(budget.acquire(1))  # nothing joins it while it is held
        budget.release(25)
        await after
        assert budget.held == 1

    asyncio.run(body())


def test_a_cancelled_waiting_ask_holds_nothing_and_lets_the_next_ones_go() -> None:
    async def body() -> None:
        budget = ByteBudget(10)
        await budget.acquire(6)
        big = asyncio.ensure_future(budget.acquire(8))
        small = await _blocked(budget.acquire(3))  # behind "big"
        big.cancel()
        await _settle()
        assert big.cancelled() and small.done()
        assert budget.held == 9 and budget.waiting == 0

    asyncio.run(body())


def test_an_ask_cancelled_after_its_grant_gives_the_bytes_back() -> None:
    async def body() -> None:
        budget = ByteBudget(10)
        await budget.acquire(10)
        waiter = asyncio.ensure_future(budget.acquire(4))
        await _settle()
        budget.release(10)  # grants 4 to the waiter, which has not resumed yet
        assert budget.held == 4
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert budget.held == 0

    asyncio.run(body())


@pytest.mark.parametrize("call", ["limit 0", "negative ask", "release more than held", "negative release"])
def test_bad_values_are_refused(call: str) -> None:
    async def body() -> None:
        if call == "limit 0":
            ByteBudget(0)
        budget = ByteBudget(10)
        await budget.acquire(2)
        if call == "negative ask":
            await budget.acquire(-1)
        elif call == "release more than held":
            budget.release(3)
        else:
            budget.release(-1)

    with pytest.raises(ValueError):
        asyncio.run(body())


def test_room_waits_for_the_asked_size_behind_waiting_asks_and_holds_nothing() -> None:
    async def body() -> None:
        budget = ByteBudget(10)
        await budget.acquire(7)
        await budget.room(3)  # fits: returns at once
        gate = await _blocked(budget.room(4))
        budget.release(7)
        await gate
        assert budget.held == 0

    asyncio.run(body())


def test_a_share_counts_a_larger_ask_as_its_limit_so_the_others_go_on() -> None:
    """One stream's huge response (or a request claiming one) holds its share, not the whole budget."""
    async def body() -> None:
        budget = ByteBudget(100)
        first, second = BudgetShare(budget, 25), BudgetShare(budget, 25)
        assert await first.take(10**12) == 25
        assert await second.take(20) == 20
        assert budget.held == 45 and first.held == 25
        blocked = await _blocked(first.take(1))  # its share is full
        first.give_back(25)
        assert await blocked == 1

    asyncio.run(body())


def test_a_share_waits_for_room_of_its_last_ask_before_reading_on() -> None:
    async def body() -> None:
        budget = ByteBudget(100)
        share = BudgetShare(budget, 50)
        await share.room()  # nothing asked yet: room for a byte
        held = await share.take(30)
        gate = await _blocked(share.room())  # 30 + 30 > 50: no room for another such ask
        share.give_back(held)
        await gate
        assert budget.held == 0

    asyncio.run(body())


def test_closing_a_share_gives_everything_back_once() -> None:
    async def body() -> None:
        budget = ByteBudget(100)
        share, other = BudgetShare(budget, 50), BudgetShare(budget, 50)
        a = await share.take(20)
        await share.take(10)
        await other.take(5)
        waiting = asyncio.ensure_future(share.take(30))  # 30 + 30 > 50: waits on its own share
        await _settle()
        share.close()
        share.close()
        share.give_back(a)  # a late clean-up: must not release the other share's bytes
        assert budget.held == 5
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert budget.held == 5 and other.held == 5

    asyncio.run(body())


def test_a_take_granted_as_its_share_closes_gives_the_bytes_back() -> None:
    async def body() -> None:
        budget = ByteBudget(10)
        holder = BudgetShare(budget, 10)
        await holder.take(10)
        share = BudgetShare(budget, 10)
        pending = asyncio.ensure_future(share.take(4))  # waits on the shared budget
        await _settle()
        holder.give_back(10)  # grants the 4; the take has not resumed yet
        share.close()
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert budget.held == 0

    asyncio.run(body())
