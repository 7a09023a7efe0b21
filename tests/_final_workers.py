"""Workers and child processes of tests/test_final_replies.py and tests/test_zmq_hostile.py;
module level so that every start method imports them."""

from __future__ import annotations

import os
import socket
import time

import zmq

import mpx


class LastWords:
    """A worker that answers with a large reply and then dies of a fatal error."""

    def __init__(self, ctx: mpx.WorkerContext) -> None:
        self.ctx = ctx

    def big(self, nbytes: int) -> bytes:
        return bytes([self.ctx.rank % 256]) * nbytes

    def exit(self, code: int, rank: int) -> int:
        """End worker ``rank`` as a fatal error does: SystemExit out of the RPC loop."""
        if self.ctx.rank == rank:
            raise SystemExit(code)
        return self.ctx.rank


class _ExitsInGetOutput:
    """A result whose get_output() (run by the output thread with async_output) raises
    SystemExit(code)."""

    def __init__(self, code: int) -> None:
        self.code = code

    def get_output(self):
        raise SystemExit(self.code)


class LastWordsThenOutputFails(LastWords):
    def exit_in_output(self, code: int, rank: int):
        """End worker ``rank`` from where its replies are made: the result's get_output()."""
        return _ExitsInGetOutput(code) if self.ctx.rank == rank else self.ctx.rank


def queue_writer(key: str, conn) -> None:
    """A queue writer for one remote reader (rank 0), in a process of its own so that its
    memory can be measured: sends its handle, then enqueues each object it is sent, answering
    "sent", until None."""
    q = mpx.MessageQueue(1, 0, config=mpx.Config(auth_key=key, heartbeat_s=1.0))
    try:
        conn.send(q.export_handle())
        q.wait_until_ready(30)
        conn.send("ready")
        while (obj := conn.recv()) is not None:
            q.enqueue(obj, timeout=10)
            conn.send("sent")
    finally:
        q.close()


def flood(endpoint: str, big_frames: int, conn) -> None:
    """An unauthenticated peer at a queue writer's ``endpoint``: offers ``big_frames`` junk
    frames of 1 MiB over ZeroMQ, then small junk frames from 8 connections, and random bytes
    over plain TCP on 4 more, until told to stop (anything on ``conn``); answers with what it
    offered. (Not a storm of connections: each one the writer has not read costs ~32 KiB.)"""
    ctx = zmq.Context()
    junk = os.urandom(1 << 20)
    offered = 0
    big = ctx.socket(zmq.DEALER)
    big.connect(endpoint)
    for _ in range(big_frames):
        big.send(junk, copy=False)  # (its send queue holds them all: 1000 messages)
        offered += len(junk)
    smalls = [ctx.socket(zmq.DEALER) for _ in range(8)]
    for s in smalls:
        s.setsockopt(zmq.SNDTIMEO, 0)
        s.connect(endpoint)
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    conn.send("flooding")
    raws = 0
    while not conn.poll(0):
        for s in smalls:
            for _ in range(100):
                try:
                    s.send(junk[:200], zmq.NOBLOCK)
                    offered += 200
                except zmq.Again:
                    break
        if raws < 4:
            raws += 1
            try:
                with socket.create_connection((host, int(port)), timeout=1) as raw:
                    raw.sendall(junk)
                    offered += len(junk)
            except OSError:
                pass  # the writer cut it off
        time.sleep(0.001)
    conn.send(offered)
    ctx.destroy(linger=0)
