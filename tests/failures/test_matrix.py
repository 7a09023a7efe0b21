"""The fault-injection matrix: each way a worker, the driver or the host can fail, with
its expected outcome and a bound on the time to detect it.

Every case ends with the executor still usable or cleanly failed, and the autouse
``no_leaks`` fixture checks that nothing (process, thread, /dev/shm segment, and with a
debug build the live-resource counters) is left behind. The start method is
``MPX_TEST_START_METHOD`` (default spawn); tox runs the file under all three.

Each case records its measured time with ``record``: printed (``pytest -s`` shows it) and,
when ``MPX_MATRIX_REPORT=path`` is set, appended to that file as a JSON line
``{"case", "start_method", "impl", "seconds", "bound"}``.

Tested elsewhere and not repeated here: SIGKILL of an idle worker and of one mid-call,
``os._exit`` in a method, arguments that fail to pickle in the driver or to unpickle in the
worker, results that fail to pickle, a method that raises (remote traceback), SIGKILL of
the driver with calls in flight, exit without ``shutdown()``, stale segments of a dead
queue writer (tests/executor/test_executor.py, tests/failures/test_failures.py). The 100-failing-calls case
below runs most of them again, back to back, to show that none of them leaks.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import _env
import _matrix_workers as MW
import _procs
import psutil
import pytest
from _env import START_METHOD

import mpx
from mpx.mechanism import segments

TESTS = _env.TESTS
# A worker's death is reported within a second (the monitor's sentinel wait answers at
# once; the rest is scheduling). Twice that here: two cores, shared with other test runs.
DEATH_BOUND = 2.0
# Orphaned workers must be gone this long after the driver's SIGKILL (the bound).
ORPHAN_BOUND = 2.0
# Workers of a 4-rank executor killing each other: the full 20 rounds under -m slow.
KILL_ROUNDS = 20
KILL_ROUNDS_DEFAULT = 3


@pytest.fixture
def record():
    """``record(case, seconds, bound)``: report a measured time, then assert the bound."""
    def rec(case: str, seconds: float, bound: float) -> None:
        entry = dict(case=case, start_method=START_METHOD, impl=mpx.ring_implementation(),
                     seconds=round(seconds, 4), bound=bound)
        print(f"\nMATRIX {case} [{START_METHOD}]: {seconds:.3f} s (bound {bound} s)")
        path = os.environ.get("MPX_MATRIX_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        assert seconds < bound, f"{case}: took {seconds:.3f} s, bound {bound} s"
    return rec


@pytest.fixture
def ex(executor):
    return functools.partial(executor, MW.Faulty)


def _usage(pid: int) -> tuple[int, int]:
    p = psutil.Process(pid)
    return p.num_fds(), p.num_threads()


# ----------------------------------------------------------------- arguments

@pytest.mark.parametrize("how,says", [("sys.exit", "exit code 3"), ("os._exit", "exit code 3"),
                                      ("segv", "SIGSEGV")])
def test_worker_dies_while_unpickling_args(ex, record, how, says):
    e = ex()
    pid = e.worker_pids[1]
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerDiedError) as ei:
        e.collective_rpc("ident", args=(MW.CrashOnUnpickle(1, how, 3),), timeout=30)
    took = time.monotonic() - t0
    err = ei.value
    assert err.rank == 1 and err.pid == pid and says in str(err), str(err)
    assert e.is_failed
    with pytest.raises(mpx.WorkerDiedError):
        e.collective_rpc("rank")
    record(f"args unpickle: {how}", took, DEATH_BOUND)


# ----------------------------------------------------------------- the method

@pytest.mark.parametrize("how,says,code", [
    ("sys.exit", "exit code 4", 4),
    ("segv", "killed by SIGSEGV", -signal.SIGSEGV),
    # The kernel's OOM killer cannot be set off safely on a shared machine; this is what it
    # does, emulated: the worker grows, then gets SIGKILL.
    ("oom_killed", "killed by SIGKILL", -signal.SIGKILL),
])
def test_method_ends_the_worker(ex, record, how, says, code):
    e = ex()
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerDiedError) as ei:
        if how == "oom_killed":
            e.collective_rpc("oom_killed", args=(64 << 20,), kwargs={"ranks": [1]})
        else:
            e.collective_rpc("crash", args=(how, 4), kwargs={"ranks": [1]})
    took = time.monotonic() - t0
    err = ei.value
    assert err.rank == 1 and err.exitcode == code and says in str(err), str(err)
    assert str(err.pid) in str(err)
    record(f"method: {how}", took, DEATH_BOUND)


def test_memory_error_under_rlimit_as(ex, record):
    """A worker under a small address-space limit: an allocation past it is MemoryError in
    Python, which is an RPCError from that rank; the worker lives on."""
    e = ex(worker_kwargs={"as_limit_mib": 512})
    t0 = time.monotonic()
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("allocate", args=(4 << 30,), kwargs={"ranks": [1]})
    took = time.monotonic() - t0
    assert ei.value.ranks == [1] and ei.value.exc_type == "MemoryError"
    assert "in allocate" in ei.value.remote_traceback
    assert e.collective_rpc("allocate", args=(1 << 20,)) == [1 << 20, 1 << 20]
    assert not e.is_failed
    record("method: MemoryError under RLIMIT_AS", took, DEATH_BOUND)


# ----------------------------------------------------------------- the result

@pytest.mark.parametrize("how,says", [("segv", "killed by SIGSEGV"), ("os._exit", "exit code 5")])
def test_pickling_the_result_ends_the_worker(ex, record, how, says):
    e = ex()
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerDiedError) as ei:
        e.collective_rpc("result", args=("crash_on_pickle", how), kwargs={"ranks": [1]})
    took = time.monotonic() - t0
    assert ei.value.rank == 1 and says in str(ei.value), str(ei.value)
    record(f"result pickling: {how}", took, DEATH_BOUND)


def test_result_that_fails_to_unpickle_in_the_driver(ex, record):
    e = ex()
    t0 = time.monotonic()
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("result", args=("fails_in_driver",), kwargs={"ranks": [1]})
    took = time.monotonic() - t0
    err = ei.value
    assert err.ranks == [1] and err.exc_type == "DeserializationError"
    assert "cannot rebuild this result in the driver" in str(err)
    # that call only: the next ones, blocking or not, are fine
    fut = e.collective_rpc("result", args=("fails_in_driver",), kwargs={"ranks": [0]},
                           non_block=True)
    assert e.collective_rpc("ident", args=("after",)) == ["after", "after"]
    with pytest.raises(mpx.RPCError, match="DeserializationError"):
        fut.result(timeout=10)
    assert e.collective_rpc("rank") == [0, 1] and not e.is_failed
    record("result unpickling in the driver", took, DEATH_BOUND)


def test_a_burst_of_results_that_fail_to_unpickle_in_the_driver(ex):
    """Replies that pile up are read in batches: an undecodable one among them fails its
    own call (on the rank that sent it) and no other."""
    e = ex()
    bad = {i for i in range(0, 120, 7)}
    futs = [e.collective_rpc("result", args=("fails_in_driver",),
                             kwargs={"ranks": [i % 2]}, non_block=True)
            if i in bad else e.collective_rpc("ident", args=(i,), non_block=True)
            for i in range(120)]
    time.sleep(0.5)  # the replies pile up, read by the background reader
    for i, fut in enumerate(futs):
        if i in bad:
            with pytest.raises(mpx.RPCError) as ei:
                fut.result(timeout=10)
            assert ei.value.ranks == [i % 2]
            assert ei.value.exc_type == "DeserializationError"
        else:
            assert fut.result(timeout=10) == [i, i]
    assert e.collective_rpc("rank") == [0, 1] and not e.is_failed


@pytest.mark.parametrize("how,says", [("os._exit", "exit code 9"), ("segv", "SIGSEGV")])
def test_crash_in_del_after_the_reply_was_sent(ex, record, how, says):
    e = ex()
    failed = threading.Event()
    e.register_failure_callback(failed.set)
    assert e.collective_rpc("result", args=("crash_on_del", how), kwargs={"ranks": [1]}) \
        == [0, "sent"]
    t0 = time.monotonic()
    # the worker drops the result right after sending it: the death shows without a call
    assert failed.wait(10), "the crash in __del__ was not noticed"
    took = time.monotonic() - t0
    with pytest.raises(mpx.WorkerDiedError, match=says) as ei:
        e.collective_rpc("rank")
    assert ei.value.rank == 1
    record(f"__del__ after reply: {how}", took, DEATH_BOUND)


def test_failing_calls_leak_nothing(ex, record):
    """100 calls that fail in every non-fatal way, then 100 good ones: no request id, ring
    slot, thread, fd or memory is left behind, and every reply matches its call."""
    e = ex(yield_us=200)
    group = e._group
    lock = threading.Lock()
    for i in range(10):  # warm up: whatever is allocated once is not a leak
        e.collective_rpc("ident", args=(i,))
        e.collective_rpc("fail", kwargs={"ranks": [0]}, non_block=True)
    sizes = {pid: _usage(pid) for pid in e.worker_pids}
    gc.collect()  # earlier tests' garbage (pipes, sockets) is not this test's
    my_fds, my_threads = _usage(os.getpid())
    rss0 = psutil.Process().memory_info().rss

    def args_pickle():
        with pytest.raises(mpx.SerializationError):
            e.collective_rpc("ident", args=(lock,))

    def raises():
        with pytest.raises(mpx.RPCError) as ei:
            e.collective_rpc("fail", kwargs={"ranks": [1]})
        assert "raise ValueError" in ei.value.remote_traceback

    def args_unpickle():
        with pytest.raises(mpx.RPCError, match="DeserializationError"):
            e.collective_rpc("ident", args=(MW.FailsInDriver(),))

    def result_pickle():
        with pytest.raises(mpx.RPCError, match="SerializationError"):
            e.collective_rpc("result", args=("unpicklable",))

    def result_unpickle():
        with pytest.raises(mpx.RPCError, match="DeserializationError"):
            e.collective_rpc("result", args=("fails_in_driver",), unique_reply_rank=0)

    def no_method():
        with pytest.raises(mpx.RPCError, match="has no method"):
            e.collective_rpc("nope")

    def timeout():
        with pytest.raises(mpx.RPCTimeoutError):
            e.collective_rpc("sleep", args=(0.1,), kwargs={"ranks": [1]}, timeout=0.02)

    def non_block():
        futs = [e.collective_rpc("fail", kwargs={"ranks": [0]}, non_block=True) for _ in range(3)]
        for f in futs:
            with pytest.raises(mpx.RPCError):
                f.result(timeout=10)

    kinds = [args_pickle, raises, args_unpickle, result_pickle, result_unpickle, no_method,
             non_block]
    t0 = time.monotonic()
    seq0 = group.calls.next_seq
    for i in range(100):
        (timeout if i % 20 == 19 else kinds[i % len(kinds)])()
    sent = group.calls.next_seq - seq0
    assert sent < 100 + 2 * 100 // len(kinds)  # the args_pickle calls sent nothing
    for i in range(100):
        if i % 10 == 0:
            assert e.collective_rpc("ident", args=(i,), unique_reply_rank=1) == i
        else:
            assert e.collective_rpc("ident", args=(i,)) == [i, i]
    took = time.monotonic() - t0
    assert not e.is_failed
    assert group.calls.pending == {}
    assert group.calls.registry.next_reply == [group.calls.next_seq] * 2  # every reply read, none owed
    assert group.broadcast.writing_end().free_slots() == e.config.max_chunks  # every slot consumed
    assert not any(q.poll() for q in group.resp)
    for pid, (fds, threads) in sizes.items():
        now_fds, now_threads = _usage(pid)
        assert now_fds <= fds and now_threads <= threads, (pid, (now_fds, now_threads), sizes)
    gc.collect()
    now_fds, now_threads = _usage(os.getpid())
    assert now_fds <= my_fds and now_threads <= my_threads, ((now_fds, now_threads),
                                                             (my_fds, my_threads))
    grew = psutil.Process().memory_info().rss - rss0
    assert grew < 32 << 20, f"driver RSS grew {grew >> 20} MiB"
    record("100 failing + 100 good calls (total)", took, 60.0)


# ----------------------------------------------------------------- SIGKILL

def test_sigkill_while_streaming_a_large_reply_into_a_full_ring(ex, record):
    e = ex(max_chunk_bytes=64 << 10, max_chunks=4)
    group = e._group
    # the driver's reader waits for rank 0's answer to the first call, so nobody reads rank
    # 1's queue: rank 1 answers, then fills its ring with the large reply and waits for room
    first = e.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0]}, non_block=True)
    fut = e.collective_rpc("big", args=(32 << 20,), kwargs={"ranks": [1]}, non_block=True)
    deadline = time.monotonic() + 10
    while not group.resp[1].poll():
        assert time.monotonic() < deadline, "the large reply never started"
        time.sleep(0.01)
    time.sleep(0.1)
    os.kill(e.worker_pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerDiedError, match="SIGKILL"):
        first.result(timeout=10)
    with pytest.raises(mpx.WorkerDiedError, match="SIGKILL") as ei:
        fut.result(timeout=10)
    took = time.monotonic() - t0
    assert ei.value.rank == 1
    record("SIGKILL mid-stream (ring full)", took, DEATH_BOUND)


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_while_the_driver_reads_a_large_reply(ex, record, seed):
    e = ex(max_chunk_bytes=64 << 10, max_chunks=4)
    pid = e.worker_pids[1]
    killed = []

    def kill():
        killed.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(0.05 + random.Random(seed).random() * 0.3, kill)
    timer.start()
    try:
        with pytest.raises(mpx.WorkerDiedError, match="SIGKILL") as ei:
            for _ in range(10_000):
                assert e.collective_rpc("big", args=(8 << 20,), kwargs={"ranks": [1]},
                                        timeout=30)[1] == bytes(8 << 20)
        took = time.monotonic() - killed[0]
    finally:
        timer.join(5)
    assert ei.value.rank == 1
    record(f"SIGKILL while the driver reads (seed {seed})", took, DEATH_BOUND)


@pytest.mark.parametrize("round_", [
    pytest.param(i, marks=[pytest.mark.slow] if i >= KILL_ROUNDS_DEFAULT else [])
    for i in range(KILL_ROUNDS)])
def test_workers_kill_each_other(ex, record, round_):
    e = ex(n=4)
    pids = e.worker_pids
    max_delay = 0.3
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerDiedError) as ei:
        e.collective_rpc("arm_killer", args=(pids, round_, max_delay), timeout=10)
        for i in range(100_000):
            assert e.collective_rpc("ident", args=(i,), timeout=10) == [i] * 4
    took = time.monotonic() - t0
    err = ei.value
    assert err.exitcode == -signal.SIGKILL and "killed by SIGKILL" in str(err), str(err)
    assert err.pid == pids[err.rank]
    record(f"4 workers kill each other (round {round_})", took, max_delay + DEATH_BOUND)


# ----------------------------------------------------------------- stalls

@pytest.mark.parametrize("stall", ["sigstop", "busy"])
def test_a_stalled_worker_times_out_as_alive(ex, record, stall):
    e = ex()
    pid = e.worker_pids[1]
    timeout = 0.5
    if stall == "sigstop":
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    else:
        busy = e.collective_rpc("sleep", args=(1.5,), kwargs={"ranks": [1]}, non_block=True)
    try:
        t0 = time.monotonic()
        with pytest.raises(mpx.RPCTimeoutError) as ei:
            e.collective_rpc("ident", args=("stalled",), timeout=timeout)
        took = time.monotonic() - t0
        msg = str(ei.value)
        assert ei.value.ranks == [1] and f"rank 1 (pid {pid}) is " in msg, msg
        assert "alive" in msg and "died" not in msg and "dead" not in msg, msg
        assert ("stopped (SIGSTOP" in msg) == (stall == "sigstop"), msg
        # stopped counts as stalled; busy (well within the watchdog timeout) does not
        assert isinstance(ei.value, mpx.WorkerStalledError) == (stall == "sigstop")
        time.sleep(0.3)
        assert not e.is_failed  # stalled is not dead
    finally:
        if stall == "sigstop":
            os.kill(pid, signal.SIGCONT)
    t1 = time.monotonic()
    if stall == "busy":
        assert busy.result(timeout=10) == [0, 1]
    # the timed-out call's late reply is dropped, never taken for this one
    assert e.collective_rpc("ident", args=("fresh",), timeout=10) == ["fresh", "fresh"]
    recovered = time.monotonic() - t1
    record(f"{stall}: RPCTimeoutError says alive", took, timeout + 1.0)
    record(f"{stall}: next call after it resumes", recovered, 2.5)


def test_shutdown_while_a_thread_waits_for_a_call(ex, record):
    e = ex(shutdown_grace_s=0.3, terminate_grace_s=0.5)
    got = []

    def caller():
        try:
            got.append(e.collective_rpc("sleep", args=(30,)))
        except BaseException as err:
            got.append(err)

    t = threading.Thread(target=caller)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    e.shutdown()
    t.join(10)
    took = time.monotonic() - t0
    assert not t.is_alive()
    assert isinstance(got[0], mpx.ExecutorFailed) and "shut down" in str(got[0]), got
    record("shutdown while a thread waits in a call", took, 3.0)


# ----------------------------------------------------------------- the driver

STARTUP_DRIVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import mpx, _matrix_workers
    mpx.Executor(_matrix_workers.SlowInit, 2, start_method={method!r},
                 worker_kwargs=dict(pid_dir={pid_dir!r}, seconds=60))
""")


