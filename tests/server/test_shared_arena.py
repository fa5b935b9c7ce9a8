"""The shared arena: a ring of spans freed oldest first, and tensors viewed through slots."""

from __future__ import annotations

import pytest
import torch

from lutb_server.shared_arena import ALIGN, SharedArena, Slot, arena_supported, layout

pytestmark = pytest.mark.skipif(not arena_supported(), reason="needs os.memfd_create (Linux)")


@pytest.fixture
def arena():  # noqa: ANN201
    a = SharedArena.create(8 * ALIGN)
    yield a
    a.close()


# (sizes to take in order, spans to release after each take (by index), expected offsets; None = no room)
RING_CASES = {
    "fills then refuses": ([ALIGN, 3 * ALIGN, 4 * ALIGN, 1], [], [0, ALIGN, 4 * ALIGN, None]),
    "rounds up to ALIGN": ([1, ALIGN + 1, 1], [], [0, ALIGN, 3 * ALIGN]),
    "too big for an empty ring": ([9 * ALIGN], [], [None]),
    "whole ring": ([8 * ALIGN, 1], [], [0, None]),
    "wraps to the front once the oldest is free": ([4 * ALIGN, 3 * ALIGN, 2 * ALIGN], [0], [0, 4 * ALIGN, 0]),
    "wrapped: room only before the oldest": ([4 * ALIGN, 3 * ALIGN, 2 * ALIGN, 3 * ALIGN], [0], [0, 4 * ALIGN, 0, None]),
    "empty again: starts over at 0": ([6 * ALIGN, 4 * ALIGN], [0], [0, 0]),
}


@pytest.mark.parametrize("sizes, release_before, want", RING_CASES.values(), ids=RING_CASES.keys())
def test_ring_spans(arena: SharedArena, sizes: list[int], release_before: list[int], want: list[int | None]) -> None:
    """``release_before``: indexes of earlier takes released just before the take after the second."""
    got: list[int | None] = []
    for i, size in enumerate(sizes):
        if i == 2 or (i == 1 and len(sizes) == 2):
            for j in release_before:
                start = got[j]
                assert start is not None
                arena.release(start)
        got.append(arena.take(size))
    assert got == want


def test_release_out_of_order_keeps_the_younger_spans_taken(arena: SharedArena) -> None:
    a, b, c = arena.take(2 * ALIGN), arena.take(2 * ALIGN), arena.take(2 * ALIGN)
    assert (a, b, c) == (0, 2 * ALIGN, 4 * ALIGN)
    arena.release(b)  # a middle span: its room comes back only once the older ones go
    assert arena.take(4 * ALIGN) is None and arena.spans == 2
    arena.release(a)  # now only c is taken: [6, 8) and [0, 4) are free
    assert arena.take(4 * ALIGN) == 0  # no room at the end: wraps to the front
    assert arena.take(1) is None  # wrapped: only [4, 4) left before c
    arena.release(c)
    assert arena.take(4 * ALIGN) == 4 * ALIGN
    with pytest.raises(KeyError):
        arena.release(3 * ALIGN)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32, torch.uint8])
