"""The executor's behaviour, the same on every topology: 2 ranks on one node over shared
memory, 2 ranks on one node over ZeroMQ (``transport="zmq"``), and 2 nodes x 2 ranks (a
``python -m mpx node`` follower on loopback; its ranks relay through the follower's ring by
default, and ``2 nodes direct`` subscribes each remote rank to the driver itself)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import _workers
import numpy as np
import pytest
from _env import START_METHOD
from _nodes import KEY, free_port, start_follower, stop_follower

import mpx

TOPOLOGIES = ["1 node shm", "1 node zmq", "2 nodes", "2 nodes direct"]


@pytest.fixture(params=TOPOLOGIES)
def ex(request):
    """An Echo executor on the topology of the test's parameter; torn down afterwards."""
    made: list = []

    def make(**kw):
        kw.setdefault("start_method", START_METHOD)
        kw.setdefault("startup_timeout_s", 60)
        if request.param.startswith("1 node"):
            e = mpx.Executor(_workers.Echo, 2, transport=request.param.split()[-1], **kw)
            made.append((e, None))
            return e
        port = free_port()
        follower = start_follower(port)
        try:
            e = mpx.Executor(_workers.Echo, 4, nnodes=2, master_port=port, auth_key=KEY,
                             heartbeat_s=1.0,
                             relay="off" if request.param.endswith("direct") else "auto", **kw)
        except BaseException:
            follower.kill()
            follower.wait()
            raise
        made.append((e, follower))
        return e

    yield make
    for e, follower in made:
        e.shutdown()
        if follower is not None:
            stop_follower(follower)


def test_call_forms(ex):
    e = ex(worker_kwargs={"scale": 10})
    n = e.world_size
    assert e.collective_rpc("mul", args=(3,)) == [30 * (r + 1) for r in range(n)]
    assert e.collective_rpc(lambda w, x: w.ctx.rank * x, args=(3,)) == [3 * r for r in range(n)]
    assert e.collective_rpc(_workers.current_pid) == e.worker_pids
    assert e.collective_rpc("mul", kwargs={"x": 2}, unique_reply_rank=n - 1) == 20 * n
    assert e.collective_rpc("mul", args=(1,), aggregator=sum) == 10 * n * (n + 1) // 2
    fut = e.collective_rpc("rank", non_block=True)
    assert isinstance(fut, concurrent.futures.Future)
    assert fut.result(timeout=10) == list(range(n))
    e.check_health(timeout=10)
    assert not e.is_failed


def test_many_calls_in_flight_come_back_in_order(ex):
    e = ex()
    futs = [e.collective_rpc("ident", args=(i,), non_block=True) for i in range(200)]
    # read the last one first: completing it completes every earlier one on the way
    assert futs[-1].result(timeout=60) == [199] * e.world_size
    assert all(f.done() for f in futs)
    assert [f.result() for f in futs] == [[i] * e.world_size for i in range(200)]


def test_concurrent_callers_from_threads(ex):
    e = ex()
    errors = []

    def caller(t):
        try:
            for i in range(50):
                assert e.collective_rpc("ident", args=((t, i),)) == [(t, i)] * e.world_size
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)


def test_large_arguments_and_results(ex):
    e = ex()
    arr = np.arange(3 << 20, dtype=np.float32)  # 12 MiB: many slots and zmq chunks
    out = e.collective_rpc("ident", args=(arr,), timeout=60)
    assert len(out) == e.world_size
    for a in out:
        assert np.array_equal(a, arr) and a.flags.writeable
    blob = os.urandom(5 << 20)
    assert e.collective_rpc("ident", args=(blob,), unique_reply_rank=e.world_size - 1,
                            timeout=60) == blob


def test_errors_keep_the_executor_usable(ex):
    e = ex()
    last = e.world_size - 1
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("fail", kwargs={"ranks": [last]})
    err = ei.value
    assert err.ranks == [last] and err.exc_type == "ValueError"
    assert err.exc_message == f"bad value on rank {last}"
    assert "in fail" in err.remote_traceback and "raise ValueError" in err.remote_traceback
    assert "Remote traceback" in str(err) and isinstance(err, RuntimeError)
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("fail", kwargs={"ranks": [last]}, unique_reply_rank=0)
    assert ei.value.ranks == [last]
    with pytest.raises(mpx.RPCError, match="has no method 'nope'"):
        e.collective_rpc("nope")
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("unpicklable_result")
    assert ei.value.exc_type == "SerializationError"
    assert ei.value.ranks == list(range(e.world_size))
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("ident", args=(_workers.BadSetState(),))
    assert ei.value.exc_type == "DeserializationError"
    before = e.collective_rpc("count")
    # bad arguments raise before anything is sent: no worker runs "mul" (which counts)
    with pytest.raises(mpx.SerializationError):
        e.collective_rpc("mul", args=(threading.Lock(),))
    with pytest.raises(ValueError, match="unique_reply_rank"):
        e.collective_rpc("mul", args=(1,), unique_reply_rank=e.world_size)
    with pytest.raises(TypeError):
        e.collective_rpc(42)
    assert e.collective_rpc("count") == before
    assert e.collective_rpc("rank") == list(range(e.world_size))
    assert not e.is_failed


def test_timeout_names_ranks_and_late_reply_is_dropped(ex):
    e = ex()
    last = e.world_size - 1
    t0 = time.monotonic()
    with pytest.raises(mpx.RPCTimeoutError) as ei:
        e.collective_rpc("sleep", args=(1.0,), kwargs={"ranks": [last]}, timeout=0.3)
    assert time.monotonic() - t0 < 0.9
    assert ei.value.ranks == [last] and isinstance(ei.value, TimeoutError)
    assert f"[{last}]" in str(ei.value)
    fut = e.collective_rpc("sleep", args=(0.5,), non_block=True)
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.05)
    assert fut.result(timeout=10) == list(range(e.world_size))
    assert e.collective_rpc("ident", args=("fresh",)) == ["fresh"] * e.world_size
    assert not e.is_failed


def test_killed_worker_fails_pending_and_later_calls(ex):
    e = ex()
    last = e.world_size - 1
    seen = []
    e.register_failure_callback(lambda: seen.append(1))
    pending = e.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0]}, non_block=True)
    t0 = time.monotonic()
    os.kill(e.worker_pids[last], signal.SIGKILL)
    with pytest.raises(mpx.WorkerDiedError) as ei:
        pending.result(timeout=10)
    assert time.monotonic() - t0 < 3
    assert ei.value.rank == last
    assert e.is_failed
    deadline = time.monotonic() + 5  # the callbacks run once the survivors were stopped
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [1]
    with pytest.raises(mpx.ExecutorFailed):
        e.collective_rpc("rank")
