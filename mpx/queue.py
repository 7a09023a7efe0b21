"""``MessageQueue``: one writer broadcasting Python objects to n readers.

A drop-in for vLLM's ``MessageQueue`` (``vllm.distributed.device_communicators.
shm_broadcast``): the same constructor, ``create_from_handle``, ``create_from_process_group``
and ``create_from_process_group_single_reader``, ``wait_until_ready``, ``enqueue``,
``dequeue``, ``acquire_write``/``acquire_read``, ``broadcast_object``, ``shutdown``,
``shutting_down``, ``n_local_reader``/``n_remote_reader``. Where the two differ, vLLM's
meaning wins; mpx adds ``poll``, ``close``, streams, cancel events and typed errors
(:mod:`mpx.errors`, subclasses of the ``TimeoutError``/``RuntimeError`` vLLM raises).

Local readers are reached over a shared-memory ring, remote readers over ZeroMQ
(``Config.transport`` chooses; the queue never cares which).

Reader ranks: as in vLLM, ``local_reader_ranks`` may hold *group* ranks, with the writer's
own group rank missing: in a group of ``n_reader + 1`` processes, ranks run from 0 to
``n_reader``. A reader attaches with its group rank; it is local when the rank is in
``local_reader_ranks``, else remote. (mpx's own executor numbers readers ``0..n_reader-1``;
both work.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from mpx import _debug
from mpx._impl import ring_implementation
from mpx.config import Config
from mpx.errors import (
    DeserializationError,
    HandleError,
    QueueClosedError,
    QueueTimeout,
    RoleError,
    ShmError,
)
from mpx.mechanism import layout
from mpx.protocol import serde
from mpx.transport.base import Handle, Reader, Writer, added_link_counts
from mpx.transport.shm import ShmReader, ShmWriter
from mpx.transport.zmq_reader import ZmqReader
from mpx.transport.zmq_writer import ZmqWriter

logger = logging.getLogger("mpx")


def _zmq_usable(config: Config) -> bool:
    """Whether a ZeroMQ end can be built under ``config`` (it needs a key or an explicit
    opt-out of authentication)."""
    return bool(config.auth_key) or config.allow_insecure


def _warn_fallback(e: ShmError) -> None:
    warnings.warn(f"mpx: {e}; using the ZeroMQ transport for local readers instead "
                  "(transport='auto')", RuntimeWarning, stacklevel=4)


def deadline_of(timeout: float | None) -> int:
    """The CLOCK_MONOTONIC nanosecond at which ``timeout`` seconds from now end, as the
    transport ends take it (-1: no deadline). ValueError for a negative timeout."""
    if timeout is None:
        return -1
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
    return time.monotonic_ns() + int(timeout * 1e9)


def make_room(has_room: Callable[[tuple], bool], parts: tuple, deadline_ns: int,
              while_full: Callable[[], bool | None]) -> None:
    """Before a write of ``parts``: call ``while_full()`` while ``has_room(parts)`` (a
    writing end's) is False, until it returns False (someone else frees the room; the
    write then waits for it). QueueTimeout once ``deadline_ns`` (-1: none) passes."""
    while not has_room(parts):
        if 0 <= deadline_ns <= time.monotonic_ns():
            raise QueueTimeout("timed out waiting for ring space")
        if while_full() is False:
            return


def _split(local: list[int], n_reader: int, transport: str) -> tuple[list[int], list[int], int]:
    """(ranks over shared memory, ranks ZeroMQ accepts, how many of those must connect), for
    a queue of ``n_reader`` readers whose ``local`` ranks are on this node.

    Remote readers may use any rank in ``[0, n_reader]`` that is not local: vLLM numbers
    readers by group rank and the writer's own rank, one of those, is not known here."""
    n_remote = n_reader - len(local)
    remote = [r for r in range(n_reader + 1) if r not in local] if n_remote else []
    if transport == "shm" and remote:
        raise ValueError(f"transport 'shm' serves one node only, but {n_remote} "
                         "readers are remote; use 'auto' or 'zmq'")
    if transport == "zmq":
        return [], sorted(set(local) | set(remote)), n_reader
    return list(local), remote, n_remote


