"""A model of the CUDA caching allocator's segments: sizes, addresses and order only.

:mod:`shardc.memory.cuda_blocks` counts one request's block; this module replays a whole
sequence of requests and frees and says how much the allocator *reserves*
(``torch.cuda.max_memory_reserved``): the segments it asked the driver for, which it keeps
until ``empty_cache``. What is allocated is the same for every order of the same lifetimes;
what is reserved depends on which cached block each request finds, so two plans with equal
allocated peaks can reserve differently (a request larger than any free block, or than any run
of adjacent free blocks, takes a new segment even when enough memory is free in pieces).

The rules are those of torch's default configuration (``c10/cuda/CUDACachingAllocator.cpp``,
no ``PYTORCH_CUDA_ALLOC_CONF``; one stream; no expandable segments):

- a request is rounded up to a multiple of 512 B (at least 512 B); up to 1 MiB it is served
  from the small pool, above from the large pool;
- the free block it gets is the smallest one of its pool that is large enough, the lowest
  address among equal sizes; it is split when the rest is at least 512 B (small pool) or more
  than 1 MiB (large pool), the request taking the lower addresses;
- without such a block a new segment is made: 2 MiB for a small request, 20 MiB for a request
  below 10 MiB, else the request rounded up to 2 MiB;
- a freed block merges with the free blocks beside it in its segment; segments are never
  returned (no ``empty_cache``, no out-of-memory retry).

A replay of a recorded H200 history (:mod:`shardc.memory.allocator_history`,
``tests/test_caching_allocator.py``: 1,924 requests of an optimizer-offload training run) puts
every request at the address the real allocator gave it and makes the same 59 segments. Not
modelled: several streams (a block freed while another stream uses it waits for that stream),
``max_split_size_mb``, ``roundup_power2_divisions``, expandable segments, and CUDA graphs'
private pools.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from shardc.memory.cuda_blocks import (
    MIN_BLOCK,
    SMALL_SEGMENT,
    SMALL_SIZE,
    round_request,
    segment_bytes,
)

__all__ = ["CachingAllocatorModel", "round_request", "segment_bytes"]


def _splits(small: bool, rest: int) -> bool:
    return rest >= MIN_BLOCK if small else rest > SMALL_SIZE


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class CachingAllocatorModel:
    """Replays ``malloc`` / ``free`` on the allocator's rules; ``reserved`` and
    ``peak_reserved`` are its segments' bytes now and at most, ``allocated`` and
    ``peak_allocated`` the bytes of its handed-out blocks. Segments get addresses from
    ``next_address`` upward unless ``malloc`` is told one (a replay of a recorded history)."""

    reserved: int = 0
    peak_reserved: int = 0
    allocated: int = 0
    peak_allocated: int = 0
    segments: int = 0
    next_address: int = 1 << 40
    # Free blocks per pool, sorted by (size, address): the best fit is a bisect away.
    _free: dict[bool, list[tuple[int, int]]] = field(
        default_factory=lambda: {True: [], False: []})
    _blocks: dict[int, _Block] = field(default_factory=dict)  # by address, free or not

    def malloc(self, nbytes: int, segment_address: int | None = None) -> int:
        """Hand out a block for ``nbytes``; returns its address. ``segment_address``: where a
        new segment lies, if this request makes one (a replay's recorded address)."""
        size = round_request(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, size)
        if block is None:
            block = self._new_segment(small, segment_bytes(size), segment_address)
        self._take(block)
        rest = block.size - size
        if _splits(small, rest):
            tail = _Block(block.addr + size, rest, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._blocks[tail.addr] = tail
            self._give(tail)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.addr

    def would_make_segment(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` now finds no cached block."""
        size = round_request(nbytes)
        return self._best_fit(size <= SMALL_SIZE, size) is None

    def free(self, address: int) -> None:
        block = self._blocks[address]
        if block.free:
            raise ValueError(f"block at {address:#x} freed twice")
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._take(neighbour)
                block = self._merge(block, neighbour)
        self._give(block)

    def add_segment(self, address: int, size: int,
                    taken: tuple[tuple[int, int], ...] = ()) -> None:
        """A segment made before the replay starts, with its ``taken`` ``(offset, size)``
        blocks handed out (to no request of the replay) and the rest free. A 2 MiB segment is
        the small pool's (a large request's segment is at least 10 MiB)."""
        small = size == SMALL_SEGMENT
        cuts = sorted(taken)
        blocks, at = [], 0
        for offset, nbytes in cuts:
            if offset > at:
                blocks.append(_Block(address + at, offset - at, small))
            blocks.append(_Block(address + offset, nbytes, small, free=False))
            at = offset + nbytes
        if at < size:
            blocks.append(_Block(address + at, size - at, small))
        for a, b in zip(blocks, blocks[1:]):
            a.next, b.prev = b, a
        for b in blocks:
            self._blocks[b.addr] = b
            if b.free:
                self._give(b)
            else:
                self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._count_segment(size)

    def _best_fit(self, small: bool, size: int) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        return self._blocks[pool[i][1]] if i < len(pool) else None

    def _new_segment(self, small: bool, size: int, address: int | None) -> _Block:
        if address is None:
            address = self.next_address
        self.next_address = max(self.next_address, address + size)
        block = _Block(address, size, small)
        self._blocks[address] = block
        self._give(block)
        self._count_segment(size)
        return block

    def _count_segment(self, size: int) -> None:
        self.segments += 1
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _give(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.addr))

    def _take(self, block: _Block) -> None:
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.addr))]

    def _merge(self, block: _Block, other: _Block) -> _Block:
        """One free block of ``block`` and its free neighbour ``other``."""
        low, high = (block, other) if block.addr < other.addr else (other, block)
        low.size += high.size
        low.next = high.next
        if high.next is not None:
            high.next.prev = low
        del self._blocks[high.addr]
        return low
