"""mpx.Executor across real worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import _env
import _procs
import _workers
import psutil
import pytest
from _env import START_METHOD
from _workers import Echo

import mpx

START_METHODS = ["fork", "spawn", "forkserver"]


@pytest.fixture
def ex(executor):
    return executor


@pytest.mark.parametrize("start_method", START_METHODS)
def test_every_start_method_starts_and_calls(ex, start_method):
    """(Every call form on every topology: test_executor_topologies.py.)"""
    e = ex(n=2, worker_kwargs={"scale": 10}, start_method=start_method)
    assert e.collective_rpc("mul", args=(3,)) == [30, 60]
    assert e.collective_rpc(lambda w, x: w.ctx.rank * x, args=(3,)) == [0, 3]
    assert e.collective_rpc(_workers.current_pid) == e.worker_pids
    assert e.collective_rpc("mul", args=(5,), non_block=True).result(timeout=10) == [50, 100]
    assert not e.is_failed


def test_worker_context(ex):
    e = ex(n=2)
    ctxs = e.collective_rpc("context")
    assert [c["rank"] for c in ctxs] == [0, 1]
    for c in ctxs:
        assert c["world_size"] == c["local_world_size"] == 2 and c["node_rank"] == 0
        assert c["local_rank"] == c["rank"]
        assert c["dist"].startswith("tcp://127.0.0.1:") and c["dist"] == ctxs[0]["dist"]
        if START_METHOD != "forkserver":
            assert c["ppid"] == os.getpid()  # (the forkserver is a forkserver child's parent)
        expect = os.environ.get("OMP_NUM_THREADS", str(max(1, os.cpu_count() // 2)))
        assert c["omp"] == expect


@pytest.mark.parametrize("start_method", START_METHODS)
def test_worker_exit_in_method_is_worker_died(ex, start_method):
    e = ex(n=2, start_method=start_method)
    calls = []
    e.register_failure_callback(lambda: calls.append(1))
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerDiedError) as ei:
        e.collective_rpc("exit", args=(3,), kwargs={"ranks": [1]})
    assert time.monotonic() - t0 < 2
    err = ei.value
    assert err.rank == 1 and err.exitcode == 3 and "exit code 3" in str(err)
    assert str(e.worker_pids[1]) in str(err)
    assert isinstance(err, mpx.ExecutorFailed) and isinstance(err, RuntimeError)
    assert e.is_failed
    with pytest.raises(mpx.WorkerDiedError):
        e.collective_rpc("rank")
    # the callbacks run once the survivor (idle: it takes the stop message) is gone
    deadline = time.monotonic() + 2
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls == [1]
    assert not _procs.running(e.worker_pids[0])
    late = []
    e.register_failure_callback(lambda: late.append(1))
    assert late == [1]
    time.sleep(0.2)
    assert calls == [1]


def test_a_stray_sigterm_leaves_the_worker_serving(ex):
    # the driver stops its workers, not a SIGTERM from elsewhere (more in test_signals.py)
    e = ex(n=1)
    os.kill(e.worker_pids[0], signal.SIGTERM)
    time.sleep(0.2)
    assert e.collective_rpc("rank", timeout=5) == [0]
    assert not e.is_failed


@pytest.mark.parametrize("start_method", START_METHODS)
def test_init_error_is_startup_error(start_method):
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerStartupError) as ei:
        mpx.Executor(_workers.FailsInInit, 2, start_method=start_method)
    assert time.monotonic() - t0 < 15
    assert ei.value.ranks == [1]
    assert "KeyError" in str(ei.value) and "no such model on rank 1" in str(ei.value)
    assert "in __init__" in ei.value.remote_traceback


def test_worker_dying_in_init_and_never_ready():
    with pytest.raises(mpx.WorkerStartupError, match=r"rank 0 \(pid \d+\) died during startup: exit code 7"):
        mpx.Executor(_workers.DiesInInit, 2)
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerStartupError, match=r"workers \[1\] did not become ready"):
        mpx.Executor(_workers.HangsInInit, 2, startup_timeout_s=1.0, shutdown_grace_s=0.2,
                     terminate_grace_s=0.5)
    assert time.monotonic() - t0 < 8


def test_shutdown_is_idempotent_and_escalates(ex):
    e = ex(n=2, shutdown_grace_s=0.3, terminate_grace_s=0.3)
    pids = e.worker_pids
    fut = e.collective_rpc("sleep", args=(30,), non_block=True)
    time.sleep(0.2)
    t0 = time.monotonic()
    e.shutdown()
    assert time.monotonic() - t0 < 3
    e.shutdown()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(mpx.ExecutorFailed):
        fut.result(timeout=1)
    with pytest.raises(mpx.ExecutorFailed, match="shut down"):
        e.collective_rpc("rank")




def test_context_manager_and_log_prefix(capfd):
    with mpx.Executor(Echo, 1) as e:
        assert e.collective_rpc("say", args=("hello from the worker",)) == [True]
        pid = e.worker_pids[0]
    out = capfd.readouterr().out
    assert f"(mpx worker rank=0 pid={pid}) hello from the worker" in out


    # /dev/shm is checked by the no_leaks fixture


def test_executor_on_pure_python_ring(monkeypatch):
    monkeypatch.setenv("MPX_PURE_PYTHON", "1")
    with mpx.Executor(Echo, 2) as e:
        assert e.collective_rpc("mul", args=(2,)) == [2, 4]
        assert e.collective_rpc(lambda w: mpx.ring_implementation()) == ["python", "python"]


def test_process_title(ex):
    pytest.importorskip("setproctitle")
    e = ex(n=2)
    titles = [" ".join(psutil.Process(p).cmdline()).strip() for p in e.worker_pids]
    assert titles == ["mpx::worker rank=0", "mpx::worker rank=1"]


def test_driver_exiting_without_shutdown_cleans_up():
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {_env.TESTS!r})
        import mpx, _workers
        ex = mpx.Executor(_workers.Echo, 2)
        print(" ".join(map(str, ex.worker_pids)), flush=True)
        ex.collective_rpc("sleep", args=(0.2,), non_block=True)
    """)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 20
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2 and not any(psutil.pid_exists(p) for p in pids)


