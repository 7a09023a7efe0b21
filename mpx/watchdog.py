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

Outside a worker, :func:`feed` and :func:`paused` do nothing.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any, Callable

from mpx import _debug, shm

logger = logging.getLogger("mpx")

# On-demand dumps (Executor.dump_stacks) ask a local worker with this signal.
DUMP_SIGNAL = signal.SIGUSR1
# How a stall's dump begins: the watchdog's own, and faulthandler's when its C thread fired.
STALL_HEAD = "mpx watchdog"
C_STALL_HEAD = "Timeout ("
# Frames of the stalled thread that a stall report carries.
TOP_FRAMES = 8

_current: Watchdog | None = None
_monotonic = time.monotonic


def dump_dir(configured: str) -> str:
    """Where dump files go: ``Config.dump_dir``, or ``<tmp>/mpx-dumps-<uid>`` (one per
    user: the directory is private)."""
    return configured or os.path.join(tempfile.gettempdir(), f"mpx-dumps-{os.getuid()}")


def dump_path(directory: str, rank: int, pid: int) -> str:
    """The dump file of worker ``rank`` with ``pid`` in ``directory``."""
    return os.path.join(directory, f"mpx-rank{rank}-pid{pid}.stacks")


_DUMP_NAME = re.compile(r"mpx-rank\d+-pid(\d+)\.stacks$")


def reap_empty_dumps(directory: str) -> list[str]:
    """Remove the empty dump files of workers that are gone (a SIGKILLed worker cannot
    remove its own); files with stacks in them stay. Returns the paths removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _DUMP_NAME.match(name)
        path = os.path.join(directory, name)
        if m and not shm.pid_alive(int(m.group(1))) and _size(path) == 0:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    return removed


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
        faulthandler.register(DUMP_SIGNAL, file=self._file, all_threads=True, chain=False)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching (unless the timeout is 0: then only on-demand dumps work)."""
        global _current
        if self.timeout_s > 0:
            _current = self
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

    def _run(self) -> None:
        tick = self.timeout_s / 4
        armed_at = 0  # the dump file's size when the switch was last set
        while not self._stop:
            now = time.monotonic()
            idle_progress = now if not self.busy or self.pauses else self.progress
            left = idle_progress + self.timeout_s - now
            stalled = self._stalled_for(now)
            if stalled >= self.timeout_s:
                key = (self.seq, self.progress)
                if self._reported_for != key:
                    self._reported_for = key
                    # (cancelling waits for a dump in progress to finish)
                    faulthandler.cancel_dump_traceback_later()
                    fired = C_STALL_HEAD in read_dump(self.path, armed_at)
                    self._on_stall(stalled, fired)
            if left > 0:
                # The dead man's switch: it fires only if this thread cannot push it again.
                # It is set from now, not from the call's start: a later call may begin
                # and hold the GIL before this thread runs again (within a tick), and must
                # get its whole timeout. A GIL-held stall is so reported up to 2 ticks late.
                armed_at = os.fstat(self._file.fileno()).st_size
                faulthandler.dump_traceback_later(self.timeout_s + 2 * tick, file=self._file)
                wait = tick
            else:
                wait = min(tick, self.timeout_s - stalled)
            self.wake.wait(wait)
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
        if c_dumped:  # (this thread could not run in time: the C thread's dump is the one)
            dumped = last_c_dump(read_dump(self.path)) or ""
            self._file.write(head.replace("follow", "are above (the C thread's dump)").encode())
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
            logger.exception("mpx: the watchdog could not report a stall to the driver")

    def stop(self) -> None:
        """Stop the thread, close the dump file, and remove it unless it holds a stall (the
        stacks dumped on demand were handed over already)."""
        global _current
        self._stop = True
        self.wake.set()
        if self._thread is not None:
            self._thread.join(5)
        faulthandler.cancel_dump_traceback_later()
        faulthandler.unregister(DUMP_SIGNAL)
        if _current is self:
            _current = None
        self._file.close()
        text = read_dump(self.path)
        if STALL_HEAD not in text and C_STALL_HEAD not in text:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def read_dump(path: str, start: int = 0) -> str:
    """The text of a dump file from byte ``start`` ('' if there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def last_c_dump(text: str) -> str | None:
    """The last dump in ``text`` that the watchdog's C thread wrote, if any."""
    cut = text.rfind(C_STALL_HEAD)
    return text[cut:] if cut >= 0 else None


def top_of_dump(text: str, lines: int = 12) -> str:
    """The first ``lines`` lines (most recent frames first) of the worker main thread's block
    of a faulthandler dump (the thread that runs the RPC loop, mpx.worker.worker_main)."""
    blocks = [b.strip() for b in text.split("\n\n") if "(most recent call first)" in b]
    main = next((b for b in blocks if " in worker_main" in b), blocks[0] if blocks else text)
    return "\n".join(main.splitlines()[:lines])


def method_of_dump(block: str) -> str | None:
    """The worker method a main-thread block of a dump is in: the frame above mpx's
    ``_call``."""
    lines = block.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith(" in _call") and "mpx" in line and i > 0:
            return lines[i - 1].rpartition(" in ")[2].strip() or None
    return None


def describe(info: dict[str, Any]) -> str:
    """One stall report as text for an error message (the time counted to now when the
    driver noted when the stall began, ``since``)."""
    stack = info.get("stack", "").rstrip()
    seconds = info["seconds"]
    if "since" in info:
        seconds = round(time.monotonic() - info["since"], 1)
    where = f"in {info['method']!r} " if info.get("method") else ""
    if info.get("reported", True):
        how = f"stalled {where}for {seconds} s without progress (watchdog)"
    else:
        how = (f"stalled {where}for {seconds} s or more without progress (no report: its "
               "main thread holds the GIL, e.g. in C code; the watchdog's C thread dumped "
               "its stacks)")
    return (f"rank {info['rank']} (pid {info['pid']}) {how}; top frames:\n{stack}\n"
            f"(every thread's stack: {info['dump_file']})")


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def signal_dump(path: str, pid: int) -> int | None:
    """Ask worker ``pid`` (its dump file: ``path``) to dump every thread's stack; the
    file's size before, to read the dump from, or None if there is no such worker."""
    start = _size(path)
    if start < 0:
        return None
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return None
    return start


def collect_dump(path: str, start: int, deadline: float) -> str | None:
    """The dump appended to ``path`` after ``start`` once it stops growing (faulthandler
    writes it from the signal handler in one go), or None by the monotonic ``deadline``."""
    size = start
    while time.monotonic() < deadline:
        now = _size(path)
        if now > start and now == size:
            return read_dump(path, start)
        size = now
        time.sleep(0.02)
    return None


def dump_all(workers: dict[int, tuple[int, str]], timeout: float,
             state: Callable[[int], str]) -> dict[int, str]:
    """Every thread's stack of each worker, ``{rank: (pid, dump file)}``, asked all at
    once; a worker with no dump by ``timeout`` gets a line naming ``state(pid)``."""
    deadline = time.monotonic() + timeout
    asked = {rank: signal_dump(path, pid) for rank, (pid, path) in workers.items()}
    out = {}
    for rank, start in asked.items():
        pid, path = workers[rank]
        text = None if start is None else collect_dump(path, start, deadline)
        out[rank] = text if text is not None else \
            f"<no stacks from rank {rank} (pid {pid}) within {timeout} s: it is {state(pid)}>"
    return out