def test_workers_exit_when_the_driver_is_sigkilled_during_startup(tmp_path, record):
    code = STARTUP_DRIVER.format(tests=TESTS, method=START_METHOD, pid_dir=str(tmp_path))
    driver = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        files = [tmp_path / "0.pid", tmp_path / "1.pid"]
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < deadline and driver.poll() is None, "workers never started"
            time.sleep(0.02)
        pids = [int(f.read_text()) for f in files]
        driver.kill()
        killed = time.monotonic()
        driver.wait(5)
        alive = _procs.wait_gone(pids, 10)
        took = time.monotonic() - killed
        assert not alive, f"workers outlived the driver: {alive}"
    finally:
        driver.kill()
        driver.wait(5)
    record("driver SIGKILL during startup: workers gone", took, ORPHAN_BOUND)


EXIT_DRIVER = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {tests!r})
    import mpx, _matrix_workers
    ex = mpx.Executor(_matrix_workers.Faulty, 2, start_method={method!r},
                      shutdown_grace_s=0.5, terminate_grace_s=1.0)
    futs = [ex.collective_rpc("sleep", args=(60,), non_block=True) for _ in range(3)]

    def caller():  # a non-daemon thread blocked in a call: the interpreter joins it at exit
        try:
            ex.collective_rpc("sleep", args=(60,))
        except mpx.ExecutorFailed as e:
            print("thread got", type(e).__name__, e, flush=True)

    threading.Thread(target=caller).start()
    time.sleep(0.3)
    print("pids", *ex.worker_pids, flush=True)
    print("exiting", flush=True)
