"""What bench_remote.py runs in other processes: the worker class of its executors (which the
follower node, ``python -m mpx node``, imports by name, with bench/ on its PYTHONPATH) and the
bare pyzmq baselines' children. Imports nothing heavy: the follower and its workers load it.
"""

from __future__ import annotations

import time

import zmq

ACK_LEN = 8


class RemoteWorker:
    """The executors' worker, on the driver's node and on the follower."""

    def __init__(self, ctx, **kw):
        self.rank = ctx.rank

    def noop(self):
        return None

    def take(self, t):
        """(when the call reached this rank's method, elements received): the arrival time
        is time.perf_counter (CLOCK_MONOTONIC, one clock for every process of the host)."""
        return time.perf_counter(), int(t.shape[0])


def _socket(ctx, kind):
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    return s


def rep_echo_child(conn):
    """Baseline of the no-op call: a REP socket on tcp://127.0.0.1 echoing every message;
    stops on an empty one."""
    ctx = zmq.Context()
    rep = _socket(ctx, zmq.REP)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    conn.close()
    try:
        while True:
            msg = rep.recv()
            rep.send(msg)
            if not msg:
                break
    finally:
        rep.close()
        ctx.term()


def pull_ack_child(idx, push_port, ack_port, conn):
    """Baseline of the 64 MiB argument: a PULL connected to the driver's PUSH; after each
    message (received with copy=False) it pushes (idx, bytes) to the driver's ack PULL.
    Stops on an empty message."""
    ctx = zmq.Context()
    pull = _socket(ctx, zmq.PULL)
    ack = _socket(ctx, zmq.PUSH)
    pull.connect(f"tcp://127.0.0.1:{push_port}")
    ack.connect(f"tcp://127.0.0.1:{ack_port}")
    conn.send("up")
    conn.close()
    try:
        while True:
            frame = pull.recv(copy=False)
            n = len(frame.buffer)
            del frame
            ack.send(idx.to_bytes(4, "little") + n.to_bytes(ACK_LEN - 4, "little"))
            if n == 0:
                break
    finally:
        pull.close()
        ack.close()
        ctx.term()


class RayNoop:
    """The Ray-actor baseline of bench_remote.py's launcher section: one actor per worker,
    called with ``ray.get([a.noop.remote() for a in actors])`` (made remote there)."""

    def noop(self):
        return None
