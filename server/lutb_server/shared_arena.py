"""Shared memory between the serving process and its compute process: batches travel without being copied through a socket.

Why: a 512-token batch is 2 MB of hidden states each way. Written through the compute
process's socket (a few hundred KB of kernel buffer), it took the serving event loop one
iteration per chunk, each behind dozens of gRPC callbacks, so under load a batch's transfer
cost more than its compute (bench/results/2026-12-03-worker-h200.md). With the arena the
serving process copies a request's tensors into memory both processes map, sends a
descriptor of a few hundred bytes, and copies the outputs out when the answer arrives.

The arena is one ``memfd`` (anonymous shared memory: not a file in ``/dev/shm``, so the 64 MB
``/dev/shm`` of a default container does not bound it) used as a ring: the serving process
takes one span per batch (inputs and outputs) and gives it back when the batch's answer has
been read. Spans are mostly freed oldest first; with several batches in flight a merged call
may answer a later batch first: the ring reuses that span's room once the spans taken before
it are free (at once if it was the newest). A batch that does not fit travels inline instead
(the caller's fallback). Linux only (:func:`os.memfd_create`); elsewhere :func:`arena_supported`
is false.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import torch

from lutb_client.codec import WireTensor, pack_bytes

ALIGN = 256
"""Bytes every tensor's offset is a multiple of (cache lines, and any dtype's alignment)."""


_MAX_GEOMETRIES = 4096
"""Cached (dtype, shape) geometries beyond which the cache starts over (a few per batch size seen)."""


def arena_supported() -> bool:
    """Whether this platform has anonymous shared memory (``memfd_create``)."""
    return hasattr(os, "memfd_create")


class Slot(NamedTuple):
    """Where one tensor lies in the arena (picklable: it is what crosses the socket)."""

    offset: int
    dtype: str
    """``torch`` dtype name, e.g. ``"bfloat16"``."""
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _nbytes(getattr(torch, self.dtype), self.shape)


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name in a :class:`Slot`, e.g. ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SharedArena:
    """``size`` bytes of shared memory, viewed as tensors through :class:`Slot` descriptors.

    The creator (the serving process) calls :meth:`create`, hands :attr:`fd` to the other
    process (``socket.send_fds``), which calls :meth:`attach`. Only the creator takes and
    releases spans; the other side only reads and writes through slots it is given.
    """

    def __init__(self, fd: int, size: int, *, owner: bool) -> None:
        self.fd, self.size = fd, size
        self._owner = owner
        self._map = mmap.mmap(fd, size)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        self._array = self._bytes.numpy()  # the same bytes for numpy (write)
        self._typed: dict[str, torch.Tensor] = {}  # the whole arena as a flat tensor of each dtype met (for view)
        self._geometry: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, tuple[int, ...], int, int]] = {}
        """(dtype, shape) -> (flat tensor of that dtype, strides, bytes, itemsize): view's arithmetic, once per shape."""
        self._live: deque[tuple[int, int]] = deque()  # (start, end) of taken spans, oldest first

    @classmethod
    def create(cls, size: int) -> SharedArena:
        """A new arena of ``size`` bytes (rounded up to :data:`ALIGN`); pages are backed when first touched."""
        size = _aligned(max(size, ALIGN))
        fd = os.memfd_create("lutb-compute-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size, owner=True)

    @classmethod
    def attach(cls, fd: int) -> SharedArena:
        """The other process's view of an arena whose descriptor it received."""
        return cls(fd, os.fstat(fd).st_size, owner=False)

    def close(self) -> None:
        """Unmap and close the descriptor (the memory goes when both processes have closed it)."""
        self._bytes = torch.empty(0, dtype=torch.uint8)
        self._array = self._bytes.numpy()
        self._typed.clear()
        self._geometry.clear()
        try:
            self._map.close()
        except BufferError:  # a tensor view is still alive somewhere: the mapping goes with it
            pass
        os.close(self.fd)

    # -- spans (the creator) --------------------------------------------------------------------

    def take(self, nbytes: int) -> int | None:
        """Offset of a free span of ``nbytes`` (aligned), or None when the ring has no room now."""
        n = _aligned(max(nbytes, 1))
        if not self._live:
            start = 0 if n <= self.size else None
        else:
            oldest, (newest_start, head) = self._live[0][0], self._live[-1]
            if newest_start < oldest:  # wrapped: free is [head, oldest)
                start = head if head + n <= oldest else None
            elif head + n <= self.size:  # free is [head, size) and [0, oldest)
                start = head
            else:
                start = 0 if n <= oldest else None
        if start is not None:
            self._live.append((start, start + n))
        return start

    def place(self, tensors: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[Slot] | None:
        """Take one span for ``tensors`` (dtype, shape) and lay them out in it (:func:`layout`); None
        when the ring has no room now. Release it with ``release(slots[0].offset)``."""
        start = self.take(sum(_span(dtype, shape) for dtype, shape in tensors))
        return None if start is None else layout(start, tensors)[0]

    def release(self, start: int) -> None:
        """Give back the span taken at ``start`` (normally the oldest)."""
        for i, (s, _) in enumerate(self._live):
            if s == start:
                del self._live[i]
                return
        raise KeyError(f"no span taken at {start}")

    def release_all(self) -> None:
        self._live.clear()

    @property
    def spans(self) -> int:
        """Spans taken and not yet released."""
        return len(self._live)

    # -- tensors (both sides) -------------------------------------------------------------------

    @property
    def memory(self) -> torch.Tensor:
        """The whole arena as one flat uint8 tensor (``[size]``; e.g. to page-lock it for device copies)."""
        return self._bytes

    def view(self, slot: Slot | tuple[int, str, tuple[int, ...]]) -> torch.Tensor:
        """The tensor ``slot`` describes, as a view of the shared memory (writes are seen by both processes).

        ``slot``: a :class:`Slot` or the plain ``(offset, dtype, shape)`` tuple it travels as (pickling a
        plain tuple is ~3x cheaper than a named one).

        Raises:
            ValueError: the slot lies outside the arena or is not aligned to its dtype.
        """
        offset, dtype, shape = slot
        key = (dtype, shape)
        geometry = self._geometry.get(key)
        if geometry is None:
            flat = self._typed.get(dtype)
            if flat is None:  # the arena's size is a multiple of ALIGN, so of every itemsize
                flat = self._typed[dtype] = self._bytes.view(getattr(torch, dtype))
            strides, step = [], 1
            for s in reversed(shape):
                strides.append(step)
                step *= s
            if len(self._geometry) >= _MAX_GEOMETRIES:
                self._geometry.clear()
            geometry = self._geometry[key] = (flat, tuple(strides[::-1]), step * flat.element_size(), flat.element_size())
        flat, strides, nbytes, itemsize = geometry
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"slot {tuple(slot)} lies outside the arena ({self.size} bytes)")
        if offset % itemsize:
            raise ValueError(f"slot {tuple(slot)} is not aligned to its dtype ({itemsize} bytes)")
        # one as_strided instead of slice + two views: ~3x cheaper, and a batch makes 8 of them
        return flat.as_strided(shape, strides, offset // itemsize)

    def write(self, slot: Slot | tuple[int, str, tuple[int, ...]], parts: Sequence[torch.Tensor | WireTensor]) -> None:
        """Copy ``parts`` (CPU tensors or WireTensors of the slot's dtype) one after another into ``slot``, which they
        must fill exactly (:func:`lutb_client.codec.pack_bytes`: one copy each, no torch call for a WireTensor).

        Raises:
            ValueError: the parts do not hold the slot's bytes, or the slot lies outside the arena.
        """
        offset, dtype, shape = slot
        end = offset + _nbytes(getattr(torch, dtype), shape)
        if offset < 0 or end > self.size:
            raise ValueError(f"slot {tuple(slot)} lies outside the arena ({self.size} bytes)")
        pack_bytes(parts, self._array[offset:end])

    def read(self, offset: int, nbytes: int) -> bytes:
        """A copy of ``nbytes`` of the arena from ``offset`` (one ``memcpy``, no tensor made)."""
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"bytes {offset}..{offset + nbytes} lie outside the arena ({self.size} bytes)")
        return self._map[offset:offset + nbytes]


def layout(start: int, tensors: list[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[Slot], int]:
    """Slots for ``tensors`` (dtype, shape) placed one after another from ``start``; also the bytes they span."""
    slots, offset = [], start
    for dtype, shape in tensors:
        slots.append(Slot(offset, dtype_name(dtype), tuple(int(s) for s in shape)))
        offset += _span(dtype, shape)
    return slots, offset - start


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= int(s)
    return n


def _span(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes a tensor takes in the arena: its own, at least one, rounded up to :data:`ALIGN`."""
    return _aligned(max(_nbytes(dtype, shape), 1))


__all__ = ["ALIGN", "SharedArena", "Slot", "arena_supported", "dtype_name", "layout"]
