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

from mpx._procinfo import files_of_dead_pids

# On-demand dumps (Executor.dump_stacks) ask a local worker with this signal.
DUMP_SIGNAL = signal.SIGUSR1
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
