"""The callback thread of one executor: it runs the done callbacks of RPCFutures.

Done callbacks are user code: they may block, wait on other futures, send calls or raise.
They never run in a thread that reads replies or holds an mpx lock; the threads that
complete futures hand them here, and this one thread runs them in completion order, so a
callback that blocks holds up later callbacks, never a reply. (A callback added to a future
that is already done runs at once in the thread that adds it, as concurrent.futures does.)
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

from mpx import _debug
from mpx._driver import lockorder

logger = logging.getLogger("mpx")

# How long close() waits for the callbacks already handed over to run.
CLOSE_WAIT_S = 5.0


class CallbackThread:
    """Runs ``future._run_callbacks()`` for the futures handed to ``run_soon``, in order,
    on a thread of its own (named ``mpx-callbacks``, started on first use)."""

    def __init__(self) -> None:
        self._due: collections.deque[Any] = collections.deque()
        # (entered itself, not the Condition: see pump.py)
        self._cv_lock = lockorder.lock("CallbackThread's lock", lockorder.CALLBACKS)
        self._cv = threading.Condition(self._cv_lock)
        self._thread: threading.Thread | None = None
        self._closed = False

    def run_soon(self, futures: list) -> None:
        """Queue the done callbacks of ``futures`` (in this order); after close(), run
        them here and now."""
        if not self.queue(futures):
            self.run_here(futures)

    def queue(self, futures: list) -> bool:
        """Queue the done callbacks of ``futures`` (in this order) for the thread; False,
        queuing nothing, after close(). Runs no user code (callers may hold a lock)."""
        with self._cv_lock:
            if self._closed:
                return False
            self._due.extend(futures)
            if self._thread is None:
                self._thread = threading.Thread(target=_debug.counted_thread(self._run),
                                                name="mpx-callbacks", daemon=True)
                self._thread.start()
            self._cv.notify()
            return True

    def run_here(self, futures: list) -> None:
        """Run the done callbacks of ``futures`` in this thread, in order."""
        for fut in futures:
            self._run_one(fut)

    def _run(self) -> None:
        while True:
            with self._cv_lock:
                while not self._due and not self._closed:
                    self._cv.wait()
                if not self._due:
                    return
            self._drain()

    def _drain(self) -> None:
        due = self._due
        while due:
            try:
                fut = due.popleft()
            except IndexError:
                return
            self._run_one(fut)

    @staticmethod
    def _run_one(fut: Any) -> None:
        try:
            fut._run_callbacks()
        except BaseException:  # (each callback's own errors are logged by the future)
            logger.exception("running the done callbacks of %r failed", fut)

    def close(self) -> None:
        """Run what was handed over, then stop the thread (waiting CLOSE_WAIT_S at most:
        a callback that blocks is left to finish on its own)."""
        with self._cv_lock:
            self._closed = True
            thread = self._thread
            self._cv.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_WAIT_S)
            if thread.is_alive():
                logger.warning("a done callback has run for over %.0f s; shutdown goes "
                               "on without it", CLOSE_WAIT_S)
