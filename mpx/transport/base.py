"""The transport interface: a writer end that delivers each message to its readers, and a
reader end that receives them, plus the handle a reader attaches with. The queue above
talks to ``Writer`` and ``Reader`` only, never to a particular transport.

The channel: ``Writer.send(obj, deadline_ns)`` encodes an object (serde's policy) and
writes it; ``Reader.recv(deadline_ns)`` reads the next message and decodes it, and
``Reader.recv_ready()`` decodes every message already there. The driver and the workers
use these; a shared-memory end runs each through the compiled end it holds
(``mpx/transport/shm_end.py``), one call into it a message.

Below the channel, a message is ``(kind, pieces)``: a kind the transport carries untouched
(it looks only at ``layout.KIND_AS_BYTES``, which says whether the reader gets ``bytes`` or
a writable ``bytearray``) and buffers to concatenate. Deadlines are absolute
``time.monotonic_ns()`` values, ``-1`` for none. Every wait ends with QueueTimeout at its
deadline, Cancelled on ``shutdown()`` or a cancel event, or PeerDiedError when the other
side is gone; a reader's wait also ends with WaitNudged (a QueueTimeout) on ``nudge()``.
None of these, nor a signal handler's exception, consumes part of a message: a reader
keeps what it received of one, and its next read goes on with it.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

from mpx.config import Config
from mpx.errors import (
    Cancelled,
    DeserializationError,
    MessageTooLargeError,
    QueueClosedError,
    QueueTimeout,
    RoleError,
)
from mpx.protocol import serde


@dataclasses.dataclass(frozen=True)
class Handle:
    """What a reader process needs to attach to a queue: small and picklable.

    ``shm``: the shared-memory ring's attach info, if any reader uses it; ``zmq``: the
    ZeroMQ writer's, if any reader uses it (each from its writer's ``handle_info()``).
    """

    layout_version: int
    n_reader: int
    n_local_reader: int
    local_reader_ranks: tuple[int, ...]
    shm: dict[str, Any] | None
    connect_ip: str | None = None
    zmq: dict[str, Any] | None = None
    max_chunk_bytes: int = 0
    max_chunks: int = 0

    # vLLM's Handle fields, for code that reads them
    @property
    def buffer_handle(self) -> tuple[int, int, int, str] | None:
        """vLLM's ``(n_local_reader, max_chunk_bytes, max_chunks, shm name)`` of the ring."""
        if self.shm is None:
            return None
        return (len(self.shm["shm_ranks"]), self.max_chunk_bytes, self.max_chunks,
                self.shm["shm_name"])

    @property
    def remote_subscribe_addr(self) -> str | None:
        """vLLM's TCP address of the writer (``tcp://host:port``), if readers are remote."""
        return self.zmq["endpoint"] if self.zmq is not None else None

    @property
    def remote_addr_ipv6(self) -> bool:
        """vLLM's: whether the writer's address is IPv6."""
        addr = self.remote_subscribe_addr
        return addr is not None and addr.startswith("tcp://[")


def added_link_counts(ends: Iterable[Endpoint]) -> tuple[int, int, int]:
    """The Endpoint.link_counts of ``ends``, added up."""
    failures = resumes = resent = 0
    for end in ends:
        f, r, s = end.link_counts()
        failures, resumes, resent = failures + f, resumes + r, resent + s
    return failures, resumes, resent