# Messages at least this large go to shared-memory and ZeroMQ readers at the same time; a
# thread costs ~0.1 ms to start, well under the time such a message takes to send.
_PARALLEL_MIN_BYTES = 4 << 20


class _Broadcast:
    """The writer side of a queue with readers of both kinds: one transport end per group
    of readers, one ``write`` or ``send`` reaching all. (A queue with one end uses that end
    itself.)"""

    def __init__(self, ends: list[Writer]) -> None:
        # an end that lends its slots in place (shared memory) first: see slot()
        self.ends = sorted(ends, key=lambda e: not e.shares_memory)
        self.shares_memory = all(e.shares_memory for e in ends)

    def reconnect_now(self) -> None:
        for e in self.ends:
            e.reconnect_now()

    def link_counts(self) -> tuple[int, int, int]:
        """The ends' Endpoint.link_counts, added up."""
        return added_link_counts(self.ends)

    def capacity(self) -> int | None:
        """The least of the ends' capacities (see Writer.capacity)."""
        caps = [c for c in (e.capacity() for e in self.ends) if c is not None]
        return min(caps) if caps else None

    def send(self, obj: Any, deadline_ns: int = -1) -> None:
        """Encode ``obj`` once (references only if every reader shares memory) and write it
        to every end."""
        kind, parts = serde.encode(obj, self.shares_memory)
        self.write(kind, parts, deadline_ns)

    def wait_ready(self, deadline_ns: int, cancel: threading.Event | None = None) -> None:
        for e in self.ends:
            e.wait_ready(deadline_ns, cancel)

    def wake_readers(self) -> None:
        for e in self.ends:
            e.wake_readers()

    def has_room(self, parts: tuple) -> bool:
        return all(e.has_room(parts) for e in self.ends)

    def missing_readers(self) -> list[int]:
        return sorted(r for e in self.ends for r in e.missing_readers())

    def release_reader(self, rank: int) -> None:
        for e in self.ends:
            e.release_reader(rank)

    def reopen_reader(self, rank: int) -> None:
        for e in self.ends:
            e.reopen_reader(rank)

    def write(self, kind: int, parts: Any, deadline_ns: int, total: int = -1) -> None:
        """Write to every end (``parts``, an iterable, is gathered first)."""
        parts = tuple(parts)
        if total < 0:
            total = sum(memoryview(p).nbytes for p in parts)
        if total < _PARALLEL_MIN_BYTES:
            for e in self.ends:
                e.write(kind, parts, deadline_ns, total)
            return
        # A large message to several ends: each but the first gets a thread, so the
        # network sends start at once, beside the ring write (both release the GIL while
        # they copy, sign and wait).
        failed: list[BaseException] = []

        def send(end: Writer) -> None:
            try:
                end.write(kind, parts, deadline_ns, total)
            except BaseException as e:
                failed.append(e)

        threads = [threading.Thread(target=_debug.counted_thread(send), args=(e,),
                                    name="mpx-send", daemon=True) for e in self.ends[1:]]
        for t in threads:
            t.start()
        try:
            self.ends[0].write(kind, parts, deadline_ns, total)
        finally:
            for t in threads:
                t.join()
        if failed:
            raise failed[0]

    @contextlib.contextmanager
    def slot(self, deadline_ns: int, kind: int):
        """The first end's slot to fill in place; the other ends get a copy of it."""
        first, *rest = self.ends
        with first.slot(deadline_ns, kind) as view:
            yield view
            copy = bytes(view) if rest else b""
        for e in rest:
            e.write(kind, (copy,), deadline_ns)

    def shutdown(self) -> None:
        for e in self.ends:
            e.shutdown()

    def close(self) -> None:
        for e in self.ends:
            e.close()


