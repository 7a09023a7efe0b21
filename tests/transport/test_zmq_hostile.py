"""A ZeroMQ queue writer among hostile peers: a flood of junk and a storm of connections
hold no memory in it, and a replayed HELLO diverts no rank's traffic."""

from __future__ import annotations

import contextlib
import time

import _final_workers
import psutil
import pytest
import zmq

import mpx
from mpx.auth import Signer

KEY = "hostile-test-key-" + "x" * 16


@pytest.fixture
def cfg():
    return mpx.Config(auth_key=KEY, heartbeat_s=1.0)


@contextlib.contextmanager
def _remote_writer(ctx, cfg):
    """A queue writer in a process of its own (so that its memory can be measured) and its
    reader here: ``(handle, writer pid, through)``; ``through(obj)`` sends obj through it."""
    parent, child = ctx.Pipe()
    writer = ctx.Process(target=_final_workers.queue_writer, args=(KEY, child), daemon=True)
    writer.start()
    r = None
    try:
        assert parent.poll(60)
        h = parent.recv()
        r = mpx.MessageQueue.create_from_handle(h, 0, config=cfg)
        assert parent.poll(30) and parent.recv() == "ready"

        def through(obj):
            parent.send(obj)
            assert parent.poll(10) and parent.recv() == "sent"
            assert r.dequeue(timeout=10) == obj

        for i in range(300):  # (what the writer allocates once is no growth)
            through(i)
        yield h, writer.pid, through
    finally:
        parent.send(None)
        writer.join(10)
        if r is not None:
            r.close()


@contextlib.contextmanager
def _peer(ctx, target, *args):
    """A hostile peer: ``target(*args, conn)`` in a process, and this end of ``conn``."""
    conn, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, child), daemon=True)
    p.start()
    try:
        yield conn
        p.join(10)
    finally:
        if p.is_alive():
            p.kill()
            p.join(5)


def test_a_flood_of_junk_holds_no_memory_in_the_writer(ctx, cfg):
    with _remote_writer(ctx, cfg) as (h, pid, through):
        rss = psutil.Process(pid).memory_info
        before = peak = rss().rss
        with _peer(ctx, _final_workers.flood, h.zmq["endpoint"], 256) as fconn:
            assert fconn.poll(60) and fconn.recv() == "flooding"
            i = 0
            until = time.monotonic() + 3
            while time.monotonic() < until:  # the queue works meanwhile
                through(("during", i))
                i += 1
                peak = max(peak, rss().rss)
            fconn.send("stop")
            assert fconn.poll(30)
            offered = fconn.recv()
        assert offered >= 256 << 20
        assert peak - before < 8 << 20, f"the writer grew by {(peak - before) >> 20} MiB"
        through("after the flood")


def test_a_storm_of_connections_holds_no_memory_in_an_idle_writer(ctx, cfg):
    """Short connections that speak ZMTP, push junk and close, at 500/s or more, cost an
    idle writer nothing (each one cost it ~20 KiB until it read: an idle writer never
    did); the queue works meanwhile and after."""
    seconds = 3
    with _remote_writer(ctx, cfg) as (h, pid, through):
        rss = psutil.Process(pid).memory_info
        before = peak = rss().rss
        with _peer(ctx, _final_workers.storm, h.zmq["endpoint"], seconds) as sconn:
            assert sconn.poll(60) and sconn.recv() == "storming"
            i = 0
            while not sconn.poll(0.05):  # idle, but for a message every half second
                peak = max(peak, rss().rss)
                i += 1
                if not i % 10:
                    through(("during", i))
            connections = sconn.recv()
        time.sleep(0.2)
        peak = max(peak, rss().rss)
        assert connections >= 500 * seconds, f"only {connections} connections in {seconds} s"
        assert peak - before < 8 << 20, f"the writer grew by {(peak - before) >> 20} MiB"
        through("after the storm")


def _dealer(endpoint, routing_id=None):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    s.connect(endpoint)
    return s


def test_a_replayed_hello_diverts_nothing_and_a_fresh_one_is_accepted(cfg, monkeypatch):
    with mpx.MessageQueue(2, 0, config=cfg) as q:
        h = q.export_handle()
        sent = []  # the HELLO reader 0 sends, as an eavesdropper captures it

        def capture(signer, header, parts):
            frame = auth_seal(signer, header, parts)
            sent.append(frame)
            return frame

        auth_seal = Signer.seal
        monkeypatch.setattr(Signer, "seal", capture)
        r0 = mpx.MessageQueue.create_from_handle(h, 0, config=cfg)
        monkeypatch.undo()
        (hello,) = sent
        r1 = None
        evil = []
        try:
            with pytest.raises(mpx.QueueTimeout, match=r"ranks \[1\]"):
                q.wait_until_ready(0.5)  # rank 0's HELLO is taken
            # the captured HELLO replayed from another connection, and from one that claims
            # reader 0's routing id
            for routing_id in (None, getattr(r0._reader, "_routing_id", None)):
                s = _dealer(h.zmq["endpoint"], routing_id)
                s.send(hello)
                evil.append(s)
            time.sleep(0.3)
            r1 = mpx.MessageQueue.create_from_handle(h, 1, config=cfg)  # a fresh HELLO
            q.wait_until_ready(10)
            for i in range(3):
                q.enqueue(("for the readers", i))
                assert r0.dequeue(timeout=5) == ("for the readers", i)
                assert r1.dequeue(timeout=5) == ("for the readers", i)
            assert not any(s.poll(200) for s in evil), "an attacker got a reader's messages"
        finally:
            for s in evil:
                s.close()
            r0.close()
            if r1 is not None:
                r1.close()
