# The C types of mpx/transport/shm_end.py (Cython's pure-Python mode): compiled, the fields
# declared here are C fields and the methods C methods (cpdef: callable from Python too);
# where it is not compiled the .py runs as it reads, and this file plays no part. What each
# one does, the .py says.
cimport cython
from libc.stdint cimport int64_t, uint32_t, uint64_t

cdef int CLOSED
cdef tuple _CLOSED_READ


@cython.final
@cython.auto_pickle(False)
cdef class EndLock:
    cdef bytearray _gate
    cdef int _waiting
    cdef object _cond_lock
    cdef object _cond

    cpdef bint acquire(self) except -1
    cpdef release(self)
    cdef _wait(self)


@cython.final
@cython.auto_pickle(False)
cdef class WriterEnd:
    cdef object _ring
    cdef EndLock _lock
    cdef object _encode
    cdef bint _open

    cpdef int write(self, uint32_t kind, parts, int64_t deadline_ns,
                    int64_t total=*) except? -9
    cpdef int send(self, obj, int64_t deadline_ns=*) except? -9
    cpdef close(self)


@cython.final
@cython.auto_pickle(False)
cdef class ReaderEnd:
    cdef object _ring
    cdef EndLock _lock
    cdef object _decode
    cdef uint64_t _in_place_min
    cdef bint _open
    cdef readonly int64_t began_ns

    cpdef tuple recv(self, int64_t deadline_ns=*)
    cpdef tuple read_into(self, decode, uint64_t in_place_min, int64_t deadline_ns,
                          int64_t slice_ns)
    cpdef close(self)
