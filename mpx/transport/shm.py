"""Shared-memory transport: one ring segment, one writer, the local readers.

Policy around the ring mechanism (``RingWriter``/``RingReader``): segment lifetime (unlink
once every reader attached, reap what dead creators left), readiness, and errors that name
the peer. Only the ring reads and writes the segment's words.

Each ``ShmWriter`` and ``ShmReader`` holds its ring (of the build ``ring_module()`` picks
when it is made) and an end over that ring (``mpx/transport/shm_end.py``, compiled): the
per-message hot path, which answers each call with a status code of
``mpx.mechanism.layout``. The errors those codes mean, naming the ranks and pids, are made
here.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import select
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from mpx import _debug
from mpx._impl import ring_module
from mpx._procinfo import pid_alive
from mpx._units import human_size
from mpx.config import Config
from mpx.errors import (
    Cancelled,
    HandleError,
    MessageTooLargeError,
    PeerDiedError,
    QueueClosedError,
    QueueTimeout,
    WaitNudged,
)
from mpx.mechanism import layout, segments
from mpx.mechanism.layout import OK, SLICE
from mpx.protocol import serde
from mpx.transport.base import Reader, Writer
from mpx.transport.shm_end import EndLock, ReaderEnd, WriterEnd

logger = logging.getLogger("mpx")

# A waiting reader with a cancel event returns to Python this often to look at it.
CANCEL_POLL_NS = 20_000_000
# A reader that waits without `indefinite` logs who it waits for this often.
WAIT_WARNING_NS = 60_000_000_000
# A message in one slot from this size up is unpickled straight from the slot, without a
# copy into memory of the reader's first: a round trip of 64 KiB-768 KiB in band takes
# 0.69-0.76x the time, 4-16 KiB 0.95-0.96x, 2 KiB 1.05x (bench_inband.py --sections p as of
# 98ffa97, which set this threshold).
IN_PLACE_MIN_BYTES = 8 << 10
_NEVER_IN_PLACE = (1 << 64) - 1  # read(): every message as an owned copy


def _as_read(kind: int, data: Any) -> tuple[int, Any]:
    return kind, data


def _ring_args(config: Config) -> dict:
    return dict(spin_ns=config.spin_us * 1000, yield_ns=config.yield_us * 1000,
                poll_ns=config.liveness_poll_ms * 1_000_000)


class _PeerWatch:
    """Whether a process has exited, zombies included (a pidfd turns readable when its
    process ends; ``kill(pid, 0)`` still succeeds on a zombie nobody reaped yet)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.fd = -2
        except (OSError, AttributeError):
            self.fd = -1

    def exited(self) -> bool:
        if self.fd == -2:
            return True
        if self.fd == -1:
            return not pid_alive(self.pid)
        # (poll, not select: a descriptor past FD_SETSIZE, 1024, is as good as any)
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        events = p.poll(0)
        if events and events[0][1] & select.POLLNVAL:
            raise OSError(errno.EBADF, f"the pidfd {self.fd} of pid {self.pid} is not open")
        return bool(events)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


def _release_view(mv: memoryview) -> None:
    try:
        mv.release()
    except BufferError:  # the caller kept a view of it: the mapping stays until that dies
        pass


