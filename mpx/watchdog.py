"""The worker's watchdog, as user code inside a worker sees it.

The RPC loop of each worker marks every call's start and end; a call that makes no progress
for ``Config.watchdog_timeout_s`` is a stall: every thread's stack goes to the worker's log
and to its dump file under ``Config.dump_dir``, and the driver is told. User code that is
slow on purpose calls :func:`feed` now and then, or wraps the slow part in ``with
paused():``. Outside a worker both do nothing. (The watchdog itself is
:mod:`mpx._worker.stall_watch`.)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Protocol


class _Watched(Protocol):
    progress: float
    pauses: int
    lock: threading.Lock
    wake: threading.Event


# The running worker's watchdog, set by mpx._worker.stall_watch.Watchdog.start().
_current: _Watched | None = None


def feed() -> None:
    """Tell this worker's watchdog the current call is making progress."""
    w = _current
    if w is not None:
        w.progress = time.monotonic()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Suspend the watchdog for a section known to be long; progress restarts after it."""
    w = _current
    if w is None:
        yield
        return
    with w.lock:
        w.pauses += 1
    try:
        yield
    finally:
        with w.lock:
            w.pauses -= 1
            w.progress = time.monotonic()
        w.wake.set()
