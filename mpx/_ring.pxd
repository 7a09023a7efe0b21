# C-level declarations of the shared-memory ring (see mpx/layout.py for the layout).
from libc.stdint cimport uint32_t, uint64_t, int64_t

cdef extern from "_ring_sync.h" nogil:
    uint64_t mpx_load64(const uint64_t* p)
    void mpx_store64(uint64_t* p, uint64_t v)
    uint32_t mpx_load32(const uint32_t* p)
    void mpx_store32(uint32_t* p, uint32_t v)
    void mpx_bump32(uint32_t* p)
    void mpx_fence()
    void mpx_relax()
    int64_t mpx_now_ns()
    void mpx_yield()
    int mpx_futex_wait(uint32_t* addr, uint32_t expected, int64_t timeout_ns)
    void mpx_futex_wake(uint32_t* addr)
    int mpx_pidfd_open(int pid)
    int mpx_pidfd_exited(int fd)
    void mpx_close_fd(int fd)
    void mpx_advise_huge(void* p, size_t n)
    void mpx_set_flag(int* p)
    int mpx_get_flag(int* p)


from cpython.buffer cimport Py_buffer

cdef class Ring:
    cdef Py_buffer pybuf
    cdef bint has_buf
    cdef char* base
    cdef char* slots
    cdef uint64_t n_chunks
    cdef uint64_t chunk_bytes
    cdef uint64_t stride
    cdef uint64_t n_readers
    cdef readonly int index          # reader index, or -1 for the writer
    cdef uint64_t seq                # writer: next slot to publish; reader: next to read
    cdef uint64_t min_read           # writer: last seen minimum of readers' read_seq
    cdef bint partial                # writer: a message was abandoned half-written
    cdef bint resting                # reader: its last wait ran out its slice (parks at once)
    cdef int interrupted
    cdef int64_t spin_ns
    cdef int64_t yield_ns
    cdef int64_t poll_ns
    cdef int* pidfds                 # writer: one per reader; reader: [writer]
    cdef int n_pidfds
    cdef readonly int gone_index     # after PEER_GONE on the writer: which reader
    # reader: the message being assembled
    cdef object dest
    cdef char* dest_ptr
    cdef uint64_t dest_off
    cdef uint32_t dest_kind
    cdef uint64_t dest_total

    cdef uint64_t* _u64(self, size_t off) nogil
    cdef uint32_t* _u32(self, size_t off) nogil
    cdef char* _slot(self, uint64_t seq) nogil
    cdef bint _has_space(self) nogil
    cdef int _check_readers(self) nogil
    cdef int _wait_space(self, int64_t deadline) nogil
    cdef int _claim_slot(self, int64_t deadline_ns) except? -9
    cdef int _wait_data(self, int64_t deadline, int64_t slice_end) nogil
    cdef int _next_published(self, int64_t deadline_ns, int64_t slice_ns) except? -9
    cdef int _reader_terminal(self) nogil
    cdef void _publish(self, uint32_t length, uint32_t flags, uint32_t kind,
                       uint64_t total) nogil
    cdef void _ack(self) nogil
    cdef void _begin(self, uint32_t kind, uint64_t total) except *
    cdef void _close_fds(self)
    cdef inline void _live(self) except *
