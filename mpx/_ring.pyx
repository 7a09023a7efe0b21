# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The shared-memory ring: slots, sequence numbers, atomics and waiting.

Mechanism only: no pickling, logging or policy. ``mpx/_ring_py.py`` is its pure-Python twin
with the same layout (``mpx/_ring_layout.pxi``, mirrored by ``mpx/mechanism/layout.py``) and
behaviour. Wait results are the status codes of ``mpx.mechanism.layout`` (OK, TIMEOUT, INTERRUPTED,
PEER_GONE, SHUTDOWN, SLICE, NUDGED, NO_MEMORY). A reader's read that stops before a message
is whole (any status but OK, or a signal handler's exception) keeps what it took of it: the
next read goes on with it. A message the reader cannot allocate memory for is skipped whole
(its slots go back to the writer), and the read that ends it returns NO_MEMORY, with its
size in ``skipped_bytes``.

A message's kind is opaque to the ring but for ``KIND_AS_BYTES``: a message whose kind has
that bit is delivered as ``bytes``, any other as a ``bytearray``.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.string cimport memcpy
from libc.stdlib cimport malloc, free
from libc.stdint cimport uint32_t, uint64_t, int64_t
from posix.unistd cimport getpid
from mpx.mechanism.waiting cimport adapt, judge, skips_yield, woke, yielded

from mpx.mechanism.buffers cimport owned_buffer

cdef extern from "Python.h":
    int PyErr_CheckSignals()
    int PyBUF_READ

include "_ring_layout.pxi"

cdef enum:
    # Copies at least this big run without the GIL; below it the release costs more than it gives.
    NOGIL_COPY = 65536
    # Pause instructions between two looks at the ring while spinning (the wait policy's
    # constants are mpx/mechanism/waiting.py's).
    SPIN_BATCH = 64
    # _terminal(): no reason to stop waiting
    NOT_TERMINAL = -1
    # _wait(): a Python signal handler raised while parked; the exception propagates
    SIGNALLED = -2
    WOKEN = -3  # a park woken by the peer with nothing to take yet (RingWriter.wake_readers)

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


cdef int _signal_pending() noexcept nogil:
    """Run this thread's pending Python signal handlers; 1 if one raised (left set)."""
    with gil:
        return 1 if PyErr_CheckSignals() != 0 else 0


cdef int _propagate() except -1:
    return -1  # the exception a signal handler raised is already set


cdef inline int64_t _slice_end(int64_t slice_ns) noexcept nogil:
    """When a slice of ``slice_ns`` from now ends (-1: no slice)."""
    return mpx_now_ns() + slice_ns if slice_ns >= 0 else -1


cdef class _RingEnd:
    """What the writer and reader ends of a ring segment share: the mapped segment, its
    geometry, and the one wait both use (spin, then ``sched_yield``, then a futex park).

    Not built directly: see RingWriter and RingReader. ``buf`` is the whole segment (a
    writable buffer, e.g. an mmap) with its header written. Waits spin for ``spin_ns``,
    call ``sched_yield`` for the yield budget, then park on a futex, waking every
    ``poll_ns`` to check that the peer is alive.

    How long it yields, and whether it spins and yields at all, is the adaptive wait policy
    of mpx/mechanism/waiting.py (its fields, ``yield_budget_ns``, ``parks_first``... are
    this end's, inherited from ``AdaptiveWait``; its steps are called here without the
    GIL). A reader judges the host by how late after the writer published (stamped in the
    segment) a yield found a message, and measures a wake's cost from the writer's wake
    (stamped too) to its running after a park. A writer waiting for room keeps the fixed
    policy.
    """

    def __cinit__(self):
        self.has_buf = False
        self.pidfds = NULL
        self.n_pidfds = 0

    def __dealloc__(self):
        self._close_fds()
        if self.has_buf:
            PyBuffer_Release(&self.pybuf)
            self.has_buf = False

    cdef int _map(self, buf, int64_t spin_ns, int64_t yield_ns, int64_t poll_ns,
                  bint writer) except -1:
        """Take ``buf``'s buffer and geometry, with one pidfd slot per peer (the writer
        watches every reader, a reader the writer)."""
        cdef int i, n
        cdef uint64_t slots_off
        if self.has_buf:
            raise ValueError("ring end already initialised")
        PyObject_GetBuffer(buf, &self.pybuf, PyBUF_WRITABLE)
        self.has_buf = True
        self.base = <char*>self.pybuf.buf
        self.chunk_bytes = self._u64(OFF_CHUNK_BYTES)[0]
        self.n_chunks = self._u64(OFF_N_CHUNKS)[0]
        self.n_readers = self._u64(OFF_N_READERS)[0]
        self.stride = self._u64(OFF_SLOT_STRIDE)[0]
        slots_off = OFF_READERS + READER_BLOCK * self.n_readers
        slots_off = (slots_off + SLOTS_ALIGN - 1) // SLOTS_ALIGN * SLOTS_ALIGN
        if <uint64_t>self.pybuf.len < slots_off + self.stride * self.n_chunks:
            raise ValueError("ring buffer is smaller than its header's geometry")
        self.slots = self.base + slots_off
        self._init_waiting(spin_ns, yield_ns)
        self.poll_ns = poll_ns
        self.interrupted = 0
        self.nudged = 0
        self.resting = False
        n = <int>self.n_readers if writer else 1
        self.pidfds = <int*>malloc(sizeof(int) * (n + 1))
        if self.pidfds == NULL:
            raise MemoryError()
        self.n_pidfds = n
        for i in range(n):
            self.pidfds[i] = -1
        return 0

    cdef void _close_fds(self) noexcept:
        cdef int i
        if self.pidfds != NULL:
            for i in range(self.n_pidfds):
                mpx_close_fd(self.pidfds[i])
            free(self.pidfds)
            self.pidfds = NULL
            self.n_pidfds = 0

    def release(self):
        """Drop the buffer export and pidfds; the ring end is unusable afterwards."""
        self._close_fds()
        if self.has_buf:
            PyBuffer_Release(&self.pybuf)
            self.has_buf = False
        self.base = NULL

    cdef inline uint64_t* _u64(self, size_t off) noexcept nogil:
        return <uint64_t*>(self.base + off)

    cdef inline uint32_t* _u32(self, size_t off) noexcept nogil:
        return <uint32_t*>(self.base + off)

    cdef inline char* _slot(self, uint64_t seq) noexcept nogil:
        return self.slots + (seq % self.n_chunks) * self.stride

    cdef inline int _live(self) except -1:
        if not self.has_buf:
            raise ValueError("ring was released")
        return 0

    # ---------------------------------------------------------------- waiting

    cdef bint _ready(self) noexcept nogil:
        """Whether the wait is over (the writer: a free slot; a reader: a published one)."""
        return False

    cdef int _terminal(self) noexcept nogil:
        """Why to stop waiting although not _ready(), or NOT_TERMINAL."""
        return NOT_TERMINAL

    cdef int _wait(self, int64_t deadline, int64_t slice_end) noexcept nogil:
        """Wait until _ready(), _terminal() says why not, ``deadline`` (-1: none) passes,
        ``slice_end`` (-1: none) passes (SLICE; after a park the next wait then parks at
        once), or nudge() (NUDGED). A park that a signal interrupted returns SLICE too;
        SIGNALLED if a handler raised. A park that the peer ends with nothing to take (a
        wake ahead of the data) spins and yields again before it parks again. A deadline
        already past waits for nothing (and leaves a nudge for a wait).

        No wake-up is lost: the end announces it is parked and then re-checks, and the peer
        publishes and then looks for parked ends (with a full fence on each side)."""
        cdef int64_t t0, now, start, took
        cdef int k, st
        cdef bint skip = False
        t0 = mpx_now_ns()
        now = start = t0
        if deadline >= 0 and now >= deadline:
            return self._not_waiting()
        if self.resting:
            self.resting = False
            skip = True
        else:
            skip = skips_yield(self)
        while True:
            while not skip and now - t0 < self.spin_ns:
                for k in range(SPIN_BATCH):
                    if self._ready():
                        return OK
                    mpx_relax()
                if mpx_take_flag(&self.nudged):
                    return NUDGED
                now = mpx_now_ns()
            while not skip and now - t0 < self.spin_ns + self.yield_budget_ns:
                mpx_yield()
                took = mpx_now_ns() - now
                now += took
                yielded(self, took)
                if self._ready():
                    if self.published_ns != NULL:
                        judge(self, now - <int64_t>mpx_load64(self.published_ns))
                    return OK
                if mpx_get_flag(&self.interrupted):
                    return INTERRUPTED
                if mpx_take_flag(&self.nudged):
                    return NUDGED
                if deadline >= 0 and now >= deadline:
                    return TIMEOUT
                if slice_end >= 0 and now >= slice_end:
                    return SLICE
            st = self._park(deadline, slice_end)
            if st != WOKEN:
                adapt(self, mpx_now_ns() - start, st == OK)
                return st
            now = mpx_now_ns()
            t0 = now
            skip = self.parks_first  # (a wake ahead of the message: it is near)

    cdef int _not_waiting(self) noexcept nogil:
        """Why a wait whose deadline has passed stops at once: _terminal(), or TIMEOUT."""
        cdef int st = self._terminal()
        return TIMEOUT if st == NOT_TERMINAL else st

    cdef int _park(self, int64_t deadline, int64_t slice_end) noexcept nogil:
        """_wait()'s last stage: park on the futex (waking every poll_ns) until _ready(),
        _terminal(), a nudge, the deadline, the slice's end, a signal, or WOKEN."""
        cdef int64_t now, until
        cdef int st, signalled
        cdef uint32_t v
        cdef uint64_t woken
        while True:
            if _signal_pending():
                return SIGNALLED
            st = self._terminal()
            if st != NOT_TERMINAL:
                return st
            if mpx_take_flag(&self.nudged):
                return NUDGED
            now = mpx_now_ns()
            if deadline >= 0 and now >= deadline:
                return TIMEOUT
            if slice_end >= 0 and now >= slice_end:
                self.resting = True
                return SLICE
            until = now + self.poll_ns
            if deadline >= 0 and deadline < until:
                until = deadline
            if slice_end >= 0 and slice_end < until:
                until = slice_end
            v = mpx_load32(self.futex)
            mpx_store32(self.parked, 1)
            mpx_fence()
            if self._ready():
                mpx_store32(self.parked, 0)
                return OK
            signalled = 0
            if (self.gate == NULL or mpx_load32(self.gate) == 0) and \
                    not mpx_get_flag(&self.interrupted) and not mpx_get_flag(&self.nudged):
                signalled = mpx_futex_wait(self.futex, v, until - now)
            mpx_store32(self.parked, 0)
            if self._ready():
                woken = mpx_load64(self.woken_ns)
                if woken >= <uint64_t>now:  # (the peer woke this park: what did it cost?)
                    woke(self, mpx_now_ns() - <int64_t>woken)
                return OK
            if mpx_take_flag(&self.nudged):
                return NUDGED
            if signalled:
                return SLICE
            if mpx_load32(self.futex) != v and self._terminal() == NOT_TERMINAL and \
                    not mpx_get_flag(&self.interrupted):
                return WOKEN

    cdef int _await(self, int64_t deadline, int64_t slice_end) except? -9:
        """_wait() without the GIL, unless already _ready(); a signal handler's exception
        propagates."""
        cdef int st
        if self._ready():
            return OK
        with nogil:
            st = self._wait(deadline, slice_end)
        if st == SIGNALLED:
            _propagate()
        return st

    # ---------------------------------------------------------------- state

    def interrupt(self):
        """Wake this process's waiters on this end: they return INTERRUPTED (sticky)."""
        self._live()
        mpx_set_flag(&self.interrupted)
        self._wake_own()

    cdef void _wake_own(self) noexcept nogil:
        """Wake the ends parked on this end's futex word, to look at their flags."""
        mpx_bump32(self.futex)
        mpx_futex_wake(self.futex)

    def state(self):
        """The segment's state bits (S_SHUTDOWN, S_CLOSED)."""
        self._live()
        return mpx_load32(self._u32(OFF_STATE))

    def readers(self):
        """``(pid, attached, closed, read_seq)`` of every reader block."""
        self._live()
        cdef uint64_t i
        cdef size_t blk
        out = []
        for i in range(self.n_readers):
            blk = OFF_READERS + READER_BLOCK * i
            out.append((mpx_load64(self._u64(blk + RB_PID)),
                        bool(mpx_load32(self._u32(blk + RB_ATTACHED))),
                        bool(mpx_load32(self._u32(blk + RB_CLOSED))),
                        mpx_load64(self._u64(blk + RB_READ_SEQ))))
        return out

    def all_attached(self):
        """Whether every reader has attached."""
        self._live()
        cdef uint64_t i
        for i in range(self.n_readers):
            if not mpx_load32(self._u32(OFF_READERS + READER_BLOCK * i + RB_ATTACHED)):
                return False
        return True

    @property
    def seq_number(self):
        """Writer: slots published; reader: slots consumed."""
        return self.seq

    def published(self):
        """Slots the writer has published so far."""
        self._live()
        return mpx_load64(self._u64(OFF_WRITE_SEQ))

    def payload_offset(self):
        """Offset in the segment of the payload of slot ``seq_number`` (the slot the writer
        fills next, or the one a reader reads next)."""
        self._live()
        return <size_t>(self._slot(self.seq) - self.base) + SLOT_HEADER


cdef class RingWriter(_RingEnd):
    """The writer end of a ring segment (see _RingEnd for ``buf`` and the wait times)."""

    def __cinit__(self):
        self.gone_index = -1
        self.release_gone = False
        self.released_gone = 0

    def __init__(self, buf, int64_t spin_ns=0, int64_t yield_ns=1000000,
                 int64_t poll_ns=100000000):
        self._map(buf, spin_ns, yield_ns, poll_ns, True)
        self.seq = mpx_load64(self._u64(OFF_WRITE_SEQ))
        self.min_read = 0
        self.partial = False
        self.futex = self._u32(OFF_SPACE_FUTEX)
        self.parked = self._u32(OFF_WRITER_PARKED)
        self.woken_ns = self._u64(OFF_SPACE_WOKEN)
        self.published_ns = NULL
        self.gate = NULL

    def set_state(self, uint32_t bits):
        """Set S_SHUTDOWN/S_CLOSED bits in the segment and wake every parked reader."""
        self._live()
        cdef uint32_t* state = self._u32(OFF_STATE)
        mpx_store32(state, mpx_load32(state) | bits)
        mpx_fence()
        mpx_bump32(self._u32(OFF_DATA_FUTEX))
        mpx_futex_wake(self._u32(OFF_DATA_FUTEX))

    cdef bint _has_space(self, uint64_t need) noexcept nogil:
        """Whether ``need`` slots are free; the readers' positions are read only when the
        last ones seen say no (they only move on)."""
        cdef uint64_t m, r, i
        if self.seq - self.min_read + need <= self.n_chunks:
            return True
        m = self.seq
        for i in range(self.n_readers):
            r = mpx_load64(self._u64(OFF_READERS + READER_BLOCK * i + RB_READ_SEQ))
            if r < m and not mpx_load32(self._u32(OFF_READERS + READER_BLOCK * i + RB_RELEASED)):
                m = r
        self.min_read = m
        return self.seq - m + need <= self.n_chunks

    cdef bint _ready(self) noexcept nogil:
        return self._has_space(1)

    cdef int _terminal(self) noexcept nogil:
        """INTERRUPTED, or PEER_GONE (with gone_index) if a reader that holds up the
        writer closed or died; with ``release_gone``, such a reader is released instead
        (as release_reader does) and the wait goes on."""
        cdef uint64_t i
        cdef size_t blk
        cdef int pid
        if mpx_get_flag(&self.interrupted):
            return INTERRUPTED
        for i in range(self.n_readers):
            blk = OFF_READERS + READER_BLOCK * i
            if self.seq - mpx_load64(self._u64(blk + RB_READ_SEQ)) < self.n_chunks or \
                    mpx_load32(self._u32(blk + RB_RELEASED)):
                continue
            if not mpx_load32(self._u32(blk + RB_CLOSED)):
                if self.pidfds[i] == -1:
                    pid = <int>mpx_load64(self._u64(blk + RB_PID))
                    if pid:
                        self.pidfds[i] = mpx_pidfd_open(pid)
                if not mpx_pidfd_exited(self.pidfds[i]):
                    continue
            if not self.release_gone:
                self.gone_index = <int>i
                return PEER_GONE
            mpx_store32(self._u32(blk + RB_RELEASED), 1)
            mpx_store64(self._u64(blk + RB_READ_SEQ), self.seq)
            mpx_fence()
            self.released_gone += 1
        return NOT_TERMINAL

    cdef int _await_space(self, int64_t deadline) except? -9:
        """Wait for a free slot; a park that a signal interrupted (its handler did not
        raise) waits on."""
        cdef int st = SLICE
        while st == SLICE:
            st = self._await(deadline, -1)
        return st

    def release_reader(self, int index):
        """Free the slots reader ``index`` has not read, for good: its process is gone and
        the group re-forms its queue without it. From now on that reader holds the writer
        up no more (a message larger than the ring, the one that tells the others where to
        go, streams past it), until ``reopen_reader`` gives its place to a new process."""
        cdef size_t blk
        self._live()
        if index < 0 or <uint64_t>index >= self.n_readers:
            raise ValueError(f"reader index {index} out of range for {self.n_readers} readers")
        blk = OFF_READERS + READER_BLOCK * index
        mpx_store32(self._u32(blk + RB_RELEASED), 1)
        mpx_store64(self._u64(blk + RB_READ_SEQ), self.seq)
        mpx_fence()

    def reopen_reader(self, int index):
        """Give reader ``index``'s place to a new process: the one that attached as that
        reader is gone (it died while it started) and read nothing the writer still needs.
        The next process to attach as ``index`` reads from the writer's position on."""
        cdef size_t blk
        self._live()
        if index < 0 or <uint64_t>index >= self.n_readers:
            raise ValueError(f"reader index {index} out of range for {self.n_readers} readers")
        blk = OFF_READERS + READER_BLOCK * index
        mpx_close_fd(self.pidfds[index])
        self.pidfds[index] = -1
        mpx_store64(self._u64(blk + RB_READ_SEQ), self.seq)
        mpx_store64(self._u64(blk + RB_PID), 0)
        mpx_store32(self._u32(blk + RB_CLOSED), 0)
        mpx_store32(self._u32(blk + RB_PARKED), 0)
        mpx_store32(self._u32(blk + RB_RELEASED), 0)
        mpx_fence()
        mpx_store32(self._u32(blk + RB_ATTACHED), 0)  # last: the place is free once this shows
        mpx_fence()

    def free_slots(self):
        """Slots the writer can fill now without waiting for any reader."""
        self._live()
        self._has_space(self.n_chunks + 1)  # never true: refreshes min_read
        return self.n_chunks - (self.seq - self.min_read)

    cpdef bint has_room(self, pieces) except -1:
        """Whether a message of ``pieces`` (buffers to concatenate) could be written now
        without waiting for a reader; one larger than the ring streams through it, and
        needs every slot free."""
        cdef uint64_t size = 0, need
        self._live()
        for p in pieces:
            if type(p) is bytes:
                size += len(<bytes>p)
            else:
                size += memoryview(p).nbytes
        need = (size + self.chunk_bytes - 1) // self.chunk_bytes
        if need < 1:
            need = 1
        elif need > self.n_chunks:
            need = self.n_chunks
        return self._has_space(need)

    cdef void _publish(self, uint64_t length, uint32_t flags, uint32_t kind,
                       uint64_t total) noexcept nogil:
        cdef char* slot = self._slot(self.seq)
        cdef uint64_t i
        (<uint64_t*>(slot + SH_LENGTH))[0] = length
        (<uint32_t*>(slot + SH_FLAGS))[0] = flags
        (<uint32_t*>(slot + SH_KIND))[0] = kind
        (<uint64_t*>(slot + SH_TOTAL))[0] = total
        self.seq += 1
        mpx_store64(self._u64(OFF_PUBLISHED_NS), <uint64_t>mpx_now_ns())
        mpx_store64(self._u64(OFF_WRITE_SEQ), self.seq)
        mpx_fence()
        self._wake_parked()

    cdef void _wake_parked(self) noexcept nogil:
        """Wake the readers if one is parked (all share one futex word)."""
        cdef uint64_t i
        for i in range(self.n_readers):
            if mpx_load32(self._u32(OFF_READERS + READER_BLOCK * i + RB_PARKED)):
                mpx_wake_stamped(self._u32(OFF_DATA_FUTEX), self._u64(OFF_DATA_WOKEN))
                break

    cpdef wake_readers(self):
        """Wake the parked readers ahead of a message (they spin and yield again, and park
        again if none comes within their yield time): their wake-up, tens of microseconds
        on a VM, then overlaps the work of making the message. Costs nothing when no
        reader is parked, nor once the ring was released. A hint, so no fence: a reader
        that parks just after this looks is woken by the message's publish, which fences."""
        if self.base == NULL:
            return
        self._wake_parked()

    cdef int _claim_slot(self, int64_t deadline) except? -9:
        """Wait for the next free slot, first aborting a message that a failed write left
        half-written."""
        cdef int st
        if self.partial:
            st = self._await_space(deadline)
            if st != OK:
                return st
            self._publish(0, F_ABORT, 0, 0)
            self.partial = False
        return self._await_space(deadline)

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
        return self._write(kind, parts, deadline_ns, total)

    cdef int _write(self, uint32_t kind, parts, int64_t deadline_ns, int64_t total) except? -9:
        self._live()
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
        if st != OK:
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
                        self._publish(off, F_BEGIN if first else 0, kind, length)
                        first = False
                        self.partial = True
                        off = 0
                        st = self._await_space(deadline_ns)
                        if st != OK:
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
        self._publish(off, (F_BEGIN if first else 0) | F_END, kind, length)
        self.partial = False
        return OK

    def begin_slot(self, int64_t deadline_ns=-1):
        """Wait until the next slot is free (aborting a message a failed write left
        half-written). On OK the caller fills ``payload_offset()`` and calls commit_slot."""
        self._live()
        return self._claim_slot(deadline_ns)

    def commit_slot(self, uint64_t length, uint32_t kind):
        """Publish the slot begin_slot made ready as a whole message of ``length`` bytes
        of ``kind``."""
        self._live()
        if length > self.chunk_bytes:
            raise ValueError(f"slot length {length} exceeds the slot size {self.chunk_bytes}")
        self._publish(length, F_BEGIN | F_END, kind, length)


cdef class RingReader(_RingEnd):
    """Reader ``index`` of a ring segment; building it attaches that reader (ValueError if
    another already did). See _RingEnd for ``buf`` and the wait times."""

    def __init__(self, buf, int index, int64_t spin_ns=0, int64_t yield_ns=1000000,
                 int64_t poll_ns=100000000):
        cdef size_t blk
        self._map(buf, spin_ns, yield_ns, poll_ns, False)
        if index < 0 or <uint64_t>index >= self.n_readers:
            raise ValueError(f"reader index {index} out of range for {self.n_readers} readers")
        blk = OFF_READERS + READER_BLOCK * index
        if not mpx_claim32(self._u32(blk + RB_ATTACHED)):
            raise ValueError(f"reader {index} is already attached to this ring")
        mpx_store64(self._u64(blk + RB_PID), <uint64_t>getpid())
        mpx_fence()
        self.index = index
        self.seq = mpx_load64(self._u64(blk + RB_READ_SEQ))
        self.write_seq = self._u64(OFF_WRITE_SEQ)
        self.futex = self._u32(OFF_DATA_FUTEX)
        self.parked = self._u32(blk + RB_PARKED)
        self.woken_ns = self._u64(OFF_DATA_WOKEN)
        self.published_ns = self._u64(OFF_PUBLISHED_NS)
        self.gate = self._u32(OFF_STATE)
        self.pidfds[0] = mpx_pidfd_open(<int>self._u64(OFF_WRITER_PID)[0])

    def release(self):
        """Drop the buffer export and pidfds; the ring end is unusable afterwards."""
        self._drop_message()
        _RingEnd.release(self)

    cdef void _drop_message(self) noexcept:
        """Forget the message being assembled (or skipped)."""
        self.dest = None
        self.skipping = False

    def mark_closed(self):
        """Tell the writer this reader is gone, waking it if it waits for space."""
        self._live()
        mpx_store32(self._u32(OFF_READERS + READER_BLOCK * self.index + RB_CLOSED), 1)
        mpx_fence()
        mpx_bump32(self._u32(OFF_SPACE_FUTEX))
        mpx_futex_wake(self._u32(OFF_SPACE_FUTEX))

    def nudge(self):
        """End the wait of this process's read on this end, now or, if none waits, the
        next read's that would wait: it returns NUDGED, having consumed nothing (a read in
        the middle of a message keeps it). Once: the wait it ends takes it. From any
        thread; the other readers parked on the ring wake too, and park again."""
        self._live()
        mpx_set_flag(&self.nudged)
        self._wake_own()

    cdef bint _ready(self) noexcept nogil:
        return mpx_load64(self.write_seq) > self.seq

    cdef int _terminal(self) noexcept nogil:
        """INTERRUPTED, or once the writer shut down, closed or died: OK while it left
        something unread, then SHUTDOWN or PEER_GONE."""
        cdef uint32_t state
        if mpx_get_flag(&self.interrupted):
            return INTERRUPTED
        state = mpx_load32(self.gate)
        if state == 0 and not mpx_pidfd_exited(self.pidfds[0]):
            return NOT_TERMINAL
        if mpx_load64(self.write_seq) > self.seq:
            return OK
        if state & S_SHUTDOWN:
            return SHUTDOWN
        return PEER_GONE

    cdef void _ack(self) noexcept nogil:
        self.bytes_read += (<uint64_t*>(self._slot(self.seq) + SH_LENGTH))[0]
        self.seq += 1
        mpx_store64(self._u64(OFF_READERS + READER_BLOCK * self.index + RB_READ_SEQ), self.seq)
        mpx_fence()
        if mpx_load32(self._u32(OFF_WRITER_PARKED)):
            mpx_wake_stamped(self._u32(OFF_SPACE_FUTEX), self._u64(OFF_SPACE_WOKEN))

    def next_slot(self, int64_t deadline_ns=-1, int64_t slice_ns=-1):
        """Wait for the next slot: ``(status, length, kind)``. On OK its payload (at
        ``payload_offset()``) stays the reader's until release_slot(). Aborted slots are
        skipped. ValueError, leaving the slot unread, when the next message spans several
        slots, or in the middle of one that read() left early."""
        self._live()
        if self.dest is not None or self.skipping:
            raise ValueError("next_slot() in the middle of a multi-slot message")
        cdef char* slot
        cdef int st
        cdef uint32_t flags
        cdef int64_t slice_end = _slice_end(slice_ns)
        while True:
            st = self._await(deadline_ns, slice_end)
            if st != OK:
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
            return (OK, (<uint64_t*>(slot + SH_LENGTH))[0], (<uint32_t*>(slot + SH_KIND))[0])

    def release_slot(self):
        """Hand the slot next_slot returned back to the writer."""
        self._live()
        if mpx_load64(self.write_seq) <= self.seq:
            raise ValueError("release_slot() without a slot")
        self._ack()

    def read(self, int64_t deadline_ns=-1, int64_t slice_ns=-1):
        """Receive the next message: ``(status, kind, data)``.

        ``data`` is owned by the caller (bytes if ``kind`` has KIND_AS_BYTES, else a
        bytearray) and never aliases the ring. With ``slice_ns >= 0`` a wait still
        unfinished ``slice_ns`` after the call returns SLICE, and so does a park that a
        signal interrupted (so Python can run its handler). The deadline, the slice, a
        nudge and an interrupt end the wait for each slot of a message too: calling again
        resumes the message. A message whose memory cannot be allocated is skipped: the
        read that ends it returns ``(NO_MEMORY, kind, None)``, its size in skipped_bytes.
        """
        return self._read(deadline_ns, _slice_end(slice_ns), False)

    cdef tuple _read(self, int64_t deadline_ns, int64_t slice_end, bint keep_unallocated):
        """read(); with ``keep_unallocated``, a message whose memory cannot be allocated
        is left unread (NO_MEMORY, nothing consumed) instead of skipped."""
        self._live()
        cdef char* slot
        cdef uint64_t length, total
        cdef uint32_t flags, kind
        cdef int st
        cdef object d
        while True:
            st = self._await(deadline_ns, slice_end)
            if st != OK:
                if st == SHUTDOWN or st == PEER_GONE:
                    self._drop_message()
                return (st, 0, None)
            slot = self._slot(self.seq)
            length = (<uint64_t*>(slot + SH_LENGTH))[0]
            flags = (<uint32_t*>(slot + SH_FLAGS))[0]
            kind = (<uint32_t*>(slot + SH_KIND))[0]
            total = (<uint64_t*>(slot + SH_TOTAL))[0]
            if flags & F_ABORT:
                self._drop_message()
                self._ack()
                continue
            if flags & F_BEGIN:
                self._drop_message()
                try:
                    self.dest = owned_buffer(kind & KIND_AS_BYTES, total, &self.dest_ptr)
                except MemoryError:
                    if keep_unallocated:
                        return (NO_MEMORY, 0, None)
                    self.skipping = True
                self.dest_kind = kind
                self.dest_off = 0
                self.dest_total = total
            elif self.dest is None and not self.skipping:
                raise RuntimeError("mpx ring corrupted: a continuation slot without a message")
            if length > self.chunk_bytes or self.dest_off + length > self.dest_total:
                raise RuntimeError("mpx ring corrupted: slot length exceeds the message")
            if self.skipping:
                pass
            elif length >= NOGIL_COPY:
                with nogil:
                    memcpy(self.dest_ptr + self.dest_off, slot + SLOT_HEADER, length)
            elif length:
                memcpy(self.dest_ptr + self.dest_off, slot + SLOT_HEADER, length)
            self.dest_off += length
            self._ack()
            if flags & F_END:
                self.resting = False
                if self.skipping:
                    self.skipping = False
                    self.skipped_bytes = self.dest_total
                    return (NO_MEMORY, self.dest_kind, None)
                d = self.dest
                self.dest = None
                return (OK, self.dest_kind, d)

    def read_with(self, consume, uint64_t in_place_min, int64_t deadline_ns=-1,
                  int64_t slice_ns=-1):
        """read(), handing the message to ``consume(kind, data)``: ``(status, kind, what
        consume returned)``. A message in one slot, of a KIND_AS_BYTES kind and at least
        ``in_place_min`` bytes, is lent without a copy: ``data`` is a read-only memoryview
        of the slot, released when consume returns (or raises: the exception propagates),
        and the slot goes back to the writer then. consume must keep nothing that refers
        to it: a buffer it took of the view is caught (RuntimeError), a memoryview made
        from it is not. Any other message: ``data`` is read()'s owned copy. A message that
        cannot be allocated is skipped, as read() skips it, and consume is not called."""
        return self._read_with(consume, in_place_min, deadline_ns, slice_ns)

    cdef tuple _read_with(self, consume, uint64_t in_place_min, int64_t deadline_ns,
                          int64_t slice_ns):
        self._live()
        cdef char* slot
        cdef uint64_t length
        cdef uint32_t flags, kind
        cdef int st
        cdef object view, out
        cdef char* ptr
        cdef int64_t slice_end = _slice_end(slice_ns)
        if self.dest is None and not self.skipping:  # (not in the middle of a message)
            while True:
                st = self._await(deadline_ns, slice_end)
                if st != OK:
                    return (st, 0, None)
                slot = self._slot(self.seq)
                flags = (<uint32_t*>(slot + SH_FLAGS))[0]
                if not flags & F_ABORT:
                    break
                self._ack()
            length = (<uint64_t*>(slot + SH_LENGTH))[0]
            kind = (<uint32_t*>(slot + SH_KIND))[0]
            if flags & (F_BEGIN | F_END) == (F_BEGIN | F_END) and kind & KIND_AS_BYTES:
                if length > self.chunk_bytes:
                    raise RuntimeError("mpx ring corrupted: slot length exceeds the message")
                if length < in_place_min:  # the common small message: copied, as read() does
                    try:
                        out = owned_buffer(True, length, &ptr)
                    except MemoryError:
                        self._ack()
                        self.skipped_bytes = length
                        return (NO_MEMORY, kind, None)
                    if length >= NOGIL_COPY:
                        with nogil:
                            memcpy(ptr, slot + SLOT_HEADER, length)
                    elif length:
                        memcpy(ptr, slot + SLOT_HEADER, length)
                    self._ack()
                    self.resting = False
                    return (OK, kind, consume(kind, out))
                view = PyMemoryView_FromMemory(slot + SLOT_HEADER, length, PyBUF_READ)
                try:
                    out = consume(kind, view)
                finally:
                    self._ack()
                    self.resting = False
                    try:
                        view.release()
                    except BufferError:
                        raise RuntimeError("read_with: consume kept a view of the ring slot") \
                            from None
                return (OK, kind, out)
        st, kind, out = self._read(deadline_ns, slice_end, False)
        if st != OK:
            return (st, kind, out)
        return (OK, kind, consume(kind, out))

    def read_ready(self):
        """Every message published whole now, without waiting for anything:
        ``(status, [(kind, data), ...])``. The status is OK, or why reading stopped
        (SHUTDOWN, PEER_GONE, INTERRUPTED) after the messages in the list, or NO_MEMORY
        with an empty list: the first message could not be allocated and was skipped (one
        met after others is left for the next call). Of a message whose later slots are
        still being written, the slots published are taken and kept: the next read goes on
        with it. Leaves a nudge for a wait. One call for a batch of replies."""
        cdef list out = []
        while mpx_load64(self.write_seq) > self.seq:
            # (a deadline past: no wait, for any slot)
            st, kind, data = self._read(0, -1, len(out) > 0)
            if st != OK:
                return (OK if st == TIMEOUT or out and st == NO_MEMORY else st, out)
            out.append((kind, data))
        return (OK, out)
