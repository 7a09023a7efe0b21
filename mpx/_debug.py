"""Debug counters of what mpx holds in this process: live segments, rings and threads.

On when the compiled ring was built with ``MPX_DEBUG=1`` (``mpx._ring.DEBUG``) or when
``MPX_DEBUG=1`` is set in the environment at import (so the pure-Python ring can be
checked too); otherwise every hook is a no-op that costs one attribute lookup. The test
suite's teardown asserts that every counter is back to zero.

- ``segments``: shared-memory mappings created or attached and not yet closed
- ``rings``: ring ends (``Ring`` objects) opened and not yet released
- ``threads``: threads mpx started that have not finished yet
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

from mpx import _impl


def _compiled_debug() -> bool:
    if _impl.pure_requested():  # (the pure build's process never loads the compiled ring)
        return False
    try:
        from mpx import _ring
    except ImportError:
        return False
    return bool(getattr(_ring, "DEBUG", False))


ENABLED: bool = os.environ.get("MPX_DEBUG", "").strip() == "1" or _compiled_debug()

NAMES = ("segments", "rings", "threads")
_counts = dict.fromkeys(NAMES, 0)
_lock = threading.Lock()


def inc(name: str) -> None:
    """Count one more live ``name``."""
    if ENABLED:
        with _lock:
            _counts[name] += 1


def dec(name: str) -> None:
    """Count one ``name`` fewer."""
    if ENABLED:
        with _lock:
            _counts[name] -= 1


def counts() -> dict[str, int]:
    """A copy of the counters (all zero when debug is off)."""
    with _lock:
        return dict(_counts)


def counted_thread(target: Callable[..., Any]) -> Callable[..., Any]:
    """``target`` wrapped so that the thread running it is counted from now (before
    ``start()``, so a teardown cannot miss it) until it returns."""
    if not ENABLED:
        return target
    inc("threads")

    @functools.wraps(target)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return target(*args, **kwargs)
        finally:
            dec("threads")

    return run


def _after_fork() -> None:
    # A forked child starts with none of its parent's threads and closes none of the
    # parent's segments or rings; the lock may have been held by a thread that is gone.
    global _lock
    _lock = threading.Lock()
    for name in NAMES:
        _counts[name] = 0


os.register_at_fork(after_in_child=_after_fork)
