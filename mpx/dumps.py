"""Stack-dump files: where each worker's go, and how the driver or a follower node asks a
worker for its stacks and reads them back (every process of a group uses this)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

from mpx._procinfo import files_of_dead_pids, pid_state

# On-demand dumps (Executor.dump_stacks) ask a local worker with this signal. The worker's
# dump thread takes it with sigwait() and dumps every thread *holding the GIL*, so no other
# thread runs Python (pushes or pops frames, starts or ends) while the stacks are walked.
DUMP_SIGNAL = signal.SIGUSR1
# ... and with this one when DUMP_SIGNAL got no answer within FORCE_AFTER_S: a thread holds
# the GIL (stuck in C code), so the dump thread cannot run. faulthandler then dumps from its
# signal handler, without the GIL: that walk of other threads' frames is safe only because
# none of them can run Python while the GIL stays held (the same bet as the dead man's
# switch). Never sent first: with threads running Python it can crash the worker (SIGSEGV).
FORCED_DUMP_SIGNAL = signal.SIGUSR2
# How long the dump thread gets to answer DUMP_SIGNAL before the forced dump. It needs the
# GIL once, which a running interpreter hands over within the switch interval (5 ms), so
# silence this long means a thread holds it in C (or the machine is badly overloaded).
FORCE_AFTER_S = 0.5
# How a stall's dump begins: the watchdog's own, and faulthandler's when its C thread fired.
STALL_HEAD = "mpx watchdog"
C_STALL_HEAD = "Timeout ("


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
    removed = []
    for path in files_of_dead_pids(directory, _DUMP_NAME):
        if _size(path) == 0:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    return removed


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
    of a faulthandler dump (the thread that runs the RPC loop, mpx._worker.main.worker_main)."""
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


def force_dump(pid: int) -> bool:
    """Ask worker ``pid``, which has not answered DUMP_SIGNAL, for a dump taken without the
    GIL (see FORCED_DUMP_SIGNAL); only while it runs: a stopped one would take it when it
    resumes, with its threads running. Whether the signal went."""
    if pid_state(pid) in (None, "T", "t", "Z", "X"):
        return False
    try:
        os.kill(pid, FORCED_DUMP_SIGNAL)
    except ProcessLookupError:
        return False
    return True


def dump_all(workers: dict[int, tuple[int, str]], timeout: float,
             state: Callable[[int], str]) -> dict[int, str]:
    """Every thread's stack of each worker, ``{rank: (pid, dump file)}``, asked all at
    once; a worker with no dump by ``timeout`` gets a line naming ``state(pid)``. A worker
    silent after FORCE_AFTER_S is asked again for a forced dump (:func:`force_dump`). Each
    dump is the text appended to the worker's file once it stops growing."""
    began = time.monotonic()
    deadline = began + timeout
    force_at: float | None = began + FORCE_AFTER_S
    asked = {rank: signal_dump(path, pid) for rank, (pid, path) in workers.items()}
    sizes = {rank: (start, start) for rank, start in asked.items() if start is not None}
    texts: dict[int, str] = {}
    while sizes and time.monotonic() < deadline:
        time.sleep(0.02)
        for rank, (start, before) in list(sizes.items()):
            path = workers[rank][1]
            now = _size(path)
            if now > start and now == before:
                texts[rank] = read_dump(path, start)
                del sizes[rank]
            else:
                sizes[rank] = (start, now)
        if force_at is not None and time.monotonic() >= force_at:
            force_at = None
            for rank, (start, now) in sizes.items():
                if now <= start:
                    force_dump(workers[rank][0])
    out = {}
    for rank in workers:
        pid = workers[rank][0]
        out[rank] = texts.get(rank) or \
            f"<no stacks from rank {rank} (pid {pid}) within {timeout} s: it is {state(pid)}>"
    return out
