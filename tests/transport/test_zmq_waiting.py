"""A reader over ZeroMQ waits as a ring's reader does (mpx.mechanism.waiting, ZmqReader's docstring):
it looks at its socket with sched_yield for its yield budget before it blocks in libzmq,
the budget adapts to how long its waits are, and ``yield_us=0`` blocks at once. (A reader
whose yields hand its core away parks at once: tests/ring/test_waiting.py, for both transports.)"""

from __future__ import annotations

import contextlib
import threading
import time

import _workers
import psutil

import mpx
from mpx.transport.zmq_reader import ZmqReader

KEY = "test-key-" + "w" * 20


@contextlib.contextmanager
def _pair(**config):
    """(writer queue, reader queue, the reader's ZmqReader) in this process, ready."""
    cfg = mpx.Config(auth_key=KEY, heartbeat_s=1.0, **config)
    with mpx.MessageQueue(1, 0, config=cfg) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=cfg)
        try:
            q.wait_until_ready(10)
            r.wait_until_ready(10)
            end = r.reading_end()
            assert isinstance(end, ZmqReader)
            yield q, r, end
        finally:
            r.close()


def _one_after(q, r, seconds):
    """Dequeue a message that ``q`` enqueues ``seconds`` from now (from another thread)."""
    t = threading.Timer(seconds, q.enqueue, args=("x",))
    t.start()
    try:
        assert r.dequeue(timeout=10) == "x"
    finally:
        t.join()


def test_the_yield_budget_shrinks_for_long_waits_and_grows_back_for_short_ones():
    window = 50_000_000  # 50 ms: wide, so that the host's load cannot blur the two cases
    with _pair(spin_us=0, yield_us=window // 1000) as (q, r, end):
        assert end.yield_budget_ns == window
        for _ in range(5):
            _one_after(q, r, 0.12)  # > the window: yielding could not have found it
        assert end.yield_budget_ns <= window // 32
        assert end.yield_cost_ns > 0  # (it yielded while its budget lasted)
        q.enqueue("there")
        time.sleep(0.05)
        assert r.dequeue(timeout=10) == "there"  # taken at once: the budget is left as it is
        assert end.yield_budget_ns <= window // 32
        grown = [end.yield_budget_ns]
        for _ in range(14):
            _one_after(q, r, 0.002)  # well within the window: a yield phase would find it
            grown.append(end.yield_budget_ns)
        assert all(a <= b <= window for a, b in zip(grown, grown[1:])), grown
        assert grown[-1] >= 2_000_000 and grown[-1] > grown[0], grown


def test_a_reader_with_no_yield_window_blocks_at_once():
    with _pair(spin_us=0, yield_us=0) as (q, r, end):
        for delay in (0.0, 0.003, 0.003):
            _one_after(q, r, delay)
        assert end.yield_cost_ns == 0 and end.yield_budget_ns == 0


def test_a_shutdown_ends_a_wait_in_its_yield_phase():
    with _pair(spin_us=0, yield_us=1_000_000) as (q, r, end):  # a 1 s yield phase
        result = []

        def read():
            try:
                r.dequeue(timeout=10)
            except BaseException as e:
                result.append((e, time.monotonic()))
        t = threading.Thread(target=read)
        t.start()
        time.sleep(0.1)  # (yielding now)
        t0 = time.monotonic()
        r.shutdown()
        t.join(5)
        assert isinstance(result[0][0], mpx.Cancelled)
        assert result[0][1] - t0 < 0.5


def test_an_idle_zmq_worker_and_its_driver_use_almost_no_cpu():
    """After its yield window a waiting end blocks in libzmq: a group over ZeroMQ that
    waits for calls, and a driver waiting for a reply that does not come, cost ~0% CPU."""
    with mpx.Executor(_workers.Echo, world_size=1, transport="zmq", auth_key=KEY) as ex:
        ex.collective_rpc("sleep", args=(0.0,))
        pid = ex.worker_pids[0]
        fut = ex.collective_rpc("sleep", args=(1.5,), non_block=True)
        time.sleep(0.2)  # (the worker is in its 1.5 s nap: the driver waits for its reply)
        worker = psutil.Process(pid)
        w0, d0 = sum(worker.cpu_times()[:2]), time.process_time()
        fut.result(timeout=10)
        time.sleep(1.0)  # (now the worker waits for the next call)
        w1, d1 = sum(worker.cpu_times()[:2]), time.process_time()
        assert d1 - d0 < 0.05, f"the driver used {d1 - d0:.3f} s of CPU in 2.3 s of waiting"
        assert w1 - w0 < 0.05, f"the worker used {w1 - w0:.3f} s of CPU in 2.3 s"

