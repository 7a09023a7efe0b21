"""Worker classes and payloads of the fault-injection matrix (tests/failures/test_matrix.py) and the
soak (tests/failures/test_soak.py); module level so that every start method imports them."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import random
import resource
import signal
import sys
import threading
import time

import mpx


def _no_core() -> None:
    # a deliberate segfault must not leave a core file behind
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def crash(how: str, code: int = 3) -> None:
    """End this process: 'sys.exit' (code), 'os._exit' (code), 'segv', 'sigkill'."""
    if how == "sys.exit":
        sys.exit(code)
    if how == "os._exit":
        os._exit(code)
    if how == "segv":
        _no_core()
        faulthandler.disable()  # (forked from pytest, it would print a fatal-error report)
        faulthandler._sigsegv()
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    raise ValueError(f"unknown crash {how!r}")


def _crash_on(rank: int, how: str, code: int):
    if multiprocessing.current_process().name == f"mpx-worker-{rank}":
        crash(how, code)
    return "unpickled"


class CrashOnUnpickle:
    """An argument that pickles fine in the driver and ends worker ``rank`` (only) while
    that worker unpickles it."""

    def __init__(self, rank: int, how: str, code: int = 3) -> None:
        self.args = (rank, how, code)

    def __reduce__(self):
        return (_crash_on, self.args)


class CrashOnPickle:
    """A result whose pickling (in the worker) crashes the worker."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __reduce__(self):
        crash(self.how, 5)
        raise AssertionError("unreachable")


def _explode():
    raise RuntimeError("cannot rebuild this result in the driver")


class FailsInDriver:
    """A result that pickles in the worker and raises while the driver unpickles it."""

    def __reduce__(self):
        return (_explode, ())


class CrashOnDel:
    """A result that travels as the string 'sent' and crashes its worker when the worker
    drops it, i.e. after the reply went out."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.pid = os.getpid()

    def __reduce__(self):
        return (str, ("sent",))

    def __del__(self):
        if os.getpid() == self.pid:
            crash(self.how, 9)


class Faulty:
    """A worker whose methods fail in every way the matrix needs."""

    def __init__(self, ctx: mpx.WorkerContext, as_limit_mib: int = 0) -> None:
        self.ctx = ctx
        if as_limit_mib:
            import psutil
            vms = psutil.Process().memory_info().vms
            limit = vms + (as_limit_mib << 20)
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    def _mine(self, ranks) -> bool:
        return ranks is None or self.ctx.rank in ranks

    def rank(self):
        return self.ctx.rank

    def ident(self, x):
        return x

    def pid(self):
        return os.getpid()

    def sleep(self, seconds, ranks=None):
        if self._mine(ranks):
            time.sleep(seconds)
        return self.ctx.rank

    def fail(self, ranks=None):
        if self._mine(ranks):
            raise ValueError(f"bad value on rank {self.ctx.rank}")
        return self.ctx.rank

    def crash(self, how, code=3, ranks=None):
        if self._mine(ranks):
            crash(how, code)
        return self.ctx.rank

    def allocate(self, nbytes, ranks=None):
        """Allocate ``nbytes``; under a small RLIMIT_AS this raises MemoryError."""
        if self._mine(ranks):
            buf = bytearray(nbytes)  # zero-filled: every page touched
            return len(buf)
        return 0

    def oom_killed(self, nbytes, ranks=None):
        """What the kernel's OOM killer does, emulated: grow, then SIGKILL."""
        if self._mine(ranks):
            buf = bytearray(nbytes)  # zero-filled: every page touched
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)
            return len(buf)
        return self.ctx.rank

    def result(self, kind, arg=None, ranks=None):
        """A troublesome result on ``ranks``, the rank elsewhere."""
        if not self._mine(ranks):
            return self.ctx.rank
        if kind == "crash_on_pickle":
            return CrashOnPickle(arg)
        if kind == "fails_in_driver":
            return FailsInDriver()
        if kind == "crash_on_del":
            return CrashOnDel(arg)
        if kind == "unpicklable":
            return threading.Lock()
        raise ValueError(kind)

    def big(self, nbytes, ranks=None):
        return bytes(nbytes) if self._mine(ranks) else b""

    def arm_killer(self, pids, seed, max_delay):
        """A timer that SIGKILLs a random other worker of ``pids`` at a random moment."""
        rnd = random.Random(seed * 100 + self.ctx.rank)
        if rnd.random() < 0.5 and self.ctx.rank != seed % len(pids):
            return None
        victim = rnd.choice([p for p in pids if p != os.getpid()])
        t = threading.Timer(rnd.random() * max_delay, os.kill, (victim, signal.SIGKILL))
        t.daemon = True
        t.start()
        return victim

    def debug_counts(self):
        """(mpx._debug's counters, the live threads named mpx-*) in this worker."""
        from mpx import _debug
        return _debug.counts(), sum(t.name.startswith("mpx-") for t in threading.enumerate())

    def usage(self):
        """(rss bytes, open fds, threads) of this worker, measured inside it."""
        import psutil
        p = psutil.Process()
        return p.memory_info().rss, p.num_fds(), p.num_threads()

    def echo_array(self, a):
        return a

    def reply_if(self, x):
        return (self.ctx.rank, x)


class SlowInit:
    """Writes its pid to ``pid_dir`` and then takes ``seconds`` to initialise."""

    def __init__(self, ctx: mpx.WorkerContext, pid_dir: str, seconds: float) -> None:
        with open(os.path.join(pid_dir, f"{ctx.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(seconds)
