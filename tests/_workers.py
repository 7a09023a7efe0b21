"""Worker classes for the executor tests (module level so every start method imports them)."""

from __future__ import annotations

import os
import resource
import signal
import sys
import threading
import time

import mpx


class Echo:
    def __init__(self, ctx: mpx.WorkerContext, scale: int = 1) -> None:
        self.ctx = ctx
        self.scale = scale
        self.calls = 0

    def mul(self, x):
        self.calls += 1
        return x * self.scale * (self.ctx.rank + 1)

    def rank(self):
        return self.ctx.rank

    def noop(self):
        return None

    def ident(self, x):
        return x

    def context(self):
        c = self.ctx
        return dict(rank=c.rank, local_rank=c.local_rank, world_size=c.world_size,
                    local_world_size=c.local_world_size, node_rank=c.node_rank,
                    dist=c.distributed_init_method, omp=os.environ.get("OMP_NUM_THREADS"),
                    pid=os.getpid(), ppid=os.getppid(), threads=threading.active_count())

    def sleep(self, seconds, ranks=None):
        if ranks is None or self.ctx.rank in ranks:
            time.sleep(seconds)
        return self.ctx.rank

    def fail(self, ranks=None):
        if ranks is None or self.ctx.rank in ranks:
            raise ValueError(f"bad value on rank {self.ctx.rank}")
        return self.ctx.rank

    def unpicklable_result(self):
        return threading.Lock()

    def exit(self, code, ranks=None):
        if ranks is None or self.ctx.rank in ranks:
            os._exit(code)
        return self.ctx.rank

    def kill_self(self, sig):
        os.kill(os.getpid(), sig)

    def say(self, text):
        print(text, flush=True)
        return True

    def faults_per_large_message(self, nbytes, rounds=10):
        """Page faults per round trip of an ``nbytes`` message through a MessageQueue in this
        process, after a few to warm up: ~0 when freed memory stays mapped."""
        q = mpx.MessageQueue(1, 1)
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
        try:
            q.wait_until_ready(timeout=10)
            r.wait_until_ready(timeout=10)
            msg = [bytes(nbytes)]
            for _ in range(3):
                q.enqueue(msg)
                r.dequeue(timeout=10)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(rounds):
                q.enqueue(msg)
                r.dequeue(timeout=10)
            return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds
        finally:
            r.close()
            q.close()

    def count(self):
        return self.calls

    def fork(self, child_sleeps=0.0):
        """Fork; the child (after sleeping) returns into mpx's loop as a method would."""
        pid = os.fork()
        if pid == 0:
            time.sleep(child_sleeps)
            return "from the child"
        return pid


class FailsInInit:
    def __init__(self, ctx, bad_rank=1):
        if ctx.rank == bad_rank:
            raise KeyError(f"no such model on rank {ctx.rank}")


class DiesInInit:
    def __init__(self, ctx):
        if ctx.rank == 0:
            os._exit(7)


class HangsInInit:
    def __init__(self, ctx):
        if ctx.rank == 1:
            time.sleep(60)


class IgnoresTerm:
    def __init__(self, ctx):
        pass

    def stubborn(self, seconds):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(seconds)


class BadSetState:
    """Pickles fine in the driver, raises while being unpickled in the worker."""

    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise RuntimeError("cannot rebuild on this side")


def current_pid(worker):
    return os.getpid()


def interpreter(worker):
    return sys.executable


def where(worker):
    c = worker.ctx
    return (c.rank, c.local_rank, c.node_rank, c.local_world_size, os.getpid())


def node_of(worker):
    """(rank, node_rank, node_id, pid, ppid): where a worker runs, as mpx told it and as
    its process tree says (a follower node's workers are children of its Ray actor)."""
    c = worker.ctx
    return (c.rank, c.node_rank, c.node_id, os.getpid(), os.getppid())


class SlowOnNodeZero(Echo):
    """Node 0's first rank takes ``delay`` s in __init__: the follower's workers are ready
    long before the leader's startup ends."""

    def __init__(self, ctx, delay=2.5):
        super().__init__(ctx)
        if ctx.rank == 0:
            time.sleep(delay)
