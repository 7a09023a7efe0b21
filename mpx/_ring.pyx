# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The shared-memory ring: slots, sequence numbers, atomics and waiting.

Mechanism only: no pickling, logging or policy. ``mpx/_ring_py.py`` is its pure-Python twin
with the same layout (``mpx/layout.py``) and behaviour. Wait results are the status codes
of ``mpx.layout`` (OK, TIMEOUT, INTERRUPTED, PEER_GONE, SHUTDOWN, SLICE).
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.bytearray cimport PyByteArray_FromStringAndSize, PyByteArray_AS_STRING
from libc.string cimport memcpy
from libc.stdlib cimport malloc, free
from libc.stdint cimport uint32_t, uint64_t, int64_t

cdef extern from "Python.h":
    int PyErr_CheckSignals()

from mpx import layout as L

cdef size_t OFF_CHUNK_BYTES = L.OFF_CHUNK_BYTES
cdef size_t OFF_N_CHUNKS = L.OFF_N_CHUNKS
cdef size_t OFF_N_READERS = L.OFF_N_READERS
cdef size_t OFF_SLOT_STRIDE = L.OFF_SLOT_STRIDE
cdef size_t OFF_WRITER_PID = L.OFF_WRITER_PID
cdef size_t OFF_WRITE_SEQ = L.OFF_WRITE_SEQ
cdef size_t OFF_DATA_FUTEX = L.OFF_DATA_FUTEX
cdef size_t OFF_STATE = L.OFF_STATE
cdef size_t OFF_SPACE_FUTEX = L.OFF_SPACE_FUTEX
cdef size_t OFF_WRITER_PARKED = L.OFF_WRITER_PARKED
cdef size_t OFF_READERS = L.OFF_READERS
cdef size_t READER_BLOCK = L.READER_BLOCK
cdef size_t RB_READ_SEQ = L.RB_READ_SEQ
cdef size_t RB_PID = L.RB_PID
cdef size_t RB_CLOSED = L.RB_CLOSED
cdef size_t RB_PARKED = L.RB_PARKED
cdef size_t SLOT_HEADER = L.SLOT_HEADER
cdef size_t SH_LENGTH = L.SH_LENGTH
cdef size_t SH_FLAGS = L.SH_FLAGS
cdef size_t SH_KIND = L.SH_KIND
cdef size_t SH_TOTAL = L.SH_TOTAL
cdef uint32_t F_BEGIN = L.F_BEGIN
cdef uint32_t F_END = L.F_END
cdef uint32_t F_ABORT = L.F_ABORT
cdef uint32_t S_SHUTDOWN = L.S_SHUTDOWN
cdef uint32_t S_CLOSED = L.S_CLOSED
cdef uint32_t K_PICKLE = L.K_PICKLE
cdef uint32_t K_BYTES = L.K_BYTES
cdef int ST_OK = L.OK
cdef int ST_TIMEOUT = L.TIMEOUT
cdef int ST_INTERRUPTED = L.INTERRUPTED
cdef int ST_PEER_GONE = L.PEER_GONE
cdef int ST_SHUTDOWN = L.SHUTDOWN
cdef int ST_SLICE = L.SLICE
cdef uint64_t HUGE_ADVICE_MIN = L.HUGE_ADVICE_MIN
cdef int _NOT_TERMINAL = -1
# A Python signal handler raised while a wait was parked: the exception propagates.
cdef int ST_SIGNAL = -2


cdef int _signal_pending() noexcept nogil:
    """Run this thread's pending Python signal handlers; 1 if one raised (left set)."""
    with gil:
        return 1 if PyErr_CheckSignals() != 0 else 0


cdef int _propagate() except -1:
    return -1  # the exception a signal handler raised is already set

# Copies at least this big run without the GIL; below it the release costs more than it gives.
DEF NOGIL_COPY = 65536
DEF SPIN_BATCH = 64

IMPLEMENTATION = "cython"

