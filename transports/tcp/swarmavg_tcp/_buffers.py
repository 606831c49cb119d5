"""Receive buffers for messages, recycled once the application lets go of them.

A fresh buffer for every large message would cost a page fault per 4 KiB page on its first
write (the allocator returns big blocks to the OS when they are freed and maps new ones): on a
VM, that alone costs more than the copy from the socket. So buffers of 64 KiB and more come
from a pool of blocks in size classes 1/16 of a power of two apart (a message of 2 MiB and a
header takes a block of 2.125 MiB, not 4 MiB: with power-of-two blocks, the all-reduce's 2 MiB
parts needed twice the pool, which then missed, and fresh blocks were page-faulted in every
round). The message is a view of a slice of a block; when the last
reference to that slice goes away (wherever and in whatever thread), a finalizer gives the block
back to the pool. A message thus stays valid for as long as anybody holds it, as the transport
protocol requires.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Final

import numpy as np

#: Messages smaller than this get a plain bytearray.
POOL_MIN: Final = 64 << 10
#: Blocks larger than this are not kept.
POOL_MAX_BLOCK: Final = 32 << 20


def block_size_for(size: int) -> int:
    """The size class of a message of ``size`` (>= 1) bytes: ``size`` rounded up to a multiple
    of 1/16 of the power of two below it (at most ~6% more), and of 4 KiB (whole pages)."""
    step = max(4096, 1 << max(0, (size - 1).bit_length() - 5))
    return -(-size // step) * step


class BufferPool:
    """A bounded pool of uninitialised byte blocks.

    :param max_cached: bytes of free blocks kept for reuse; the rest is freed.
    """

    def __init__(self, max_cached: int = 128 << 20) -> None:
        self._free: dict[int, list[np.ndarray[Any, Any]]] = {}
        self._cached = 0
        self._max_cached = max_cached
        self._lock = threading.Lock()

    @property
    def cached_bytes(self) -> int:
        """Bytes held in free blocks."""
        return self._cached

    def get(self, size: int) -> memoryview:
        """A writable buffer of exactly ``size`` bytes, with unspecified contents."""
        if size < POOL_MIN:
            return memoryview(bytearray(size))
        block_size = block_size_for(size)
        block = None
        if block_size <= POOL_MAX_BLOCK:
            with self._lock:
                free = self._free.get(block_size)
                if free:
                    block = free.pop()
                    self._cached -= block_size
        if block is None:
            block = np.empty(block_size, dtype=np.uint8)
        piece = block[:size]
        if block_size <= POOL_MAX_BLOCK:
            weakref.finalize(piece, self._put, block)
        return memoryview(piece)  # type: ignore[arg-type]  # numpy arrays export buffers

    def _put(self, block: np.ndarray[Any, Any]) -> None:
        size = block.nbytes
        with self._lock:
            if self._cached + size <= self._max_cached:
                self._free.setdefault(size, []).append(block)
                self._cached += size

    def clear(self) -> None:
        """Free every cached block."""
        with self._lock:
            self._free.clear()
            self._cached = 0


#: The pool every connection of the process shares.
POOL: Final = BufferPool()
