"""Observers never change a call: what an observer hook raises is logged, once, and mpx goes
on as if the hook had not been called.

The observers are tracing (the tracer provider, its samplers and span processors, in the
driver and in each worker: mpx/_driver/tracing.py, mpx/_worker/tracing.py) and the
Prometheus collector (mpx/metrics.py). Where mpx hands over to one it catches what the hook
raises (``Exception``: ``KeyboardInterrupt``, ``SystemExit`` and other requests to stop go on
up, as usual) and calls :func:`report`, which logs a warning with the traceback the first
time a hook raises a given type of error in this process, and nothing the times after.
Only the branches where an observer is on do this: a call without one pays nothing.

Threads: any. ``report`` takes a lock of its own for the check-and-record only, and logs
after letting it go; it runs no user code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("mpx")

T = TypeVar("T")

# (hook, type of error) pairs already logged in this process
_reported: set[tuple[str, type]] = set()
_lock = threading.Lock()


def report(hook: str, error: Exception) -> None:
    """Log that ``hook`` (what mpx handed over to, in words) raised ``error``, the first
    time it raises an error of this type; the call it observed goes on untouched."""
    key = (hook, type(error))
    if key in _reported:
        return
    with _lock:
        if key in _reported:
            return
        _reported.add(key)
    try:
        text = str(error)
    except Exception:  # (an error's own __str__ may raise too)
        text = "<str() of the error raised>"
    logger.warning("%s raised %s: %s; the call goes on untouched (each hook's kind of error "
                   "is logged once)", hook, type(error).__qualname__, text, exc_info=error)


def run(hook: str, fn: Callable[..., T], *args: Any) -> T | None:
    """``fn(*args)``, or None when it raises an Exception (reported as ``hook``'s)."""
    try:
        return fn(*args)
    except Exception as e:
        report(hook, e)
        return None
