"""ByteBudget: grants in the order asked, one oversized ask alone, and cancellation that leaves nothing held."""

from __future__ import annotations

import asyncio

import pytest

from lutb_server.byte_budget import ByteBudget


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


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
        after = asyncio.ensure_future(budget.acquire(1))
        await _settle()
        assert not after.done()  # nothing joins it while it is held
        budget.release(25)
        await after
        assert budget.held == 1

    asyncio.run(body())


def test_a_cancelled_waiting_ask_holds_nothing_and_lets_the_next_ones_go() -> None:
    async def body() -> None:
        budget = ByteBudget(10)
        await budget.acquire(6)
        big = asyncio.ensure_future(budget.acquire(8))
        small = asyncio.ensure_future(budget.acquire(3))
        await _settle()
        assert not small.done()  # behind "big"
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