class Endpoint(abc.ABC):
    """The lifecycle every transport end shares: open, then shut down (this process's
    waiters are woken and end with Cancelled; the peers are not told), then closed
    (resources released, once; the peers are told). ``_lock`` (``lock``, or a
    ``threading.Lock``) serialises the end's operations with ``close()``."""

    #: the peers map this process's shared memory (serde may then send references)
    shares_memory: ClassVar[bool] = False

    def __init__(self, config: Config,
                 lock: contextlib.AbstractContextManager[Any] | None = None) -> None:
        self.config = config
        self._lock = threading.Lock() if lock is None else lock
        self._closed = False
        self._shut = False

    def link_counts(self) -> tuple[int, int, int]:
        """What this end's network link went through: frames that failed authentication
        (each one reset the link), times the link was taken up again where it broke, and
        frames sent again for that; zeros for an end without one (shared memory)."""
        return 0, 0, 0

    def reconnect_now(self) -> None:
        """This end's network link is suspected stale (its node was silent, and is heard
        again): take it up again now, on a new connection, where it was (a reader's; a
        writer's lets its readers back in at once; a no-op for shared memory). From any
        thread."""
        return None  # (the ZeroMQ transport's ends do it: zmq_reader, zmq_writer)

    def link_state(self) -> str:
        """What is wrong with this end's network link now, in words ("" if nothing, or no
        link: shared memory)."""
        return ""

    def shutdown(self) -> None:
        """Wake this process's waiters on this end (Cancelled, also for later waits)."""
        if self._closed or self._shut:
            return
        self._shut = True
        self._wake()

    def close(self) -> None:
        """Release every resource and tell the peers; idempotent."""
        if self._closed:
            return
        self._closed = True  # (first: a waiter woken by close sees a closed end, not a shut one)
        self._shut = True
        self._wake()
        with self._lock:
            self._release()

    def _shut_error(self, what: str) -> Exception:
        """The error that ends a wait which saw ``_shut``: QueueClosedError if close() set
        it (close sets ``_closed`` first, so it is read after ``_shut``), else Cancelled."""
        if self._closed:
            return QueueClosedError(f"{what}: the queue was closed")
        return Cancelled(f"{what} cancelled: the queue was shut down")

    def _check_open(self) -> None:
        if self._closed:
            raise Cancelled("the queue is closed")

    @abc.abstractmethod
    def _wake(self) -> None:
        """Wake this process's waiters (they see ``_shut``)."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Release the end's resources (once, under ``_lock``)."""

    @abc.abstractmethod
    def wait_ready(self, deadline_ns: int, cancel: threading.Event | None = None) -> None:
        """Return once the peers this end needs are attached or connected."""


class Writer(Endpoint):
    """The writer end of a transport: delivers each message to every one of its readers."""

    @abc.abstractmethod
    def write(self, kind: int, pieces: Iterable, deadline_ns: int, total: int = -1) -> None:
        """Deliver one message to every reader, or raise (QueueTimeout, Cancelled,
        PeerDiedError) leaving the transport usable. Given ``total`` (the message's length),
        ``pieces`` may be any iterable, taken as the message goes out; pieces that do not
        add up to ``total`` raise ValueError, and readers never see the message."""

    def send(self, obj: Any, deadline_ns: int = -1) -> None:
        """Encode ``obj`` (serde.encode; references only where every reader shares this
        process's memory) and write it. What encoding raises propagates, and nothing is
        written; then write()'s errors."""
        kind, parts = serde.encode(obj, self.shares_memory)
        self.write(kind, parts, deadline_ns)

    @abc.abstractmethod
    def handle_info(self) -> dict[str, Any]:
        """What a reader needs to attach (picklable)."""

    def capacity(self) -> int | None:
        """The largest message that can be written whole without a reader taking part of
        it first (a ring's size); None: no such limit."""
        return None

    def has_room(self, pieces: tuple) -> bool:
        """Whether a message of ``pieces`` can be written now without waiting."""
        return True

    def wake_readers(self) -> None:
        """A message follows: wake the readers that sleep, so that their wake-up overlaps
        the making of it. A hint; nothing by default."""

    def missing_readers(self) -> list[int]:
        """The ranks of the readers that have not attached yet."""
        return []

    def release_reader(self, rank: int) -> None:
        """Reader ``rank``'s process is gone for good (the group re-forms its queues without
        it): what it left unread stops holding this writer up, for the messages that tell
        the other readers where to go next. A rank this end does not serve is ignored."""

    def reopen_reader(self, rank: int) -> None:
        """The process that attached as reader ``rank`` died before it read anything this
        writer must keep (it died while it started): its place goes to the next process
        that attaches as ``rank``. A rank this end does not serve is ignored."""

    @contextlib.contextmanager
    def slot(self, deadline_ns: int, kind: int) -> Iterator[memoryview]:
        """A writable buffer of ``max_chunk_bytes``; a clean exit delivers all of it as one
        message of ``kind``, an exception delivers nothing. A transport with slots in
        shared memory lends one in place."""
        buf = bytearray(self.config.max_chunk_bytes)
        yield memoryview(buf)
        self.write(kind, (buf,), deadline_ns)


