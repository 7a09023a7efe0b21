# The C types of mpx/mechanism/codec.py, which this file augments when Cython compiles it
# (plain Python never reads it). The values and the reasons of the constants are in the
# .py; the primitives it reaches memory with are mpx/mechanism/buffers.pxd's.
cimport cython
from libc.stdint cimport uint64_t

cdef Py_ssize_t FRESH_MEMO_BYTES, CHUNK_REFS
cdef unsigned char SMALL_NONE, SMALL_FALSE, SMALL_TRUE, SMALL_INT, SMALL_FLOAT
cdef unsigned char SMALL_STR, SMALL_BYTES, SMALL_TUPLE
cdef Py_ssize_t SMALL_MAX_BYTES, SMALL_MAX_LEN, SMALL_MAX_DEPTH

cdef class Assembler:
    cdef object dest
    cdef uint64_t off, total
    cdef bint as_bytes

    cdef _fits(self, uint64_t n)


cdef class Sink:
    cdef readonly list parts, oob
    cdef readonly Py_ssize_t size, big

    @cython.locals(n=Py_ssize_t)
    cpdef write(self, b)
    @cython.locals(t=type, last=Py_ssize_t, m=Py_ssize_t, head=Py_ssize_t)
    cdef bint _out_of_band(self, b, Py_ssize_t n, Py_ssize_t refs) except -1
    @cython.locals(large=bint)
    cdef tuple _dump(self, pickler, dump, clear_memo, obj)
    cpdef reset(self)


cdef class _RefProbe(Sink):
    cdef readonly list seen

    cdef bint _out_of_band(self, b, Py_ssize_t n, Py_ssize_t refs) except -1


cdef class _Kept:
    cdef Sink sink
    cdef object pickler, dump, clear_memo, seen
    cdef bint busy


cdef class Encoder:
    cdef readonly Py_ssize_t oob_min_bytes
    cdef readonly bint small_tuples
    cdef readonly object bytes_kind, small_kind, pickle_kind, oob_kind
    cdef object _local
    cdef dict _modules, _registered

    @cython.locals(k=_Kept)
    cpdef encode(self, obj, bint local_only=*)
    @cython.locals(k=_Kept, kept=list, old=_Kept, i=Py_ssize_t)
    cpdef keep(self, obj, pickler, Sink sink, bint local_only, bint with_torch, seen)
    cpdef dump(self, obj, pickler, Sink sink)
    cdef tuple _pickled(self, _Kept k, obj)
    cdef tuple _message(self, Sink sink, tuple parts)


cdef tuple _framed(Sink sink)


cdef class Decoder:
    cdef readonly object bytes_kind, small_kind, pickle_kind, oob_kind
    cdef readonly object error, passthrough

    cpdef decode(self, kind, data)
    cdef object _undecodable(self, BaseException e)


cdef object _unframed(data)


@cython.locals(buf=cython.p_char, n=Py_ssize_t)
cdef object _small_bytes(tuple obj)

@cython.locals(n=Py_ssize_t, k=type, room=Py_ssize_t)
cdef Py_ssize_t _put_tuple(tuple t, char* buf, Py_ssize_t pos, int depth) except -2

cdef object _small_decode(data)

@cython.locals(t=tuple, at=Py_ssize_t)
cdef object _small_tuple(const unsigned char* p, Py_ssize_t end)  # (a buffers.Reader)

@cython.locals(i=Py_ssize_t, tag=cython.uchar, m=Py_ssize_t, inner=tuple)
cdef Py_ssize_t _get_items(const unsigned char* p, Py_ssize_t at, Py_ssize_t end, Py_ssize_t n,
                           int depth, tuple items) except -1
