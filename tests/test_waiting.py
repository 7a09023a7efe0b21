"""The wait policy across processes: a waiter whose yields hand its core away parks at
once, and one on a quiet host yields (mpx._ring._RingEnd's docstring; over ZeroMQ,
ZmqReader's)."""

from __future__ import annotations

import os
import subprocess
import sys

import _procs
import pytest

import mpx

KEY = "test-key-" + "c" * 20

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to pin to")


def _busy_loops(n, cpu):
    """``n`` busy-loop processes pinned to ``cpu``, killed with this process."""
    code = ("import ctypes, os, signal; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
            f"os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass")
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def _stop(loops):
    for p in loops:
        p.kill()
        p.wait()


@pytest.mark.parametrize("remote", [False, True], ids=["shm", "zmq"])
def test_a_reader_on_a_crowded_core_parks_first_and_yields_again_once_it_is_quiet(impl, ctx, remote):
    """The reader (this thread) shares its CPU with two busy loops, the writer (a child
    process on the other CPU) sends a message every millisecond: each yield returns a time
    slice late, so the reader learns that a wake costs less and parks at once. Once the
    loops are gone, a window of yielding finds quick yields, and it yields again. The same
    over ZeroMQ, whose reader judges by how long the yield took that found the message."""
    cpu_a, cpu_b = sorted(os.sched_getaffinity(0))[:2]
    # (a wide window: each message is found yielding)
    cfg = mpx.Config(spin_us=0, yield_us=50_000, **(dict(auth_key=KEY, heartbeat_s=5.0)
                                                    if remote else {}))
    if remote:
        w, conn = _procs.start(ctx, _procs.paced_remote_writer, cfg, cpu_b, 0.001, 0.0)
    else:
        w, conn = _procs.start(ctx, _procs.paced_writer, cpu_b, 0.001, 0.0)
    mine = os.sched_getaffinity(0)
    loops = []
    q = mpx.MessageQueue.create_from_handle(conn.recv(), 0, config=cfg)
    ring = q.reading_end() if remote else q.reading_end()._ring
    try:
        q.wait_until_ready(10)
        assert not ring.parks_first
        loops = _busy_loops(2, cpu_a)
        os.sched_setaffinity(0, {cpu_a})  # (this thread)
        for _ in range(1000):
            q.dequeue(timeout=10)
            if ring.parks_first:
                break
        assert ring.parks_first, (ring.yield_cost_ns, ring.wake_cost_ns)
        _stop(loops)
        yielding = 0  # reads in a row since it last parked first
        for _ in range(5000):  # a span parked (256 waits), then a window yielding (32)...
            q.dequeue(timeout=10)
            yielding = 0 if ring.parks_first else yielding + 1
            if yielding > 64:  # ...which it kept: it yields again
                break
        assert yielding > 64, (ring.yield_cost_ns, ring.wake_cost_ns)
    finally:
        os.sched_setaffinity(0, mine)
        _stop(loops)
        conn.send("stop")
        q.close()
        w.join(10)
        conn.close()


def test_a_reader_whose_yields_run_the_writers_work_keeps_yielding(impl, ctx):
    """The reader (this thread) and the writer share one CPU and nothing else runs there:
    each of the reader's yields hands the core to the writer, which works 2 ms on the
    message and publishes it. The yields return milliseconds later, but never late after
    the message was published: the reader does not take the host for crowded."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    w, conn = _procs.start(ctx, _procs.paced_writer, cpu, 0.0005, 0.002)
    mine = os.sched_getaffinity(0)
    q = mpx.MessageQueue.create_from_handle(conn.recv(), 0, config=mpx.Config(
        spin_us=0, yield_us=50_000))
    ring = q.reading_end()._ring
    try:
        q.wait_until_ready(10)
        os.sched_setaffinity(0, {cpu})
        run = longest = 0  # reads in a row that did not park first (a rule that judged
        costliest = 0      # a yield by its length would park first from the first)
        for _ in range(1000):
            q.dequeue(timeout=10)
            run = 0 if ring.parks_first else run + 1
            longest = max(longest, run)
            costliest = max(costliest, ring.yield_cost_ns)
            if longest > 64:
                break
        assert longest > 64, (ring.yield_cost_ns, ring.wake_cost_ns)
        # (the last yields may have met the writer asleep; some ran its work)
        assert costliest > 100_000, "the yields ran the writer's work"
    finally:
        os.sched_setaffinity(0, mine)
        conn.send("stop")
        q.close()
        w.join(10)
        conn.close()
