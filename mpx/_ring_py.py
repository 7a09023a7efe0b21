"""Pure-Python twin of ``mpx/_ring.pyx``: the same layout (``mpx.layout``), API and
behaviour, for machines without the compiled extension or with ``MPX_PURE_PYTHON=1``.

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

from mpx import layout as L

IMPLEMENTATION = "python"

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
    r, _, _ = select.select([fd], [], [], 0)
    return bool(r)


class Ring:
    """See ``mpx._ring.Ring``."""

    def __init__(self, buf, index: int, spin_ns: int = 0, yield_ns: int = 1000000,
                 poll_ns: int = 100000000) -> None:
        mv = memoryview(buf)
        if mv.readonly:
            raise TypeError("ring buffer must be writable")
        self._mv = mv.cast("B")
        self._q = self._mv.cast("Q")
        self._i = self._mv.cast("I")
        self._addr_obj = ctypes.c_char.from_buffer(buf)
        self._addr = ctypes.addressof(self._addr_obj)
        q = self._q
        self.chunk_bytes = q[L.OFF_CHUNK_BYTES // 8]
        self.n_chunks = q[L.OFF_N_CHUNKS // 8]
        self.n_readers = q[L.OFF_N_READERS // 8]
        self.stride = q[L.OFF_SLOT_STRIDE // 8]
        self._slots = L.slots_offset(self.n_readers)
        if self._mv.nbytes < self._slots + self.stride * self.n_chunks:
            raise ValueError("ring buffer is smaller than its header's geometry")
        if index < -1 or index >= self.n_readers:
            raise ValueError(f"reader index {index} out of range for {self.n_readers} readers")
        self.index = index
        self.spin_ns, self.yield_ns, self.poll_ns = spin_ns, yield_ns, poll_ns
        self._interrupted = False
        self.partial = False
        self._resting = False  # reader: its last wait ran out its slice (parks at once)
        self.gone_index = -1
        self._dest: bytearray | None = None
        self._dest_kind = 0
        self._dest_off = 0
        self._released = False
        if index < 0:
            self.seq = q[L.OFF_WRITE_SEQ // 8]
            self._min_read = 0
            self._pidfds = [-1] * self.n_readers
        else:
            self._rb = L.reader_block(index)
            self.seq = q[(self._rb + L.RB_READ_SEQ) // 8]
            self._pidfds = [_pidfd_open(q[L.OFF_WRITER_PID // 8])]

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

    def _futex_wake(self, off: int) -> None:
        if _SYS_FUTEX is not None:
            _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._addr + off), _FUTEX_WAKE,
                          0x7FFFFFFF, None, None, 0)

    def _live(self) -> None:
        if self._released:
            raise ValueError("ring was released")

    def release(self) -> None:
        """Drop the buffer export and pidfds; the Ring is unusable afterwards."""
        if self._released:
            return
        self._released = True
        for fd in self._pidfds:
            if fd >= 0:
                os.close(fd)
        self._pidfds = []
        self._dest = None
        del self._addr_obj
        self._i.release()
        self._q.release()
        self._mv.release()

    # ------------------------------------------------------------------ state

    def interrupt(self) -> None:
        self._live()
        self._interrupted = True
        off = L.OFF_SPACE_FUTEX if self.index < 0 else L.OFF_DATA_FUTEX
        self._bump32(off)
        self._futex_wake(off)

    def set_state(self, bits: int) -> None:
        self._live()
        self._set32(L.OFF_STATE, self._w32(L.OFF_STATE) | bits)
        L.fence()
        self._bump32(L.OFF_DATA_FUTEX)
        self._futex_wake(L.OFF_DATA_FUTEX)

    def mark_reader_closed(self) -> None:
        self._live()
        self._set32(self._rb + L.RB_CLOSED, 1)
        L.fence()
        self._bump32(L.OFF_SPACE_FUTEX)
        self._futex_wake(L.OFF_SPACE_FUTEX)

    @property
    def seq_number(self) -> int:
        return self.seq

    def published(self) -> int:
        self._live()
        return self._w64(L.OFF_WRITE_SEQ)

    # ------------------------------------------------------------------ writer

    def _has_space(self) -> bool:
        if self.seq - self._min_read < self.n_chunks:
            return True
        q = self._q
        m = self.seq
        for i in range(self.n_readers):
            r = q[(L.reader_block(i) + L.RB_READ_SEQ) >> 3]
            if r < m:
                m = r
        self._min_read = m
        return self.seq - m < self.n_chunks

    def _check_readers(self) -> int | None:
        for i in range(self.n_readers):
            blk = L.reader_block(i)
            if self.seq - self._w64(blk + L.RB_READ_SEQ) < self.n_chunks:
                continue
            if self._w32(blk + L.RB_CLOSED):
                self.gone_index = i
                return L.PEER_GONE
            if self._pidfds[i] == -1:
                pid = self._w64(blk + L.RB_PID)
                if pid:
                    self._pidfds[i] = _pidfd_open(pid)
            if _pidfd_exited(self._pidfds[i]):
                self.gone_index = i
                return L.PEER_GONE
        return None

    def _wait_space(self, deadline: int) -> int:
        if self._has_space():
            return L.OK
        t0 = now = time.monotonic_ns()
        while now - t0 < self.spin_ns + self.yield_ns:
            os.sched_yield()
            if self._has_space():
                return L.OK
            if self._interrupted:
                return L.INTERRUPTED
            now = time.monotonic_ns()
        while True:
            if self._interrupted:
                return L.INTERRUPTED
            st = self._check_readers()
            if st is not None:
                return st
            now = time.monotonic_ns()
            if 0 <= deadline <= now:
                return L.TIMEOUT
            until = now + self.poll_ns
            if 0 <= deadline < until:
                until = deadline
            v = self._w32(L.OFF_SPACE_FUTEX)
            self._set32(L.OFF_WRITER_PARKED, 1)
            L.fence()
            if self._has_space():
                self._set32(L.OFF_WRITER_PARKED, 0)
                return L.OK
            signalled = False
            if not self._interrupted:
                signalled = self._futex_wait(L.OFF_SPACE_FUTEX, v, until - now)
            self._set32(L.OFF_WRITER_PARKED, 0)
            if self._has_space():
                return L.OK
            if signalled:
                return L.SLICE

    def _publish(self, length: int, flags: int, kind: int, total: int) -> None:
        s = self._slot(self.seq)
        q, i32 = self._q, self._i
        q[(s + L.SH_LENGTH) >> 3] = length
        i32[(s + L.SH_FLAGS) >> 2] = flags
        i32[(s + L.SH_KIND) >> 2] = kind
        q[(s + L.SH_TOTAL) >> 3] = total
        self.seq += 1
        q[L.OFF_WRITE_SEQ >> 3] = self.seq
        L.fence()
        for r in range(self.n_readers):
            if i32[(L.reader_block(r) + L.RB_PARKED) >> 2]:
                self._bump32(L.OFF_DATA_FUTEX)
                self._futex_wake(L.OFF_DATA_FUTEX)
                break

    def write(self, kind: int, parts, deadline_ns: int = -1, total: int = -1) -> int:
        self._live()
        if self.index >= 0:
            raise ValueError("write() on a reader ring")
        length = sum(memoryview(p).nbytes for p in parts) if total < 0 else total
        st = self._claim_slot(deadline_ns)
        if st != L.OK:
            return st
        chunk = self.chunk_bytes
        payload = self._slot(self.seq) + L.SLOT_HEADER
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
                    self._publish(off, L.F_BEGIN if first else 0, kind, length)
                    first = False
                    self.partial = True
                    off = 0
                    st = self._wait_space(deadline_ns)
                    if st != L.OK:
                        return st
                    payload = self._slot(self.seq) + L.SLOT_HEADER
                c = min(rem, chunk - off)
                mv[payload + off:payload + off + c] = v[pos:pos + c]
                off += c
                pos += c
                rem -= c
        if written != length:
            raise ValueError(f"the message's pieces add up to {written} bytes, not {length}")
        self._publish(off, (L.F_BEGIN if first else 0) | L.F_END, kind, length)
        self.partial = False
        return L.OK

    # ------------------------------------------------------------------ raw slots

    def payload_offset(self) -> int:
        self._live()
        return self._slot(self.seq) + L.SLOT_HEADER

    def begin_slot(self, deadline_ns: int = -1) -> int:
        self._live()
        if self.index >= 0:
            raise ValueError("begin_slot() on a reader ring")
        return self._claim_slot(deadline_ns)

    def _claim_slot(self, deadline_ns: int) -> int:
        """Wait for the next free slot, first aborting a message that a failed write left
        half-written."""
        if self.partial:
            st = self._wait_space(deadline_ns)
            if st != L.OK:
                return st
            self._publish(0, L.F_ABORT, 0, 0)
            self.partial = False
        return self._wait_space(deadline_ns)

    def commit_slot(self, length: int, kind: int) -> None:
        self._live()
        if length > self.chunk_bytes:
            raise ValueError(f"slot length {length} exceeds the slot size {self.chunk_bytes}")
        self._publish(length, L.F_BEGIN | L.F_END, kind, length)

    def next_slot(self, deadline_ns: int = -1, slice_ns: int = -1):
        self._live()
        if self.index < 0:
            raise ValueError("next_slot() on the writer ring")
        if self._dest is not None:
            raise ValueError("next_slot() in the middle of a multi-slot message")
        q = self._q
        while True:
            if q[L.OFF_WRITE_SEQ >> 3] <= self.seq:
                st = self._wait_data(deadline_ns, slice_ns)
                if st != L.OK:
                    return (st, 0, 0)
            s = self._slot(self.seq)
            flags = self._i[(s + L.SH_FLAGS) >> 2]
            if flags & L.F_ABORT:
                self._ack()
                continue
            if flags & (L.F_BEGIN | L.F_END) != (L.F_BEGIN | L.F_END):
                raise ValueError(f"the next message spans several slots "
                                 f"({q[(s + L.SH_TOTAL) >> 3]} bytes); read it with read()")
            return (L.OK, q[(s + L.SH_LENGTH) >> 3], self._i[(s + L.SH_KIND) >> 2])

    def release_slot(self) -> None:
        self._live()
        if self.index < 0:
            raise ValueError("release_slot() on the writer ring")
        if self._q[L.OFF_WRITE_SEQ >> 3] <= self.seq:
            raise ValueError("release_slot() without a slot")
        self._ack()

    # ------------------------------------------------------------------ reader

    def _reader_terminal(self) -> int | None:
        if self._interrupted:
            return L.INTERRUPTED
        state = self._w32(L.OFF_STATE)
        if state == 0 and not _pidfd_exited(self._pidfds[0]):
            return None
        if self._w64(L.OFF_WRITE_SEQ) > self.seq:
            return L.OK
        if state & L.S_SHUTDOWN:
            return L.SHUTDOWN
        return L.PEER_GONE

    def _wait_data(self, deadline: int, slice_ns: int) -> int:
        wseq = L.OFF_WRITE_SEQ >> 3
        q = self._q
        t0 = now = time.monotonic_ns()
        slice_end = t0 + slice_ns if slice_ns >= 0 else -1
        if self._resting:  # the last wait ran out its slice: park again at once
            self._resting = False
            t0 -= self.spin_ns + self.yield_ns
        while now - t0 < self.spin_ns + self.yield_ns:
            if q[wseq] > self.seq:
                return L.OK
            if self._interrupted:
                return L.INTERRUPTED
            os.sched_yield()
            now = time.monotonic_ns()
            if 0 <= deadline <= now:
                return L.TIMEOUT
        parked = self._rb + L.RB_PARKED
        while True:
            st = self._reader_terminal()
            if st is not None:
                return st
            now = time.monotonic_ns()
            if 0 <= deadline <= now:
                return L.TIMEOUT
            if 0 <= slice_end <= now:
                self._resting = True
                return L.SLICE
            until = now + self.poll_ns
            if 0 <= deadline < until:
                until = deadline
            if 0 <= slice_end < until:
                until = slice_end
            v = self._w32(L.OFF_DATA_FUTEX)
            self._set32(parked, 1)
            L.fence()
            if q[wseq] > self.seq:
                self._set32(parked, 0)
                return L.OK
            signalled = False
            if self._w32(L.OFF_STATE) == 0 and not self._interrupted:
                signalled = self._futex_wait(L.OFF_DATA_FUTEX, v, until - now)
            self._set32(parked, 0)
            if q[wseq] > self.seq:
                return L.OK
            if signalled:
                return L.SLICE

    def _ack(self) -> None:
        self.seq += 1
        self._q[(self._rb + L.RB_READ_SEQ) >> 3] = self.seq
        L.fence()
        if self._w32(L.OFF_WRITER_PARKED):
            self._bump32(L.OFF_SPACE_FUTEX)
            self._futex_wake(L.OFF_SPACE_FUTEX)

    def read(self, deadline_ns: int = -1, slice_ns: int = -1):
        self._live()
        if self.index < 0:
            raise ValueError("read() on the writer ring")
        q, i32, mv = self._q, self._i, self._mv
        while True:
            if q[L.OFF_WRITE_SEQ >> 3] <= self.seq:
                st = self._wait_data(deadline_ns, slice_ns)
                if st != L.OK:
                    if st in (L.SHUTDOWN, L.PEER_GONE):
                        self._dest = None
                    return (st, 0, None)
            s = self._slot(self.seq)
            length = q[(s + L.SH_LENGTH) >> 3]
            flags = i32[(s + L.SH_FLAGS) >> 2]
            kind = i32[(s + L.SH_KIND) >> 2]
            total = q[(s + L.SH_TOTAL) >> 3]
            if flags & L.F_ABORT:
                self._dest = None
                self._ack()
                continue
            p = s + L.SLOT_HEADER
            if flags & L.F_BEGIN:
                if flags & L.F_END and kind != L.K_PICKLE_OOB:
                    if length != total or length > self.chunk_bytes:
                        raise RuntimeError("mpx ring corrupted: slot length exceeds the message")
                    data = bytes(mv[p:p + length])
                    self._ack()
                    return (L.OK, kind, data)
                self._dest = bytearray(total)
                self._dest_kind = kind
                self._dest_off = 0
            elif self._dest is None:
                raise RuntimeError("mpx ring corrupted: a continuation slot without a message")
            dest = self._dest
            if length > self.chunk_bytes or self._dest_off + length > len(dest):
                raise RuntimeError("mpx ring corrupted: slot length exceeds the message")
            dest[self._dest_off:self._dest_off + length] = mv[p:p + length]
            self._dest_off += length
            self._ack()
            if flags & L.F_END:
                self._dest = None
                self._resting = False
                kind = self._dest_kind
                out = dest if kind == L.K_PICKLE_OOB else bytes(dest)
                return (L.OK, kind, out)


class Assembler:
    """Builds one message of ``total`` bytes from consecutive pieces (the ZeroMQ reader's
    chunks) in memory the caller will own: bytes for K_PICKLE/K_BYTES, a bytearray
    otherwise."""

    def __init__(self, kind: int, total: int) -> None:
        self._kind = kind
        self._dest = bytearray(total)
        self._off = 0

    def add(self, piece) -> None:
        """Append ``piece``; ValueError if it would overrun the message."""
        n = memoryview(piece).nbytes
        if n > len(self._dest) - self._off:
            raise ValueError(f"a piece of {n} bytes overruns the message "
                             f"({self._off} of {len(self._dest)} bytes filled)")
        self._dest[self._off:self._off + n] = piece
        self._off += n

    @property
    def complete(self) -> bool:
        return self._off == len(self._dest)

    def result(self):
        """The message; ValueError unless every byte was added."""
        if not self.complete:
            raise ValueError(f"message incomplete: {self._off} of {len(self._dest)} bytes")
        return self._dest if self._kind == L.K_PICKLE_OOB else bytes(self._dest)