""")


def test_interpreter_exit_with_calls_pending(record):
    code = EXIT_DRIVER.format(tests=TESTS, method=START_METHOD)
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in driver.stdout:
            lines.append(line)
            if line.startswith("exiting"):
                break
        exiting = time.monotonic()
        rc = driver.wait(30)
        took = time.monotonic() - exiting
        lines += driver.stdout.readlines()
    finally:
        driver.kill()
        driver.stdout.close()
        driver.wait(5)
    out = "".join(lines)
    assert rc == 0, out
    assert "thread got ExecutorFailed the executor was shut down" in out, out
    pids = [int(p) for p in next(ln for ln in lines if ln.startswith("pids")).split()[1:]]
    assert not _procs.wait_gone(pids, 2)
    # 0.5 s shutdown grace, then SIGTERM: the workers are busy in sleep(60)
    record("interpreter exit with calls pending", took, 6.0)


CRASHING_DRIVER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import mpx, mpx._driver.group, _matrix_workers

    def crash(*args, **kwargs):  # the driver dies after creating its ring, before any attach
        print(os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    mpx._driver.group.LocalWorkers = crash
    mpx.Executor(_matrix_workers.Faulty, 2, start_method={method!r})
""")

# Crash a driver, then run doctor and the reaper. In a private /dev/shm when it can be had:
# any other mpx process on the machine (other test runs) reaps stale segments too.
REAP_SCENARIO = textwrap.dedent("""
    import json, os, subprocess, sys, time
    sys.path.insert(0, {tests!r})
    import mpx, _matrix_workers
    from mpx.mechanism import segments
    crashed = subprocess.run([sys.executable, "-c", {driver!r}], capture_output=True,
                             text=True, timeout=60)
    pid = int(crashed.stdout.split()[0])
    out = dict(rc=crashed.returncode,
               left=[n for n in segments.stale_segments() if n.startswith(f"/mpx-{{pid}}-")])
    out["doctor"] = subprocess.run([sys.executable, "-m", "mpx", "doctor", "--no-torch"],
                                   capture_output=True, text=True, timeout=120).stdout
    t0 = time.monotonic()
    if {reaper!r} == "next start":
        ex = mpx.Executor(_matrix_workers.Faulty, 1, start_method={method!r})
        out["works"] = ex.collective_rpc("rank") == [0]
        out["seconds"] = time.monotonic() - t0
        ex.shutdown()
    else:
        out["cleanup"] = subprocess.run([sys.executable, "-m", "mpx", "cleanup"],
                                        capture_output=True, text=True, timeout=60).stdout
        out["seconds"] = time.monotonic() - t0
    out["remaining"] = [n for n in out["left"] if os.path.exists("/dev/shm" + n)]
    print(json.dumps(out))
""")


