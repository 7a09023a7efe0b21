"""Pure-Python twin of ``mpx/_ring.pyx``: the same layout (``mpx.mechanism.layout``), API and
behaviour (``RingWriter`` and ``RingReader`` over a shared ``_RingEnd``), for machines
without the compiled extension or with ``MPX_PURE_PYTHON=1``.

Python has no atomics, so this relies on what CPython and the hardware give: aligned
8-byte stores through ``memoryview.cast('Q')`` are single stores, x86 keeps stores in
order, and a lock round trip (an atomic read-modify-write in the C library) serves as the
full fence between "announce parked" and "re-check". Parking uses the futex syscall via
ctypes where the architecture is known, else short sleeps; parks are bounded by the
liveness poll period either way.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import select
import time
from typing import Any

from mpx.mechanism import layout
from mpx.mechanism.waiting import AdaptiveWait

IMPLEMENTATION = "python"

# _park(): woken by the peer with nothing to take yet (RingWriter.wake_readers)
_WOKEN = -3


def _nbytes(parts: Any) -> int:
    """The bytes of a message's ``parts`` (one bytes object, the common case, without a
    generator)."""
    if len(parts) == 1 and type(parts[0]) is bytes:
        return len(parts[0])
    return sum(memoryview(p).nbytes for p in parts)


_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _pidfd_open(pid: int) -> int:
    if pid <= 0:
        return -1
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -2
    except (OSError, AttributeError):
        return -1


def _pidfd_exited(fd: int) -> bool:
    if fd == -2:
        return True
    if fd < 0:
        return False
    p = select.poll()  # (not select: a descriptor past FD_SETSIZE, 1024, is as good as any)
    p.register(fd, select.POLLIN)
    events = p.poll(0)
    if events and events[0][1] & select.POLLNVAL:
        raise OSError(errno.EBADF, f"pidfd {fd} is not open")
    return bool(events)


def _slice_end(slice_ns: int) -> int:
    """When a slice of ``slice_ns`` from now ends (-1: no slice)."""
    return time.monotonic_ns() + slice_ns if slice_ns >= 0 else -1


class _RingEnd(AdaptiveWait):
    """See ``mpx._ring._RingEnd``."""

    # set by the subclasses: the word this end parks on, the word that says it is parked,
    # the word that must be 0 for it to park (None: no gate), and the word where the peer
    # stamps when it woke the first
    _futex: int
    _parked: int
    _gate: int | None
    _woken: int
    _published: int | None  # a reader: the word where the writer stamps when it published

    def __init__(self, buf, spin_ns: int, yield_ns: int, poll_ns: int) -> None:
        mv = memoryview(buf)
        if mv.readonly:
            raise TypeError("ring buffer must be writable")
        self._mv = mv.cast("B")
        self._q = self._mv.cast("Q")
        self._i = self._mv.cast("I")
        self._addr_obj = ctypes.c_char.from_buffer(buf)
        self._addr = ctypes.addressof(self._addr_obj)
        q = self._q
        self.chunk_bytes = q[layout.OFF_CHUNK_BYTES // 8]
        self.n_chunks = q[layout.OFF_N_CHUNKS // 8]
        self.n_readers = q[layout.OFF_N_READERS // 8]
        self.stride = q[layout.OFF_SLOT_STRIDE // 8]
        self._slots = layout.slots_offset(self.n_readers)
        self._released = False
        self._pidfds: list[int] = []
        if self._mv.nbytes < self._slots + self.stride * self.n_chunks:
            self.release()
            raise ValueError("ring buffer is smaller than its header's geometry")
        self.poll_ns = poll_ns
        self._init_waiting(spin_ns, yield_ns)  # (mpx.mechanism.waiting)
        self._interrupted = False
        self._nudged = False  # set by nudge(); taken (under the GIL) by the wait it ends
        self._resting = False
        self.seq = 0

    # ------------------------------------------------------------------ helpers

    def _w64(self, off: int) -> int:
        return self._q[off >> 3]

    def _w32(self, off: int) -> int:
        return self._i[off >> 2]

    def _set32(self, off: int, v: int) -> None:
        self._i[off >> 2] = v

    def _bump32(self, off: int) -> None:
        self._i[off >> 2] = (self._i[off >> 2] + 1) & 0xFFFFFFFF

    def _slot(self, seq: int) -> int:
        return self._slots + (seq % self.n_chunks) * self.stride

    def _futex_wait(self, off: int, expected: int, timeout_ns: int) -> bool:
        """Sleep while the word equals ``expected``; True if a signal interrupted it."""
        timeout_ns = max(timeout_ns, 0)
        if _SYS_FUTEX is None:
            if self._w32(off) == expected:
                time.sleep(min(timeout_ns, 200_000) / 1e9)
            return False
        ts = _Timespec(timeout_ns // 1_000_000_000, timeout_ns % 1_000_000_000)
        rc = _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._addr + off), _FUTEX_WAIT,
                           ctypes.c_uint32(expected), ctypes.byref(ts), None, 0)
        return rc < 0 and ctypes.get_errno() == errno.EINTR

    def _wake_stamped(self, off: int, woken: int) -> None:
        """Wake the ends parked on the word at ``off``, stamping the word at ``woken``
        first (mpx_wake_stamped)."""
        self._q[woken >> 3] = time.monotonic_ns()
        self._bump32(off)
        self._futex_wake(off)

    def _futex_wake(self, off: int) -> None:
        if _SYS_FUTEX is not None:
            _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._addr + off), _FUTEX_WAKE,
                          0x7FFFFFFF, None, None, 0)

    def _live(self) -> None:
        if self._released:
            raise ValueError("ring was released")

    def release(self) -> None:
        """Drop the buffer export and pidfds; the ring end is unusable afterwards."""
        if self._released:
            return
        self._released = True
        for fd in self._pidfds:
            if fd >= 0:
                os.close(fd)
        self._pidfds = []
        del self._addr_obj
        self._i.release()
        self._q.release()
        self._mv.release()

    # ------------------------------------------------------------------ waiting

    def _ready(self) -> bool:
        raise NotImplementedError

    def _terminal(self) -> int | None:
        raise NotImplementedError

    def _take_nudge(self) -> bool:
        if not self._nudged:
            return False
        self._nudged = False  # (a nudge that comes in between is merged into this one)
        return True

    def _wait(self, deadline: int, slice_end: int) -> int:
        """See ``mpx._ring._RingEnd._wait`` (Python runs signal handlers between bytecodes,
        so there is no SIGNALLED here; the spin is a yield loop)."""
        if self._ready():
            return layout.OK
        t0 = now = start = time.monotonic_ns()
        if 0 <= deadline <= now:
            return self._not_waiting()
        if self._resting:
            self._resting = False
            skip = True
        else:
            skip = self._skips_yield()
        yield_cpu, clock = os.sched_yield, time.monotonic_ns
        while True:
            while not skip and now - t0 < self.spin_ns + self.yield_budget_ns:
                yield_cpu()
                took = clock() - now
                now += took
                self._yielded(took)
                if self._ready():
                    if self._published is not None:
                        self._judge(now - self._w64(self._published))
                    return layout.OK
                if self._interrupted:
                    return layout.INTERRUPTED
                if self._nudged and self._take_nudge():
                    return layout.NUDGED
                if 0 <= deadline <= now:
                    return layout.TIMEOUT
                if 0 <= slice_end <= now:
                    return layout.SLICE
            st = self._park(deadline, slice_end)
            if st != _WOKEN:
                self._adapt(time.monotonic_ns() - start, st == layout.OK)
                return st
            t0 = now = time.monotonic_ns()
            skip = self.parks_first

    def _not_waiting(self) -> int:
        """See ``mpx._ring._RingEnd._not_waiting``."""
        st = self._terminal()
        return layout.TIMEOUT if st is None else st

    def _park(self, deadline: int, slice_end: int) -> int:
        """See ``mpx._ring._RingEnd._park``."""
        while True:
            st = self._terminal()
            if st is not None:
                return st
            if self._take_nudge():
                return layout.NUDGED
            now = time.monotonic_ns()
            if 0 <= deadline <= now:
                return layout.TIMEOUT
            if 0 <= slice_end <= now:
                self._resting = True
                return layout.SLICE
            until = now + self.poll_ns
            if 0 <= deadline < until:
                until = deadline
            if 0 <= slice_end < until:
                until = slice_end
            v = self._w32(self._futex)
            self._set32(self._parked, 1)
            layout.fence()
            if self._ready():
                self._set32(self._parked, 0)
                return layout.OK
            signalled = False
            if (self._gate is None or self._w32(self._gate) == 0) and not self._interrupted \
                    and not self._nudged:
                signalled = self._futex_wait(self._futex, v, until - now)
            self._set32(self._parked, 0)
            if self._ready():
                woken = self._w64(self._woken)
                if woken >= now:  # (the peer woke this park: what did it cost?)
                    self._woke(time.monotonic_ns() - woken)
                return layout.OK
            if self._take_nudge():
                return layout.NUDGED
            if signalled:
                return layout.SLICE
            if self._w32(self._futex) != v and self._terminal() is None and \
                    not self._interrupted:
                return _WOKEN

    # ------------------------------------------------------------------ state

    def interrupt(self) -> None:
        """Wake this process's waiters on this end: they return INTERRUPTED (sticky)."""
        self._live()
        self._interrupted = True
        self._wake_own()

    def _wake_own(self) -> None:
        """See ``mpx._ring._RingEnd._wake_own``."""
        self._bump32(self._futex)
        self._futex_wake(self._futex)

    def state(self) -> int:
        """The segment's state bits (S_SHUTDOWN, S_CLOSED)."""
        self._live()
        return self._w32(layout.OFF_STATE)

    def readers(self) -> list[tuple[int, bool, bool, int]]:
        """``(pid, attached, closed, read_seq)`` of every reader block."""
        self._live()
        out = []
        for i in range(self.n_readers):
            blk = layout.reader_block(i)
            out.append((self._w64(blk + layout.RB_PID), bool(self._w32(blk + layout.RB_ATTACHED)),
                        bool(self._w32(blk + layout.RB_CLOSED)), self._w64(blk + layout.RB_READ_SEQ)))
        return out

    def all_attached(self) -> bool:
        """Whether every reader has attached."""
        self._live()
        return all(self._w32(layout.reader_block(i) + layout.RB_ATTACHED) for i in range(self.n_readers))

    @property
    def seq_number(self) -> int:
        """Writer: slots published; reader: slots consumed."""
        return self.seq

    def published(self) -> int:
        """Slots the writer has published so far."""
        self._live()
        return self._w64(layout.OFF_WRITE_SEQ)

    def payload_offset(self) -> int:
        """See ``mpx._ring._RingEnd.payload_offset``."""
        self._live()
        return self._slot(self.seq) + layout.SLOT_HEADER


