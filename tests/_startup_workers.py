"""Worker classes of tests/failures/test_startup_exit.py: workers that end at a chosen moment, and
workers that join a gloo group. Module level so that every start method imports them."""

from __future__ import annotations

import multiprocessing.connection
import os
import resource
import sys
import threading
import time

import mpx
from mpx.protocol.wire import Ready


def end(how: str, code: int) -> None:
    """End this process: 'sys.exit' (code; every finally runs, the queues close first),
    'os._exit' (code), 'signal' (signal ``code``, at once)."""
    if how == "sys.exit":
        sys.exit(code)
    if how == "os._exit":
        os._exit(code)
    if how == "signal":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # (SIGABRT, SIGSEGV: no core file)
        os.kill(os.getpid(), code)
        time.sleep(10)
    raise ValueError(f"unknown end {how!r}")


class ExitsAfterReady:
    """Rank 0 ends (``end(how, code)``) right after it sent its response queue's handle;
    with ``slow_s``, rank 1 sleeps that long in ``__init__`` first, so the driver is still
    waiting for it when rank 0 ends."""

    def __init__(self, ctx: mpx.WorkerContext, how: str, code: int, slow_s: float = 0.0) -> None:
        self.ctx = ctx
        if ctx.rank == 1:
            time.sleep(slow_s)
        if ctx.rank != 0:
            return
        send = multiprocessing.connection.Connection.send

        def send_then_end(conn, obj):
            send(conn, obj)
            if isinstance(obj, Ready):
                end(how, code)

        multiprocessing.connection.Connection.send = send_then_end  # type: ignore[method-assign]

    def pid(self):
        return os.getpid()


class FailsInInit:
    """``__init__`` raises on rank 1."""

    def __init__(self, ctx: mpx.WorkerContext) -> None:
        if ctx.rank == 1:
            raise ValueError("no good")


def _linger_then(seconds: float, how: str, code: int) -> None:
    time.sleep(seconds)
    if how == "signal":
        end(how, code)


class Exits:
    """``end(how, code, rank, linger_s)``: rank ``rank`` ends; with ``linger_s`` its process
    outlives its closed queues by that long (a non-daemon thread: the interpreter waits for
    it), then exits with ``code`` (how='sys.exit') or dies of signal ``code``
    (how='signal')."""

    def __init__(self, ctx: mpx.WorkerContext) -> None:
        self.ctx = ctx

    def pid(self):
        return os.getpid()

    def init_method(self):
        return self.ctx.distributed_init_method

    def end(self, how: str, code: int, rank: int, linger_s: float = 0.0):
        if self.ctx.rank != rank:
            return self.ctx.rank
        if not linger_s:
            end(how, code)
        threading.Thread(target=_linger_then, args=(linger_s, how, code)).start()
        sys.exit(code if how == "sys.exit" else 0)  # the queues close now


class GlooAllReduce:
    """Joins a gloo group through ``ctx.distributed_init_method`` in ``__init__``, as an
    engine's worker does; ``all_reduce(x)`` sums ``x`` over the ranks."""

    def __init__(self, ctx: mpx.WorkerContext) -> None:
        import datetime

        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=ctx.distributed_init_method,
                                rank=ctx.rank, world_size=ctx.world_size,
                                timeout=datetime.timedelta(seconds=60))

    def all_reduce(self, x: float) -> float:
        import torch
        import torch.distributed as dist
        t = torch.tensor([x])
        dist.all_reduce(t)
        return float(t.item())

    def __del__(self) -> None:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
