"""Shared-memory transport: one ring segment, one writer, the local readers.

Policy around the ring mechanism: segment lifetime (unlink once every reader attached,
reap what dead creators left), readiness, and errors that name the peer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import threading
import time
import weakref
from typing import Any

from mpx import _debug, shm
from mpx import layout as L
from mpx._impl import ring_module
from mpx._procinfo import pid_alive
from mpx.config import Config
from mpx.errors import Cancelled, HandleError, PeerDiedError, QueueClosedError, QueueTimeout

logger = logging.getLogger("mpx")

# A waiting reader with a cancel event returns to Python this often to look at it.
CANCEL_POLL_NS = 20_000_000
# A reader that waits without `indefinite` logs who it waits for this often.
WAIT_WARNING_NS = 60_000_000_000

def _ring_args(config: Config) -> dict:
    return dict(spin_ns=config.spin_us * 1000, yield_ns=config.yield_us * 1000,
                poll_ns=config.liveness_poll_ms * 1_000_000)


def _reader_pids(mm, n: int) -> list[tuple[int, int, bool]]:
    """(pid, attached, closed) of each reader block."""
    out = []
    for i in range(n):
        blk = L.reader_block(i)
        out.append((L.u64(mm, blk + L.RB_PID), L.u32(mm, blk + L.RB_ATTACHED),
                    bool(L.u32(mm, blk + L.RB_CLOSED))))
    return out


def _all_attached(mm, n: int) -> bool:
    return all(L.u32(mm, L.reader_block(i) + L.RB_ATTACHED) for i in range(n))


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
        return bool(select.select([self.fd], [], [], 0)[0])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


def _release_view(mv: memoryview) -> None:
    try:
        mv.release()
    except BufferError:  # the caller kept a view of it: the mapping stays until that dies
        pass


def _cleanup_segment(creator_pid: int, name: str, state: dict) -> None:
    if os.getpid() == creator_pid and not state["unlinked"]:
        state["unlinked"] = True
        shm.unlink(name)


class ShmWriter:
    """The writer end of a ring for ``ranks`` (global reader ranks, by ring index)."""

    def __init__(self, ranks: list[int], config: Config) -> None:
        self.ranks = list(ranks)
        self.config = config
        n = len(ranks)
        shm.reap_stale()
        size = L.segment_size(config.max_chunk_bytes, config.max_chunks, n)
        self.name, self._mm = shm.create(size, config.shm_dir)
        self.token = secrets.randbits(63)
        L.init_header(self._mm, config.max_chunk_bytes, config.max_chunks, n, self.token,
                      os.getpid())
        self._state = {"unlinked": False}
        self._finalizer = weakref.finalize(self, _cleanup_segment, os.getpid(), self.name,
                                           self._state)
        mod = ring_module()
        self.implementation = mod.IMPLEMENTATION
        self._ring = mod.Ring(self._mm, -1, **_ring_args(config))
        self._slowest = 0  # the slowest reader's position when last read (has_room)
        _debug.inc("rings")
        self._lock = threading.Lock()
        self._closed = False
        self._shut = False
        if n == 0:
            self._unlink()

    def handle_info(self) -> dict[str, Any]:
        return dict(shm_name=self.name, token=self.token, writer_pid=os.getpid(),
                    max_chunk_bytes=self.config.max_chunk_bytes,
                    max_chunks=self.config.max_chunks, shm_ranks=tuple(self.ranks))

    def _unlink(self) -> None:
        if not self._state["unlinked"]:
            self._state["unlinked"] = True
            shm.unlink(self.name)

    def wait_ready(self, deadline_ns: int, cancel: threading.Event | None = None) -> None:
        n = len(self.ranks)
        delay = 0.0005
        while not _all_attached(self._mm, n):
            if self._closed or self._shut:
                raise Cancelled("wait_until_ready cancelled: the queue was shut down")
            if cancel is not None and cancel.is_set():
                raise Cancelled("wait_until_ready cancelled by its cancel event")
            if 0 <= deadline_ns <= time.monotonic_ns():
                missing = [self.ranks[i] for i, (_, att, _) in
                           enumerate(_reader_pids(self._mm, n)) if not att]
                raise QueueTimeout(f"readers never attached to the queue: ranks {missing}")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        self._unlink()

    def _peer_error(self, index: int, waiting_for: str) -> PeerDiedError:
        pid, _, closed = _reader_pids(self._mm, len(self.ranks))[index]
        rank = self.ranks[index]
        what = "closed the queue" if closed else "died"
        return PeerDiedError(f"reader rank {rank} (pid {pid}) {what} while the writer {waiting_for}",
                             role="reader", rank=rank, pid=pid)

    def _read_seqs(self) -> list[int]:
        return [L.u64(self._mm, L.reader_block(i) + L.RB_READ_SEQ)
                for i in range(len(self.ranks))]

    def free_slots(self) -> int:
        """Slots the writer can fill now without waiting for any reader."""
        seq = self._ring.seq_number
        self._slowest = min(self._read_seqs(), default=seq)
        return self.config.max_chunks - (seq - self._slowest)

    def has_room(self, need: int) -> bool:
        """Whether ``need`` slots are free now; the readers' positions are read only when
        the last ones seen say no (they only move on)."""
        if self.config.max_chunks - (self._ring.seq_number - self._slowest) >= need:
            return True
        return self.free_slots() >= need

    def slots_needed(self, parts: tuple) -> int:
        """Slots a message of ``parts`` takes, capped at the ring's size (it streams)."""
        if len(parts) == 1 and isinstance(parts[0], bytes) and \
                len(parts[0]) <= self.config.max_chunk_bytes:
            return 1  # a small pickle: the common case, counted without memoryviews
        size = sum(memoryview(p).nbytes for p in parts)
        return min(self.config.max_chunks, max(1, -(-size // self.config.max_chunk_bytes)))

    def write(self, kind: int, parts, deadline_ns: int, total: int = -1) -> None:
        """Write the message ``parts``; given its length ``total``, ``parts`` may be any
        iterable of buffers, taken as the message streams (see Ring.write)."""
        with self._lock:
            if self._closed:
                raise Cancelled("the queue is closed")
            st = self._ring.write(kind, parts, deadline_ns, total)
            if st != L.OK:
                raise self._write_error(st)

    @contextlib.contextmanager
    def slot(self, deadline_ns: int):
        """One free slot's payload (``max_chunk_bytes``) as a writable memoryview; a clean
        exit publishes it as one K_BYTES message of the whole slot, an exception publishes
        nothing. Holds the writer's lock throughout."""
        with self._lock:
            if self._closed:
                raise Cancelled("the queue is closed")
            st = self._ring.begin_slot(deadline_ns)
            if st != L.OK:
                raise self._write_error(st)
            off = self._ring.payload_offset()
            size = self.config.max_chunk_bytes
            mv = memoryview(self._mm)[off:off + size]
            try:
                yield mv
            finally:
                _release_view(mv)
            self._ring.commit_slot(size, L.K_BYTES)

    def _write_error(self, st: int) -> Exception:
        if st == L.TIMEOUT:
            seq = self._ring.seq_number
            behind = [f"rank {rank} (pid {pid})" for rank, (pid, _, _), read in
                      zip(self.ranks, _reader_pids(self._mm, len(self.ranks)),
                          self._read_seqs())
                      if seq - read >= self.config.max_chunks]
            return QueueTimeout("enqueue timed out waiting for ring space; readers that "
                                f"have not consumed older messages: {', '.join(behind) or 'none'}")
        if st == L.INTERRUPTED:
            return Cancelled("enqueue cancelled: the queue was shut down")
        if st == L.PEER_GONE:
            return self._peer_error(self._ring.gone_index, "waited for ring space")
        return RuntimeError(f"unexpected ring status {st}")

    def shutdown(self) -> None:
        """Wake an enqueue of this process that waits for ring space (Cancelled; a later
        one that would wait is Cancelled too). The readers are not told: close() does that."""
        if self._closed or self._shut:
            return
        self._shut = True
        try:
            self._ring.interrupt()
        except ValueError:  # close() in another thread released the ring meanwhile
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._shut = True
        self._ring.interrupt()
        self._closed = True
        with self._lock:
            self._ring.set_state(L.S_CLOSED)
            self._unlink()
            self._ring.release()
            _debug.dec("rings")
            shm.close(self._mm)
        self._finalizer.detach()


class ShmReader:
    """Reader ``index`` of the ring in ``info`` (global rank ``rank``)."""

    def __init__(self, info: dict[str, Any], index: int, rank: int, config: Config) -> None:
        self.index = index
        self.rank = rank
        self.config = config
        name = info["shm_name"]
        self._mm = shm.attach(name)
        try:
            self._validate(info)
            blk = L.reader_block(index)
            if L.u32(self._mm, blk + L.RB_ATTACHED):
                raise HandleError(f"reader rank {rank} is already attached to this queue")
            L.put_u64(self._mm, blk + L.RB_PID, os.getpid())
            L.put_u32(self._mm, blk + L.RB_ATTACHED, 1)
            L.fence()
            n = L.u64(self._mm, L.OFF_N_READERS)
            if _all_attached(self._mm, n):
                shm.unlink(name)
            self.writer_pid = info["writer_pid"]
            self._shm_ranks = tuple(info["shm_ranks"])
            mod = ring_module()
            self.implementation = mod.IMPLEMENTATION
            self._ring = mod.Ring(self._mm, index, **_ring_args(config))
            _debug.inc("rings")
        except BaseException:
            shm.close(self._mm)
            raise
        self._lock = threading.Lock()
        self._closed = False
        self._shut = False

    def _validate(self, info: dict[str, Any]) -> None:
        h = L.read_header(self._mm)
        if h["magic"] != L.MAGIC:
            raise HandleError(f"segment {info['shm_name']} is not an mpx ring")
        if h["version"] != L.VERSION:
            raise HandleError(f"segment {info['shm_name']} has ring layout version {h['version']}, "
                              f"this mpx speaks version {L.VERSION}: mix of mpx versions?")
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
                n = L.u64(self._mm, L.OFF_N_READERS)
                pids = _reader_pids(self._mm, n)
                closed = L.u32(self._mm, L.OFF_STATE) & L.S_CLOSED
            if all(att for _, att, _ in pids):
                return
            if closed or writer.exited():
                what = "closed the queue" if closed else "died"
                raise PeerDiedError(f"the writer (pid {self.writer_pid}) {what} while reader "
                                    f"rank {self.rank} waited for the other readers to attach",
                                    role="writer", pid=self.writer_pid)
            if self._shut:
                raise Cancelled(f"wait_until_ready on reader rank {self.rank} cancelled: the "
                                "queue was shut down")
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"wait_until_ready on reader rank {self.rank} cancelled by its "
                                "cancel event")
            if 0 <= deadline_ns <= time.monotonic_ns():
                missing = [self._shm_ranks[i] for i, (_, att, _) in enumerate(pids) if not att]
                raise QueueTimeout(f"reader rank {self.rank}: readers never attached to the "
                                   f"queue: ranks {missing}")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _gone(self) -> PeerDiedError:
        closed = L.u32(self._mm, L.OFF_STATE) & L.S_CLOSED
        what = "closed the queue" if closed else "died"
        return PeerDiedError(f"the writer (pid {self.writer_pid}) {what}; reader rank {self.rank} "
                             "has read everything it published", role="writer", pid=self.writer_pid)

    def poll(self) -> bool:
        return not self._closed and self._ring.published() > self._ring.seq_number

    def read(self, deadline_ns: int, cancel: threading.Event | None, warn: bool):
        with self._lock:
            if self._closed:
                raise Cancelled("the queue is closed")
            slice_ns = CANCEL_POLL_NS if cancel is not None else (WAIT_WARNING_NS if warn else -1)
            warn_at = time.monotonic_ns() + WAIT_WARNING_NS
            while True:
                if cancel is not None and cancel.is_set():
                    raise Cancelled(f"dequeue on rank {self.rank} cancelled by its cancel event")
                st, kind, data = self._ring.read(deadline_ns, slice_ns)
                if st == L.OK:
                    return kind, data
                if st == L.SLICE:  # a slice ended or a signal came: Python runs its handlers
                    if warn and time.monotonic_ns() >= warn_at:
                        warn_at = time.monotonic_ns() + WAIT_WARNING_NS
                        logger.warning("mpx: reader rank %d (pid %d) has waited %d s for the "
                                       "writer (pid %d), which is alive but sent nothing",
                                       self.rank, os.getpid(), WAIT_WARNING_NS // 10**9,
                                       self.writer_pid)
                    continue
                raise self._read_error(st)

    def _read_error(self, st: int) -> Exception:
        if st == L.TIMEOUT:
            return QueueTimeout(f"dequeue on reader rank {self.rank} timed out: nothing "
                                f"from the writer (pid {self.writer_pid})")
        if st == L.INTERRUPTED:
            return Cancelled(f"dequeue on rank {self.rank} cancelled: the queue was shut down")
        if st == L.SHUTDOWN:
            return Cancelled(f"the writer (pid {self.writer_pid}) shut the queue down")
        if st == L.PEER_GONE:
            return self._gone()
        return RuntimeError(f"unexpected ring status {st}")

    @contextlib.contextmanager
    def slot(self, deadline_ns: int, cancel: threading.Event | None):
        """The next slot's payload as a read-only memoryview, in the ring (no copy); the
        slot goes back to the writer when the block exits, also by an exception. Waits like
        read(); for messages that fit one slot (acquire_write's, or small enqueues)."""
        with self._lock:
            if self._closed:
                raise Cancelled("the queue is closed")
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
                if st == L.OK:
                    break
                if st != L.SLICE:
                    raise self._read_error(st)
            off = self._ring.payload_offset()
            mv = memoryview(self._mm)[off:off + length].toreadonly()
            try:
                yield mv
            finally:
                _release_view(mv)
                self._ring.release_slot()

    def shutdown(self) -> None:
        """Wake this process's dequeue (Cancelled once nothing already published is left
        unread) and wait_until_ready."""
        if not self._closed and not self._shut:
            self._shut = True
            try:
                self._ring.interrupt()
            except ValueError:  # close() in another thread released the ring meanwhile
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._ring.interrupt()
        self._closed = True
        with self._lock:
            self._ring.mark_reader_closed()
            self._ring.release()
            _debug.dec("rings")
            shm.close(self._mm)

