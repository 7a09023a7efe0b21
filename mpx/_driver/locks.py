# cython: language_level=3, boundscheck=False, wraparound=False, annotation_typing=False, binding=False
"""The futures core's locks: ``CLock``, the C lock of the compiled core (the call table's,
each future's, the baton's), and ``Baton``, the right to read replies, which compiled an
interrupt cannot leave held.

One source, two builds (Cython's pure-Python mode): setup.py compiles this file, with the C
types of mpx/_driver/locks.pxd, into the extension ``mpx._driver.locks``; without a
compiler, and under MPX_PURE_PYTHON=1, it runs as plain Python (mpx/_impl.py chooses).
There a lock is a ``threading.Lock`` (mpx/_driver/primitives.py makes and takes the locks
of both builds), and ``CLock`` cannot be made.
"""

from __future__ import annotations

from typing import Any

try:
    import cython
except ImportError:  # Cython is a build dependency only: plain Python needs cython.compiled
    from mpx.mechanism import _cython_shim as cython  # type: ignore[no-redef]

if cython.compiled:
    from cython.cimports.cpython.exc import PyErr_CheckSignals
    from cython.cimports.libc.errno import EINTR, ETIMEDOUT, errno
    from cython.cimports.mpx._driver.locks import (  # (its .pxd)
        sem_clockwait,
        sem_destroy,
        sem_init,
        sem_post,
        sem_trywait,
        sem_wait,
    )
    from cython.cimports.mpx._driver.primitives import (
        compiled_only,
        lock_exit,
        lock_try,
        lock_within,
        new_lock,
        now,
        this_thread,
    )
    from cython.cimports.posix.time import CLOCK_MONOTONIC, timespec
else:
    from mpx._driver.primitives import (
        compiled_only,
        lock_exit,
        lock_try,
        lock_within,
        new_lock,
        now,
        this_thread,
    )

IMPLEMENTATION = "cython" if cython.compiled else "python"


class CLock:
    """A C lock, for the compiled core's locks: the Baton's, the call table's
    (``Ledger.lock``, which is ``CallRegistry.lock``, mpx/_driver/registry.py) and each
    future's (``FutureCore._lock``). The compiled code takes and releases it with no Python
    call between (mpx/_driver/primitives.pxd); Python code enters it with ``with``:
    ``__enter__`` and ``__exit__`` are C functions, so no interrupt lands inside them (see
    Baton). ``acquire``, ``release`` and ``locked`` are threading.Lock's, for the
    threading.Condition built on a future's lock and for concurrent.futures' waits. Not
    reentrant. A wait for it lets the GIL go and runs the signal handlers whenever a signal
    cuts it short: a handler's exception (Ctrl-C) ends the wait, with the lock not taken.
    (Plain Python takes a threading.Lock instead: this class's methods would be Python
    there, and it cannot be made.)"""

    __slots__ = ("_sem",)
    _sem: Any  # (a C sem_t: the .pxd's)

    # A POSIX semaphore of one, as CPython's own locks are on Linux, held here rather than
    # behind PyThread_acquire_lock, which reads the clock on every acquire, even one that
    # does not wait (3.11, HAVE_SEM_CLOCKWAIT): a free lock is taken with one atomic.

    def __cinit__(self) -> None:  # (compiled only)
        if sem_init(cython.address(self._sem), 0, 1) != 0:
            raise OSError(errno, "sem_init failed for a CLock")

    def __init__(self) -> None:
        compiled_only("CLock")

    def __dealloc__(self) -> None:
        sem_destroy(cython.address(self._sem))

    def _try(self) -> bool:
        """Take it if it is free, without waiting."""
        return sem_trywait(cython.address(self._sem)) == 0

    def _wait(self, until: float) -> bool:
        """Take it, waiting until monotonic ``until`` at most (< 0: no limit)."""
        if self._try():
            return True
        ts = cython.declare(timespec)
        if until >= 0:
            ts.tv_sec = int(until)
            ts.tv_nsec = int((until - ts.tv_sec) * 1e9)
        while True:
            with cython.nogil:
                if until >= 0:
                    r = sem_clockwait(cython.address(self._sem), CLOCK_MONOTONIC,
                                      cython.address(ts))
                else:
                    r = sem_wait(cython.address(self._sem))
                err = errno
            if r == 0:
                return True
            if err == ETIMEDOUT:
                return False
            if err != EINTR:
                raise OSError(err, "waiting for a CLock failed")
            PyErr_CheckSignals()  # (raises what a handler raised: nothing is held)

    def _release(self) -> None:
        sem_post(cython.address(self._sem))

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take it, as threading.Lock.acquire does: without waiting unless ``blocking``,
        else for ``timeout`` seconds at most (-1: no limit); whether it was taken."""
        if not blocking:
            if timeout != -1:
                raise ValueError("can't specify a timeout for a non-blocking call")
            return self._try()
        if timeout == -1:
            return self._wait(-1.0)
        if timeout < 0:
            raise ValueError("timeout value must be a non-negative number")
        return self._wait(now() + timeout)

    def release(self) -> None:
        """Release it (from any thread, as a threading.Lock); RuntimeError if it is free."""
        if self._try():
            self._release()
            raise RuntimeError("release unlocked lock")
        self._release()

    def locked(self) -> bool:
        """Whether some thread holds it."""
        if self._try():
            self._release()
            return False
        return True

    def __enter__(self) -> CLock:
        self._wait(-1.0)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._release()


class Baton:
    """The right to read replies, held by one thread at a time (mpx/_driver/pump.py).

    An interrupt (the KeyboardInterrupt of SIGINT's handler, or whatever a signal handler
    raises) is raised in the main thread when the interpreter next checks, which it does
    after each call returns and on entering a Python function: between a lock's
    ``acquire()`` and the ``try`` that would release it, or in a ``finally`` before its
    ``release()``. Compiled, ``take`` and ``let_go`` take and release a ``CLock`` and mark
    the holding thread with no such check between, so that the pattern ::

        try:
            if baton.take():
                ...  # read
        finally:
            if baton.let_go():
                ...  # what the hand-over does next (may be cut short: nothing is held)

    never leaves the baton held. (Uncompiled, an interrupt can still land inside them: the
    thread's next try to read then fails to take it, and its ``finally`` lets it go.)
    A thread never takes the baton twice: ``take`` refuses one this thread holds.
    """

    __slots__ = ("_lock", "_held", "_holder")

    def __init__(self) -> None:
        self._lock = new_lock()
        self._held = False
        self._holder = 0  # the holding thread's ident, while _held

    def take(self, timeout: float = 0.0) -> bool:
        """Take the baton if it is free, waiting up to ``timeout`` seconds for it (0: not
        at all); False if another thread holds it then, or this one does. A signal
        handler's exception (Ctrl-C) ends the wait, with the baton not taken."""
        me = this_thread()
        if self._held and self._holder == me:
            return False
        got = lock_try(self._lock) if timeout <= 0 else lock_within(self._lock, timeout)
        if got:
            self._holder = me
            self._held = True
        return got

    def held(self) -> bool:
        """Whether this thread holds the baton."""
        return self._held and self._holder == this_thread()

    def locked(self) -> bool:
        """Whether some thread holds the baton (for other threads, a hint)."""
        return self._held

    @property
    def holder(self) -> int | None:
        """The holding thread's ident, or None."""
        return self._holder if self._held else None

    def let_go(self) -> bool:
        """Release the baton if this thread holds it: whether it did."""
        if not self._held or self._holder != this_thread():
            return False
        self._held = False
        lock_exit(self._lock)
        return True
