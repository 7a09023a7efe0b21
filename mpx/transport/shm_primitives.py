"""The shared-memory end's primitives (``shm_end``): how it calls the ring it is given (the
ring's contract, ``mpx/_ring.pyi``, which both builds of the ring keep), the ring's clock,
and the gate of its lock's fast path.

This file holds the plain versions, which ``shm_end`` imports where it runs as plain Python.
Where ``shm_end`` is compiled it cimports ``shm_primitives.pxd`` instead: the same functions
as ``cdef inline`` C. Those call a ring of the compiled build at C level and the pure twin
through these same Python methods (a queue picks its ring's build when it is made, so a
compiled end may be given either); their gate is a byte tested and set under the GIL.
"""

from __future__ import annotations

import threading
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


# A gate: taken by one thread at a time, without waiting. Plain, a threading.Lock, whose
# non-blocking acquire is the one atomic test-and-set plain Python has.

def new_gate() -> threading.Lock:
    """A gate, free."""
    return threading.Lock()


def take_if_free(gate: threading.Lock) -> bool:
    """Take ``gate`` if it is free, atomically among this process's threads: whether this
    call took it."""
    return gate.acquire(False)


def is_taken(gate: threading.Lock) -> bool:
    """Whether ``gate`` is taken."""
    return gate.locked()


def give_back(gate: threading.Lock) -> None:
    """Free ``gate`` (taken)."""
    gate.release()
