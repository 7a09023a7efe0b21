"""The watchdog across real worker processes: stalls in Python, in C holding the GIL, feeds
and pauses, no false alarms while idle, and stacks on demand."""

from __future__ import annotations

import os
import time

import _procs
import _watchdog_workers as WW
import psutil
import pytest
from _env import START_METHOD

import mpx
from mpx import dumps

TIMEOUT = 0.5  # watchdog timeout of these tests


@pytest.fixture
def make(executor, tmp_path):
    def make_(n=2, **kw):
        kw.setdefault("watchdog_timeout_s", TIMEOUT)
        return executor(WW.Sleeper, n, dump_dir=str(tmp_path), **kw)
    return make_


def dump_file(tmp_path, ex, rank):
    return dumps.dump_path(str(tmp_path), rank, ex.worker_pids[rank])


def test_call_sleeping_past_the_timeout_is_reported_stalled(make, tmp_path):
    ex = make()
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerStalledError) as ei:
        ex.collective_rpc("nap", args=(3.0,), kwargs={"ranks": [1]}, timeout=1.5)
    assert time.monotonic() - t0 < 2.5
    err = ei.value
    assert isinstance(err, mpx.RPCTimeoutError) and err.ranks == [1]
    info = err.stalls[1]
    assert info["method"] == "nap" and info["pid"] == ex.worker_pids[1]
    assert info["seconds"] >= TIMEOUT
    assert "in nap" in info["stack"] and "time.sleep(seconds)" in info["stack"]
    assert "rank 1" in str(err) and "'nap'" in str(err) and "in nap" in str(err)
    dumped = dumps.read_dump(dump_file(tmp_path, ex, 1))
    assert "without progress" in dumped and "most recent call first" in dumped
    assert "nap" in dumped
    assert not os.path.getsize(dump_file(tmp_path, ex, 0))  # rank 0 never stalled
    # the stalled call's late reply is dropped; the executor goes on
    assert ex.collective_rpc("rank", timeout=10) == [0, 1]
    assert not ex.is_failed


def test_stall_in_c_holding_the_gil_is_dumped_by_the_c_thread(make, tmp_path):
    ex = make()
    with pytest.raises(mpx.WorkerStalledError) as ei:
        ex.collective_rpc("hold_gil", args=(3.0,), kwargs={"ranks": [0]}, timeout=1.5)
    err = ei.value
    assert err.ranks == [0]
    assert "holds the GIL" in str(err) and "in 'hold_gil'" in str(err)
    assert "hold_gil" in err.stalls[0]["stack"] and err.stalls[0]["method"] == "hold_gil"
    assert "Timeout (" in dumps.read_dump(dump_file(tmp_path, ex, 0))
    assert ex.collective_rpc("rank", timeout=10) == [0, 1]


@pytest.mark.parametrize("rounds", [2, pytest.param(50, marks=pytest.mark.slow)])
def test_no_false_stall_when_a_gil_holding_call_follows_a_long_one(make, tmp_path, rounds):
    """A call that holds the GIL for 1.5 s right after a 1.8 s call, under a 2 s watchdog:
    busy, not stalled, and no dump (the dead man's switch follows the current call)."""
    ex = make(n=1, watchdog_timeout_s=2.0)
    for _ in range(rounds):
        ex.collective_rpc("nap", args=(1.8,))
        with pytest.raises(mpx.RPCTimeoutError) as ei:
            ex.collective_rpc("hold_gil", args=(1.5,), timeout=1.0)
        assert not isinstance(ei.value, mpx.WorkerStalledError), str(ei.value)
        assert "busy" in str(ei.value), str(ei.value)
    assert ex.collective_rpc("rank", timeout=10) == [0]
    dumped = dumps.read_dump(dump_file(tmp_path, ex, 0))
    assert "Timeout (" not in dumped and "without progress" not in dumped, dumped[:2000]


