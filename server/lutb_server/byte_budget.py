"""A bound on the bytes that one event loop's tasks hold at once, waited for in the order asked.

The servicer holds one :class:`ByteBudget` for the responses of all ``ForwardStream`` calls of a serving process, and
gives each stream a :class:`BudgetShare` of it (docs/serving.md, "Memory held by streams"): a stream waits for room
before it reads its next request, sets that request's response bytes aside, and gives them back once gRPC has taken
the response. A client that stops reading its responses therefore stops the server reading its requests (HTTP/2
flow control then holds the client back), instead of leaving them to pile up in the server's memory.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ByteBudget:
    """At most ``limit`` bytes held at once (one ask above ``limit`` is granted alone, when nothing is held).

    Not thread-safe: use it from one event loop.

    Args:
        limit: the bound, in bytes (>= 1).
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit: {limit} bytes; must be at least 1")
        self.limit = limit
        self.held = 0
        """Bytes granted and not yet released."""
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        """Asks waiting to be granted."""
        return sum(1 for _, future in self._waiters if not future.done())

    async def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` (>= 0) fit, behind every earlier ask still waiting, then hold them.

        Cancelled while waiting, it holds nothing (and the asks behind it move up); cancelled after the grant, it gives
        the bytes back before the cancellation propagates."""
        if nbytes < 0:
            raise ValueError(f"nbytes: {nbytes}; must be >= 0")
        if not self._waiters and self._fits(nbytes):
            self.held += nbytes
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, future)
        self._waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted just before the cancellation reached us
                self.release(nbytes)
            else:
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass
                self._grant()  # an ask at the head that did not fit may have held smaller ones back
            raise

    async def room(self, nbytes: int = 1) -> None:
        """Return once ``nbytes`` would fit and no earlier ask waits (holding nothing): where a holder waits before it
        takes on work whose exact size it learns only afterwards."""
        if not self._waiters and self.held + nbytes <= self.limit:
            return
        await self.acquire(nbytes)
        self.release(nbytes)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` acquired earlier, and grant the waiting asks that now fit, in order."""
        if nbytes < 0 or nbytes > self.held:
            raise ValueError(f"release of {nbytes} bytes with {self.held} held")
        self.held -= nbytes
        self._grant()

    def _fits(self, nbytes: int) -> bool:
        return self.held == 0 or self.held + nbytes <= self.limit

    def _grant(self) -> None:
        while self._waiters:
            nbytes, future = self._waiters[0]
            if future.done():  # cancelled, its task not yet resumed to remove it
                self._waiters.popleft()
                continue
            if not self._fits(nbytes):
                return
            self._waiters.popleft()
            self.held += nbytes
            future.set_result(None)


class BudgetShare:
    """One holder's part of a shared :class:`ByteBudget`, at most ``limit`` bytes of it at once (a stream's).

    An ask above ``limit`` counts as ``limit``, so that one large ask cannot hold the shared budget's other holders
    back until nothing is held. :meth:`close` gives back what is still held, once, and from then on :meth:`give_back`
    does nothing: a holder's clean-up may run late, or twice, without releasing another holder's bytes.

    Args:
        shared: the budget this is a part of.
        limit: the most this part holds at once (>= 1).
    """

    def __init__(self, shared: ByteBudget, limit: int) -> None:
        self.shared = shared
        self._own = ByteBudget(limit)
        self._taken = 0  # bytes of ``shared`` this part holds
        self.closed = False
        self._expected = 1  # the last ask: what the next one probably is

    @property
    def held(self) -> int:
        """Bytes of the shared budget this part holds."""
        return self._taken

    async def room(self) -> None:
        """Return once this part and the shared budget have room for an ask of the last ask's size (1 byte before the
        first), behind the asks already waiting; holds nothing."""
        await self._own.room(self._expected)
        await self.shared.room(self._expected)

    async def take(self, nbytes: int) -> int:
        """Hold ``nbytes`` (at most ``limit``: see the class) of this part and of the shared budget, waiting for them in
        that order; returns the bytes held, for :meth:`give_back`. Cancelled, it holds nothing. Raises
        ``asyncio.CancelledError`` when the part was closed meanwhile."""
        nbytes = min(max(0, nbytes), self._own.limit)
        self._expected = max(1, nbytes)
        await self._own.acquire(nbytes)
        try:
            await self.shared.acquire(nbytes)
        except BaseException:
            self._own.release(nbytes)
            raise
        if self.closed:
            self.shared.release(nbytes)
            self._own.release(nbytes)
            raise asyncio.CancelledError("the budget share was closed")
        self._taken += nbytes
        return nbytes

    def give_back(self, nbytes: int) -> None:
        """Release ``nbytes`` that :meth:`take` returned (nothing once closed)."""
        if self.closed:
            return
        self._taken -= nbytes
        self._own.release(nbytes)
        self.shared.release(nbytes)

    def close(self) -> None:
        """Give back everything still held, and make :meth:`give_back` a no-op (idempotent)."""
        if self.closed:
            return
        self.closed = True
        taken, self._taken = self._taken, 0
        self.shared.release(taken)


__all__ = ["BudgetShare", "ByteBudget"]
