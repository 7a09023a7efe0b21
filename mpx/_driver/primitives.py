"""The futures core's few primitives that differ between its builds: here in plain Python,
and in C as the ``cdef inline`` functions of ``primitives.pxd`` beside this file, which the
compiled modules of the core cimport (this file is never compiled). Each module of the core
(locks, meter, ledger, waiters, future_core) chooses one set once, where it is imported,
so that its own logic is one source. The two sets take the same arguments and give the
same results, but for what a "lock" is: compiled, a ``CLock`` (mpx/_driver/locks.py);
here, a ``threading.Lock``. None of them runs a Python frame: each is a C function in
both builds (``lock_within`` and ``compiled_only`` excepted here, which no hot path calls).

- ``now()``: ``time.monotonic()`` (compiled: clock_gettime(CLOCK_MONOTONIC)).
- ``this_thread()``: this thread's ident, as ``threading.get_ident()`` gives it.
- ``frexp(x)``: ``(m, e)`` with ``x == m * 2**e``, ``0.5 <= abs(m) < 1`` (``math.frexp``).
- ``new_lock()``: a new lock, free.
- ``lock_enter(lock)``: take it, waiting as long as it takes; a signal handler's exception
  (Ctrl-C) ends the wait, with the lock not taken. ``lock_exit(lock)``: release it.
  Used as ``lock_enter(lock)`` then ``try: ... finally: lock_exit(lock)``. Compiled, no
  interrupt can land between the two (no Python runs there); here one can, between
  ``lock_enter``'s return and the ``try``, as after any ``acquire()`` in Python: the plain
  build does not guard that instant (Python code enters the same locks with ``with``).
- ``lock_try(lock)``: take it if it is free: whether it did.
- ``lock_within(lock, timeout)``: take it, waiting ``timeout`` seconds at most: whether
  it did.
- ``compiled_only(what)``: TypeError here (``what`` is the compiled core's); nothing
  compiled.
"""

from __future__ import annotations

import _thread
import functools
import math
import threading
import time
from collections.abc import Callable
from typing import Any

now: Callable[[], float] = time.monotonic
this_thread: Callable[[], int] = threading.get_ident
frexp: Callable[[float], tuple[float, int]] = math.frexp
new_lock: Callable[[], Any] = _thread.allocate_lock
lock_enter: Callable[[Any], bool] = _thread.LockType.acquire
lock_exit: Callable[[Any], None] = _thread.LockType.release
lock_try: Callable[[Any], bool] = functools.partial(_thread.LockType.acquire, blocking=False)


def lock_within(lock: Any, timeout: float) -> bool:
    return bool(lock.acquire(True, timeout))


def compiled_only(what: str) -> None:
    raise TypeError(f"{what} is the compiled core's; plain Python takes a threading.Lock")