def test_the_watchdog_floor_holds_under_gil_heavy_calls(make, tmp_path):
    """At the smallest watchdog timeout Config accepts, 1000 GIL-heavy calls (some just
    past it, some holding the GIL in C) crash no worker (a tiny timeout once made
    faulthandler's C thread dump stacks while they ran: SIGSEGV)."""
    floor = mpx.config.WATCHDOG_MIN_S
    ex = make(n=2, watchdog_timeout_s=floor)
    pids = ex.worker_pids
    for i in range(1000):
        if i % 100 == 99:
            ex.collective_rpc("hold_gil", args=(floor / 4,))
        else:
            ex.collective_rpc("churn", args=(2000,))
    assert not ex.is_failed and ex.worker_pids == pids
    ex.check_health(timeout=10)


def test_check_health_names_the_stalled_rank(make):
    ex = make()
    pending = ex.collective_rpc("nap", args=(4.0,), kwargs={"ranks": [0]}, non_block=True)
    time.sleep(TIMEOUT + 0.2)
    deadline = time.monotonic() + 3
    while True:  # until the report is in (a loaded machine may delay it)
        try:
            ex.check_health(timeout=0.3)
        except mpx.WorkerStalledError as e:
            err = e
            break
        except mpx.RPCTimeoutError:
            assert time.monotonic() < deadline, "no stall report within 3 s"
    assert err.ranks == [0] and err.stalls[0]["method"] == "nap"
    assert "'nap'" in str(err) and "time.sleep(seconds)" in str(err)
    assert pending.result(timeout=10) == [0, 1]
    ex.check_health(timeout=10)  # the stall is over


def test_feeding_and_pausing_prevent_false_alarms(make, tmp_path):
    ex = make()
    assert ex.collective_rpc("fed", args=(4 * TIMEOUT, TIMEOUT / 5), timeout=30) == ["fed"] * 2
    assert ex.collective_rpc("quiet", args=(3 * TIMEOUT,), timeout=30) == ["paused"] * 2
    for rank in (0, 1):
        assert os.path.getsize(dump_file(tmp_path, ex, rank)) == 0
    ex.check_health(timeout=10)


def test_no_false_alarm_while_idle_for_ten_seconds(make, tmp_path):
    ex = make()
    ex.collective_rpc("rank")
    procs = [psutil.Process(p) for p in ex.worker_pids]
    cpu0 = [p.cpu_times() for p in procs]
    time.sleep(10)
    used = [sum(p.cpu_times()[:2]) - sum(c[:2]) for p, c in zip(procs, cpu0)]
    for rank in (0, 1):
        assert os.path.getsize(dump_file(tmp_path, ex, rank)) == 0
    assert max(used) < 0.2  # seconds of CPU over 10 s: the watchdog's wakes are cheap
    ex.check_health(timeout=10)


def test_dump_stacks_on_demand_even_while_holding_the_gil(make):
    ex = make(watchdog_timeout_s=60)
    pending = ex.collective_rpc("hold_gil", args=(2.0,), kwargs={"ranks": [1]}, non_block=True)
    time.sleep(0.3)
    stacks = ex.dump_stacks(timeout=5)
    assert sorted(stacks) == [0, 1]
    assert "hold_gil" in stacks[1]
    assert "_serve" in stacks[0] and "hold_gil" not in stacks[0]
    assert all("most recent call first" in s for s in stacks.values())
    assert pending.result(timeout=10) == [0, 1]


def test_dump_stacks_while_threads_run_python_crashes_no_worker(make):
    """Stacks on demand, over and over, of workers whose threads run Python all the time:
    no worker dies. (faulthandler's signal handler used to walk the other threads' frames
    without the GIL while they pushed and popped them: SIGSEGV in its dump_frame, most runs
    within a few seconds; the dump thread now walks them holding the GIL.)"""
    ex = make(watchdog_timeout_s=0)
    pids = ex.worker_pids
    assert ex.collective_rpc("start_churners", args=(2,)) == [2, 2]
    end = time.monotonic() + 6
    dumps_taken = 0
    while time.monotonic() < end:
        stacks = ex.dump_stacks(timeout=5)
        assert not ex.is_failed, f"a worker died after {dumps_taken} dumps"
        assert all("in churn" in s for s in stacks.values()), stacks
        dumps_taken += 1
    assert dumps_taken > 20
    assert ex.collective_rpc("stop_churners", timeout=10) == [0, 0]
    assert ex.worker_pids == pids and not ex.is_failed


