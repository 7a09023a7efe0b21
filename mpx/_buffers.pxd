# Owned message memory, shared by the ring's reader and the ZeroMQ reassembler.
from libc.stdint cimport uint64_t

cdef object owned_buffer(bint as_bytes, uint64_t size, char** ptr)
