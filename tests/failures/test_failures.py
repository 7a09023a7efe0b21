"""Peers that die: SIGKILL of the writer or a reader, idle cost, and stale segments."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import _procs
import psutil
import pytest

import mpx
from mpx.mechanism import segments

pytestmark = pytest.mark.usefixtures("impl")

DETECT_S = 1.0  # the bound: a peer's death is reported within a second


def spawn_writer(ctx, msgs, then):
    parent, child = ctx.Pipe()
    w = ctx.Process(target=_procs.writer_process, args=(1, child, msgs, then), daemon=True)
    w.start()
    assert parent.poll(30)
    return w, parent, parent.recv()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_writer_sigkilled_mid_stream(ctx, seed):
    w, conn, handle = spawn_writer(ctx, [], "stream")
    r = mpx.MessageQueue.create_from_handle(handle, 0)
    try:
        rnd = random.Random(seed)
        stop_at = time.monotonic() + rnd.random() * 0.5
        n = 0
        while time.monotonic() < stop_at:
            r.dequeue(timeout=10)
            n += 1
        os.kill(w.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(mpx.PeerDiedError) as ei:
            while True:
                r.dequeue(timeout=10)
        took = time.monotonic() - killed
        assert took < DETECT_S, took
        assert f"pid {w.pid}" in str(ei.value) and ei.value.role == "writer"
        w.join(5)
    finally:
        r.close()


def test_writer_sigkilled_while_reader_parked(ctx):
    w, conn, handle = spawn_writer(ctx, [], "hang")
    r = mpx.MessageQueue.create_from_handle(handle, 0)
    try:
        assert conn.poll(10) and conn.recv() == "sent"
        threading.Timer(0.5, os.kill, (w.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(mpx.PeerDiedError, match="died"):
            r.dequeue(timeout=10)
        assert time.monotonic() - t0 < 0.5 + DETECT_S
        w.join(5)
    finally:
        r.close()


def test_reader_sigkilled_while_writer_waits_for_space(ctx):
    q = mpx.MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=4)
    try:
        h = q.export_handle()
        slow, sconn = _procs.start(ctx, _procs.slow_reader, h)
        ok, oconn = _procs.start(ctx, _procs.echo_reader, h, 1)
        assert sconn.recv()[0] == "ready" and oconn.recv()[0] == "ready"
        q.wait_until_ready(10)
        for i in range(4):
            q.enqueue(i)
        threading.Timer(0.3, os.kill, (slow.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(mpx.PeerDiedError) as ei:
            q.enqueue("blocked", timeout=10)
        assert time.monotonic() - t0 < 0.3 + DETECT_S
        e = ei.value
        assert (e.role, e.rank, e.pid) == ("reader", 0, slow.pid)
        assert "reader rank 0" in str(e) and str(slow.pid) in str(e)
        slow.join(5)
    finally:
        q.close()
        ok.join(10)


@pytest.mark.parametrize("seed", [1, 2])
def test_reader_sigkilled_at_random_point(ctx, seed):
    q = mpx.MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
    try:
        p, conn = _procs.start(ctx, _procs.checking_reader, q.export_handle(), 0, 10**9, seed)
        q.wait_until_ready(30)
        rnd = random.Random(seed)
        threading.Timer(rnd.random() * 0.5, os.kill, (p.pid, signal.SIGKILL)).start()
        with pytest.raises(mpx.PeerDiedError, match=f"rank 0 \\(pid {p.pid}\\) died"):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                q.enqueue(os.urandom(rnd.randrange(1, 10000)), timeout=10)
        p.join(5)
    finally:
        q.close()


def test_idle_parked_reader_uses_no_cpu(ctx):
    q = mpx.MessageQueue(1, 1)
    try:
        p, conn = _procs.start(ctx, _procs.idle_reader, q.export_handle())
        assert conn.recv()[0] == "ready"
        q.wait_until_ready(10)
        proc = psutil.Process(p.pid)
        time.sleep(0.3)
        c0 = sum(proc.cpu_times()[:2])
        time.sleep(3)
        used = sum(proc.cpu_times()[:2]) - c0
        assert used / 3 < 0.02, f"idle reader used {used / 3:.1%} of a core"
        q.enqueue("wake")
        assert conn.poll(5) and conn.recv()[:2] == ("got", ("obj", "'wake'"))
        p.join(10)
    finally:
        q.close()


def test_stale_segment_of_dead_creator_is_reaped(ctx):
    w, conn, handle = spawn_writer(ctx, [], "hang")
    name = handle.shm["shm_name"]
    os.kill(w.pid, signal.SIGKILL)  # before any reader attached: the name is still there
    w.join(5)
    assert os.path.exists("/dev/shm" + name)
    assert name in segments.stale_segments()
    out = subprocess.run([sys.executable, "-m", "mpx", "cleanup"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert name.lstrip("/") in out.stdout
    assert not os.path.exists("/dev/shm" + name)


def test_new_queue_reaps_stale_segments(ctx):
    w, conn, handle = spawn_writer(ctx, [], "hang")
    name = handle.shm["shm_name"]
    os.kill(w.pid, signal.SIGKILL)
    w.join(5)
    with mpx.MessageQueue(1, 1):
        assert not os.path.exists("/dev/shm" + name)
