"""Worker classes for the driver's rules and its stress test (module level, so every start
method imports them)."""

from __future__ import annotations

import os
import signal
import threading
import time

import mpx


class Journal:
    """Remembers the order in which its calls ran (``log``), and sleeps or answers big."""

    def __init__(self, ctx: mpx.WorkerContext) -> None:
        self.ctx = ctx
        self.seen: list = []

    def log(self, tag, seconds=0.0):
        self.seen.append(tag)
        if seconds:
            time.sleep(seconds)
        return tag

    def journal(self):
        out, self.seen = self.seen, []
        return out

    def ident(self, x):
        return x

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.ctx.rank

    def big(self, nbytes, stop_after_s=None):
        """``nbytes`` of reply; with ``stop_after_s``, this process SIGSTOPs itself that
        long after the method returns (part way through writing the reply)."""
        if stop_after_s is not None:
            threading.Timer(stop_after_s, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        return bytes(nbytes)

    def pid(self):
        return os.getpid()

    def die(self, ranks):
        if self.ctx.rank in ranks:
            os._exit(3)
        return self.ctx.rank
