# The C bodies of mpx/mechanism/buffers.py's primitives, written once here as cdef inline
# functions (no extension of their own: each module that cimports them compiles them in).
# mpx/mechanism/codec.py cimports them where it is compiled and imports buffers.py where it
# is not; mpx/_ring.pyx cimports owned_buffer. What each does, and the constants' values
# and reasons, are in the .py; tests/test_serde.py holds the two to the same values.
from cpython.buffer cimport Py_buffer, PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport (
    PyByteArray_AS_STRING,
    PyByteArray_FromStringAndSize,
    PyByteArray_Resize,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.float cimport PyFloat_AS_DOUBLE, PyFloat_FromDouble
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_FromLongLong
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.ref cimport Py_INCREF, Py_REFCNT
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.unicode cimport PyUnicode_DATA, PyUnicode_GET_LENGTH
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object)

cdef extern from "_ring_sync.h" nogil:
    void mpx_advise_huge(void* p, size_t n)

cdef extern from *:
    """
    #include <alloca.h>
    /* A macro, not an inline function: alloca's memory lives until the function that
       calls it returns, so it must be the caller's. */
    #define mpx_scratch(n) ((char *)alloca(n))
    """
    char* scratch "mpx_scratch"(size_t n) nogil

cdef enum:
    HUGE_ADVICE_MIN = 4194304

ctypedef object (*Reader)(const unsigned char* p, Py_ssize_t n)


cdef inline object owned_buffer(bint as_bytes, uint64_t size, char** ptr):
    if size > <uint64_t>PY_SSIZE_T_MAX:
        raise MemoryError(f"cannot allocate a buffer of {size} bytes")
    if as_bytes:
        buf = PyBytes_FromStringAndSize(NULL, size)
        ptr[0] = PyBytes_AS_STRING(buf)
    else:
        # Not PyByteArray_FromStringAndSize(NULL, size): when its malloc fails it frees a
        # bytearray whose export count it has not set yet, and CPython (3.11-3.13) prints
        # "SystemError: deallocated bytearray object has exported buffers". An empty one
        # resized fails cleanly.
        buf = PyByteArray_FromStringAndSize(NULL, 0)
        PyByteArray_Resize(buf, size)
        ptr[0] = PyByteArray_AS_STRING(buf)
    if size >= HUGE_ADVICE_MIN:
        mpx_advise_huge(ptr[0], size)
    return buf


cdef inline object writable_buffer(bint as_bytes, uint64_t size):
    cdef char* ptr
    return owned_buffer(as_bytes, size, &ptr)


cdef inline Py_ssize_t copy_into(object dest, Py_ssize_t off, object piece,
                                 Py_ssize_t room) except -1:
    cdef Py_buffer view
    cdef char* p
    PyObject_GetBuffer(piece, &view, PyBUF_SIMPLE)
    cdef Py_ssize_t n = view.len
    if 0 < n <= room:
        p = PyBytes_AS_STRING(dest) if type(dest) is bytes else PyByteArray_AS_STRING(dest)
        with nogil:
            memcpy(p + off, view.buf, n)
    PyBuffer_Release(&view)
    return n


cdef inline object finished(object dest, bint as_bytes):
    return dest


cdef inline object read_buffer(object data, Reader read):
    cdef Py_buffer view
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        return read(<const unsigned char*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef inline bytes bytes_of(const char* p, Py_ssize_t n):
    return p[:n]


cdef inline int put_i64(char* p, Py_ssize_t at, object o) except -1:
    cdef int overflow = 0
    cdef long long v = PyLong_AsLongLongAndOverflow(o, &overflow)
    if overflow:
        return 0
    memcpy(p + at, &v, 8)
    return 1


cdef inline void put_f64(char* p, Py_ssize_t at, object o) noexcept:
    cdef double d = PyFloat_AS_DOUBLE(o)
    memcpy(p + at, &d, 8)


cdef inline Py_ssize_t put_ascii(char* p, Py_ssize_t at, object o, Py_ssize_t room) noexcept:
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(o)
    if n > room or not PyUnicode_IS_ASCII(o):
        return -1
    memcpy(p + at, PyUnicode_DATA(o), n)
    return n


cdef inline Py_ssize_t put_bytes(char* p, Py_ssize_t at, object o, Py_ssize_t room) noexcept:
    cdef Py_ssize_t n = PyBytes_GET_SIZE(o)
    if n > room:
        return -1
    memcpy(p + at, PyBytes_AS_STRING(o), n)
    return n


cdef inline object get_i64(const unsigned char* p, Py_ssize_t at):
    cdef long long v
    memcpy(&v, p + at, 8)
    return PyLong_FromLongLong(v)


cdef inline object get_f64(const unsigned char* p, Py_ssize_t at):
    cdef double d
    memcpy(&d, p + at, 8)
    return PyFloat_FromDouble(d)


cdef inline tuple new_tuple(Py_ssize_t n):
    return PyTuple_New(n)


cdef inline void set_item(tuple t, Py_ssize_t i, object item) noexcept:
    Py_INCREF(item)
    PyTuple_SET_ITEM(t, i, item)


cdef inline tuple built_tuple(tuple t):
    return t


cdef inline Py_ssize_t ref_count(object o) noexcept:
    return Py_REFCNT(o)
