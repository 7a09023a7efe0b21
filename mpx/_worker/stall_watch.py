"""The worker's watchdog: explains calls that run too long.

Inside a worker, the RPC loop marks each call's start and end; user code that is slow on
purpose calls :func:`feed` now and then, or wraps the slow part in ``with paused():``. A
call that makes no progress for ``Config.watchdog_timeout_s`` is a stall: every thread's
stack goes to the worker's log and to its dump file under ``Config.dump_dir``, once per
stall, and the driver is told (rank, method, for how long, the top frames).

Two parts cover the two ways a worker can be stuck:

- a Python thread that wakes when the oldest progress would become a stall and handles it
  (it needs the GIL, which a worker stuck in Python or in a blocking system call leaves
  free);
- a dead man's switch: faulthandler's C thread, armed for ``progress + timeout`` and pushed
  back by the Python thread on every wake. A main thread stuck in C code *holding* the GIL
  stops the Python thread, and then the C thread dumps the stacks to the dump file when
  the switch runs out. Arming costs tens of microseconds, so it happens on the watchdog's
  wakes (every quarter timeout at most), never per call.

User code reaches it through :func:`mpx.watchdog.feed` and :func:`mpx.watchdog.paused`.

Stacks on demand (``Executor.dump_stacks``, or ``kill -USR1``): :data:`DUMP_SIGNAL` is
blocked in every thread of the worker (:func:`block_dump_signal`, before any thread starts)
and taken by a dump thread with ``sigwait``, which dumps every thread while holding the GIL.
faulthandler's own signal handler would walk the other threads' frames without the GIL,
while they push and pop them: a worker with a thread running Python crashed (SIGSEGV in
faulthandler's dump_frame) within tens of dumps. The GIL-less dump is kept for
:data:`FORCED_DUMP_SIGNAL`, which the driver sends only when the dump thread could not get
the GIL in time (a thread holds it in C: nothing else runs Python, so the walk is safe).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from mpx import _debug, watchdog
from mpx.dumps import (
    C_STALL_HEAD,
    DUMP_SIGNAL,
    FORCED_DUMP_SIGNAL,
    STALL_HEAD,
    dump_path,
    last_c_dump,
    read_dump,
)

logger = logging.getLogger("mpx")

# Frames of the stalled thread that a stall report carries.
TOP_FRAMES = 8

_monotonic = time.monotonic


def block_dump_signal() -> None:
    """Block DUMP_SIGNAL in the calling thread, and so in every thread it starts later: call
    it first thing in the worker's main thread. Only the dump thread takes it (sigwait);
    until that thread runs, a request waits pending."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {DUMP_SIGNAL})