def test_a_reported_stall_costs_no_cpu(make):
    """After reporting a stall the watchdog waits, as it does otherwise (it once spun until
    the call ended, running Python all the time)."""
    ex = make(n=1)
    pending = ex.collective_rpc("nap", args=(2.5,), non_block=True)
    time.sleep(TIMEOUT + 0.5)  # reported by now
    proc = psutil.Process(ex.worker_pids[0])
    cpu0 = sum(proc.cpu_times()[:2])
    time.sleep(1.0)
    assert sum(proc.cpu_times()[:2]) - cpu0 < 0.1
    assert pending.result(timeout=10) == [0]


def test_dump_files_are_removed_at_shutdown_unless_they_hold_a_stall(make, tmp_path):
    ex = make()
    ex.collective_rpc("rank")
    files = [dump_file(tmp_path, ex, r) for r in (0, 1)]
    assert all(os.path.exists(f) for f in files)
    ex.dump_stacks(timeout=5)  # stacks on demand are handed over: nothing to keep
    ex.shutdown()
    assert not any(os.path.exists(f) for f in files)
    ex = make()
    with pytest.raises(mpx.WorkerStalledError):
        ex.collective_rpc("nap", args=(1.5,), kwargs={"ranks": [0]}, timeout=1.0)
    files = [dump_file(tmp_path, ex, r) for r in (0, 1)]
    ex.shutdown()
    assert [os.path.exists(f) for f in files] == [True, False]  # the stall's evidence stays


def test_watchdog_off(make, tmp_path):
    ex = make(watchdog_timeout_s=0)
    with pytest.raises(mpx.RPCTimeoutError) as ei:
        ex.collective_rpc("nap", args=(1.5,), kwargs={"ranks": [1]}, timeout=0.8)
    assert not isinstance(ei.value, mpx.WorkerStalledError)
    assert "busy" in str(ei.value)
    assert "_serve" in ex.dump_stacks(timeout=5)[0]  # stacks on demand still work


def test_unusable_dump_dir_fails_startup_with_its_name(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(mpx.WorkerStartupError, match="MPX_DUMP_DIR"):
        mpx.Executor(WW.Sleeper, 1, dump_dir=str(blocker / "dumps"), startup_timeout_s=60,
                     start_method=START_METHOD)


def test_empty_dumps_of_dead_workers_are_reaped(make, tmp_path):
    """A SIGKILLed worker cannot remove its empty dump file: the next executor's start and
    `python -m mpx cleanup` do; files with stacks in them, and live workers' files, stay."""
    import signal
    import subprocess
    import sys
    ex = make(n=1)
    victim = dump_file(tmp_path, ex, 0)
    os.kill(ex.worker_pids[0], signal.SIGKILL)
    _procs.wait_gone([ex.worker_pids[0]], 5)
    ex.shutdown()
    kept = tmp_path / "mpx-rank3-pid999999999.stacks"
    kept.write_text("Thread 0x1 (most recent call first):\n")
    assert os.path.exists(victim)
    ex2 = make(n=1)
    assert not os.path.exists(victim) and kept.exists()
    assert os.path.exists(dump_file(tmp_path, ex2, 0))  # a live worker's file stays
    stale = tmp_path / "mpx-rank0-pid999999998.stacks"
    stale.touch()
    out = subprocess.run([sys.executable, "-m", "mpx", "cleanup"], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, MPX_DUMP_DIR=str(tmp_path)))
    assert f"removed {stale}" in out.stdout and not stale.exists() and kept.exists()
    assert os.path.exists(dump_file(tmp_path, ex2, 0))