class RingWriter(_RingEnd):
    """See ``mpx._ring.RingWriter``."""

    def __init__(self, buf, spin_ns: int = 0, yield_ns: int = 1000000,
                 poll_ns: int = 100000000) -> None:
        super().__init__(buf, spin_ns, yield_ns, poll_ns)
        self.seq = self._q[layout.OFF_WRITE_SEQ // 8]
        self._min_read = 0
        self.partial = False
        self.gone_index = -1
        self.release_gone = False  # a reader gone is released, not PEER_GONE (_terminal)
        self.released_gone = 0     # how many readers were released so
        self._pidfds = [-1] * self.n_readers
        self._futex, self._parked, self._gate = layout.OFF_SPACE_FUTEX, layout.OFF_WRITER_PARKED, None
        self._woken, self._published = layout.OFF_SPACE_WOKEN, None
        # each reader's read seq (an index into _q) and parked flag (into _i), looked at on
        # every message
        blocks = [layout.reader_block(i) for i in range(self.n_readers)]
        self._read_seqs = [(b + layout.RB_READ_SEQ) >> 3 for b in blocks]
        self._parked_flags = [(b + layout.RB_PARKED) >> 2 for b in blocks]
        self._released_flags = [(b + layout.RB_RELEASED) >> 2 for b in blocks]

    def set_state(self, bits: int) -> None:
        """Set S_SHUTDOWN/S_CLOSED bits in the segment and wake every parked reader."""
        self._live()
        self._set32(layout.OFF_STATE, self._w32(layout.OFF_STATE) | bits)
        layout.fence()
        self._bump32(layout.OFF_DATA_FUTEX)
        self._futex_wake(layout.OFF_DATA_FUTEX)

    def _has_space(self, need: int) -> bool:
        if self.seq - self._min_read + need <= self.n_chunks:
            return True
        q, i32 = self._q, self._i
        m = self.seq
        for at, released in zip(self._read_seqs, self._released_flags):
            r = q[at]
            if r < m and not i32[released]:
                m = r
        self._min_read = m
        return self.seq - m + need <= self.n_chunks

    def _ready(self) -> bool:
        return self._has_space(1)

    def _terminal(self) -> int | None:
        if self._interrupted:
            return layout.INTERRUPTED
        for i in range(self.n_readers):
            blk = layout.reader_block(i)
            if self.seq - self._w64(blk + layout.RB_READ_SEQ) < self.n_chunks or \
                    self._w32(blk + layout.RB_RELEASED):
                continue
            if not self._w32(blk + layout.RB_CLOSED):
                if self._pidfds[i] == -1:
                    pid = self._w64(blk + layout.RB_PID)
                    if pid:
                        self._pidfds[i] = _pidfd_open(pid)
                if not _pidfd_exited(self._pidfds[i]):
                    continue
            if not self.release_gone:
                self.gone_index = i
                return layout.PEER_GONE
            self._set32(blk + layout.RB_RELEASED, 1)
            self._q[(blk + layout.RB_READ_SEQ) >> 3] = self.seq
            layout.fence()
            self.released_gone += 1
        return None

    def _wait_space(self, deadline: int) -> int:
        st = layout.SLICE
        while st == layout.SLICE:
            st = self._wait(deadline, -1)
        return st

    def release_reader(self, index: int) -> None:
        """See ``mpx._ring.RingWriter.release_reader``."""
        self._live()
        if not 0 <= index < self.n_readers:
            raise ValueError(f"reader index {index} out of range for {self.n_readers} readers")
        blk = layout.reader_block(index)
        self._set32(blk + layout.RB_RELEASED, 1)
        self._q[(blk + layout.RB_READ_SEQ) >> 3] = self.seq
        layout.fence()

    def reopen_reader(self, index: int) -> None:
        """See ``mpx._ring.RingWriter.reopen_reader``."""
        self._live()
        if not 0 <= index < self.n_readers:
            raise ValueError(f"reader index {index} out of range for {self.n_readers} readers")
        blk = layout.reader_block(index)
        if self._pidfds[index] >= 0:
            os.close(self._pidfds[index])
            self._pidfds[index] = -1
        self._q[(blk + layout.RB_READ_SEQ) >> 3] = self.seq
        self._q[(blk + layout.RB_PID) >> 3] = 0
        for field in (layout.RB_CLOSED, layout.RB_PARKED, layout.RB_RELEASED):
            self._set32(blk + field, 0)
        layout.fence()
        self._set32(blk + layout.RB_ATTACHED, 0)  # last: the place is free once this shows
        layout.fence()

    def free_slots(self) -> int:
        """Slots the writer can fill now without waiting for any reader."""
        self._live()
        self._has_space(self.n_chunks + 1)  # never true: refreshes _min_read
        return self.n_chunks - (self.seq - self._min_read)

    def has_room(self, pieces: tuple) -> bool:
        """See ``mpx._ring.RingWriter.has_room``."""
        self._live()
        size = _nbytes(pieces)
        need = min(self.n_chunks, max(1, -(-size // self.chunk_bytes)))
        return self._has_space(need)

    def _publish(self, length: int, flags: int, kind: int, total: int) -> None:
        s = self._slot(self.seq)
        q, i32 = self._q, self._i
        q[(s + layout.SH_LENGTH) >> 3] = length
        i32[(s + layout.SH_FLAGS) >> 2] = flags
        i32[(s + layout.SH_KIND) >> 2] = kind
        q[(s + layout.SH_TOTAL) >> 3] = total
        self.seq += 1
        q[layout.OFF_PUBLISHED_NS >> 3] = time.monotonic_ns()
        q[layout.OFF_WRITE_SEQ >> 3] = self.seq
        layout.fence()
        self._wake_parked()

    def _wake_parked(self) -> None:
        i32 = self._i
        for at in self._parked_flags:
            if i32[at]:
                self._wake_stamped(layout.OFF_DATA_FUTEX, layout.OFF_DATA_WOKEN)
                break

    def wake_readers(self) -> None:
        """See ``mpx._ring.RingWriter.wake_readers``."""
        if self._released:
            return
        self._wake_parked()  # (a hint: no fence, as there)

    def _claim_slot(self, deadline_ns: int) -> int:
        """Wait for the next free slot, first aborting a message that a failed write left
        half-written."""
        if self.partial:
            st = self._wait_space(deadline_ns)
            if st != layout.OK:
                return st
            self._publish(0, layout.F_ABORT, 0, 0)
            self.partial = False
        return self._wait_space(deadline_ns)

    def write(self, kind: int, parts, deadline_ns: int = -1, total: int = -1) -> int:
        """See ``mpx._ring.RingWriter.write``."""
        self._live()
        length = _nbytes(parts) if total < 0 else total
        if self.partial or not self._has_space(1):  # (hot: the free slot's case inline)
            st = self._claim_slot(deadline_ns)
            if st != layout.OK:
                return st
        chunk = self.chunk_bytes
        payload = self._slot(self.seq) + layout.SLOT_HEADER
        off = written = 0
        first = True
        mv = self._mv
        for part in parts:
            v = memoryview(part).cast("B")
            pos, rem = 0, v.nbytes
            if rem > length - written:
                raise ValueError(f"the message's pieces exceed its length {length}")
            written += rem
            while rem:
                if off == chunk:
                    self._publish(off, layout.F_BEGIN if first else 0, kind, length)
                    first = False
                    self.partial = True
                    off = 0
                    st = self._wait_space(deadline_ns)
                    if st != layout.OK:
                        return st
                    payload = self._slot(self.seq) + layout.SLOT_HEADER
                c = min(rem, chunk - off)
                mv[payload + off:payload + off + c] = v[pos:pos + c]
                off += c
                pos += c
                rem -= c
        if written != length:
            raise ValueError(f"the message's pieces add up to {written} bytes, not {length}")
        self._publish(off, (layout.F_BEGIN if first else 0) | layout.F_END, kind, length)
        self.partial = False
        return layout.OK

    def begin_slot(self, deadline_ns: int = -1) -> int:
        """See ``mpx._ring.RingWriter.begin_slot``."""
        self._live()
        return self._claim_slot(deadline_ns)

    def commit_slot(self, length: int, kind: int) -> None:
        """See ``mpx._ring.RingWriter.commit_slot``."""
        self._live()
        if length > self.chunk_bytes:
            raise ValueError(f"slot length {length} exceeds the slot size {self.chunk_bytes}")
        self._publish(length, layout.F_BEGIN | layout.F_END, kind, length)


class RingReader(_RingEnd):
    """See ``mpx._ring.RingReader``."""

    def __init__(self, buf, index: int, spin_ns: int = 0, yield_ns: int = 1000000,
                 poll_ns: int = 100000000) -> None:
        super().__init__(buf, spin_ns, yield_ns, poll_ns)
        self._dest: bytearray | None = None
        self._dest_kind = 0
        self._dest_off = 0
        self._dest_total = 0
        self._skipping = False  # the message being read could not be allocated
        self.skipped_bytes = 0  # after NO_MEMORY: the skipped message's size
        self.bytes_read = 0     # the payload bytes of every slot read so far
        if not 0 <= index < self.n_readers:
            self.release()
            raise ValueError(f"reader index {index} out of range for {self.n_readers} readers")
        blk = self._rb = layout.reader_block(index)
        if self._w32(blk + layout.RB_ATTACHED):  # no compare-and-swap in Python: check, then set
            self.release()
            raise ValueError(f"reader {index} is already attached to this ring")
        self._set32(blk + layout.RB_ATTACHED, 1)
        self._q[(blk + layout.RB_PID) >> 3] = os.getpid()
        layout.fence()
        self.index = index
        self.seq = self._w64(blk + layout.RB_READ_SEQ)
        self._pidfds = [_pidfd_open(self._w64(layout.OFF_WRITER_PID))]
        self._futex, self._woken = layout.OFF_DATA_FUTEX, layout.OFF_DATA_WOKEN
        self._published = layout.OFF_PUBLISHED_NS
        self._parked, self._gate = blk + layout.RB_PARKED, layout.OFF_STATE

    def release(self) -> None:
        """Drop the buffer export and pidfds; the ring end is unusable afterwards."""
        self._drop_message()
        super().release()

    def _drop_message(self) -> None:
        """Forget the message being assembled (or skipped)."""
        self._dest = None
        self._skipping = False

    def mark_closed(self) -> None:
        """Tell the writer this reader is gone, waking it if it waits for space."""
        self._live()
        self._set32(self._rb + layout.RB_CLOSED, 1)
        layout.fence()
        self._bump32(layout.OFF_SPACE_FUTEX)
        self._futex_wake(layout.OFF_SPACE_FUTEX)

    def nudge(self) -> None:
        """See ``mpx._ring.RingReader.nudge``."""
        self._live()
        self._nudged = True
        self._wake_own()

    def _ready(self) -> bool:
        return self._q[layout.OFF_WRITE_SEQ >> 3] > self.seq

    def _terminal(self) -> int | None:
        if self._interrupted:
            return layout.INTERRUPTED
        state = self._w32(layout.OFF_STATE)
        if state == 0 and not _pidfd_exited(self._pidfds[0]):
            return None
        if self._w64(layout.OFF_WRITE_SEQ) > self.seq:
            return layout.OK
        if state & layout.S_SHUTDOWN:
            return layout.SHUTDOWN
        return layout.PEER_GONE

    def _ack(self) -> None:
        self.bytes_read += self._q[(self._slot(self.seq) + layout.SH_LENGTH) >> 3]
        self.seq += 1
        self._q[(self._rb + layout.RB_READ_SEQ) >> 3] = self.seq
        layout.fence()
        if self._w32(layout.OFF_WRITER_PARKED):
            self._wake_stamped(layout.OFF_SPACE_FUTEX, layout.OFF_SPACE_WOKEN)

    def next_slot(self, deadline_ns: int = -1, slice_ns: int = -1) -> tuple[int, int, int]:
        """See ``mpx._ring.RingReader.next_slot``."""
        self._live()
        if self._dest is not None or self._skipping:
            raise ValueError("next_slot() in the middle of a multi-slot message")
        q = self._q
        slice_end = _slice_end(slice_ns)
        while True:
            st = self._wait(deadline_ns, slice_end)
            if st != layout.OK:
                return (st, 0, 0)
            s = self._slot(self.seq)
            flags = self._i[(s + layout.SH_FLAGS) >> 2]
            if flags & layout.F_ABORT:
                self._ack()
                continue
            if flags & (layout.F_BEGIN | layout.F_END) != (layout.F_BEGIN | layout.F_END):
                raise ValueError(f"the next message spans several slots "
                                 f"({q[(s + layout.SH_TOTAL) >> 3]} bytes); read it with read()")
            return (layout.OK, q[(s + layout.SH_LENGTH) >> 3], self._i[(s + layout.SH_KIND) >> 2])

    def release_slot(self) -> None:
        """See ``mpx._ring.RingReader.release_slot``."""
        self._live()
        if self._q[layout.OFF_WRITE_SEQ >> 3] <= self.seq:
            raise ValueError("release_slot() without a slot")
        self._ack()

    def read_with(self, consume, in_place_min: int, deadline_ns: int = -1,
                  slice_ns: int = -1):
        """See ``mpx._ring.RingReader.read_with``."""
        self._live()
        q, i32 = self._q, self._i
        slice_end = -1 if slice_ns < 0 else time.monotonic_ns() + slice_ns  # (hot: inline)
        if self._dest is None and not self._skipping:
            while True:
                if not self._ready():  # (hot: a message there inline)
                    st = self._wait(deadline_ns, slice_end)
                    if st != layout.OK:
                        return (st, 0, None)
                s = self._slot(self.seq)
                flags = i32[(s + layout.SH_FLAGS) >> 2]
                if not flags & layout.F_ABORT:
                    break
                self._ack()
            length = q[(s + layout.SH_LENGTH) >> 3]
            kind = i32[(s + layout.SH_KIND) >> 2]
            whole = layout.F_BEGIN | layout.F_END
            if flags & whole == whole and kind & layout.KIND_AS_BYTES and length >= in_place_min:
                if length > self.chunk_bytes:
                    raise RuntimeError("mpx ring corrupted: slot length exceeds the message")
                p = s + layout.SLOT_HEADER
                view = self._mv[p:p + length].toreadonly()
                try:
                    out = consume(kind, view)
                finally:
                    self._ack()
                    self._resting = False
                    try:
                        view.release()
                    except BufferError:
                        raise RuntimeError("read_with: consume kept a view of the ring "
                                           "slot") from None
                return (layout.OK, kind, out)
        st, kind, out = self._read(deadline_ns, slice_end, False)
        if st != layout.OK:
            return (st, kind, out)
        return (layout.OK, kind, consume(kind, out))

    def read_ready(self):
        """See ``mpx._ring.RingReader.read_ready``."""
        out = []
        while self._q[layout.OFF_WRITE_SEQ >> 3] > self.seq:
            # (a deadline past: no wait, for any slot)
            st, kind, data = self._read(0, -1, bool(out))
            if st != layout.OK:
                ok = st == layout.TIMEOUT or out and st == layout.NO_MEMORY
                return (layout.OK if ok else st, out)
            out.append((kind, data))
        return (layout.OK, out)

    def read(self, deadline_ns: int = -1, slice_ns: int = -1):
        """See ``mpx._ring.RingReader.read``."""
        return self._read(deadline_ns, _slice_end(slice_ns), False)

    def _skipped(self, kind: int, nbytes: int) -> tuple[int, int, Any]:
        self.skipped_bytes = nbytes
        self._resting = False
        return (layout.NO_MEMORY, kind, None)

    def _read(self, deadline_ns: int, slice_end: int, keep_unallocated: bool):
        """See ``mpx._ring.RingReader._read``."""
        self._live()
        q, i32, mv = self._q, self._i, self._mv
        while True:
            st = layout.OK if self._ready() else self._wait(deadline_ns, slice_end)
            if st != layout.OK:
                if st in (layout.SHUTDOWN, layout.PEER_GONE):
                    self._drop_message()
                return (st, 0, None)
            s = self._slot(self.seq)
            length = q[(s + layout.SH_LENGTH) >> 3]
            flags = i32[(s + layout.SH_FLAGS) >> 2]
            kind = i32[(s + layout.SH_KIND) >> 2]
            total = q[(s + layout.SH_TOTAL) >> 3]
            as_bytes = kind & layout.KIND_AS_BYTES
            if flags & layout.F_ABORT:
                self._drop_message()
                self._ack()
                continue
            p = s + layout.SLOT_HEADER
            if flags & layout.F_BEGIN:
                self._drop_message()
                if flags & layout.F_END and as_bytes:
                    if length != total or length > self.chunk_bytes:
                        raise RuntimeError("mpx ring corrupted: slot length exceeds the message")
                    try:
                        data = bytes(mv[p:p + length])
                    except MemoryError:
                        if keep_unallocated:
                            return (layout.NO_MEMORY, 0, None)
                        self._ack()
                        return self._skipped(kind, length)
                    self._ack()
                    return (layout.OK, kind, data)
                try:
                    self._dest = bytearray(total)
                except MemoryError:
                    if keep_unallocated:
                        return (layout.NO_MEMORY, 0, None)
                    self._skipping = True
                self._dest_kind = kind
                self._dest_off = 0
                self._dest_total = total
            elif self._dest is None and not self._skipping:
                raise RuntimeError("mpx ring corrupted: a continuation slot without a message")
            dest = self._dest
            if length > self.chunk_bytes or self._dest_off + length > self._dest_total:
                raise RuntimeError("mpx ring corrupted: slot length exceeds the message")
            if dest is not None:
                dest[self._dest_off:self._dest_off + length] = mv[p:p + length]
            self._dest_off += length
            self._ack()
            if flags & layout.F_END:
                kind = self._dest_kind
                self._drop_message()
                self._resting = False
                if dest is None:
                    return self._skipped(kind, self._dest_total)
                try:
                    out = bytes(dest) if kind & layout.KIND_AS_BYTES else dest
                except MemoryError:  # (the copy into bytes; the message is consumed)
                    return self._skipped(kind, self._dest_total)
                return (layout.OK, kind, out)
