"""``MessageQueue``: one writer broadcasting Python objects to n readers.

Method names follow vLLM's ``MessageQueue`` so engines can swap it in. Local readers are
reached over a shared-memory ring, remote readers over ZeroMQ (``Config.transport``
chooses; the queue never cares which).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from typing import Any, Callable

from mpx import _debug, serde
from mpx import layout as L
from mpx.config import Config
from mpx.errors import HandleError, QueueClosedError, QueueTimeout, RoleError, ShmError
from mpx.transport.shm import ShmReader, ShmWriter
from mpx.transport.zmq import ZmqReader, ZmqWriter

logger = logging.getLogger("mpx")


@dataclasses.dataclass(frozen=True)
class Handle:
    """What a reader process needs to attach to a queue: small and picklable."""

    layout_version: int
    n_reader: int
    n_local_reader: int
    local_reader_ranks: tuple[int, ...]
    transport: dict[str, Any] | None      # the shared-memory ring, if any reader uses it
    connect_ip: str | None = None
    remote: dict[str, Any] | None = None  # the ZeroMQ endpoint, if any reader uses it
    max_chunk_bytes: int = 0
    max_chunks: int = 0


def _warn_fallback(e: ShmError) -> None:
    warnings.warn(f"mpx: {e}; using the ZeroMQ transport for local readers instead "
                  "(transport='auto')", RuntimeWarning, stacklevel=4)


def _deadline(timeout: float | None) -> int:
    if timeout is None:
        return -1
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
    return time.monotonic_ns() + int(timeout * 1e9)


# Messages at least this large go to shared-memory and ZeroMQ readers at the same time; a
# thread costs ~0.1 ms to start, well under the time such a message takes to send.
_PARALLEL_MIN_BYTES = 4 << 20


class _Broadcast:
    """The writer side: one transport per group of readers, one ``write`` reaching all."""

    def __init__(self, shm_end: ShmWriter | None, zmq_end: ZmqWriter | None) -> None:
        self.shm = shm_end
        self.zmq = zmq_end
        self.ends: list[Any] = [e for e in (shm_end, zmq_end) if e is not None]
        self.implementation = "+".join(e.implementation for e in self.ends) or "none"

    def wait_ready(self, deadline_ns: int) -> None:
        for e in self.ends:
            e.wait_ready(deadline_ns)

    def free_slots(self) -> int:
        return self.shm.free_slots() if self.shm is not None else 1 << 30

    def has_room(self, need: int) -> bool:
        return self.shm.has_room(need) if self.shm is not None else True

    def slots_needed(self, parts: tuple) -> int:
        return self.shm.slots_needed(parts) if self.shm is not None else 1

    def write(self, kind: int, parts: tuple, deadline_ns: int) -> None:
        if self.shm is None or self.zmq is None or \
                sum(memoryview(p).nbytes for p in parts) < _PARALLEL_MIN_BYTES:
            for e in self.ends:
                e.write(kind, parts, deadline_ns)
            return
        # A large message to both: the network send starts at once, beside the ring write
        # (both release the GIL while they copy, sign and wait).
        failed: list[BaseException] = []

        def send_remote() -> None:
            try:
                self.zmq.write(kind, parts, deadline_ns)  # type: ignore[union-attr]
            except BaseException as e:
                failed.append(e)

        remote = threading.Thread(target=_debug.counted_thread(send_remote),
                                  name="mpx-zmq-send", daemon=True)
        remote.start()
        try:
            self.shm.write(kind, parts, deadline_ns)
        finally:
            remote.join()
        if failed:
            raise failed[0]

    def shutdown(self) -> None:
        for e in self.ends:
            e.shutdown()

    def close(self) -> None:
        for e in self.ends:
            e.close()


class MessageQueue:
    """A one-writer, n-reader broadcast queue of Python objects.

    The process that constructs it is the writer. Each reader process calls
    ``MessageQueue.create_from_handle(writer.export_handle(), rank)``. Every reader receives
    every message, in order. Objects travel as pickle protocol 5; buffers (numpy arrays,
    bytearrays, CPU tensors) are copied straight into the ring and the reader gets owned,
    writable copies.
    """

    def __init__(self, n_reader: int, n_local_reader: int,
                 local_reader_ranks: list[int] | None = None,
                 max_chunk_bytes: int | None = None, max_chunks: int | None = None,
                 connect_ip: str | None = None, *, config: Config | None = None) -> None:
        if not isinstance(n_reader, int) or n_reader < 0:
            raise ValueError(f"n_reader must be an int >= 0, got {n_reader!r}")
        if not isinstance(n_local_reader, int) or not 0 <= n_local_reader <= n_reader:
            raise ValueError(f"n_local_reader must be in [0, n_reader={n_reader}], "
                             f"got {n_local_reader!r}")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        ranks = list(local_reader_ranks)
        if len(ranks) != n_local_reader or len(set(ranks)) != len(ranks) or \
                any(not isinstance(r, int) or not 0 <= r < n_reader for r in ranks):
            raise ValueError(f"local_reader_ranks must be {n_local_reader} distinct ranks in "
                             f"[0, {n_reader}), got {local_reader_ranks!r}")
        base = config or Config.from_env()
        sizes: dict[str, Any] = {k: v for k, v in (("max_chunk_bytes", max_chunk_bytes),
                                                   ("max_chunks", max_chunks)) if v is not None}
        self.config = dataclasses.replace(base, **sizes)
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.local_reader_ranks = tuple(ranks)
        self.rank: int | None = None
        self._reader: ShmReader | ZmqReader | None = None
        self._closed = False
        shm_ranks, zmq_ranks = self._split(ranks)
        shm_end = zmq_end = None
        try:
            if shm_ranks:
                try:
                    shm_end = ShmWriter(shm_ranks, self.config)
                except ShmError as e:
                    if self.config.transport != "auto":
                        raise
                    _warn_fallback(e)
                    zmq_ranks, shm_ranks = sorted(zmq_ranks + shm_ranks), []
            if zmq_ranks:
                zmq_end = ZmqWriter(zmq_ranks, self.config, connect_ip or self.config.host)
        except BaseException:
            if shm_end is not None:
                shm_end.close()
            raise
        self._writer: _Broadcast | None = _Broadcast(shm_end, zmq_end)
        self._end: _Broadcast | ShmReader | ZmqReader = self._writer
        self._handle = Handle(L.VERSION, n_reader, n_local_reader, tuple(ranks),
                              shm_end.handle_info() if shm_end else None, connect_ip,
                              zmq_end.handle_info() if zmq_end else None,
                              self.config.max_chunk_bytes, self.config.max_chunks)
        logger.debug("mpx: queue for %d readers (shared memory: %s, zmq: %s), %s", n_reader,
                     shm_ranks, zmq_ranks, self.config.describe())

    def _split(self, local: list[int]) -> tuple[list[int], list[int]]:
        """(ranks over shared memory, ranks over ZeroMQ) for this config's transport."""
        remote = [r for r in range(self.n_reader) if r not in local]
        transport = self.config.transport
        if transport == "shm" and remote:
            raise ValueError(f"transport 'shm' serves one node only, but reader ranks {remote} "
                             "are remote; use 'auto' or 'zmq'")
        if transport == "zmq":
            return [], sorted(local + remote)
        return list(local), remote

    @classmethod
    def create_from_handle(cls, handle: Handle, rank: int, *,
                           config: Config | None = None) -> MessageQueue:
        """Attach to the queue of ``handle`` as reader ``rank`` (``0 <= rank < n_reader``)."""
        if not isinstance(handle, Handle):
            raise HandleError(f"expected an mpx.queue.Handle, got {type(handle).__name__}")
        if handle.layout_version != L.VERSION:
            raise HandleError(f"the handle is for ring layout version {handle.layout_version}, "
                              f"this mpx speaks version {L.VERSION}: mix of mpx versions?")
        if not isinstance(rank, int) or not 0 <= rank < handle.n_reader:
            raise ValueError(f"reader rank must be in [0, {handle.n_reader}), got {rank!r}")
        self = cls.__new__(cls)
        self.config = config or Config.from_env(max_chunk_bytes=handle.max_chunk_bytes or None,
                                                max_chunks=handle.max_chunks or None)
        self.n_reader = handle.n_reader
        self.n_local_reader = handle.n_local_reader
        self.local_reader_ranks = handle.local_reader_ranks
        self.rank = rank
        self._writer = None
        self._handle = handle
        self._closed = False
        shm_info = handle.transport
        if shm_info is not None and rank in shm_info["shm_ranks"]:
            self._reader = ShmReader(shm_info, shm_info["shm_ranks"].index(rank), rank,
                                     self.config)
        elif handle.remote is not None and rank in handle.remote["zmq_ranks"]:
            self._reader = ZmqReader(handle.remote, rank, self.config)
        else:
            raise HandleError(f"the handle has no transport for reader rank {rank}")
        self._end = self._reader
        return self

    # ------------------------------------------------------------------ properties

    @property
    def is_writer(self) -> bool:
        return self._writer is not None

    @property
    def ring_implementation(self) -> str:
        """``"cython"`` or ``"python"``: the ring this end of the queue runs on."""
        return self._end.implementation

    def export_handle(self) -> Handle:
        """The picklable handle readers attach with (writer only)."""
        self._need_writer("export_handle")
        return self._handle

    # ------------------------------------------------------------------ operations

    def _need_writer(self, what: str) -> _Broadcast:
        if self._closed:
            raise QueueClosedError(f"{what}() on a closed queue")
        if self._writer is None:
            raise RoleError(f"{what}() is for the writer; this end is reader rank {self.rank}")
        return self._writer

    def _need_reader(self, what: str) -> ShmReader | ZmqReader:
        if self._closed:
            raise QueueClosedError(f"{what}() on a closed queue")
        if self._reader is None:
            raise RoleError(f"{what}() is for readers; this end is the writer")
        return self._reader

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Writer: wait until every reader attached (QueueTimeout names the missing ranks).
        Reader: wait until every reader attached."""
        deadline = _deadline(timeout)
        if self._closed:
            raise QueueClosedError("wait_until_ready() on a closed queue")
        self._end.wait_ready(deadline)

    def enqueue(self, obj: Any, timeout: float | None = None, *,
                while_full: Callable[[], bool | None] | None = None) -> None:
        """Broadcast ``obj`` to every reader. Blocks while the ring is full, up to ``timeout``
        seconds. An object that cannot be pickled raises SerializationError and nothing is
        sent.

        ``while_full``, if given, is called repeatedly while the ring lacks room for the
        message, before anything is written: a caller whose readers may be blocked on
        something only it can do (drain their replies) does that there. Once it returns
        False (someone else does it), the write waits for room as usual.
        """
        writer = self._need_writer("enqueue")
        deadline = _deadline(timeout)
        kind, parts = serde.encode(obj, local_only=writer.zmq is None)
        if while_full is not None:
            need = writer.slots_needed(parts)
            while not writer.has_room(need):
                if 0 <= deadline <= time.monotonic_ns():
                    raise QueueTimeout("enqueue timed out waiting for ring space")
                if while_full() is False:
                    break
        writer.write(kind, parts, deadline)

    def poll(self) -> bool:
        """Reader: True if a message (or the start of one) is waiting to be dequeued."""
        return self._need_reader("poll").poll()

    def dequeue(self, timeout: float | None = None, cancel: threading.Event | None = None,
                indefinite: bool = False) -> Any:
        """The next object. Raises QueueTimeout after ``timeout`` seconds, Cancelled when
        ``cancel`` is set or the queue is shut down, PeerDiedError when the writer is gone
        and nothing it published remains unread. Unless ``indefinite``, a wait longer than a
        minute logs a warning naming the writer."""
        reader = self._need_reader("dequeue")
        deadline = _deadline(timeout)
        kind, data = reader.read(deadline, cancel, not indefinite)
        return serde.decode(kind, data)

    def dequeue_stream(self, timeout: float | None = None,
                       cancel: threading.Event | None = None) -> tuple[int, int, Any]:
        """The next message as ``(kind, total, pieces)``, not unpickled: ``pieces`` yields
        its bytes as they arrive (a remote reader streams chunks; a local one yields the
        whole message). For relays, with :meth:`enqueue_stream`."""
        reader = self._need_reader("dequeue_stream")
        deadline = _deadline(timeout)
        if isinstance(reader, ZmqReader):
            return reader.read_stream(deadline, cancel)
        kind, data = reader.read(deadline, cancel, False)
        return kind, memoryview(data).nbytes, (data,)

    def enqueue_stream(self, kind: int, total: int, pieces: Any,
                       timeout: float | None = None) -> None:
        """Broadcast a message of ``total`` bytes from the iterable ``pieces`` as they come
        (to readers over shared memory; ZeroMQ readers get it once it is whole). An
        exception from ``pieces`` propagates, and readers never see the message."""
        writer = self._need_writer("enqueue_stream")
        deadline = _deadline(timeout)
        if writer.zmq is not None or writer.shm is None:
            writer.write(kind, tuple(pieces), deadline)
        else:
            writer.shm.write(kind, pieces, deadline, total)

    def broadcast_object(self, obj: Any = None) -> Any:
        """vLLM's helper: the writer enqueues ``obj`` and returns it, a reader dequeues."""
        if self.is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def shutdown(self) -> None:
        """Wake every waiter of this process with Cancelled. On the writer, readers also
        get Cancelled once they have read everything already enqueued."""
        if self._closed:
            return
        self._end.shutdown()

    def close(self) -> None:
        """Release the queue's resources; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._end.close()

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "writer" if self._writer is not None else f"reader rank={self.rank}"
        state = " closed" if self._closed else ""
        return f"<mpx.MessageQueue {role} n_reader={self.n_reader}{state}>"
