"""Restart and resize as a hostile user meets them (issue 49): from threads that end, with
deaths at awkward moments, with callbacks that raise BaseExceptions, with calls naming a
rank that is leaving, with snapshots taken meanwhile, and with sizes the group cannot hold.
Each test is one class of defect; tests/membership/test_restart.py has the happy paths."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import _env
import pytest
from _env import START_METHOD
from _restart_workers import Member

import mpx
from mpx.metrics import Collector

RING = dict(max_chunk_bytes=64 << 10, max_chunks=8)
TESTS = _env.TESTS


def _kill(ex, rank):
    pid = ex.worker_pids()[rank]
    os.kill(pid, signal.SIGKILL)
    return pid


def _until(predicate, timeout=30.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not come within {timeout} s"
        time.sleep(0.005)


# ---------------------------------------------------------------- a worker's life


def test_ranks_grown_from_a_thread_that_ends_live_on(impl, executor):
    """The parent-death signal fires when the *thread* that forked a child ends: a worker
    must never be tied to one."""
    ex = executor(Member, n=1, max_restarts=1, **RING)
    t = threading.Thread(target=ex.resize, args=(3,))
    t.start()
    t.join()
    asyncio.run(asyncio.to_thread(ex.resize, 4))
    time.sleep(0.5)  # (a parent-death signal would have killed them by now)
    assert [r for r, *_ in ex.collective_rpc("who", timeout=30)] == [0, 1, 2, 3]
    assert not ex.is_failed


def test_a_rank_restarted_from_a_thread_that_ends_lives_on(impl, executor):
    ex = executor(Member, n=2, max_restarts=2, **RING)
    restarted = []
    ex.register_restart_callback(restarted.append)

    def kill_and_wait():  # the death is found, and the rank restarted, while this thread runs
        old = _kill(ex, 1)
        _until(lambda: restarted, what="the restart")
        return old

    old = asyncio.run(asyncio.to_thread(kill_and_wait))
    time.sleep(0.5)
    out = ex.collective_rpc("who", timeout=30)
    assert out[1][2] != old and not ex.is_failed


# ---------------------------------------------------------------- deaths meet regroups


def test_a_death_while_a_resize_waits_for_calls_is_reported_at_once(impl, executor):
    ex = executor(Member, n=2, max_restarts=1, **RING)
    slow = ex.collective_rpc("nap", args=(3.0,), non_block=True)
    result: list = []
    t = threading.Thread(target=lambda: result.append(_try(ex.resize, 3, timeout=30)))
    t.start()
    time.sleep(0.2)  # the resize waits for `slow`
    killed_at = time.monotonic()
    _kill(ex, 1)
    with pytest.raises(mpx.WorkerDiedError) as ei:
        slow.result(timeout=30)
    took = time.monotonic() - killed_at
    assert ei.value.rank == 1 and took < 1.0, took
    t.join(60)
    assert result == [None], result
    assert [r for r, *_ in ex.collective_rpc("who", timeout=30)] == [0, 1, 2]
    assert not ex.is_failed


def test_a_dead_rank_s_calls_fail_before_its_restart_ends(impl, executor):
    """The restart waits for the survivors' calls in progress; the calls the dead rank
    will never answer complete when the death is found."""
    ex = executor(Member, n=2, max_restarts=1, **RING)
    busy = ex.collective_rpc("nap", args=(3.0, 0), non_block=True)  # rank 0 naps in it
    lost = ex.collective_rpc("die", args=(1, 0.2), non_block=True)  # rank 1 dies in it
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerDiedError):
        lost.result(timeout=30)
    assert time.monotonic() - t0 < 1.5  # (0.2 s to the death, then under 1 s)
    assert busy.result(timeout=30) == [0, 1]
    assert [r for r, *_ in ex.collective_rpc("who", timeout=30)] == [0, 1]


def _try(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except BaseException as e:  # noqa: BLE001 (the test reports it)
        return e
    return None


# ---------------------------------------------------------------- one membership per call


def test_unique_reply_rank_racing_a_shrink_never_fails_the_executor(impl, executor):
    ex = executor(Member, n=3, **RING)
    stop = threading.Event()
    errors: list[BaseException] = []
    answers = [0, 0]

    def caller():
        while not stop.is_set():
            try:
                out = ex.collective_rpc("echo", args=("x",), unique_reply_rank=2, timeout=30)
                assert out == (2, "x"), out
                answers[0] += 1
            except ValueError as e:  # rank 2 is not in the group the call went to
                assert "unique_reply_rank" in str(e)
                answers[1] += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            ex.resize(2)
            time.sleep(0.02)
            ex.resize(3)
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[0]
    assert not ex.is_failed and answers[0]
    assert ex.collective_rpc("echo", args=(1,), unique_reply_rank=2) == (2, 1)


def test_snapshots_see_one_membership_while_the_group_resizes(impl, executor):
    ex = executor(Member, n=2, **RING)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen = set()
    collector = Collector(ex)

    def look():
        while not stop.is_set():
            try:
                s = ex.stats()
                assert len(s.ranks) == len(s.ranks) and [r.rank for r in s.ranks] == \
                    list(range(len(s.ranks)))
                seen.add(len(s.ranks))
                families = list(collector.collect())
                assert families, "an empty scrape"
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    t = threading.Thread(target=look)
    t.start()
    try:
        for n in (4, 2, 3, 1, 2):
            ex.resize(n)
            ex.collective_rpc("echo", args=(n,))
    finally:
        stop.set()
        t.join(30)
    assert not errors, repr(errors[0])
    assert len(seen) > 1


# ---------------------------------------------------------------- BaseExceptions in user code


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt, RuntimeError])
def test_a_restart_callback_that_raises_leaves_the_death_watch_running(impl, executor, exc):
    ex = executor(Member, n=2, max_restarts=2, **RING)
    restarted = []

    def callback(rank):
        restarted.append(rank)
        raise exc("from the callback")

    ex.register_restart_callback(callback)
    _kill(ex, 1)
    _until(lambda: len(restarted) == 1, what="the first restart")
    old = _kill(ex, 1)
    _until(lambda: len(restarted) == 2, what="the second restart")
    out = ex.collective_rpc("who", timeout=30)
    assert out[1][2] != old and out[1][1] == 2 and not ex.is_failed
    _kill(ex, 0)
    _kill(ex, 1)  # rank 1's restarts are used up: the executor fails, and says so
    _until(lambda: ex.is_failed, timeout=10, what="the failure")


def test_a_failure_callback_that_raises_system_exit_leaves_a_clean_failure(impl, executor):
    ex = executor(Member, n=2, **RING)
    ex.register_failure_callback(lambda: (_ for _ in ()).throw(SystemExit(3)))
    ran = []
    ex.register_failure_callback(lambda: ran.append(1))
    _kill(ex, 1)
    _until(lambda: ex.is_failed and ran, timeout=10, what="the failure callbacks")
    with pytest.raises(mpx.WorkerDiedError):
        ex.collective_rpc("who", timeout=5)


# ---------------------------------------------------------------- per-rank resources


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_restarted_rank_whose_new_process_dies_in_startup_comes_back(impl, executor,
                                                                       transport):
    """The new process attached to the re-formed ring before it died: its reader slot is
    given back, and the next process takes it."""
    ex = executor(Member, n=2, max_restarts=3, transport=transport,
                  worker_kwargs=dict(slow_generation=1), **RING)
    first = _kill(ex, 1)
    _until(lambda: ex.worker_pids()[1] != first, what="generation 1")
    pid = ex.worker_pids()[1]
    if transport == "shm":  # until it has mapped (and so attached to) the new ring
        _until(lambda: _maps_a_ring(pid), what="generation 1's attach")
    else:
        time.sleep(1.0)  # (inside __init__'s nap)
    second = _kill(ex, 1)
    deadline = time.monotonic() + 60
    while True:
        try:
            out = ex.collective_rpc("who", timeout=30)
            break
        except mpx.WorkerDiedError as e:
            assert not isinstance(e, mpx.WorkerRestartError), e
            assert time.monotonic() < deadline
    assert out[1][1] == 2 and out[1][2] not in (first, second) and not ex.is_failed


def _maps_a_ring(pid):
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "/dev/shm/mpx-" in f.read()
    except OSError:
        return False


def test_restart_works_with_every_start_method(impl, executor):
    for method in ("fork", "forkserver", "spawn"):
        ex = executor(Member, n=2, max_restarts=1, start_method=method, **RING)
        old = _kill(ex, 1)
        _until(lambda ex=ex, old=old: ex.worker_pids()[1] != old and _answers(ex),
               timeout=60, what=f"the restart under {method}")
        assert not ex.is_failed, method
        ex.shutdown()


def _answers(ex):
    try:
        ex.collective_rpc("who", timeout=30)
        return True
    except mpx.WorkerDiedError:
        return False


def test_restart_and_resize_with_the_smallest_ring(impl, executor):
    """The message that re-forms the group is larger than this ring: it streams."""
    ex = executor(Member, n=2, max_restarts=1, max_chunks=4, max_chunk_bytes=64)
    old = _kill(ex, 1)
    _until(lambda: ex.worker_pids()[1] != old and _answers(ex), timeout=60,
           what="the restart")
    ex.resize(3)
    assert [r for r, *_ in ex.collective_rpc("who", timeout=30)] == [0, 1, 2]
    assert not ex.is_failed


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize("n", [2 ** 31, 10 ** 6])
def test_a_size_the_group_cannot_hold_is_refused_before_allocating(executor, n):
    ex = executor(Member, n=1, **RING)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="limit") as ei:
        ex.resize(n)
    assert time.monotonic() - t0 < 1.0 and str(n) in str(ei.value)
    with pytest.raises(ValueError, match="limit"):
        mpx.Executor(Member, n, **RING)
    assert ex.world_size == 1 and len(ex.collective_rpc("who")) == 1


# ---------------------------------------------------------------- Ctrl-C meets a regroup


_INTERRUPTED_REGROUP = textwrap.dedent("""
    import faulthandler, os, signal, sys, threading, time
    faulthandler.dump_traceback_later(120, exit=True)
    sys.path.insert(0, {tests!r})
    import mpx
    from _restart_workers import Member, full_answer

    def main():
        hits = 0
        ex = mpx.Executor(Member, 2, max_restarts=50, start_method={start!r},
                          max_chunk_bytes=1 << 20, max_chunks=16)
        stop = threading.Event()
        def storm():
            while not stop.wait(0.004):
                os.kill(os.getpid(), signal.SIGINT)
        t = threading.Thread(target=storm, daemon=True)
        t.start()
        t_end = time.monotonic() + {seconds}
        sizes = [3, 2]
        i = 0
        while True:
            try:
                while time.monotonic() < t_end:
                    try:
                        if i % 4 == 3 and ex.world_size > 1:
                            os.kill(ex.worker_pids()[1], signal.SIGKILL)  # a restart
                        ex.resize(sizes[i % 2], timeout=30)
                    except KeyboardInterrupt:
                        hits += 1
                    except mpx.WorkerDiedError:
                        pass
                    i += 1
                stop.set()
                t.join()
                time.sleep(0.05)
                break
            except KeyboardInterrupt:
                hits += 1
        full_answer(ex)
        futs = [ex.collective_rpc("echo", args=(k,), non_block=True) for k in range(10)]
        assert [f.result(timeout=30)[0] for f in futs] == [(0, k) for k in range(10)]
        ex.shutdown()
        print("interrupts", hits, "regroups", i)

    if __name__ == "__main__":
        main()
""")


def test_ctrl_c_storm_during_resizes_and_restarts_leaves_a_usable_executor(tmp_path):
    script = tmp_path / "storm.py"
    script.write_text(_INTERRUPTED_REGROUP.format(tests=TESTS, start=START_METHOD, seconds=4))
    before = {n for n in os.listdir("/dev/shm") if n.startswith("mpx-")}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "interrupts" in r.stdout
    left = {n for n in os.listdir("/dev/shm") if n.startswith("mpx-")} - before
    assert not left, left
