"""Worker classes for the watchdog and async-output tests (module level for every start
method)."""

from __future__ import annotations

import ctypes
import threading
import time

import mpx
from mpx import watchdog


class Sleeper:
    def __init__(self, ctx: mpx.WorkerContext) -> None:
        self.ctx = ctx

    def rank(self):
        return self.ctx.rank

    def nap(self, seconds, ranks=None):
        if ranks is None or self.ctx.rank in ranks:
            time.sleep(seconds)
        return self.ctx.rank

    def churn(self, n):
        """Pure Python work: the GIL taken and handed back all the time."""
        return sum(i * i for i in range(n))

    def hold_gil(self, seconds, ranks=None):
        """Sleep in C without releasing the GIL (ctypes.PyDLL keeps it)."""
        if ranks is None or self.ctx.rank in ranks:
            ctypes.PyDLL(None).usleep(int(seconds * 1e6))
        return self.ctx.rank

    def fed(self, seconds, step):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(step)
            watchdog.feed()
        return "fed"

    def quiet(self, seconds):
        with watchdog.paused():
            time.sleep(seconds)
        return "paused"

    def start_churners(self, n):
        """Threads that run Python without a pause, calling it through C (map) so that
        frames and C-level eval loops come and go all the time."""
        self.churning = threading.Event()
        self.churning.set()

        def churn():
            while self.churning.is_set():
                list(map(self.churn, range(8)))

        self.churners = [threading.Thread(target=churn, daemon=True) for _ in range(n)]
        for t in self.churners:
            t.start()
        return len(self.churners)

    def stop_churners(self):
        self.churning.clear()
        for t in self.churners:
            t.join(5)
        return sum(t.is_alive() for t in self.churners)


class Deferred:
    """A result whose value is ready only after get_output() (as after a device copy)."""

    def __init__(self, value, delay=0.0, fail=False):
        self.value, self.delay, self.fail = value, delay, fail
        self.lock = threading.Lock()  # not picklable: only what get_output returns travels

    def get_output(self):
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError(f"copy of {self.value!r} failed")
        return self.value, threading.current_thread().name


class Outputs:
    def __init__(self, ctx: mpx.WorkerContext) -> None:
        self.ctx = ctx

    def deferred(self, value, compute=0.0, delay=0.0, fail_ranks=()):
        time.sleep(compute)
        return Deferred(value, delay, self.ctx.rank in fail_ranks)

    def plain(self, value):
        return value
