# cython: language_level=3, annotation_typing=False
"""The hot path of a shared-memory transport end, over the ring it is given: a writer end
writes a message (its parts, or an object it encodes first) into the ring; a reader end
reads the next message out of the ring and decodes it (into memory of its own, or in place
from a slot, as the ring's ``read_with`` lends it).

Its Python side, ``mpx/transport/shm.py``, holds one end per ``ShmWriter`` or ``ShmReader``:
it makes the ring and gives it to the end with its lock and with serde's encoder or
decoder, and it turns the status each call returns (``mpx.mechanism.layout``: OK, TIMEOUT,
INTERRUPTED, ..., CLOSED once ``close()`` was called) into the typed error. The end calls
nothing of its Python side.

Concurrency: every call runs under the end's ``EndLock``, which the Python side also takes
around what else touches the ring, and to release the ring in ``close()`` (after the end's
``close()``): a call never touches a released ring, and one thread at a time uses it.

One source: compiled where mpx was built (its C types in ``shm_end.pxd``), run as this plain
Python where it was not, or under ``MPX_PURE_PYTHON=1``. The ring may be either build's (a
queue picks its own, ``mpx._impl.ring_module()``): ``shm_primitives`` calls a compiled ring
at C level and the pure twin through its Python methods.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

try:
    import cython
except ImportError:  # Cython is a build dependency only: plain Python needs cython.compiled
    from mpx.mechanism import _cython_shim as cython  # type: ignore[no-redef]

if cython.compiled:
    from cython.cimports.mpx.transport.shm_primitives import (
        give_back,
        is_taken,
        new_gate,
        now_ns,
        ring_read_with,
        ring_write,
        take_if_free,
    )
else:
    from mpx.transport.shm_primitives import (
        give_back,
        is_taken,
        new_gate,
        now_ns,
        ring_read_with,
        ring_write,
        take_if_free,
    )

from mpx.mechanism import layout

IMPLEMENTATION = "cython" if cython.compiled else "python"

CLOSED = layout.CLOSED
_CLOSED_READ = (layout.CLOSED, 0, None)


class EndLock:
    """The lock of a shared-memory end (see the module's docstring): a mutex as
    ``threading.Lock`` is (not reentrant; a wait for it ends early only by a signal
    handler's exception), for ``with`` and the end's calls.

    Held is its gate taken (``shm_primitives``): without contention, as nearly every call
    runs, taking and giving it back is, compiled, a byte tested and set in C under the GIL,
    where ``threading.Lock`` cost the end two Python calls a message. A thread that finds
    the gate taken waits on a condition until it takes it; ``release()`` notifies one."""

    def __init__(self) -> None:
        self._gate = new_gate()
        self._waiting = 0  # threads in _wait()
        # (what `with` enters: the Condition's own __enter__ is Python, and an interrupt
        # there would leave its lock held)
        self._cond_lock = threading.Lock()
        self._cond = threading.Condition(self._cond_lock)

    def acquire(self) -> bool:
        """Take the lock, waiting while another thread holds it."""
        if not take_if_free(self._gate):
            self._wait()
        return True

    def release(self) -> None:
        """Give the lock back (RuntimeError if it is not held)."""
        if not is_taken(self._gate):
            raise RuntimeError("release of an end lock that is not held")
        give_back(self._gate)
        if self._waiting:  # (read after the gate is free: see _wait)
            with self._cond_lock:
                self._cond.notify()

    def _wait(self) -> None:
        # (a waiter counts itself before it tries the gate, a releaser frees the gate
        # before it counts the waiters: one that counted none left a gate the waiter takes)
        with self._cond_lock:
            self._waiting += 1
            try:
                while not take_if_free(self._gate):
                    self._cond.wait()
            except BaseException:  # (a signal handler raised: a wake-up it took goes on)
                self._cond.notify()
                raise
            finally:
                self._waiting -= 1

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class WriterEnd:
    """A shared-memory writer end's hot path over ``ring`` (a ``RingWriter`` of either
    build), under ``lock``. ``encode(obj, local_only)``: serde's encoder, ``(kind,
    parts)``."""

    def __init__(self, ring: Any, lock: EndLock,
                 encode: Callable[[Any, bool], tuple[int, tuple]]) -> None:
        self._ring = ring
        self._lock = lock
        self._encode = encode
        self._open = True

    def write(self, kind: int, parts: Iterable, deadline_ns: int, total: int = -1) -> int:
        """Write one message of ``kind`` made of ``parts`` (see the ring's ``write``): the
        ring's status, or CLOSED."""
        lock = self._lock
        lock.acquire()
        try:
            if not self._open:
                return CLOSED
            return ring_write(self._ring, kind, parts, deadline_ns, total)
        finally:
            lock.release()

    def send(self, obj: Any, deadline_ns: int = -1) -> int:
        """Encode ``obj`` for readers that share this process's memory, and write it: as
        write(). What encoding raises propagates, and nothing is written."""
        kind, parts = self._encode(obj, True)
        return self.write(kind, parts, deadline_ns, -1)

    def close(self) -> None:
        """(Under the lock, before the ring is released) every later call returns CLOSED."""
        self._open = False


class ReaderEnd:
    """A shared-memory reader end's hot path over ``ring`` (a ``RingReader`` of either
    build), under ``lock``. ``decode(kind, data)``: serde's decoder of a message that may be
    lent in place (its result owns its memory); ``in_place_min``: one-slot messages from
    this size up are decoded in place."""

    def __init__(self, ring: Any, lock: EndLock, decode: Callable[[int, Any], Any],
                 in_place_min: int) -> None:
        self._ring = ring
        self._lock = lock
        self._decode = decode
        self._in_place_min = in_place_min
        self._open = True
        self.began_ns = -1  # when the last read with a slice began (the ring's clock)

    def recv(self, deadline_ns: int = -1) -> tuple[int, int, Any]:
        """The next message, decoded with the end's decoder: read_into()'s ``(status,
        kind, object)``, waiting until ``deadline_ns``."""
        return self.read_into(self._decode, self._in_place_min, deadline_ns, -1)

    def read_into(self, decode: Callable[[int, Any], Any], in_place_min: int,
                  deadline_ns: int, slice_ns: int) -> tuple[int, int, Any]:
        """``(status, kind, decode(kind, data))`` of the next message (the ring's
        ``read_with``): a wait still unfinished after ``slice_ns`` (>= 0) returns SLICE,
        and the read goes on at the next call; ``began_ns`` says when this one began. A
        closed end: ``(CLOSED, 0, None)``."""
        if slice_ns >= 0:
            self.began_ns = now_ns()
        lock = self._lock
        lock.acquire()
        try:
            if not self._open:
                return _CLOSED_READ
            return ring_read_with(self._ring, decode, in_place_min, deadline_ns, slice_ns)
        finally:
            lock.release()

    def close(self) -> None:
        """(Under the lock, before the ring is released) every later call returns
        ``(CLOSED, 0, None)``."""
        self._open = False