class Watchdog:
    """One per worker process (see the module docstring). ``report(info)`` sends a stall
    report to the driver; it runs on the watchdog's thread. Its dump file also takes the
    stacks that :data:`DUMP_SIGNAL` asks for (``Executor.dump_stacks``)."""

    def __init__(self, rank: int, timeout_s: float, directory: str,
                 report: Callable[[dict], None]) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.report = report
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.busy = False
        self.method: str | None = None
        self.seq = -1
        self.progress = time.monotonic()
        self.pauses = 0
        self._reported_for: tuple[int, float] | None = None
        self._stop = False
        self._main = threading.main_thread()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.path = dump_path(directory, rank, os.getpid())
        self._file = open(self.path, "a+b", buffering=0)  # noqa: SIM115 (closed in stop)
        # Writes to the file by the two Python threads (a stall's head and dump, a dump on
        # demand) one at a time.
        self._write_lock = threading.Lock()
        faulthandler.register(FORCED_DUMP_SIGNAL, file=self._file, all_threads=True,
                              chain=False)
        self._thread: threading.Thread | None = None
        self._dumper: threading.Thread | None = None

    def start(self) -> None:
        """Start answering dump requests, and watching (unless the timeout is 0: then only
        on-demand dumps work)."""
        self._dumper = threading.Thread(target=_debug.counted_thread(self._serve_dumps),
                                        name="mpx-dumper", daemon=True)
        self._dumper.start()
        if self.timeout_s > 0:
            watchdog._current = self
            self._thread = threading.Thread(target=_debug.counted_thread(self._run),
                                            name="mpx-watchdog", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ the RPC loop's marks

    def begin(self, method: str, seq: int) -> None:
        self.method = method
        self.seq = seq
        self.progress = _monotonic()
        self.busy = True

    def end(self) -> None:
        self.busy = False

    # ------------------------------------------------------------ the thread

    def _stalled_for(self, now: float) -> float:
        if not self.busy or self.pauses:
            return 0.0
        return now - self.progress

    def _serve_dumps(self) -> None:
        """The dump thread: every thread's stack to the file for each DUMP_SIGNAL. It dumps
        holding the GIL (faulthandler.dump_traceback keeps it throughout), so no other thread
        pushes or pops a frame, or starts or ends, during the walk."""
        while True:
            signal.sigwait({DUMP_SIGNAL})
            if self._stop:
                return
            with self._write_lock:
                faulthandler.dump_traceback(file=self._file, all_threads=True)

    def _run(self) -> None:
        tick = self.timeout_s / 4
        armed_at = 0  # the dump file's size when the switch was last set
        while not self._stop:
            now = time.monotonic()
            stalled = self._stalled_for(now)
            if stalled >= self.timeout_s:
                key = (self.seq, self.progress)
                if self._reported_for != key:
                    self._reported_for = key
                    # (cancelling waits for a dump in progress to finish)
                    faulthandler.cancel_dump_traceback_later()
                    fired = C_STALL_HEAD in read_dump(self.path, armed_at)
                    self._on_stall(stalled, fired)
            # The dead man's switch: it fires only if this thread cannot push it again.
            # It is set from now, not from the call's start: a later call may begin and
            # hold the GIL before this thread runs again (within a tick), and must get its
            # whole timeout. A GIL-held stall is so reported up to 2 ticks late. It stays
            # armed during a reported stall too: the stalled call may end and the next one
            # hold the GIL before this thread wakes again.
            armed_at = os.fstat(self._file.fileno()).st_size
            faulthandler.dump_traceback_later(self.timeout_s + 2 * tick, file=self._file)
            # A tick, whatever the state: a stall is reported once, and the next can come
            # no sooner than a timeout after the call's next progress. (This wait once
            # went to zero during a stall: the thread spun, running Python all the time.)
            self.wake.wait(tick)
            self.wake.clear()
        faulthandler.cancel_dump_traceback_later()

    def _on_stall(self, seconds: float, c_dumped: bool) -> None:
        """Dump every thread's stack to the file and the log, or, when the C thread already
        dumped them to the file (this thread could not run in time), copy that to the log;
        then report to the driver."""
        method, seq = self.method, self.seq
        ident = self._main.ident
        frames = sys._current_frames().get(ident) if ident is not None else None
        top = "".join(traceback.format_stack(frames)[-TOP_FRAMES:]) if frames else ""
        head = (f"{STALL_HEAD}: worker rank {self.rank} (pid {os.getpid()}) has been in "
                f"{method!r} (call {seq}) for {seconds:.1f} s without progress; stacks of "
                "every thread follow\n")
        with self._write_lock:
            if c_dumped:  # (this thread could not run in time: the C thread's dump is it)
                dumped = last_c_dump(read_dump(self.path)) or ""
                self._file.write(
                    head.replace("follow", "are above (the C thread's dump)").encode())
            else:
                self._file.write(head.encode())
                faulthandler.dump_traceback(file=self._file, all_threads=True)
        try:
            sys.stderr.write(head)
            if c_dumped:
                sys.stderr.write(f"(as dumped to {self.path} by the watchdog's C thread)\n"
                                 + dumped)
            else:
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):
            pass  # no usable stderr: the file has it
        info = dict(rank=self.rank, pid=os.getpid(), method=method, seq=seq,
                    seconds=round(seconds, 1), stack=top, dump_file=self.path)
        try:
            self.report(info)
        except Exception:
            logger.exception("the watchdog could not report a stall to the driver")

    def stop(self) -> None:
        """Stop the thread, close the dump file, and remove it unless it holds a stall (the
        stacks dumped on demand were handed over already)."""
        self._stop = True
        self.wake.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._dumper is not None and self._dumper.ident is not None:
            signal.pthread_kill(self._dumper.ident, DUMP_SIGNAL)  # (its sigwait returns)
            self._dumper.join(5)
        faulthandler.cancel_dump_traceback_later()
        faulthandler.unregister(FORCED_DUMP_SIGNAL)
        if watchdog._current is self:
            watchdog._current = None
        self._file.close()
        text = read_dump(self.path)
        if STALL_HEAD not in text and C_STALL_HEAD not in text:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