class MessageQueue:
    """A one-writer, n-reader broadcast queue of Python objects (vLLM's ``MessageQueue``).

    The process that constructs it is the writer. Each reader process calls
    ``MessageQueue.create_from_handle(writer.export_handle(), rank)``. Every reader receives
    every message, in order. Objects travel as pickle protocol 5; out-of-band buffers
    (numpy arrays, CPU tensors) are copied straight into the ring and the reader gets
    owned, writable copies (bytearrays travel in band, inside the pickle).

    ``n_reader`` readers, ``n_local_reader`` of them on this node (shared memory), the rest
    remote (ZeroMQ over TCP on ``connect_ip``, HMAC-signed with ``Config.auth_key``).
    ``local_reader_ranks``: the local readers' ranks, default ``range(n_local_reader)``; they
    may be group ranks (see the module docstring). ``max_chunk_bytes`` x ``max_chunks``: the
    ring's slots (a multiple of 64 bytes, at least one slot; defaults from ``config``, not
    vLLM's 24 MiB x 10; ``MessageQueue(1, 1, 1024, 1)``, sizes in the ranks' place, works
    too); a message larger than a slot streams through the ring, so unlike
    vLLM nothing overflows to a socket. ``enable_shm_tensor_arena`` is accepted for vLLM's
    signature and changes nothing: mpx already moves large CPU tensors through shared
    memory out of band (one copy in, one copy out, no aliasing), and ``mpx.share`` sends a
    tensor by reference.

    The ring's name in ``/dev/shm`` is unlinked once every local reader attached (by the
    last one to attach), so that nothing is left when processes are killed. A writer that
    may start another process in a dead reader's place (``reopen_reader``) passes
    ``keep_name=True``: the name then stays until this writer's ``wait_until_ready`` sees
    every reader attached, or it closes.
    """

    def __init__(self, n_reader: int, n_local_reader: int,
                 local_reader_ranks: list[int] | None = None,
                 max_chunk_bytes: int | None = None, max_chunks: int | None = None,
                 connect_ip: str | None = None, enable_shm_tensor_arena: bool = False, *,
                 config: Config | None = None, keep_name: bool = False) -> None:
        if isinstance(local_reader_ranks, int) and not isinstance(local_reader_ranks, bool):
            # MessageQueue(1, 1, 1024, 1): the sizes given positionally, ranks left out (an
            # int is never a list of ranks)
            if max_chunks is not None and connect_ip is None:
                connect_ip = max_chunks  # type: ignore[assignment]
            local_reader_ranks, max_chunk_bytes, max_chunks = \
                None, local_reader_ranks, max_chunk_bytes
        if not isinstance(n_reader, int) or n_reader < 0:
            raise ValueError(f"n_reader must be an int >= 0, got {n_reader!r}")
        if not isinstance(n_local_reader, int) or not 0 <= n_local_reader <= n_reader:
            raise ValueError(f"n_local_reader must be in [0, n_reader={n_reader}], "
                             f"got {n_local_reader!r}")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        ranks = list(local_reader_ranks)
        # ranks may be group ranks of a group of n_reader + 1 (the writer's own is missing)
        if len(ranks) != n_local_reader or len(set(ranks)) != len(ranks) or \
                any(not isinstance(r, int) or not 0 <= r <= n_reader for r in ranks):
            raise ValueError(f"local_reader_ranks must be {n_local_reader} distinct ranks in "
                             f"[0, {n_reader}] (reader or group ranks), got "
                             f"{local_reader_ranks!r}")
        base = config or Config.from_env()
        sizes: dict[str, Any] = {k: v for k, v in (("max_chunk_bytes", max_chunk_bytes),
                                                   ("max_chunks", max_chunks)) if v is not None}
        config = dataclasses.replace(base, **sizes)
        shm_ranks, zmq_ranks, zmq_need = _split(ranks, n_reader, config.transport)
        shm_end: ShmWriter | None = None
        zmq_end: ZmqWriter | None = None
        try:
            if shm_ranks:
                try:
                    shm_end = ShmWriter(shm_ranks, config, keep_name=keep_name)
                except ShmError as e:
                    if config.transport != "auto":
                        raise
                    if not _zmq_usable(config):
                        raise ShmError(
                            f"{e}. (transport='auto' cannot fall back to ZeroMQ for the local "
                            "readers either: it needs Config.auth_key / MPX_AUTH_KEY)") from e
                    _warn_fallback(e)
                    zmq_ranks, shm_ranks = sorted(set(zmq_ranks) | set(shm_ranks)), []
                    zmq_need += n_local_reader
            if zmq_ranks:
                zmq_end = ZmqWriter(zmq_ranks, config, connect_ip or config.host,
                                    need=zmq_need)
        except BaseException:
            if shm_end is not None:
                shm_end.close()
            raise
        ends: list[Writer] = [e for e in (shm_end, zmq_end) if e]
        handle = Handle(layout.VERSION, n_reader, n_local_reader, tuple(ranks),
                        shm_end.handle_info() if shm_end else None, connect_ip,
                        zmq_end.handle_info() if zmq_end else None,
                        config.max_chunk_bytes, config.max_chunks)
        self._init_fields(config, handle, ends[0] if len(ends) == 1 else _Broadcast(ends),
                          enable_shm_tensor_arena=bool(enable_shm_tensor_arena))
        logger.debug("queue for %d readers (shared memory: %s, zmq: %s), %s", n_reader,
                     shm_ranks, zmq_ranks, config.describe())

    def _init_fields(self, config: Config, handle: Handle, end: Writer | _Broadcast | Reader,
                     rank: int | None = None, enable_shm_tensor_arena: bool = False) -> None:
        """Set every field of a queue, the one place they are set (both constructors end
        here): this process's ``end`` of the queue of ``handle``, the writer's or reader
        ``rank``'s."""
        self.config = config
        self._handle = handle
        self.n_reader = handle.n_reader
        self.n_local_reader = handle.n_local_reader
        self.n_remote_reader = handle.n_reader - handle.n_local_reader
        self.local_reader_ranks = handle.local_reader_ranks
        self.enable_shm_tensor_arena = enable_shm_tensor_arena
        self.rank = rank
        self.local_reader_rank = handle.local_reader_ranks.index(rank) \
            if rank in handle.local_reader_ranks else -1
        self.shutting_down = False
        self._closed = False
        self._implementation = ring_implementation()
        self._writer: Writer | _Broadcast | None = None if isinstance(end, Reader) else end
        self._reader: Reader | None = end if isinstance(end, Reader) else None
        # this queue's side, writer or reader: what waiting, shutdown and close act on
        self._own_end = end

    @classmethod
    def create_from_handle(cls, handle: Handle, rank: int, *,
                           config: Config | None = None) -> MessageQueue:
        """Attach to the queue of ``handle`` as the reader of ``rank``: a local (shared
        memory) reader when ``rank in handle.local_reader_ranks``, else a remote one.
        ``rank`` is in ``[0, n_reader]`` (a reader rank, or a group rank as in vLLM)."""
        if not isinstance(handle, Handle):
            raise HandleError(f"expected an mpx.queue.Handle, got {type(handle).__name__}")
        if handle.layout_version != layout.VERSION:
            raise HandleError(f"the handle is for ring layout version {handle.layout_version}, "
                              f"this mpx speaks version {layout.VERSION}: mix of mpx versions?")
        if not isinstance(rank, int) or not 0 <= rank <= handle.n_reader:
            raise ValueError(f"reader rank must be in [0, {handle.n_reader}], got {rank!r}")
        config = config or Config.from_env(max_chunk_bytes=handle.max_chunk_bytes or None,
                                           max_chunks=handle.max_chunks or None)
        reader: Reader
        if handle.shm is not None and rank in handle.shm["shm_ranks"]:
            reader = ShmReader(handle.shm, handle.shm["shm_ranks"].index(rank), rank, config)
        elif handle.zmq is not None and rank in handle.zmq["zmq_ranks"]:
            reader = ZmqReader(handle.zmq, rank, config)
        else:
            raise HandleError(f"the handle has no transport for reader rank {rank}")
        self = cls.__new__(cls)
        self._init_fields(config, handle, reader, rank)
        return self

    @staticmethod
    def create_from_process_group(pg: Any, max_chunk_bytes: int, max_chunks: int,
                                  writer_rank: int = 0, external_writer_handle: Handle | None = None,
                                  blocking: bool = True) -> MessageQueue:
        """vLLM's collective constructor: group rank ``writer_rank`` of the
        ``torch.distributed`` group ``pg`` (or a StatelessProcessGroup-like object with
        ``rank``, ``world_size``, ``broadcast_obj`` and ``all_gather_obj``) writes, every
        other rank reads. Readers on the writer's node use shared memory, the others ZeroMQ.
        Every rank of ``pg`` must call it; each gets its end. With
        ``external_writer_handle``, the writer rank attaches to that queue (as a reader of
        it, as vLLM does) instead of creating one. ``blocking``: wait_until_ready() before
        returning."""
        from mpx import _pg
        group_rank, world = _pg.rank_and_size(pg)
        same_node = _pg.same_node_as(pg, writer_rank)
        if group_rank == writer_rank:
            if external_writer_handle is not None:
                q = MessageQueue.create_from_handle(external_writer_handle, group_rank)
            else:
                local = [r for r in range(world) if same_node[r] and r != writer_rank]
                q = MessageQueue(world - 1, len(local), local_reader_ranks=local,
                                 max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks)
            try:
                _pg.broadcast(pg, q.export_handle(), writer_rank)
            except BaseException:
                q.close()
                raise
        else:
            q = MessageQueue.create_from_handle(_pg.broadcast(pg, None, writer_rank), group_rank)
        if blocking:
            try:
                q.wait_until_ready()
            except BaseException:
                q.close()
                raise
        return q

    @staticmethod
    def create_from_process_group_single_reader(
            pg: Any, max_chunk_bytes: int, max_chunks: int, reader_rank: int = 0,
            blocking: bool = False) -> tuple[MessageQueue, list[Handle]]:
        """vLLM's many-writers-one-reader constructor: every rank of ``pg`` (the reader's
        too) creates a one-reader queue, local if it shares the node of group rank
        ``reader_rank``, and the handles are gathered there. Returns ``(this rank's writer
        queue, handles)``; ``handles`` (in group rank order) is empty except on the reader,
        which attaches to each with ``create_from_handle(handle, 0)``. ``blocking``: each
        writer waits for its reader to attach before returning."""
        from mpx import _pg
        group_rank, world = _pg.rank_and_size(pg)
        same_node = _pg.same_node_as(pg, reader_rank)[group_rank]
        q = MessageQueue(1, 1 if same_node else 0, max_chunk_bytes=max_chunk_bytes,
                         max_chunks=max_chunks)
        try:
            handles = _pg.gather(pg, q.export_handle(), reader_rank)
            if blocking:
                q.wait_until_ready()
        except BaseException:
            q.close()
            raise
        return q, handles

    # ------------------------------------------------------------------ properties

    @property
    def is_writer(self) -> bool:
        return self._writer is not None

    @property
    def _is_writer(self) -> bool:  # vLLM's name
        return self._writer is not None

    @property
    def _is_local_reader(self) -> bool:  # vLLM's name
        return self._reader is not None and self._reader.shares_memory

    @property
    def _is_remote_reader(self) -> bool:  # vLLM's name
        return self._reader is not None and not self._reader.shares_memory

    @property
    def handle(self) -> Handle:
        """The queue's handle (vLLM's attribute; ``export_handle()`` returns it too)."""
        return self._handle

    @property
    def ring_implementation(self) -> str:
        """``"cython"`` or ``"python"``: the implementation of the ring (and of the
        ZeroMQ reassembler) this end of the queue runs on."""
        return self._implementation

    def admit_remote_reader(self, rank: int) -> None:
        """(The writer's) A new process reads this queue as remote reader ``rank`` from now
        on, in place of the one before (a remote rank started again): the queue is ready
        again once it has connected (``wait_until_ready``). RoleError without remote
        readers."""
        end = self._need_writer("admit_remote_reader")
        ends = end.ends if isinstance(end, _Broadcast) else [end]
        for e in ends:
            if isinstance(e, ZmqWriter):
                e.admit_reader(rank)
                return
        raise RoleError("admit_remote_reader: this queue has no remote readers")

    def reconnect_links(self) -> None:
        """Take this process's end's network link up again now, on a new connection, where
        it was (a remote reader's: its writer's node was silent and is heard again, and
        TCP's retransmission timer would keep what was sent in the silence waiting; see
        mpx/_node/liveness.py). On a writer with remote readers whose node was silent and
        is heard again: let them back in, and answer them, at once. A no-op for shared
        memory."""
        self._own_end.reconnect_now()

    def link_counts(self) -> tuple[int, int, int]:
        """What this process's end of the queue saw of its network links (remote readers,
        or a remote writer): frames that failed authentication, times a broken link was
        taken up again where it broke, frames sent again for that (zeros over shared
        memory; see mpx/transport/zmq_link.py)."""
        return self._own_end.link_counts()

    def export_handle(self) -> Handle:
        """The picklable handle readers attach with; on a reader end, the handle it
        attached with (as in vLLM)."""
        return self._handle

    # ------------------------------------------------------------------ operations

    def _need_writer(self, what: str) -> Writer | _Broadcast:
        if self._closed:
            raise QueueClosedError(f"{what}() on a closed queue")
        if self._writer is None:
            raise RoleError(f"{what}() is for the writer; this end is reader rank {self.rank}")
        return self._writer

    def _need_reader(self, what: str) -> Reader:
        if self._closed:
            raise QueueClosedError(f"{what}() on a closed queue")
        if self._reader is None:
            raise RoleError(f"{what}() is for readers; this end is the writer")
        return self._reader

    def writing_end(self) -> Writer | _Broadcast:
        """This writer's end of the channel (its transport end, or one reaching all of
        them): ``send(obj, deadline_ns)`` is ``enqueue`` without the argument handling (the
        executor's workers send replies with it); ``write(kind, parts, deadline_ns)`` sends
        a message ``serde.encode`` made (the executor's calls, which wait in the driver
        while the ring is full), ``has_room(parts)`` says whether it fits now,
        ``capacity()`` how large a message fits whole. They raise as ``enqueue`` does; kept
        past ``close()``, Cancelled."""
        return self._need_writer("writing_end")

    def reading_end(self) -> Reader:
        """This reader's end of the channel: ``recv(deadline_ns)`` is ``dequeue`` without
        the argument handling (the executor's reply reading and its workers' loop call
        it), ``recv_ready(on_error)`` is ``dequeue_ready``. They raise as ``dequeue`` does;
        kept past ``close()``, Cancelled."""
        return self._need_reader("reading_end")

    def wait_until_ready(self, timeout: float | None = None,
                         cancel: threading.Event | None = None) -> None:
        """Collective (vLLM): the writer and every reader call it. The writer waits until
        every reader attached (QueueTimeout names the missing ranks); a local reader until
        every local reader attached, a remote one until it reached the writer.

        Every wait has an exit: QueueTimeout after ``timeout`` seconds, Cancelled on
        ``shutdown()`` or when ``cancel`` is set, QueueClosedError when the queue is closed
        (also from another thread), and on a reader PeerDiedError when the writer died or
        closed the queue first."""
        deadline = deadline_of(timeout)
        if self._closed:
            raise QueueClosedError("wait_until_ready() on a closed queue")
        self._own_end.wait_ready(deadline, cancel)

    def enqueue(self, obj: Any, timeout: float | None = None, *,
                while_full: Callable[[], bool | None] | None = None) -> None:
        """Broadcast ``obj`` to every reader. Blocks while the ring is full, up to ``timeout``
        seconds (then QueueTimeout, a TimeoutError, naming the readers behind). An object
        that cannot be pickled raises SerializationError and nothing is sent.

        ``while_full``, if given, is called repeatedly while the ring lacks room for the
        message, before anything is written: a caller whose readers may be blocked on
        something only it can do (drain their replies) does that there. Once it returns
        False (someone else does it), the write waits for room as usual.
        """
        writer = self._writer
        if writer is None or self._closed:
            writer = self._need_writer("enqueue")
        deadline = -1 if timeout is None else deadline_of(timeout)
        writer.wake_readers()  # a parked reader wakes while the object is pickled
        if while_full is None:
            writer.send(obj, deadline)
            return
        kind, parts = serde.encode(obj, writer.shares_memory)
        make_room(writer.has_room, parts, deadline, while_full)
        writer.write(kind, parts, deadline)

    def wake_readers(self) -> None:
        """Writer: a message follows soon. Readers parked in a long wait wake now (and
        poll for their yield time), so that their wake-up, tens of microseconds on a VM,
        overlaps the work before the ``enqueue``; ``enqueue`` does this itself before it
        pickles. Costs nothing when no reader sleeps; does nothing once closed."""
        writer = self._writer
        if writer is None:
            writer = self._need_writer("wake_readers")  # (raises RoleError)
        if not self._closed:
            writer.wake_readers()

    @contextlib.contextmanager
    def acquire_write(self, timeout: float | None = None):
        """vLLM's raw slot access: a writable memoryview of one free slot
        (``max_chunk_bytes``), in the ring, no copy. Leaving the block cleanly publishes
        the whole slot as one message (a ``dequeue`` returns it as bytes; remote readers
        get a copy); an exception publishes nothing. Waits for a free slot up to
        ``timeout`` (QueueTimeout). Don't keep views of the slot past the block."""
        writer = self._need_writer("acquire_write")
        with writer.slot(deadline_of(timeout), serde.K_BYTES) as view:
            yield view

    @contextlib.contextmanager
    def acquire_read(self, timeout: float | None = None, indefinite: bool = False, *,
                     cancel: threading.Event | None = None):
        """vLLM's raw slot access (local readers): a memoryview of the next slot's
        payload, in the ring, no copy; the slot goes back to the writer when the block
        exits, also when it exits by an exception. For messages that fit one slot
        (acquire_write's, or enqueues no bigger than ``max_chunk_bytes``, which arrive
        serialized). Waits like ``dequeue``: QueueTimeout after ``timeout`` (a
        TimeoutError), Cancelled (a RuntimeError, "cancelled") on shutdown() or ``cancel``.
        ``indefinite`` is accepted for vLLM (mpx logs no long-wait warning here)."""
        reader = self._need_reader("acquire_read")
        with reader.slot(deadline_of(timeout), cancel) as view:
            yield view

    def poll(self) -> bool:
        """Reader: True if a message (or the start of one) is waiting to be dequeued."""
        return self._need_reader("poll").poll()

    def nudge(self) -> None:
        """Reader, from another thread of this process: end the wait of the ``dequeue``
        in progress now, or, if none waits, of the next one that would wait. It raises
        WaitNudged (a QueueTimeout) at once, having consumed nothing: a message it was in
        the middle of stays for the next dequeue. A nudge is never lost and ends one wait;
        a dequeue that finds a message waiting returns it and leaves the nudge for later.
        Wakes a parked shared-memory reader in microseconds, a remote one within 20 ms.
        Does nothing once closed (RoleError on the writer)."""
        reader = self._reader
        if reader is None:
            reader = self._need_reader("nudge")  # (raises RoleError)
        if not self._closed:
            reader.nudge()

    def dequeue(self, timeout: float | None = None, cancel: threading.Event | None = None,
                indefinite: bool = False) -> Any:
        """The next object. Raises QueueTimeout (a TimeoutError) after ``timeout`` seconds,
        Cancelled (a RuntimeError whose message says "cancelled") when ``cancel`` is set or
        after ``shutdown()`` once nothing already published is left unread, PeerDiedError
        when the writer died or closed the queue and nothing it published remains unread.
        Unless ``indefinite``, a wait longer than a minute logs a warning naming the writer.

        vLLM's signature is ``dequeue(timeout=None, indefinite=False)``: callers written
        for vLLM (0.33 included) pass ``indefinite`` by keyword, which works here as is; a
        bool passed in ``cancel``'s place is taken as ``indefinite``."""
        if type(cancel) is bool:
            cancel, indefinite = None, cancel
        reader = self._reader
        if reader is None or self._closed:
            reader = self._need_reader("dequeue")
        return reader.read_into(-1 if timeout is None else deadline_of(timeout), cancel,
                                not indefinite, serde.decode_lent)

    def dequeue_ready(self, on_error: Callable[[DeserializationError], Any]) -> list:
        """Every message already published, unpickled, in order, without waiting: one call
        for a batch (an empty list when nothing is there). A message that cannot be
        unpickled is replaced in the list by ``on_error(the DeserializationError)``; the
        messages after it are still returned. A message this process could not allocate
        memory for (skipped: MessageTooLargeError) is the list's only one, so replaced."""
        reader = self._reader
        if reader is None or self._closed:
            reader = self._need_reader("dequeue_ready")
        return reader.recv_ready(on_error)

    def dequeue_stream(self, timeout: float | None = None,
                       cancel: threading.Event | None = None) -> tuple[int, int, Any]:
        """The next message as ``(kind, total, pieces)``, not unpickled: ``pieces`` yields
        its bytes as they arrive (a remote reader streams chunks; a local one yields the
        whole message). For relays, with :meth:`enqueue_stream`."""
        reader = self._need_reader("dequeue_stream")
        return reader.read_stream(deadline_of(timeout), cancel)

    def enqueue_stream(self, kind: int, total: int, pieces: Any,
                       timeout: float | None = None) -> None:
        """Broadcast a message of ``total`` bytes from the iterable ``pieces`` as they come
        (to readers over shared memory; ZeroMQ readers get it once it is whole). An
        exception from ``pieces`` propagates, and readers never see the message."""
        writer = self._need_writer("enqueue_stream")
        writer.write(kind, pieces, deadline_of(timeout), total)

    def broadcast_object(self, obj: Any = None) -> Any:
        """vLLM's helper: the writer enqueues ``obj`` and returns it, a reader dequeues."""
        if self.is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def shutdown(self) -> None:
        """vLLM's meaning: flag this end (``shutting_down``) and wake this process's
        waiting reader, whose dequeue/acquire_read raises Cancelled ("cancelled") once
        nothing already published is left unread; its wait_until_ready is woken too. On the
        writer it wakes an enqueue of this process that waits for space; the readers are
        not told, and keep waiting until their timeouts, as in vLLM. To tell them the writer
        is gone, ``close()`` it: they read what was published, then get PeerDiedError."""
        self.shutting_down = True
        if self._closed:
            return
        self._own_end.shutdown()

    def close(self) -> None:
        """Release the queue's resources; idempotent. Closing the writer tells every reader
        it is gone (PeerDiedError once they have read what it published)."""
        if self._closed:
            return
        self.shutting_down = True
        self._closed = True
        self._own_end.close()

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "writer" if self._writer is not None else f"reader rank={self.rank}"
        state = " closed" if self._closed else ""
        return f"<mpx.MessageQueue {role} n_reader={self.n_reader}{state}>"