@pytest.mark.parametrize("shape", [(0, 4), (1,), (3, 5), (2, 3, 7)])
def test_slots_view_tensors_round_trip(arena: SharedArena, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensors = [(torch.randn(shape) * 50).to(dtype) for _ in range(2)]
    slots, nbytes = layout(ALIGN, [(t.dtype, tuple(t.shape)) for t in tensors])
    assert all(s.offset % ALIGN == 0 for s in slots) and nbytes >= sum(s.nbytes for s in slots)
    for t, slot in zip(tensors, slots):
        arena.view(slot).copy_(t)
    other = SharedArena.attach(_dup(arena.fd))  # a second mapping of the same memory, as the child has
    try:
        for t, slot in zip(tensors, slots):
            assert torch.equal(other.view(slot), t)
    finally:
        other.close()


def test_a_slot_outside_the_arena_is_refused(arena: SharedArena) -> None:
    with pytest.raises(ValueError, match="outside"):
        arena.view(Slot(7 * ALIGN, "float32", (ALIGN,)))
    with pytest.raises(ValueError, match="outside"):
        arena.view(Slot(-ALIGN, "uint8", (1,)))


@pytest.mark.parametrize("splits", [[3], [1, 2], [0, 2, 1], [1, 1, 1]], ids=["one", "two", "with-empty", "three"])
def test_write_fills_a_slot_with_the_parts_bytes_and_read_returns_them(arena: SharedArena, splits: list[int]) -> None:
    """``write`` puts the parts one after another (WireTensor bytes and numpy views of torch tensors alike),
    touches nothing outside the slot, and the other process's mapping sees it; ``read`` copies bytes back out."""
    from lutb_client.codec import WireTensor, encode_tensor

    whole = torch.randn(sum(splits), 5).to(torch.bfloat16)
    parts, row = [], 0
    for i, n in enumerate(splits):  # alternate the two forms a request tensor can take
        part = whole[row:row + n]
        parts.append(WireTensor.from_message(encode_tensor(part)) if i % 2 else part)
        row += n
    arena.memory.fill_(0xAB)
    slot = Slot(2 * ALIGN, "bfloat16", (sum(splits), 5))
    arena.write(slot, parts)
    other = SharedArena.attach(_dup(arena.fd))
    try:
        assert torch.equal(other.view(slot), whole)
    finally:
        other.close()
    written = slot.nbytes
    assert int((arena.memory != 0xAB).sum()) <= written and bool((arena.memory[2 * ALIGN + written:] == 0xAB).all())
    assert arena.read(slot.offset, written) == whole.view(-1).view(torch.uint8).numpy().tobytes()


def test_write_refuses_parts_that_do_not_fill_the_slot(arena: SharedArena) -> None:
    from lutb_client.codec import WireTensor

    slot = Slot(0, "float32", (2, 3))
    five, two = WireTensor(torch.float32, (5,), b"\0" * 20), WireTensor(torch.float32, (2,), b"\0" * 8)
    with pytest.raises(ValueError, match="hold 20 bytes"):
        arena.write(slot, [five])
    with pytest.raises(ValueError, match="more bytes"):
        arena.write(slot, [five, two])
    with pytest.raises(ValueError, match="outside"):
        arena.write(Slot(7 * ALIGN, "float32", (ALIGN,)), [])
    with pytest.raises(ValueError, match="outside"):
        arena.read(8 * ALIGN - 4, 8)


def _dup(fd: int) -> int:
    import os

    return os.dup(fd)


def test_place_lays_out_a_span_it_takes(arena: SharedArena) -> None:
    shapes = [(torch.bfloat16, (3, 5)), (torch.int32, (3, 2)), (torch.float32, (0, 2))]
    slots = arena.place(shapes)
    assert slots is not None and [s.offset for s in slots] == [0, ALIGN, 2 * ALIGN] and arena.spans == 1
    assert [(s.dtype, s.shape) for s in slots] == [("bfloat16", (3, 5)), ("int32", (3, 2)), ("float32", (0, 2))]
    assert arena.place([(torch.uint8, (8 * ALIGN,))]) is None  # no room left for a whole ring
    later = arena.place([(torch.float32, (2, 40)), (torch.uint8, (1,))])  # 320 bytes: two ALIGNs, then one
    assert later is not None and [s.offset for s in later] == [3 * ALIGN, 5 * ALIGN] and arena.spans == 2
    assert arena.place([(torch.uint8, (2 * ALIGN + 1,))]) is None  # 3 ALIGNs: only 2 left
    arena.release(slots[0].offset)
    arena.release(later[0].offset)
    assert arena.spans == 0


def test_a_plain_tuple_views_what_its_slot_views(arena: SharedArena) -> None:
    """Slots cross the socket as plain ``(offset, dtype, shape)`` tuples."""
    slot = Slot(2 * ALIGN, "int32", (3, 4))
    t = torch.arange(12, dtype=torch.int32).view(3, 4)
    arena.view(slot).copy_(t)
    plain = arena.view(tuple(slot))
    assert plain.data_ptr() == arena.view(slot).data_ptr() and torch.equal(plain, t)
    with pytest.raises(ValueError, match="outside"):
        arena.view((7 * ALIGN, "int32", (ALIGN,)))
    with pytest.raises(ValueError, match="aligned"):
        arena.view((2, "int32", (1,)))


def test_views_of_one_shape_at_other_offsets_are_their_own(arena: SharedArena, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-shape arithmetic is cached; the offset is not, and the cache stays bounded."""
    import lutb_server.shared_arena as shared_arena

    a, b = arena.view(Slot(0, "float32", (2, 3))), arena.view(Slot(ALIGN, "float32", (2, 3)))
    a.fill_(1.0)
    b.fill_(2.0)
    assert b.data_ptr() - a.data_ptr() == ALIGN and bool((a == 1.0).all()) and bool((b == 2.0).all())
    assert a.stride() == (3, 1) and arena.view(Slot(0, "float32", (3, 2))).stride() == (2, 1)
    monkeypatch.setattr(shared_arena, "_MAX_GEOMETRIES", 4)
    for n in range(1, 12):
        assert arena.view(Slot(0, "uint8", (n,))).shape == (n,)
    assert len(arena._geometry) <= 4
