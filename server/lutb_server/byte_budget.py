"""A bound on the bytes that one event loop's tasks hold at once, waited for in the order asked.

The servicer holds one for the responses of all ``ForwardStream`` calls of a serving process, and one per stream
(docs/serving.md, "Memory held by streams"): a stream acquires a request's response bytes before it reads the next
request, and gives them back once gRPC has taken the response. A client that stops reading its responses therefore
stops the server reading its requests (HTTP/2 flow control then holds the client back), instead of leaving them to
pile up in the server's memory.
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


__all__ = ["ByteBudget"]