class _Unlinker:
    """Unlinks a segment's name once, and only in the process that created it (a forked
    child's copy of the writer must not): called when every reader attached, on close, or
    by the writer's finalizer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid = os.getpid()
        self.done = False

    def __call__(self) -> None:
        if not self.done and os.getpid() == self.pid:
            self.done = True
            segments.unlink(self.name)


class ShmWriter(Writer):
    """The writer end of a ring for ``ranks`` (global reader ranks, by ring index): the
    segment's lifetime, readiness and the errors that name a reader. Its hot path
    (``write``, ``send``) is its ``WriterEnd``'s; ``has_room`` and ``wake_readers`` the
    ring's. With ``keep_name`` the readers leave the segment's name to it (MessageQueue)."""

    shares_memory = True

    def __init__(self, ranks: list[int], config: Config, keep_name: bool = False) -> None:
        lock = EndLock()  # (its end's, which runs each call under it)
        self.keep_name = keep_name
        super().__init__(config, lock)
        self.ranks = list(ranks)
        n = len(ranks)
        segments.reap_stale()
        size = layout.segment_size(config.max_chunk_bytes, config.max_chunks, n)
        self.segment, self._mm = segments.create(size, config.shm_dir)
        self._unlink = _Unlinker(self.segment)
        self.token = secrets.randbits(63)
        try:
            layout.init_header(self._mm, config.max_chunk_bytes, config.max_chunks, n, self.token,
                          os.getpid())
            self._ring = ring_module().RingWriter(self._mm, **_ring_args(config))
        except BaseException:
            self._unlink()
            segments.close(self._mm)
            raise
        self._finalizer = weakref.finalize(self, self._unlink)
        self._end = WriterEnd(self._ring, lock, serde.encode)
        _debug.inc("rings")
        if n == 0:
            self._unlink()

    def handle_info(self) -> dict[str, Any]:
        return dict(shm_name=self.segment, token=self.token, writer_pid=os.getpid(),
                    max_chunk_bytes=self.config.max_chunk_bytes,
                    max_chunks=self.config.max_chunks, shm_ranks=tuple(self.ranks),
                    writer_unlinks=self.keep_name)

    def wait_ready(self, deadline_ns: int, cancel: threading.Event | None = None) -> None:
        delay = 0.0005
        while True:
            with self._lock:  # close() releases the ring under this lock
                if self._closed:
                    raise Cancelled("wait_until_ready cancelled: the queue was shut down")
                readers = self._ring.readers()
            if all(attached for _, attached, _, _ in readers):
                break
            if self._shut:
                raise Cancelled("wait_until_ready cancelled: the queue was shut down")
            if cancel is not None and cancel.is_set():
                raise Cancelled("wait_until_ready cancelled by its cancel event")
            if 0 <= deadline_ns <= time.monotonic_ns():
                missing = [rank for rank, (_, attached, _, _) in zip(self.ranks, readers)
                           if not attached]
                raise QueueTimeout(f"readers never attached to the queue: ranks {missing}")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        self._unlink()

    def _peer_error(self, index: int, waiting_for: str) -> PeerDiedError:
        pid, _, closed, _ = self._ring.readers()[index]
        rank = self.ranks[index]
        what = "closed the queue" if closed else "died"
        return PeerDiedError(f"reader rank {rank} (pid {pid}) {what} while the writer {waiting_for}",
                             role="reader", rank=rank, pid=pid)

    def write(self, kind: int, pieces: Iterable, deadline_ns: int, total: int = -1) -> None:
        st = self._end.write(kind, pieces, deadline_ns, total)
        if st:  # (not OK)
            raise self._write_error(st)

    def send(self, obj: Any, deadline_ns: int = -1) -> None:
        st = self._end.send(obj, deadline_ns)
        if st:
            raise self._write_error(st)

    def has_room(self, pieces: tuple) -> bool:
        return self._ring.has_room(pieces)

    def wake_readers(self) -> None:
        self._ring.wake_readers()

    def capacity(self) -> int:
        return self.config.max_chunks * self.config.max_chunk_bytes

    def release_gone_readers(self) -> None:
        """From now on a reader that closed or died while it holds the writer up is released
        (as release_reader does) and the write goes on, instead of PeerDiedError: a
        follower's relay ring, whose dead worker's rank is started again elsewhere."""
        with self._lock:
            self._check_open()
            self._ring.release_gone = True

    def missing_readers(self) -> list[int]:
        with self._lock:
            self._check_open()
            readers = self._ring.readers()
        return [rank for rank, (_, attached, _, _) in zip(self.ranks, readers) if not attached]

    def release_reader(self, rank: int) -> None:
        if rank in self.ranks:
            with self._lock:
                self._check_open()
                self._ring.release_reader(self.ranks.index(rank))

    def reopen_reader(self, rank: int) -> None:
        if rank in self.ranks:
            with self._lock:
                self._check_open()
                self._ring.reopen_reader(self.ranks.index(rank))

    def free_slots(self) -> int:
        """Slots the writer can fill now without waiting for any reader."""
        return self._ring.free_slots()

    @contextlib.contextmanager
    def slot(self, deadline_ns: int, kind: int) -> Iterator[memoryview]:
        """One free slot's payload, in the ring (no copy); holds the writer's lock."""
        with self._lock:
            self._check_open()
            st = self._ring.begin_slot(deadline_ns)
            if st == OK:
                off = self._ring.payload_offset()
                size = self.config.max_chunk_bytes
                mv = memoryview(self._mm)[off:off + size]
                try:
                    yield mv
                finally:
                    _release_view(mv)
                self._ring.commit_slot(size, kind)
                return
        raise self._write_error(st)

    def _write_error(self, st: int) -> Exception:
        """The error of a write that ended with status ``st`` (takes the lock: what the
        ring says of the readers names those it waited for)."""
        if st == layout.INTERRUPTED:
            return Cancelled("enqueue cancelled: the queue was shut down")
        with self._lock:  # (close() releases the ring under it)
            if st == layout.CLOSED or self._closed:
                return Cancelled("the queue is closed")
            if st == layout.TIMEOUT:
                seq = self._ring.seq_number
                behind = [f"rank {rank} (pid {pid})" for rank, (pid, _, _, read) in
                          zip(self.ranks, self._ring.readers())
                          if seq - read >= self.config.max_chunks]
                return QueueTimeout("enqueue timed out waiting for ring space; readers that "
                                    "have not consumed older messages: "
                                    f"{', '.join(behind) or 'none'}")
            if st == layout.PEER_GONE:
                return self._peer_error(self._ring.gone_index, "waited for ring space")
        return RuntimeError(f"unexpected ring status {st}")

    def _wake(self) -> None:
        """Wake an enqueue of this process that waits for ring space (Cancelled; a later
        one that would wait is Cancelled too). The readers are not told: close() does that."""
        try:
            self._ring.interrupt()
        except ValueError:  # close() in another thread released the ring meanwhile
            pass

    def _release(self) -> None:
        self._end.close()
        self._ring.set_state(layout.S_CLOSED)
        self._unlink()
        self._ring.release()
        _debug.dec("rings")
        segments.close(self._mm)
        self._finalizer.detach()


class ShmReader(Reader):
    """Reader ``index`` of the ring in ``info`` (global rank ``rank``): attaching,
    readiness, slices and warnings of long waits, and the errors that name the writer.
    Its hot path (``read_into``, ``recv``) is its ``ReaderEnd``'s."""

    shares_memory = True

    @property
    def bytes_read(self) -> int:
        return self._ring.bytes_read  # (kept by the ring once released, too)

    def __init__(self, info: dict[str, Any], index: int, rank: int, config: Config) -> None:
        lock = EndLock()
        super().__init__(config, lock)
        self.index = index
        self.rank = rank
        self.writer_pid = info["writer_pid"]
        self._shm_ranks = tuple(info["shm_ranks"])
        name = self._name = info["shm_name"]
        self._writer_unlinks = bool(info.get("writer_unlinks"))
        self._mm = segments.attach(name)
        try:
            self._validate(info)
            try:
                self._ring = ring_module().RingReader(self._mm, index, **_ring_args(config))
            except ValueError as e:
                raise HandleError(f"reader rank {rank} cannot attach: {e}") from None
        except BaseException:
            segments.close(self._mm)
            raise
        self._in_place_min = IN_PLACE_MIN_BYTES
        self._warn_ns = WAIT_WARNING_NS
        self._end = ReaderEnd(self._ring, lock, serde.decode_lent, IN_PLACE_MIN_BYTES)
        _debug.inc("rings")
        if not self._writer_unlinks and self._ring.all_attached():
            segments.unlink(name)

    def _validate(self, info: dict[str, Any]) -> None:
        h = layout.read_header(self._mm)
        if h["magic"] != layout.MAGIC:
            raise HandleError(f"segment {info['shm_name']} is not an mpx ring")
        if h["version"] != layout.VERSION:
            raise HandleError(f"segment {info['shm_name']} has ring layout version {h['version']}, "
                              f"this mpx speaks version {layout.VERSION}: mix of mpx versions?")
        for key in ("max_chunk_bytes", "max_chunks", "token", "writer_pid"):
            if h[key] != info[key]:
                raise HandleError(f"segment {info['shm_name']} does not match its handle: "
                                  f"{key} is {h[key]}, the handle says {info[key]}")
        if h["n_readers"] != len(info["shm_ranks"]):
            raise HandleError(f"segment {info['shm_name']} has {h['n_readers']} readers, "
                              f"the handle says {len(info['shm_ranks'])}")

    def wait_ready(self, deadline_ns: int, cancel: threading.Event | None = None) -> None:
        """Return once every reader of the ring attached. Every exit of a wait: QueueTimeout
        at the deadline (naming the missing ranks), Cancelled on shutdown() or ``cancel``,
        QueueClosedError on close() (also from another thread), PeerDiedError when the
        writer died or closed the queue."""
        writer = _PeerWatch(self.writer_pid)
        try:
            self._wait_ready(deadline_ns, cancel, writer)
        finally:
            writer.close()

    def _wait_ready(self, deadline_ns: int, cancel: threading.Event | None,
                    writer: _PeerWatch) -> None:
        delay = 0.0005
        while True:
            with self._lock:  # close() unmaps under this lock
                if self._closed:
                    raise QueueClosedError(f"wait_until_ready on reader rank {self.rank}: "
                                           "the queue was closed")
                readers = self._ring.readers()
                closed = self._ring.state() & layout.S_CLOSED
            if all(attached for _, attached, _, _ in readers):
                return
            if closed or writer.exited():
                what = "closed the queue" if closed else "died"
                raise PeerDiedError(f"the writer (pid {self.writer_pid}) {what} while reader "
                                    f"rank {self.rank} waited for the other readers to attach",
                                    role="writer", pid=self.writer_pid)
            if self._shut:
                raise self._shut_error(f"wait_until_ready on reader rank {self.rank}")
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"wait_until_ready on reader rank {self.rank} cancelled by its "
                                "cancel event")
            if 0 <= deadline_ns <= time.monotonic_ns():
                missing = [rank for rank, (_, attached, _, _) in zip(self._shm_ranks, readers)
                           if not attached]
                raise QueueTimeout(f"reader rank {self.rank}: readers never attached to the "
                                   f"queue: ranks {missing}")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _gone(self) -> Exception:
        with self._lock:  # (close() releases the ring under it)
            if self._closed:
                return Cancelled("the queue is closed")
            closed = self._ring.state() & layout.S_CLOSED
        what = "closed the queue" if closed else "died"
        return PeerDiedError(f"the writer (pid {self.writer_pid}) {what}; reader rank {self.rank} "
                             "has read everything it published", role="writer", pid=self.writer_pid)

    def poll(self) -> bool:
        return not self._closed and self._ring.published() > self._ring.seq_number

    def read(self, deadline_ns: int, cancel: threading.Event | None, warn: bool):
        return self.read_into(deadline_ns, cancel, warn, _as_read, _NEVER_IN_PLACE)

    def read_into(self, deadline_ns: int, cancel: threading.Event | None, warn: bool,
                  decode: Callable[[int, Any], Any], in_place_min: int | None = None) -> Any:
        if in_place_min is None:
            in_place_min = self._in_place_min
        if cancel is not None:
            return self._read_in_slices(deadline_ns, cancel, warn, decode, in_place_min, -1)
        st, _, got = self._end.read_into(decode, in_place_min, deadline_ns,
                                         self._warn_ns if warn else -1)
        if st == OK:
            return got
        if st != SLICE:
            raise self._read_error(st)
        return self._read_in_slices(deadline_ns, None, warn, decode, in_place_min,
                                    self._end.began_ns if warn else -1)

    def recv(self, deadline_ns: int = -1) -> Any:
        while True:
            st, _, got = self._end.recv(deadline_ns)
            if st == OK:
                return got
            if st != SLICE:  # (SLICE: a signal came while it was parked; its handler ran)
                raise self._read_error(st)

    def _read_in_slices(self, deadline_ns: int, cancel: threading.Event | None, warn: bool,
                        decode: Callable[[int, Any], Any], in_place_min: int,
                        since_ns: int) -> Any:
        """read_into() that returns to Python every slice: to look at ``cancel``, and to
        warn of a long wait; ``since_ns``: when the wait began (-1: now)."""
        slice_ns = CANCEL_POLL_NS if cancel is not None else (WAIT_WARNING_NS if warn else -1)
        warn_at = (time.monotonic_ns() if since_ns < 0 else since_ns) + WAIT_WARNING_NS
        while True:
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"dequeue on rank {self.rank} cancelled by its cancel event")
            if warn and time.monotonic_ns() >= warn_at:
                warn_at = time.monotonic_ns() + WAIT_WARNING_NS
                logger.warning("reader rank %d (pid %d) has waited %g s for the writer "
                               "(pid %d), which is alive but sent nothing", self.rank,
                               os.getpid(), WAIT_WARNING_NS / 1e9, self.writer_pid)
            st, _, got = self._end.read_into(decode, in_place_min, deadline_ns, slice_ns)
            if st == OK:
                return got
            if st != SLICE:  # (SLICE: a slice ended or a signal came; its handler ran)
                raise self._read_error(st)

    def read_ready(self) -> list[tuple[int, Any]]:
        # (of a message still being written, the ring keeps what was published: the next
        # read goes on with it)
        with self._lock:  # (`with`, not acquire(): an interrupt cannot come in between)
            if self._closed:
                self._check_open()
            st, got = self._ring.read_ready()
        if st != layout.OK and not got:
            raise self._read_error(st)
        return got

    def _read_error(self, st: int) -> Exception:
        """The error of a read that ended with status ``st``."""
        if st == layout.CLOSED:
            return Cancelled("the queue is closed")
        if st == layout.TIMEOUT:
            return QueueTimeout(f"dequeue on reader rank {self.rank} timed out: nothing "
                                f"from the writer (pid {self.writer_pid})")
        if st == layout.INTERRUPTED:
            return Cancelled(f"dequeue on rank {self.rank} cancelled: the queue was shut down")
        if st == layout.SHUTDOWN:
            return Cancelled(f"the writer (pid {self.writer_pid}) shut the queue down")
        if st == layout.PEER_GONE:
            return self._gone()
        if st == layout.NUDGED:
            return WaitNudged(f"dequeue on reader rank {self.rank}: its wait was nudged")
        if st == layout.NO_MEMORY:
            n = self._ring.skipped_bytes
            return MessageTooLargeError(
                f"reader rank {self.rank} (pid {os.getpid()}) could not allocate memory for a "
                f"message of {n} bytes ({human_size(n)}) from the writer (pid "
                f"{self.writer_pid}); the message was skipped, the queue reads on", nbytes=n)
        return RuntimeError(f"unexpected ring status {st}")

    @contextlib.contextmanager
    def slot(self, deadline_ns: int, cancel: threading.Event | None):
        """The next slot's payload as a read-only memoryview, in the ring (no copy); the
        slot goes back to the writer when the block exits, also by an exception. Waits like
        read(); for messages that fit one slot (acquire_write's, or small enqueues)."""
        with self._lock:
            self._check_open()
            slice_ns = CANCEL_POLL_NS if cancel is not None else -1
            while True:
                if cancel is not None and cancel.is_set():
                    raise Cancelled(f"acquire_read on rank {self.rank} cancelled by its cancel "
                                    "event")
                try:
                    st, length, _ = self._ring.next_slot(deadline_ns, slice_ns)
                except ValueError as e:
                    raise ValueError(f"acquire_read on reader rank {self.rank}: {e}; use "
                                     "dequeue() for it (the message stays unread)") from None
                if st != SLICE:
                    break
            if st == OK:
                off = self._ring.payload_offset()
                mv = memoryview(self._mm)[off:off + length].toreadonly()
                try:
                    yield mv
                finally:
                    _release_view(mv)
                    self._ring.release_slot()
                return
        raise self._read_error(st)

    def nudge(self) -> None:
        # the ring's futex is bumped and woken: a parked read returns in microseconds
        try:
            self._ring.nudge()
        except ValueError:  # close() in another thread released the ring meanwhile
            pass

    def _wake(self) -> None:
        """Wake this process's dequeue (Cancelled once nothing already published is left
        unread) and wait_until_ready."""
        try:
            self._ring.interrupt()
        except ValueError:  # close() in another thread released the ring meanwhile
            pass

    def _release(self) -> None:
        self._end.close()
        self._ring.mark_closed()
        self._ring.release()
        _debug.dec("rings")
        segments.close(self._mm)
        if self._writer_unlinks and not pid_alive(self.writer_pid):
            segments.unlink(self._name)  # (the writer died before it could)