def _private_shm(argv: list[str], size: str = "1m") -> list[str] | None:
    """``argv`` run with a fresh tmpfs of ``size`` on /dev/shm in a private mount
    namespace, or None where that is not allowed (unshare -m needs CAP_SYS_ADMIN)."""
    try:
        ok = subprocess.run(["unshare", "-m", "sh", "-c",
                             f"mount -t tmpfs -o size={size} tmpfs /dev/shm"],
                            capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        return None
    return ["unshare", "-m", "sh", "-c",
            f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" "$@"'] + argv


@pytest.mark.parametrize("reaper", ["next start", "cleanup"])
def test_segments_of_a_driver_that_died_before_attach(record, reaper):
    driver = CRASHING_DRIVER.format(tests=TESTS, method=START_METHOD)
    code = REAP_SCENARIO.format(tests=TESTS, driver=driver, reaper=reaper, method=START_METHOD)
    argv = [sys.executable, "-c", code]
    argv = _private_shm(argv, "256m") or argv
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(TESTS))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["rc"] == -signal.SIGKILL
    left = out["left"]
    assert left, "the crashed driver left no segment: nothing to test"
    assert all(n in out["doctor"] for n in left), out["doctor"]
    if reaper == "next start":
        assert out["works"]
    else:
        assert all(f"removed {n}" in out["cleanup"] for n in left), out["cleanup"]
    assert out["remaining"] == []
    record(f"stale segments reaped by {reaper}", out["seconds"], 20.0)


# ----------------------------------------------------------------- the host

SMALL_SHM_DRIVER = textwrap.dedent("""
    import json, multiprocessing, sys, time, warnings
    sys.path.insert(0, {tests!r})
    import psutil
    import mpx, _matrix_workers
    out = {{}}
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ex = mpx.Executor(_matrix_workers.Faulty, 2, start_method={method!r},
                              transport={transport!r}, **{overrides!r})
        out["warnings"] = [str(w.message) for w in caught]
        out["started"] = time.monotonic() - t0
        big = bytes(range(256)) * 8192
        out["calls_work"] = (ex.collective_rpc("ident", args=(big,), unique_reply_rank=1) == big
                             and ex.collective_rpc("rank") == [0, 1])
        ex.shutdown()
    except mpx.ShmError as e:
        out["error"] = str(e)
        out["seconds"] = time.monotonic() - t0
        out["children"] = [" ".join(p.cmdline()) for p in psutil.Process().children()
                           if "resource_tracker" not in " ".join(p.cmdline())]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("transport", ["shm", "auto"])
@pytest.mark.parametrize("how", ["tmpfs", "config"])
def test_dev_shm_too_small(record, transport, how):
    """/dev/shm too small for a ring: ShmError before any worker starts with transport
    'shm'; a warning and the ZeroMQ transport with 'auto'. 'tmpfs': a 1 MiB /dev/shm in a
    private mount namespace; 'config': a ring bigger than /dev/shm's free space."""
    overrides: dict = {}
    if how == "config":
        # twice the free space: it cannot fit even if other segments go away meanwhile (a
        # ring that did fit would be fallocated in RAM: keep far from that)
        overrides = dict(max_chunk_bytes=segments.free_bytes() + 64 & ~63, max_chunks=2)
    code = SMALL_SHM_DRIVER.format(tests=TESTS, method=START_METHOD, transport=transport,
                                   overrides=overrides)
    argv = [sys.executable, "-c", code]
    if how == "tmpfs":
        argv = _private_shm(argv, "1m")
        if argv is None:
            pytest.skip("cannot mount a tmpfs in a private mount namespace (unshare -m)")
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if transport == "shm":
        assert "needs" in out["error"] and "bytes free" in out["error"], out
        assert out["children"] == [], out  # no worker was started
        record(f"/dev/shm too small ({how}), transport shm: ShmError", out["seconds"], 2.0)
    else:
        assert "error" not in out, out
        assert any("using the ZeroMQ transport" in w for w in out["warnings"]), out
        assert out["calls_work"], out
        record(f"/dev/shm too small ({how}), transport auto: zmq fallback start",
               out["started"], 10.0)
