"""The mechanism below the ring's callers, as pyzmq keeps its backend: what moves bytes
and waits, and knows nothing of calls, messages or the protocol.

    layout.py      the ring's memory layout and status codes (mirrors ../_ring_layout.pxi)
    waiting.py     the wait policy: spin, yield, park; its constants, pinned by a test
    segments.py    named POSIX shared-memory segments: create, attach, unlink, reap
    buffers.py     the primitives that reach memory (owned message memory, packing numbers,
                   building tuples): plain here, C in buffers.pxd's cdef inline functions
    codec.py       serde's compiled half (Cython pure mode, + codec.pxd): message assembly,
                   the pickler's sink, the small-tuple codec

The ring itself, ``mpx/_ring.pyx`` and its twin ``mpx/_ring_py.py``, stays at the top of
the package, where the project's shape fixes it; it is of this layer.
"""
