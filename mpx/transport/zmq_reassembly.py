"""A ZeroMQ reader's chunks gathered into messages: each message's chunks in order, from its
first to its last, or the message is not delivered.

A chunk out of order (replayed), a message older than the last one begun (replayed), and a
message whose sizes do not add up are dropped and counted. A message the writer gave up on
part way (a later message begins before its end) is discarded, and the later one read on.
A message this process cannot allocate memory for is skipped, its chunks dropped as they
come (MessageTooLargeError).

Nothing here waits or locks: its reader feeds it the chunks it received, under its lock.
"""

from __future__ import annotations

import os
from typing import Any

from mpx._units import human_size
from mpx.errors import MessageAbortedError, MessageTooLargeError
from mpx.mechanism import codec, layout
from mpx.transport.zmq_drops import DropLog
from mpx.transport.zmq_framing import Chunk


class Partial:
    """A message being gathered: its first chunk, the assembler, and the index of the
    chunk it needs next."""

    def __init__(self, first: Chunk, assembler: Any) -> None:
        self.first = first
        self.out = assembler(first.total, bool(first.kind & layout.KIND_AS_BYTES))
        self.next = 0


class Reassembly:
    """The messages that reader ``rank`` receives from the writer at ``endpoint``, chunk by
    chunk (``add``, or ``begins`` and ``next_piece`` for a message streamed as it comes);
    the chunks it throws away are counted in ``drops``. ``partial``: a message begun (a
    read that ended part way leaves it here, and the next read goes on with it)."""

    def __init__(self, drops: DropLog, endpoint: str, rank: int) -> None:
        self.drops, self._endpoint, self._rank = drops, endpoint, rank
        self.partial: Partial | None = None
        self._seq = 0  # the lowest sequence number a new message may have
        self._skipping = -1  # the sequence number of a message skipped (too large)
        self._assembler = codec.Assembler

    def begins(self, c: Chunk) -> bool:
        """Whether ``c`` is the first chunk of the next message: then the messages before
        it are over. A stray continuation and a replayed message are dropped, the rest of a
        message skipped is passed over."""
        if c.seq == self._skipping:
            return False  # the rest of a message too large for this process
        if c.index != 0:
            self.drops.drop(self._endpoint, f"chunk {c.index} of message {c.seq} out of "
                            "order (replayed?)")
            return False
        if c.seq < self._seq:
            self.drops.drop(self._endpoint, f"sequence {c.seq}, expected {self._seq} or "
                            "later (replayed?)")
            return False
        # a later sequence number than expected: the writer gave up on those between
        self._seq = c.seq + 1
        return True

    def add(self, c: Chunk, lend_min: int) -> tuple[int, Any] | None:
        """``(kind, data)`` of the message that ``c`` completes, else None. A message of one
        chunk of at least ``lend_min`` bytes (``lend_min`` >= 0) comes as ``c``'s view of its
        frame; any other is gathered into memory of its own (MessageTooLargeError if it
        cannot be allocated: the message is skipped)."""
        part = self.partial
        if part is not None and c.index == 0 and c.seq > part.first.seq:
            self.partial = part = None  # the writer gave up on that one
        if part is None:
            if not self.begins(c):
                return None
            if c.count == 1 and 0 <= lend_min <= c.total:
                if c.data.nbytes == c.total:
                    return c.kind, c.data
                self.drops.drop(self._endpoint, f"message {c.seq}: its one chunk holds "
                                f"{c.data.nbytes} bytes, its header says {c.total}")
                return None
            try:
                self.partial = part = Partial(c, self._assembler)
            except MemoryError:
                self._skipping = c.seq
                raise self._too_large(c.total) from None
        elif c.seq != part.first.seq or c.index != part.next:
            self.drops.drop(self._endpoint, f"chunk {c.index} of message {c.seq} out of "
                            "order (replayed?)")
            return None
        first = part.first
        try:
            part.out.add(c.data)
        except ValueError as e:  # more bytes than the header says
            self.partial = None
            self.drops.drop(self._endpoint, f"message {first.seq}: {e}")
            return None
        part.next += 1
        if part.next < first.count:
            return None
        self.partial = None
        if not part.out.complete:
            self.drops.drop(self._endpoint, f"message {first.seq} is shorter than its header says")
            return None
        try:
            return first.kind, part.out.result()
        except MemoryError:  # (the pure Assembler copies a bytes message)
            raise self._too_large(first.total) from None

    def next_piece(self, first: Chunk, index: int, c: Chunk) -> bool:
        """Whether ``c`` is chunk ``index`` of the message streamed from ``first`` (else it
        is dropped). MessageAbortedError if ``c`` begins a later message: the writer gave
        up on this one part way (``c`` is then still to be read)."""
        if c.index == 0 and c.seq > first.seq:
            raise MessageAbortedError(f"the writer gave up on message {first.seq} part way")
        if c.seq == first.seq and c.index == index:
            return True
        self.drops.drop(self._endpoint, f"chunk {c.index} of message {c.seq} out of order "
                        "(replayed?)")
        return False

    def _too_large(self, n: int) -> MessageTooLargeError:
        """The error of a message of ``n`` bytes skipped: no memory for it."""
        return MessageTooLargeError(
            f"reader rank {self._rank} (pid {os.getpid()}) could not allocate memory for a "
            f"message of {n} bytes ({human_size(n)}) from the writer at {self._endpoint}; "
            "the message was skipped, the queue reads on", nbytes=n)