cdef extern from *:
    """
    #ifndef MPX_DEBUG
    #define MPX_DEBUG 0
    #endif
    """
    int MPX_DEBUG_BUILD "MPX_DEBUG"

# True when built with MPX_DEBUG=1: mpx._debug then keeps its counters (see there).
DEBUG = bool(MPX_DEBUG_BUILD)


cdef object _owned_dest(uint32_t kind, uint64_t total, char** ptr):
    """A new, uninitialised message buffer the caller will own (bytes for K_PICKLE and
    K_BYTES, else a bytearray), with huge-page advice when large; its memory in ``*ptr``."""
    cdef object dest
    if kind == K_PICKLE or kind == K_BYTES:
        dest = PyBytes_FromStringAndSize(NULL, total)
        ptr[0] = PyBytes_AS_STRING(dest)
    else:
        dest = PyByteArray_FromStringAndSize(NULL, total)
        ptr[0] = PyByteArray_AS_STRING(dest)
    if total >= HUGE_ADVICE_MIN:
        mpx_advise_huge(ptr[0], total)
    return dest


cdef class Ring:
    """One process's end of a ring segment: the writer (``index == -1``) or reader ``index``.

    ``buf`` is the whole segment (a writable buffer, e.g. an mmap) with its header already
    written. Waits spin for ``spin_ns``, call ``sched_yield`` until ``spin_ns + yield_ns``,
    then park on a futex, waking every ``poll_ns`` to check that the peer is alive.
    """

    def __cinit__(self):
        self.has_buf = False
        self.pidfds = NULL
        self.n_pidfds = 0
        self.gone_index = -1

    def __init__(self, buf, int index, int64_t spin_ns=0, int64_t yield_ns=1000000,
                 int64_t poll_ns=100000000):
        cdef int i
        PyObject_GetBuffer(buf, &self.pybuf, PyBUF_WRITABLE)
        self.has_buf = True
        self.base = <char*>self.pybuf.buf
        self.chunk_bytes = self._u64(OFF_CHUNK_BYTES)[0]
        self.n_chunks = self._u64(OFF_N_CHUNKS)[0]
        self.n_readers = self._u64(OFF_N_READERS)[0]
        self.stride = self._u64(OFF_SLOT_STRIDE)[0]
        cdef size_t slots_off = L.slots_offset(self.n_readers)
        if <uint64_t>self.pybuf.len < slots_off + self.stride * self.n_chunks:
            raise ValueError("ring buffer is smaller than its header's geometry")
        if index < -1 or index >= <int>self.n_readers:
            raise ValueError(f"reader index {index} out of range for {self.n_readers} readers")
        self.slots = self.base + slots_off
        self.index = index
        self.spin_ns = spin_ns
        self.yield_ns = yield_ns
        self.poll_ns = poll_ns
        self.interrupted = 0
        self.partial = False
        if index < 0:
            self.seq = mpx_load64(self._u64(OFF_WRITE_SEQ))
            self.min_read = 0
            self.n_pidfds = <int>self.n_readers
        else:
            self.seq = mpx_load64(self._u64(OFF_READERS + READER_BLOCK * index + RB_READ_SEQ))
            self.n_pidfds = 1
        self.pidfds = <int*>malloc(sizeof(int) * (self.n_pidfds + 1))
        for i in range(self.n_pidfds):
            self.pidfds[i] = -1
        if index >= 0:
            self.pidfds[0] = mpx_pidfd_open(<int>self._u64(OFF_WRITER_PID)[0])

    def __dealloc__(self):
        self._close_fds()
        if self.has_buf:
            PyBuffer_Release(&self.pybuf)
            self.has_buf = False

    cdef void _close_fds(self):
        cdef int i
        if self.pidfds != NULL:
            for i in range(self.n_pidfds):
                mpx_close_fd(self.pidfds[i])
            free(self.pidfds)
            self.pidfds = NULL
            self.n_pidfds = 0

    def release(self):
        """Drop the buffer export and pidfds; the Ring is unusable afterwards."""
        self._close_fds()
        self.dest = None
        if self.has_buf:
            PyBuffer_Release(&self.pybuf)
            self.has_buf = False
        self.base = NULL

    cdef inline uint64_t* _u64(self, size_t off) nogil:
        return <uint64_t*>(self.base + off)

    cdef inline uint32_t* _u32(self, size_t off) nogil:
        return <uint32_t*>(self.base + off)

    cdef inline char* _slot(self, uint64_t seq) nogil:
        return self.slots + (seq % self.n_chunks) * self.stride

    cdef inline void _live(self) except *:
        if not self.has_buf:
            raise ValueError("ring was released")

    # ---------------------------------------------------------------- interrupts, state

    def interrupt(self):
        """Wake this process's waiters on this ring: they return INTERRUPTED (sticky)."""
        self._live()
        mpx_set_flag(&self.interrupted)
        if self.index < 0:
            mpx_bump32(self._u32(OFF_SPACE_FUTEX))
            mpx_futex_wake(self._u32(OFF_SPACE_FUTEX))
        else:
            mpx_bump32(self._u32(OFF_DATA_FUTEX))
            mpx_futex_wake(self._u32(OFF_DATA_FUTEX))

    def set_state(self, uint32_t bits):
        """Writer: set SHUTDOWN/CLOSED bits in the segment and wake every parked reader."""
        self._live()
        cdef uint32_t* state = self._u32(OFF_STATE)
        mpx_store32(state, mpx_load32(state) | bits)
        mpx_fence()
        mpx_bump32(self._u32(OFF_DATA_FUTEX))
        mpx_futex_wake(self._u32(OFF_DATA_FUTEX))

    def mark_reader_closed(self):
        """Reader: tell the writer this reader is gone, waking it if it waits for space."""
        self._live()
        mpx_store32(self._u32(OFF_READERS + READER_BLOCK * self.index + RB_CLOSED), 1)
        mpx_fence()
        mpx_bump32(self._u32(OFF_SPACE_FUTEX))
        mpx_futex_wake(self._u32(OFF_SPACE_FUTEX))

    @property
    def seq_number(self):
        """Writer: slots published; reader: slots consumed."""
        return self.seq

    def published(self):
        """Slots the writer has published so far."""
        self._live()
        return mpx_load64(self._u64(OFF_WRITE_SEQ))

    # ---------------------------------------------------------------- writer

    cdef bint _has_space(self) nogil:
        cdef uint64_t m, r
        cdef uint64_t i
        if self.seq - self.min_read < self.n_chunks:
            return True
        m = self.seq
        for i in range(self.n_readers):
            r = mpx_load64(self._u64(OFF_READERS + READER_BLOCK * i + RB_READ_SEQ))
            if r < m:
                m = r
        self.min_read = m
        return self.seq - m < self.n_chunks

    cdef int _check_readers(self) nogil:
        """PEER_GONE (with gone_index) if a reader that holds up the writer is gone."""
        cdef uint64_t i
        cdef size_t blk
        cdef int pid
        for i in range(self.n_readers):
            blk = OFF_READERS + READER_BLOCK * i
            if self.seq - mpx_load64(self._u64(blk + RB_READ_SEQ)) < self.n_chunks:
                continue
            if mpx_load32(self._u32(blk + RB_CLOSED)):
                self.gone_index = <int>i
                return ST_PEER_GONE
            if self.pidfds[i] == -1:
                pid = <int>mpx_load64(self._u64(blk + RB_PID))
                if pid:
                    self.pidfds[i] = mpx_pidfd_open(pid)
            if mpx_pidfd_exited(self.pidfds[i]):
                self.gone_index = <int>i
                return ST_PEER_GONE
        return _NOT_TERMINAL

    cdef int _wait_space(self, int64_t deadline) nogil:
        cdef int64_t t0, now, until
        cdef int k, st, signalled
        cdef uint32_t v
        cdef uint32_t* parked
        cdef uint32_t* futex
        if self._has_space():
            return ST_OK
        t0 = mpx_now_ns()
        now = t0
        while now - t0 < self.spin_ns:
            for k in range(SPIN_BATCH):
                mpx_relax()
            if self._has_space():
                return ST_OK
            now = mpx_now_ns()
        while now - t0 < self.spin_ns + self.yield_ns:
            mpx_yield()
            if self._has_space():
                return ST_OK
            if mpx_get_flag(&self.interrupted):
                return ST_INTERRUPTED
            now = mpx_now_ns()
        parked = self._u32(OFF_WRITER_PARKED)
        futex = self._u32(OFF_SPACE_FUTEX)
        while True:
            if mpx_get_flag(&self.interrupted):
                return ST_INTERRUPTED
            if _signal_pending():
                return ST_SIGNAL
            st = self._check_readers()
            if st != _NOT_TERMINAL:
                return st
            now = mpx_now_ns()
            if deadline >= 0 and now >= deadline:
                return ST_TIMEOUT
            until = now + self.poll_ns
            if deadline >= 0 and deadline < until:
                until = deadline
            v = mpx_load32(futex)
            mpx_store32(parked, 1)
            mpx_fence()
            if self._has_space():
                mpx_store32(parked, 0)
                return ST_OK
            signalled = 0
            if not mpx_get_flag(&self.interrupted):
                signalled = mpx_futex_wait(futex, v, until - now)
            mpx_store32(parked, 0)
            if self._has_space():
                return ST_OK
            if signalled:
                return ST_SLICE

    cdef void _publish(self, uint32_t length, uint32_t flags, uint32_t kind,
                       uint64_t total) nogil:
        cdef char* slot = self._slot(self.seq)
        cdef uint64_t i
        (<uint64_t*>(slot + SH_LENGTH))[0] = length
        (<uint32_t*>(slot + SH_FLAGS))[0] = flags
        (<uint32_t*>(slot + SH_KIND))[0] = kind
        (<uint64_t*>(slot + SH_TOTAL))[0] = total
        self.seq += 1
        mpx_store64(self._u64(OFF_WRITE_SEQ), self.seq)
        mpx_fence()
        for i in range(self.n_readers):
            if mpx_load32(self._u32(OFF_READERS + READER_BLOCK * i + RB_PARKED)):
                mpx_bump32(self._u32(OFF_DATA_FUTEX))
                mpx_futex_wake(self._u32(OFF_DATA_FUTEX))
                break

    def write(self, uint32_t kind, parts, int64_t deadline_ns=-1, int64_t total=-1):
        """Publish one message made of ``parts`` (buffers, concatenated) as ``kind``.

        Streams across as many slots as it needs, waiting for space up to ``deadline_ns``
        (CLOCK_MONOTONIC ns; -1: none). Returns a status; on anything but OK a message
        already begun is aborted in front of the next write. Given ``total`` (the message's
        length), ``parts`` may be any iterable, taken one piece at a time while the message
        streams (a relay forwards chunks as they arrive); pieces that do not add up to
        ``total`` raise ValueError, and so abort the message, like an exception from the
        iterable.
        """
        self._live()
        if self.index >= 0:
            raise ValueError("write() on a reader ring")
        cdef Py_buffer buf
        cdef uint64_t length = 0, written = 0, off = 0, c, rem
        cdef char* src
        cdef char* payload
        cdef bint first = True
        cdef int st
        if total < 0:
            for part in parts:
                PyObject_GetBuffer(part, &buf, PyBUF_SIMPLE)
                length += <uint64_t>buf.len
                PyBuffer_Release(&buf)
        else:
            length = <uint64_t>total
        st = self._claim_slot(deadline_ns)
        if st != ST_OK:
            return st
        payload = self._slot(self.seq) + SLOT_HEADER
        for part in parts:
            PyObject_GetBuffer(part, &buf, PyBUF_SIMPLE)
            try:
                src = <char*>buf.buf
                rem = <uint64_t>buf.len
                if rem > length - written:
                    raise ValueError(f"the message's pieces exceed its length {length}")
                written += rem
                while rem > 0:
                    if off == self.chunk_bytes:
                        self._publish(<uint32_t>off, F_BEGIN if first else 0, kind, length)
                        first = False
                        self.partial = True
                        off = 0
                        with nogil:
                            st = self._wait_space(deadline_ns)
                        if st == ST_SIGNAL:
                            _propagate()
                        if st != ST_OK:
                            return st
                        payload = self._slot(self.seq) + SLOT_HEADER
                    c = self.chunk_bytes - off
                    if rem < c:
                        c = rem
                    if c >= NOGIL_COPY:
                        with nogil:
                            memcpy(payload + off, src, c)
                    else:
                        memcpy(payload + off, src, c)
                    off += c
                    src += c
                    rem -= c
            finally:
                PyBuffer_Release(&buf)
        if written != length:
            raise ValueError(f"the message's pieces add up to {written} bytes, not {length}")
        self._publish(<uint32_t>off, (F_BEGIN if first else 0) | F_END, kind, length)
        self.partial = False
        return ST_OK

    # ---------------------------------------------------------------- raw slots

    def payload_offset(self):
        """Offset in the segment of the payload of slot ``seq_number`` (the slot the writer
        fills next, or the one a reader reads next)."""
        self._live()
        return <size_t>(self._slot(self.seq) - self.base) + SLOT_HEADER

    def begin_slot(self, int64_t deadline_ns=-1):
        """Writer: wait until the next slot is free (aborting a message a failed write left
        half-written). On OK the caller fills ``payload_offset()`` and calls commit_slot."""
        self._live()
        if self.index >= 0:
            raise ValueError("begin_slot() on a reader ring")
        return self._claim_slot(deadline_ns)

    cdef int _claim_slot(self, int64_t deadline_ns) except? -9:
        """Wait for the next free slot, first aborting a message that a failed write left
        half-written (a signal's handler may raise)."""
        cdef int st
        if self.partial:
            with nogil:
                st = self._wait_space(deadline_ns)
            if st == ST_SIGNAL:
                _propagate()
            if st != ST_OK:
                return st
            self._publish(0, F_ABORT, 0, 0)
            self.partial = False
        with nogil:
            st = self._wait_space(deadline_ns)
        if st == ST_SIGNAL:
            _propagate()
        return st

    def commit_slot(self, uint64_t length, uint32_t kind):
        """Writer: publish the slot begin_slot made ready as a whole message of ``length``
        bytes of ``kind``."""
        self._live()
        if length > self.chunk_bytes:
            raise ValueError(f"slot length {length} exceeds the slot size {self.chunk_bytes}")
        self._publish(<uint32_t>length, F_BEGIN | F_END, kind, length)

    def next_slot(self, int64_t deadline_ns=-1, int64_t slice_ns=-1):
        """Reader: wait for the next slot: ``(status, length, kind)``. On OK its payload
        (at ``payload_offset()``) stays the reader's until release_slot(). Aborted slots
        are skipped. ValueError, leaving the slot unread, when the next message spans
        several slots, or in the middle of one that read() left early."""
        self._live()
        if self.index < 0:
            raise ValueError("next_slot() on the writer ring")
        if self.dest is not None:
            raise ValueError("next_slot() in the middle of a multi-slot message")
        cdef char* slot
        cdef int st
        cdef uint32_t flags
        while True:
            st = self._next_published(deadline_ns, slice_ns)
            if st != ST_OK:
                return (st, 0, 0)
            slot = self._slot(self.seq)
            flags = (<uint32_t*>(slot + SH_FLAGS))[0]
            if flags & F_ABORT:
                self._ack()
                continue
            if flags & (F_BEGIN | F_END) != (F_BEGIN | F_END):
                raise ValueError(
                    f"the next message spans several slots "
                    f"({(<uint64_t*>(slot + SH_TOTAL))[0]} bytes); read it with read()")
            return (ST_OK, (<uint64_t*>(slot + SH_LENGTH))[0], (<uint32_t*>(slot + SH_KIND))[0])

    def release_slot(self):
        """Reader: hand the slot next_slot returned back to the writer."""
        self._live()
        if self.index < 0:
            raise ValueError("release_slot() on the writer ring")
        if mpx_load64(self._u64(OFF_WRITE_SEQ)) <= self.seq:
            raise ValueError("release_slot() without a slot")
        self._ack()

    # ---------------------------------------------------------------- reader

    cdef int _next_published(self, int64_t deadline_ns, int64_t slice_ns) except? -9:
        """Reader: wait until the next slot is published (a signal's handler may raise)."""
        cdef int st
        if mpx_load64(self._u64(OFF_WRITE_SEQ)) > self.seq:
            return ST_OK
        with nogil:
            st = self._wait_data(deadline_ns, slice_ns)
        if st == ST_SIGNAL:
            _propagate()
        return st

    cdef int _reader_terminal(self) nogil:
        """Why a reader with nothing to read should stop waiting, or _NOT_TERMINAL."""
        cdef uint32_t state
        if mpx_get_flag(&self.interrupted):
            return ST_INTERRUPTED
        state = mpx_load32(self._u32(OFF_STATE))
        if state == 0 and not mpx_pidfd_exited(self.pidfds[0]):
            return _NOT_TERMINAL
        if mpx_load64(self._u64(OFF_WRITE_SEQ)) > self.seq:
            return ST_OK
        if state & S_SHUTDOWN:
            return ST_SHUTDOWN
        return ST_PEER_GONE

    cdef int _wait_data(self, int64_t deadline, int64_t slice_ns) nogil:
        cdef uint64_t* wseq = self._u64(OFF_WRITE_SEQ)
        cdef int64_t t0, now, until, slice_end
        cdef int k, st, signalled
        cdef uint32_t v
        cdef uint32_t* parked
        cdef uint32_t* futex
        t0 = mpx_now_ns()
        now = t0
        slice_end = t0 + slice_ns if slice_ns >= 0 else -1
        if self.resting:  # the last wait ran out its slice: park again at once
            self.resting = False
            t0 -= self.spin_ns + self.yield_ns
        while now - t0 < self.spin_ns:
            for k in range(SPIN_BATCH):
                if mpx_load64(wseq) > self.seq:
                    return ST_OK
                mpx_relax()
            now = mpx_now_ns()
        while now - t0 < self.spin_ns + self.yield_ns:
            mpx_yield()
            if mpx_load64(wseq) > self.seq:
                return ST_OK
            if mpx_get_flag(&self.interrupted):
                return ST_INTERRUPTED
            now = mpx_now_ns()
            if deadline >= 0 and now >= deadline:
                return ST_TIMEOUT
        parked = self._u32(OFF_READERS + READER_BLOCK * self.index + RB_PARKED)
        futex = self._u32(OFF_DATA_FUTEX)
        while True:
            if _signal_pending():
                return ST_SIGNAL
            st = self._reader_terminal()
            if st != _NOT_TERMINAL:
                return st
            now = mpx_now_ns()
            if deadline >= 0 and now >= deadline:
                return ST_TIMEOUT
            if slice_end >= 0 and now >= slice_end:
                self.resting = True
                return ST_SLICE
            until = now + self.poll_ns
            if deadline >= 0 and deadline < until:
                until = deadline
            if slice_end >= 0 and slice_end < until:
                until = slice_end
            v = mpx_load32(futex)
            mpx_store32(parked, 1)
            mpx_fence()
            if mpx_load64(wseq) > self.seq:
                mpx_store32(parked, 0)
                return ST_OK
            signalled = 0
            if mpx_load32(self._u32(OFF_STATE)) == 0 and not mpx_get_flag(&self.interrupted):
                signalled = mpx_futex_wait(futex, v, until - now)
            mpx_store32(parked, 0)
            if mpx_load64(wseq) > self.seq:
                return ST_OK
            if signalled:
                return ST_SLICE

    cdef void _ack(self) nogil:
        self.seq += 1
        mpx_store64(self._u64(OFF_READERS + READER_BLOCK * self.index + RB_READ_SEQ), self.seq)
        mpx_fence()
        if mpx_load32(self._u32(OFF_WRITER_PARKED)):
            mpx_bump32(self._u32(OFF_SPACE_FUTEX))
            mpx_futex_wake(self._u32(OFF_SPACE_FUTEX))

    def read(self, int64_t deadline_ns=-1, int64_t slice_ns=-1):
        """Receive the next message: ``(status, kind, data)``.

        ``data`` is owned by the caller (bytes for K_PICKLE/K_BYTES, a bytearray otherwise)
        and never aliases the ring. With ``slice_ns >= 0`` a wait that sees no data for that
        long returns SLICE, and so does a park that a signal interrupted (so Python can run
        its handler); calling again resumes, also in the middle of a message.
        """
        self._live()
        if self.index < 0:
            raise ValueError("read() on the writer ring")
        cdef char* slot
        cdef uint64_t length, total
        cdef uint32_t flags, kind
        cdef int st
        cdef object d
        while True:
            st = self._next_published(deadline_ns, slice_ns)
            if st != ST_OK:
                if st == ST_SHUTDOWN or st == ST_PEER_GONE:
                    self.dest = None
                return (st, 0, None)
            slot = self._slot(self.seq)
            length = (<uint64_t*>(slot + SH_LENGTH))[0]
            flags = (<uint32_t*>(slot + SH_FLAGS))[0]
            kind = (<uint32_t*>(slot + SH_KIND))[0]
            total = (<uint64_t*>(slot + SH_TOTAL))[0]
            if flags & F_ABORT:
                self.dest = None
                self._ack()
                continue
            if flags & F_BEGIN:
                self._begin(kind, total)
            elif self.dest is None:
                raise RuntimeError("mpx ring corrupted: a continuation slot without a message")
            if length > self.chunk_bytes or self.dest_off + length > self.dest_total:
                raise RuntimeError("mpx ring corrupted: slot length exceeds the message")
            if length >= NOGIL_COPY:
                with nogil:
                    memcpy(self.dest_ptr + self.dest_off, slot + SLOT_HEADER, length)
            elif length:
                memcpy(self.dest_ptr + self.dest_off, slot + SLOT_HEADER, length)
            self.dest_off += length
            self._ack()
            if flags & F_END:
                d = self.dest
                self.dest = None
                self.resting = False
                return (ST_OK, self.dest_kind, d)

    cdef void _begin(self, uint32_t kind, uint64_t total) except *:
        self.dest = _owned_dest(kind, total, &self.dest_ptr)
        self.dest_kind = kind
        self.dest_off = 0
        self.dest_total = total



cdef class Assembler:
    """Builds one message of ``total`` bytes from consecutive pieces (the ZeroMQ reader's
    chunks) in memory the caller will own: bytes for K_PICKLE/K_BYTES, a bytearray
    otherwise, with huge-page advice when large, as the ring's reader does."""

    cdef object dest
    cdef char* ptr
    cdef uint64_t off, total

    def __init__(self, uint32_t kind, uint64_t total):
        self.dest = _owned_dest(kind, total, &self.ptr)
        self.off = 0
        self.total = total

    def add(self, const unsigned char[::1] piece):
        """Append ``piece``; ValueError if it would overrun the message."""
        cdef size_t n = piece.shape[0]
        if n > self.total - self.off:
            raise ValueError(f"a piece of {n} bytes overruns the message "
                             f"({self.off} of {self.total} bytes filled)")
        if n:
            with nogil:
                memcpy(self.ptr + self.off, &piece[0], n)
        self.off += n

    @property
    def complete(self):
        return self.off == self.total

    def result(self):
        """The message; ValueError unless every byte was added."""
        if self.off != self.total:
            raise ValueError(f"message incomplete: {self.off} of {self.total} bytes")
        d, self.dest = self.dest, None
        return d
