# C-level declarations of the shared-memory ring (layout: mpx/_ring_layout.pxi).
from libc.stdint cimport uint32_t, uint64_t, int64_t
from cpython.buffer cimport Py_buffer
from mpx.mechanism.waiting cimport AdaptiveWait

cdef extern from "_ring_sync.h" nogil:
    uint64_t mpx_load64(const uint64_t* p)
    void mpx_store64(uint64_t* p, uint64_t v)
    uint32_t mpx_load32(const uint32_t* p)
    void mpx_store32(uint32_t* p, uint32_t v)
    void mpx_bump32(uint32_t* p)
    int mpx_claim32(uint32_t* p)
    void mpx_fence()
    void mpx_relax()
    int64_t mpx_now_ns()
    void mpx_yield()
    int mpx_futex_wait(uint32_t* addr, uint32_t expected, int64_t timeout_ns)
    void mpx_futex_wake(uint32_t* addr)
    void mpx_wake_stamped(uint32_t* addr, uint64_t* woken_ns)
    int mpx_pidfd_open(int pid)
    int mpx_pidfd_exited(int fd)
    void mpx_close_fd(int fd)
    void mpx_set_flag(int* p)
    int mpx_get_flag(int* p)
    int mpx_take_flag(int* p)


cdef class _RingEnd(AdaptiveWait):    # (the wait policy's fields and steps: mpx/mechanism/waiting)
    cdef Py_buffer pybuf
    cdef bint has_buf
    cdef char* base
    cdef char* slots
    cdef uint64_t n_chunks
    cdef uint64_t chunk_bytes
    cdef uint64_t stride
    cdef uint64_t n_readers
    cdef uint64_t seq                # writer: next slot to publish; reader: next to read
    cdef int interrupted             # set by interrupt(): sticky
    cdef int nudged                  # set by nudge(): taken by the wait it ends
    cdef bint resting                # its last wait ran out its slice: the next parks at once
    cdef int64_t poll_ns
    cdef int* pidfds                 # writer: one per reader; reader: [writer]
    cdef int n_pidfds
    cdef uint32_t* futex             # the word this end parks on
    cdef uint32_t* parked            # set while it is parked, so the peer knows to wake it
    cdef uint32_t* gate              # it parks only while this word is 0 (NULL: no gate)
    cdef uint64_t* woken_ns          # when the peer last woke its futex word (the peer writes)
    cdef uint64_t* published_ns      # a reader: when the writer last published (else NULL)

    cdef int _map(self, buf, int64_t spin_ns, int64_t yield_ns, int64_t poll_ns,
                  bint writer) except -1
    cdef inline uint64_t* _u64(self, size_t off) noexcept nogil
    cdef inline uint32_t* _u32(self, size_t off) noexcept nogil
    cdef inline char* _slot(self, uint64_t seq) noexcept nogil
    cdef inline int _live(self) except -1
    cdef bint _ready(self) noexcept nogil
    cdef int _terminal(self) noexcept nogil
    cdef int _wait(self, int64_t deadline, int64_t slice_end) noexcept nogil
    cdef int _not_waiting(self) noexcept nogil
    cdef int _park(self, int64_t deadline, int64_t slice_end) noexcept nogil
    cdef int _await(self, int64_t deadline, int64_t slice_end) except? -9
    cdef void _wake_own(self) noexcept nogil
    cdef void _close_fds(self) noexcept


cdef class RingWriter(_RingEnd):
    cdef uint64_t min_read           # the readers' lowest read_seq when last looked at
    cdef bint partial                # a message was abandoned half-written
    cdef readonly int gone_index     # after PEER_GONE: which reader
    cdef public bint release_gone    # a reader gone is released, not PEER_GONE
    cdef readonly int released_gone  # how many readers were released so

    cdef bint _has_space(self, uint64_t need) noexcept nogil
    cdef int _await_space(self, int64_t deadline) except? -9
    cdef int _claim_slot(self, int64_t deadline) except? -9
    cdef void _publish(self, uint64_t length, uint32_t flags, uint32_t kind,
                       uint64_t total) noexcept nogil
    cdef void _wake_parked(self) noexcept nogil
    # (write(), at C level: mpx/transport/shm_primitives.pxd calls it)
    cdef int _write(self, uint32_t kind, parts, int64_t deadline_ns, int64_t total) except? -9
    cpdef bint has_room(self, pieces) except -1
    cpdef wake_readers(self)


cdef class RingReader(_RingEnd):
    cdef readonly int index
    cdef uint64_t* write_seq
    # the message being assembled
    cdef object dest
    cdef char* dest_ptr
    cdef uint64_t dest_off
    cdef uint32_t dest_kind
    cdef uint64_t dest_total
    cdef bint skipping               # the message being read could not be allocated
    cdef readonly uint64_t skipped_bytes  # after NO_MEMORY: the skipped message's size
    cdef readonly uint64_t bytes_read     # the payload bytes of every slot read so far

    cdef void _ack(self) noexcept nogil
    cdef void _drop_message(self) noexcept
    cdef tuple _read(self, int64_t deadline_ns, int64_t slice_end, bint keep_unallocated)
    # (read_with(), at C level: mpx/transport/shm_primitives.pxd calls it)
    cdef tuple _read_with(self, consume, uint64_t in_place_min, int64_t deadline_ns,
                          int64_t slice_ns)