class Reader(Endpoint):
    """A reader end of a transport: receives every message, in order."""

    rank: int

    @property
    def bytes_read(self) -> int:
        """The bytes of the messages read so far (their payload, as the writer sent it)."""
        return 0

    @abc.abstractmethod
    def poll(self) -> bool:
        """Whether a message (or the start of one) is waiting."""

    @abc.abstractmethod
    def read(self, deadline_ns: int, cancel: threading.Event | None,
             warn: bool) -> tuple[int, Any]:
        """The next message as ``(kind, data)``; ``data`` is owned (bytes or bytearray).
        ``warn``: log the wait when it grows long."""

    def read_into(self, deadline_ns: int, cancel: threading.Event | None, warn: bool,
                  decode: Callable[[int, Any], Any], in_place_min: int | None = None) -> Any:
        """``decode(kind, data)`` of the next message, waiting as read() does. A transport
        may lend ``data`` in place (a memoryview of shared memory, valid for the call
        only), for messages from ``in_place_min`` bytes up (None: its own threshold):
        ``decode`` must return objects that own their memory."""
        kind, data = self.read(deadline_ns, cancel, warn)
        return decode(kind, data)

    def recv(self, deadline_ns: int = -1) -> Any:
        """The next message, decoded (serde.decode_lent), waiting until ``deadline_ns``; the
        errors of read(), and DeserializationError for a message that does not decode (it
        is consumed: the next recv() reads the one after it)."""
        return self.read_into(deadline_ns, None, False, serde.decode_lent)

    def recv_ready(self, on_error: Callable[[DeserializationError], Any]) -> list:
        """Every message already whole, decoded, in order, without waiting (read_ready()); a
        message that does not decode is ``on_error(its DeserializationError)`` in its
        place, and those after it still come. A message this process could not allocate
        memory for (skipped: MessageTooLargeError) is the list's only one, so replaced."""
        try:
            ready = self.read_ready()
        except MessageTooLargeError as e:  # (skipped; the list's only message)
            return [on_error(e)]
        out: list = []
        append, decode = out.append, serde.decode_lent  # (owned data: decode's result, in C)
        for kind, data in ready:
            try:
                append(decode(kind, data))
            except DeserializationError as e:
                append(on_error(e))
        return out

    def drain(self, deadline_ns: int) -> None:
        """After shutdown(): let the reads that follow take, besides what has arrived, what
        the writer sent that is still on its way (its last messages, when it died), waiting
        for them until ``deadline_ns`` at most; they end with Cancelled as before. Nothing
        to do where a message written is readable at once (shared memory)."""

    @abc.abstractmethod
    def nudge(self) -> None:
        """End the wait of this end's read in progress (called from another thread of this
        process), or, if none waits now, of the next read that would wait: that read
        raises WaitNudged at once, having consumed nothing. A nudge is never lost and ends
        one wait; nudges before that wait ends count as one. A read that finds a message
        waiting returns it and leaves the nudge for a later wait."""

    def read_ready(self) -> list[tuple[int, Any]]:
        """Every message already whole, as ``(kind, data)`` pairs, without waiting for
        anything (a message whose rest is still coming is kept for the next read); raises
        as read() does once nothing before the error is left."""
        out: list = []
        while self.poll():
            try:
                out.append(self.read(0, None, False))  # (a deadline past: no waiting)
            except QueueTimeout:
                break
            except Exception:
                if not out:
                    raise
                break  # (the error recurs at the next read)
        return out

    def read_stream(self, deadline_ns: int,
                    cancel: threading.Event | None) -> tuple[int, int, Iterable]:
        """The next message as ``(kind, total, pieces)``: ``pieces`` yields its bytes as they
        arrive, and raises MessageAbortedError if the writer gives up on it part way."""
        kind, data = self.read(deadline_ns, cancel, False)
        return kind, memoryview(data).nbytes, (data,)

    def slot(self, deadline_ns: int,
             cancel: threading.Event | None) -> contextlib.AbstractContextManager[memoryview]:
        """The next message, when it fits one slot, as a read-only view of that slot in
        shared memory (given back to the writer when the block exits). Only readers that
        share memory with the writer have slots: RoleError here."""
        raise RoleError(f"acquire_read() is for local (shared-memory) readers; reader rank "
                        f"{self.rank} is remote: use dequeue()")
