"""A ZeroMQ queue's link outlives its TCP connection: what the writer holds for resends.

A TCP connection breaks (a reset, a NAT that forgot it, a frame that failed its HMAC, which
the reader treats as a broken link) without either process dying. Then:

- the reader's DEALER connects again (libzmq retries every ``reconnect_ivl``; its routing id
  is the same, so the writer's ROUTER takes the new connection in the old one's place:
  ROUTER_HANDOVER) and, once connected, sends a sealed RESUME naming the last frame it has
  and a fresh nonce;
- the writer answers with a RESUMED frame carrying that nonce and then every frame it
  holds after the named one, in order; the reader drops what came between its reconnection
  and that RESUMED (the resend has it again), so that nothing is lost, doubled or reordered;
- a reader whose link stays broken for ``Config.link_grace`` is lost, as a dead one
  (PeerDiedError at the writer; at the reader, its writer is lost).

What a writer holds is bounded: a frame is held until every reader has acknowledged it
(a reader sends ACK every ``Config.max_chunks`` frames it reads), and at most
``WINDOW_PER_CHUNKS`` x ``Config.max_chunks`` frames are held (64 at the defaults, so at
most 64 x ``max_chunk_bytes`` = 64 MiB): a writer whose window is full waits for the
acknowledgements as it waits for room in a reader's pipe (until its deadline, then
QueueTimeout naming the reader that is behind).

Nothing here locks: the writer uses it under its own lock (zmq_writer).
"""

from __future__ import annotations

import collections

# The window in frames, per Config.max_chunks (a reader's acknowledgement interval): four
# intervals, so that the window never fills while readers keep up.
WINDOW_PER_CHUNKS = 4
_ALL = 1 << 63  # (acknowledged: every frame, for a reader that left)


class ResendWindow:
    """The frames a writer has sent that some reader has not acknowledged, oldest first, at
    most ``frames_max`` of them; ``acked[rank]``: the last frame reader ``rank`` has."""

    def __init__(self, frames_max: int) -> None:
        self.frames_max = frames_max
        self._frames: collections.deque[tuple[int, bytes]] = collections.deque()
        self.acked: dict[int, int] = {}
        self.down: dict[int, float] = {}  # rank -> since when its link has been broken
        self.last = 0  # the number of the last frame held

    def full(self) -> bool:
        return len(self._frames) >= self.frames_max

    def hold(self, number: int, frame: bytes) -> None:
        """Hold frame ``number`` (just sent) until every reader has acknowledged it."""
        self._frames.append((number, frame))
        self.last = number

    def join(self, rank: int) -> None:
        """Reader ``rank`` reads the frames sent from now on."""
        self.acked[rank] = self.last
        self._trim()

    def leave(self, rank: int) -> None:
        """Reader ``rank`` is gone for good: nothing is held for it any more."""
        self.acked.pop(rank, None)
        self.down.pop(rank, None)
        self._trim()

    def done(self, rank: int) -> None:
        """Reader ``rank`` is closing: it reads nothing more, and nothing is held for it."""
        if rank in self.acked:
            self.acked[rank] = _ALL
            self._trim()

    def settled(self) -> bool:
        """Whether every reader that is not away has acknowledged every frame (or left)."""
        return all(n >= self.last for r, n in self.acked.items() if r not in self.down)

    def ack(self, rank: int, number: int) -> None:
        if rank in self.acked and number > self.acked[rank]:
            self.acked[rank] = number
            self._trim()

    def behind(self) -> int | None:
        """The reader that has acknowledged least (the one a full window waits for)."""
        return min(self.acked, key=self.acked.__getitem__) if self.acked else None

    def after(self, number: int) -> list[tuple[int, bytes]]:
        """The frames held after frame ``number``, oldest first."""
        return [(n, f) for n, f in self._frames if n > number]

    def oldest(self) -> int | None:
        return self._frames[0][0] if self._frames else None

    def _trim(self) -> None:
        frames = self._frames
        if not self.acked:
            frames.clear()
            return
        low = min(self.acked.values())
        while frames and frames[0][0] <= low:
            frames.popleft()
