"""Workers and child processes of tests/executor/test_final_replies.py and
tests/transport/test_zmq_hostile.py;
module level so that every start method imports them."""

from __future__ import annotations

import os
import socket
import struct
import threading
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
    offered. (Not a storm of connections: see storm().)"""
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


# What a ZeroMQ DEALER says first (ZMTP 3.1, NULL mechanism): its greeting and READY.
_ZMTP_GREETING = b"\xff" + bytes(7) + b"\x01\x7f\x03\x01" + b"NULL".ljust(20, b"\x00") + bytes(32)
_ZMTP_READY_BODY = (b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
                    + b"\x08Identity" + struct.pack(">I", 0))
_ZMTP_HELLO = _ZMTP_GREETING + bytes([0x04, len(_ZMTP_READY_BODY)]) + _ZMTP_READY_BODY


def storm(endpoint: str, seconds: float, conn, threads: int = 8) -> None:
    """An unauthenticated peer storming a queue writer's ``endpoint`` with short connections
    for ``seconds``: each one speaks ZMTP as a DEALER, waits (a few ms at most) for the
    writer's greeting and READY, pushes four junk messages and closes. Answers "storming"
    once begun, then how many connections it opened."""
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    junk = (bytes([0x00, 200]) + os.urandom(200)) * 4
    until = time.monotonic() + seconds
    counts = [0] * threads

    def loop(i):
        while time.monotonic() < until:
            try:
                with socket.create_connection((host, int(port)), timeout=1) as s:
                    counts[i] += 1
                    s.sendall(_ZMTP_HELLO)
                    s.settimeout(0.005)
                    got = b""
                    while len(got) <= len(_ZMTP_GREETING):
                        b = s.recv(4096)
                        if not b:
                            break
                        got += b
                    s.sendall(junk)
            except OSError:
                pass  # refused, cut off, or no READY in time

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    conn.send("storming")
    for t in workers:
        t.join()
    conn.send(sum(counts))