def test_workers_keep_freed_memory_for_large_messages(ex, monkeypatch):
    """A worker keeps freed heap mapped, so a large message does not land in fresh (faulting)
    pages; malloc settings in the environment win (glibc reads them when a process starts:
    a spawned worker)."""
    size = 1100 << 10
    pages = size // 4096
    e = ex(n=1)
    [kept] = e.collective_rpc("faults_per_large_message", args=(size,))
    assert kept < pages  # (without: ~2.4 faults per page of the message here)
    if START_METHOD == "spawn":
        monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(128 << 10))
        e2 = ex(n=1)
        [fresh] = e2.collective_rpc("faults_per_large_message", args=(size,))
        assert fresh > pages


def test_a_large_call_and_reply_leave_no_large_pickler_memo_behind(ex, impl):
    """A kept pickler's memo table grows with the largest message and never shrinks (every
    later call paid for clearing it: 7 -> 250 us a no-op call). Neither the driver, which
    pickled a large argument, nor the worker, which pickled a large reply, holds one
    after."""
    e = ex(n=1)
    big = [[i] for i in range(40000)]
    e.collective_rpc("noop")
    e.collective_rpc(lambda w: tracemalloc.start())
    tracemalloc.start()
    try:
        assert e.collective_rpc("ident", args=(big,)) == [big]
        driver_left = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    worker_left = e.collective_rpc(
        lambda w: (tracemalloc.get_traced_memory()[0], tracemalloc.stop())[0])[0]
    assert driver_left < 256 << 10, f"the driver holds {driver_left} bytes after the call"
    assert worker_left < 256 << 10, f"the worker holds {worker_left} bytes after the reply"
    assert e.collective_rpc("ident", args=(3,)) == [3]


SMALL_CALLS = [  # every call and reply here is a small message (serde.K_SMALL), no pickle
    (True, False, None, 0, -1, (1 << 63) - 1, -(1 << 63), 0.0, -0.0, 2.5, "ascii", b"\x00\xff"),
    ((), (1, "a"), (2.0, b"b")),
]
PICKLED_CALLS = [  # near misses: pickled, and must come back just as they went
    (1 << 63, "\u00e9", ("a" * 256,), (((1,),),), [1], {"k": 1}, bytearray(b"x")),
    tuple(range(300)),
]


@pytest.mark.parametrize("args", SMALL_CALLS + PICKLED_CALLS)
def test_small_messages_and_their_near_misses_arrive_exactly(ex, impl, args):
    """The driver (the compiled codec) and the workers (the implementation under test)
    encode and decode each other's messages (small tuples as small messages where the codec
    is compiled, else as pickles); values keep their types, bools, signed zeros and all;
    what is not small is pickled."""
    from mpx.protocol import serde
    small = serde._codec.small_encode((0, 1, "ident", (args,), None, None))
    assert (small is not None) == (args in SMALL_CALLS)
    e = ex(n=2)
    for back in e.collective_rpc("ident", args=(args,)):
        assert repr(back) == repr(args)
    assert e.collective_rpc(lambda w, x: repr(x), args=(args,)) == [repr(args)] * 2
