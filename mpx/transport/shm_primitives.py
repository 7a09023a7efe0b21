"""The shared-memory end's primitives (``shm_end``): how it calls the ring it is given (the
ring's contract, ``mpx/_ring.pyi``, which both builds of the ring keep), the ring's clock,
and the test-and-set of its lock's fast path.

This file holds the plain versions, which ``shm_end`` imports where it runs as plain Python.
Where ``shm_end`` is compiled it cimports ``shm_primitives.pxd`` instead: the same functions
as ``cdef inline`` C. Those call a ring of the compiled build at C level and the pure twin
through these same Python methods (a queue picks its ring's build when it is made, so a
compiled end may be given either), and test and set a flag under the GIL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any


def ring_write(ring: Any, kind: int, parts: Iterable, deadline_ns: int, total: int) -> int:
    """``ring.write(kind, parts, deadline_ns, total)``: the ring's status."""
    return ring.write(kind, parts, deadline_ns, total)


def ring_read_with(ring: Any, consume: Callable[[int, Any], Any], in_place_min: int,
                   deadline_ns: int, slice_ns: int) -> tuple[int, int, Any]:
    """``ring.read_with(consume, in_place_min, deadline_ns, slice_ns)``: ``(status, kind,
    what consume returned)``."""
    return ring.read_with(consume, in_place_min, deadline_ns, slice_ns)


now_ns = time.monotonic_ns  # the rings' clock: CLOCK_MONOTONIC, as their deadlines are


def take_if_free(flag: bytearray) -> bool:
    """Set ``flag[0]`` if it is 0, atomically among this process's threads: True if this
    call set it. Compiled, a test and a set under the GIL with no Python code between them;
    plain Python cannot promise that, so here it never takes it (the caller takes its slow
    path, which tests and sets the flag under a lock every taker holds)."""
    return False
