"""Holding Ctrl-C back while the group's membership changes.

A signal handler's exception (SIGINT's KeyboardInterrupt, a SIGTERM handler's SystemExit)
lands in the main thread between any two bytecodes: inside an ``except`` that undoes a step,
between a lock's acquire and the ``try`` that releases it, between creating a segment and
recording it. A membership change has many such windows, and one interrupt in one of them
used to leave the call table paused with the baton held, or a broadcast ring in /dev/shm.

``Deferred`` closes them all at once: inside it, in the main thread, the Python handlers
of SIGINT and SIGTERM are replaced by one that only records the signal. The code inside
raises the interrupt itself at the points where undoing is complete
(``raise_if_interrupted``), and whatever is still recorded when it ends is handed to the
original handler then (its exception propagates from the ``with``). In other threads,
where no signal handler runs, it does nothing. A change that has passed its point of no
return is never cut short: it finishes (each of its waits has a deadline), then the
interrupt comes.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

# The signals whose Python handlers are held back (others keep theirs).
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Deferred:
    """Context manager: the Python signal handlers of ``SIGNALS`` held back inside it (see
    the module docstring). Not re-entrant: one per membership change."""

    def __init__(self) -> None:
        self._saved: dict[int, Any] = {}
        self._held: list[tuple[int, FrameType | None]] = []

    def __enter__(self) -> Deferred:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            handler = signal.getsignal(sig)
            if callable(handler):  # (a Python handler: default_int_handler included)
                self._saved[sig] = handler
                signal.signal(sig, self._hold)
        return self

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self._held.append((signum, frame))

    @property
    def interrupted(self) -> bool:
        """Whether a signal came and is held."""
        return bool(self._held)

    def raise_if_interrupted(self) -> None:
        """Run the original handler of the first held signal now (a point where the change
        is undone cleanly): its exception propagates from here."""
        if self._held:
            signum, frame = self._held.pop(0)
            self._saved[signum](signum, frame)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        saved, held = self._saved, self._held
        self._saved, self._held = {}, []
        if exc is None:  # (an exception already on its way goes on; the signal was its cause)
            for signum, frame in held[:1]:
                saved[signum](signum, frame)
