# The compiled versions of mpx/transport/shm_primitives.py, which mpx/transport/shm_end.py
# cimports where it is compiled (cdef inline: their code is compiled into it; no module of
# this name is built). What each does, the .py says.
from cpython.bytearray cimport PyByteArray_AS_STRING
from libc.stdint cimport int64_t, uint32_t, uint64_t

from mpx._ring cimport RingReader, RingWriter, mpx_now_ns


cdef inline int ring_write(ring, uint32_t kind, parts, int64_t deadline_ns,
                           int64_t total) except? -9:
    # a ring of the compiled build at C level (its .pxd's method), the twin by its contract
    if type(ring) is RingWriter:
        return (<RingWriter>ring)._write(kind, parts, deadline_ns, total)
    return ring.write(kind, parts, deadline_ns, total)


cdef inline tuple ring_read_with(ring, consume, uint64_t in_place_min, int64_t deadline_ns,
                                 int64_t slice_ns):
    if type(ring) is RingReader:
        return (<RingReader>ring)._read_with(consume, in_place_min, deadline_ns, slice_ns)
    return ring.read_with(consume, in_place_min, deadline_ns, slice_ns)


cdef inline int64_t now_ns() noexcept nogil:
    return mpx_now_ns()


# A gate is a byte, 1 while taken: tested and set under the GIL, with no Python code
# between the test and the set, so that no other thread can come in between.

cdef inline bytearray new_gate():
    return bytearray(1)


cdef inline bint take_if_free(bytearray gate) noexcept:
    cdef char* p = PyByteArray_AS_STRING(gate)
    if p[0]:
        return False
    p[0] = 1
    return True


cdef inline bint is_taken(bytearray gate) noexcept:
    return PyByteArray_AS_STRING(gate)[0] != 0


cdef inline void give_back(bytearray gate) noexcept:
    PyByteArray_AS_STRING(gate)[0] = 0
