"""The RPC loops the benchmarks time, on mpx's public API only: the worker most of them call,
an mpx.Executor of it, and the baselines: a multiprocessing.Pipe RPC loop, and the same loop
on bare MessageQueues (what the shared-memory transport costs without the Executor).
"""

from __future__ import annotations

import contextlib
import time

import kit_procs
import kit_timing

import mpx

SETUP_TIMEOUT = CALL_TIMEOUT = 60.0


class Worker:
    """The worker of most benchmarks: mpx builds it with a context, a Pipe child without."""

    def __init__(self, ctx=None, **kw):
        self.rank = 0 if ctx is None else ctx.rank

    def noop(self):
        return None

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    def take(self, t):
        return int(t.shape[0])

    def nbytes(self, b):
        return len(b)

    def step(self, d):
        return len(d["req_ids"])

    def stamp(self):  # CLOCK_MONOTONIC (system-wide) as the reply leaves
        return time.monotonic_ns()


def new_executor(n, worker=Worker, **kw):
    ex = mpx.Executor(worker, world_size=n, start_method="spawn", **kw)
    kit_procs.child_pids.update(ex.worker_pids)
    return ex


def payload_size(obj):
    """The payload's size in bytes (an array's nbytes)."""
    return int(getattr(obj, "nbytes", None) or len(obj))


class CallOn:
    """A PipePeers handler: ``(method, args, kwargs)`` calls that method of ``worker``."""

    def __init__(self, worker):
        self.worker = worker

    def __call__(self, msg):
        method, args, kwargs = msg
        return getattr(self.worker, method)(*args, **kwargs)


def serve(recv, reply, handler):
    """Answer each object from ``recv`` with ``reply(handler(obj))``, until None arrives."""
    while (obj := recv()) is not None:
        answer = handler(obj)
        del obj  # free a big payload before the next one arrives
        reply(answer)


def _pipe_child(conn, handler):
    serve(conn.recv, conn.send, handler)
    conn.close()


class PipePeers:
    """``n`` spawn children, each at the end of its own multiprocessing.Pipe, answering every object
    with ``handler(obj)`` (child i with ``handler[i]`` given a list): the baseline. ``rpc(method,
    *args)`` with ``CallOn`` handlers is the Pipe RPC loop: the call to every child, then every
    answer."""

    def __init__(self, n, handler):
        self.conns, self.procs = [], []
        for h in handler if isinstance(handler, list) else [handler] * n:
            a, b = kit_procs.CTX.Pipe()
            self.procs.append(kit_procs.start(_pipe_child, (b, h)))
            b.close()
            self.conns.append(a)
        self.pids = [p.pid for p in self.procs]

    def call(self, obj):
        for c in self.conns:
            c.send(obj)
        return [c.recv() for c in self.conns]

    def rpc(self, method, *args):
        return self.call((method, args, {}))

    def close(self):
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send(None)
        for p in self.procs:
            kit_procs.join(p, 10, what="Pipe child")
        for c in self.conns:
            c.close()


def pipe_rpc(n, worker=Worker):
    return PipePeers(n, CallOn(worker()))


def _queue_child(handle, rank, conn, worker):
    """The RPC loop of an executor's worker straight on MessageQueues: reader ``rank`` of the
    broadcast queue in, a one-reader queue back."""
    worker, q_in, back = worker(), mpx.MessageQueue.create_from_handle(handle, rank), mpx.MessageQueue(1, 1)
    conn.send(back.export_handle())
    back.wait_until_ready(timeout=SETUP_TIMEOUT)
    q_in.wait_until_ready(timeout=SETUP_TIMEOUT)
    while (msg := q_in.dequeue(indefinite=True)) is not None:
        _, seq, method, args, _, _ = msg
        back.enqueue((seq, 0, getattr(worker, method)(*args)))
    back.close()
    q_in.close()


class QueueRPC:
    """The Pipe RPC loop on bare MessageQueues (one broadcast queue, one back from each of ``n``
    children), its messages shaped as the executor's (a 6-tuple call, a 3-tuple reply): what the
    shared-memory transport costs without the Executor."""

    def __init__(self, n=1, worker=Worker):
        self.q, self.back = mpx.MessageQueue(n, n), []
        self.procs = []
        for rank in range(n):
            a, b = kit_procs.CTX.Pipe()
            self.procs.append(kit_procs.start(_queue_child, (self.q.export_handle(), rank, b, worker)))
            b.close()
            if not a.poll(SETUP_TIMEOUT):
                raise RuntimeError("a MessageQueue RPC child did not come up")
            self.back.append(mpx.MessageQueue.create_from_handle(a.recv(), 0))
            a.close()
        for q in [self.q, *self.back]:
            q.wait_until_ready(timeout=SETUP_TIMEOUT)
        self.pids, self.seq = [p.pid for p in self.procs], 0

    def call(self, method, *args):
        self.seq += 1
        self.q.enqueue((0, self.seq, method, args, None, None))
        return [back.dequeue(timeout=CALL_TIMEOUT)[2] for back in self.back]

    def close(self):
        self.q.enqueue(None, timeout=SETUP_TIMEOUT)
        for p in self.procs:
            kit_procs.join(p, 10, what=None)
        for q in [*self.back, self.q]:
            q.close()


def queue_round_trip(make_msgs, iters, warm):
    """us of enqueue + dequeue of each of ``make_msgs()``, in this process, on one MessageQueue with
    its reader here: encode, ring write, ring read, decode, and no wake."""
    q = mpx.MessageQueue(1, 1)
    r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
    try:
        q.wait_until_ready(timeout=SETUP_TIMEOUT)
        r.wait_until_ready(timeout=SETUP_TIMEOUT)
        msgs = make_msgs()

        def rt():
            for m in msgs:
                q.enqueue(m)
                r.dequeue(timeout=CALL_TIMEOUT)
        return kit_timing.timed_us(rt, iters, warm)
    finally:
        r.close()
        q.close()
