"""A dead rank restarted in place (Config.max_restarts) and a group resized between calls
(Executor.resize), across real worker processes, on both ring implementations."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
from _restart_workers import Member

import mpx

BIG = 3 << 20  # larger than the test rings below: streams through the ring
RING = dict(max_chunk_bytes=64 << 10, max_chunks=8)


def _kill(ex, rank):
    pid = ex.worker_pids()[rank]
    os.kill(pid, signal.SIGKILL)
    return pid


def _wait_restarted(ex, rank, old_pid, timeout=60.0):
    """The first call every rank answers after ``rank`` (pid ``old_pid``) was killed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            out = ex.collective_rpc("who", timeout=max(0.1, deadline - time.monotonic()))
        except mpx.WorkerDiedError as e:
            assert e.rank == rank
            continue
        assert out[rank][2] != old_pid
        return out


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_killed_rank_comes_back_in_place(impl, executor, transport):
    ex = executor(Member, n=3, max_restarts=2, transport=transport, heartbeat_s=1.0, **RING)
    failed, restarted = [], []
    ex.register_failure_callback(lambda: failed.append(1))
    ex.register_restart_callback(restarted.append)
    before = ex.collective_rpc("who")
    assert [g for _, g, _, _, _ in before] == [0, 0, 0]
    old = _kill(ex, 1)
    after = _wait_restarted(ex, 1, old)
    assert [(r, g) for r, g, _, _, _ in after] == [(0, 0), (1, 1), (2, 0)]
    assert after[0][2] == before[0][2] and after[2][2] == before[2][2]  # the others stayed
    assert ex.worker_pids() == [p for _, _, p, _, _ in after] == list(ex.worker_pids)
    assert after[1][4] == ex.distributed_init_method != before[1][4]  # a fresh one
    assert not ex.is_failed and not failed
    deadline = time.monotonic() + 10
    while not restarted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert restarted == [1]
    assert ex.collective_rpc("length", args=(b"x" * BIG,)) == [BIG] * 3  # large both ways
    assert [len(b) for b in ex.collective_rpc("blob", args=(BIG,))] == [BIG] * 3
    s = ex.stats()
    assert [r.deaths for r in s.ranks] == [0, 1, 0] and all(r.alive for r in s.ranks)
    ex.check_health()


def test_calls_answered_keep_their_results_the_others_fail(impl, executor):
    ex = executor(Member, n=2, max_restarts=1, **RING)
    # rank 0 naps in the first call (rank 1 answers it at once), then rank 1 dies in the
    # second while rank 0 is still in the first
    answered = ex.collective_rpc("nap", args=(1.0, 0), non_block=True)
    lost = ex.collective_rpc("die", args=(1, 0.2), non_block=True)
    queued = []
    assert answered.result(timeout=30) == [0, 1]
    with pytest.raises(mpx.WorkerDiedError) as ei:
        lost.result(timeout=30)
    assert ei.value.rank == 1 and "rank 1" in str(ei.value)
    queued.append(ex.collective_rpc("echo", args=("after",), timeout=30))
    assert queued == [[(0, "after"), (1, "after")]]
    assert not ex.is_failed


def test_a_call_made_during_the_restart_waits_for_it(impl, executor):
    ex = executor(Member, n=2, max_restarts=1, **RING)
    old = _kill(ex, 0)
    deadline = time.monotonic() + 10
    while not ex.stats().ranks[0].deaths:  # the death is counted once calls are held
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    futures = [ex.collective_rpc("echo", args=(i,), non_block=True) for i in range(20)]
    blocking = ex.collective_rpc("echo", args=(20,), timeout=60)
    assert [f.result(timeout=60) for f in futures] == [[(0, i), (1, i)] for i in range(20)]
    assert blocking == [(0, 20), (1, 20)]
    assert ex.worker_pids()[0] != old


def test_ranks_that_die_together_come_back_together(impl, executor):
    ex = executor(Member, n=3, max_restarts=1, **RING)
    restarted = []
    ex.register_restart_callback(restarted.append)
    before = ex.worker_pids()
    for rank in (0, 2):
        os.kill(before[rank], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while sorted(restarted) != [0, 2]:
        assert time.monotonic() < deadline, restarted
        time.sleep(0.01)
    after = ex.collective_rpc("who", timeout=30)
    assert [g for _, g, _, _, _ in after] == [1, 0, 1] and after[1][2] == before[1]
    assert not ex.is_failed


def test_when_restarts_run_out_a_death_fails_the_executor(impl, executor):
    ex = executor(Member, n=2, max_restarts=1, **RING)
    failures = []
    ex.register_failure_callback(lambda: failures.append(1))
    _wait_restarted(ex, 1, _kill(ex, 1))
    _kill(ex, 1)
    with pytest.raises(mpx.WorkerDiedError) as ei:
        for _ in range(100):
            ex.collective_rpc("who", timeout=30)
            time.sleep(0.05)
    assert ei.value.rank == 1
    deadline = time.monotonic() + 10
    while not failures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ex.is_failed and failures == [1]


def test_a_restarted_rank_whose_init_raises_fails_the_executor(impl, executor):
    ex = executor(Member, n=2, max_restarts=3, worker_kwargs=dict(fail_from_generation=1))
    _kill(ex, 1)
    with pytest.raises(mpx.WorkerRestartError) as ei:
        for _ in range(200):
            try:
                ex.collective_rpc("who", timeout=30)
            except mpx.WorkerDiedError as e:
                if isinstance(e, mpx.WorkerRestartError):
                    raise
            time.sleep(0.05)
    assert ei.value.ranks == [1] and "refuses generation 1" in str(ei.value)
    assert isinstance(ei.value, mpx.WorkerStartupError) and ex.is_failed


def test_a_restarted_process_killed_while_it_starts_is_restarted_again(impl, executor):
    ex = executor(Member, n=2, max_restarts=3, worker_kwargs=dict(slow_generation=1))
    first = _kill(ex, 1)
    deadline = time.monotonic() + 30
    while ex.worker_pids()[1] == first:  # generation 1 starts, and naps in __init__
        assert time.monotonic() < deadline
        time.sleep(0.005)
    second = _kill(ex, 1)
    out = _wait_restarted(ex, 1, second)
    assert out[1][1] == 2 and out[1][2] not in (first, second) and not ex.is_failed
    assert ex.stats().ranks[1].deaths == 2


def test_resize_grows_and_shrinks(impl, executor):
    ex = executor(Member, n=2, **RING)
    first = ex.collective_rpc("who")
    ex.resize(4)
    grown = ex.collective_rpc("who")
    assert ex.world_size == 4 and [r for r, *_ in grown] == [0, 1, 2, 3]
    assert [p for _, _, p, _, _ in grown[:2]] == [p for _, _, p, _, _ in first]
    assert [w for _, _, _, w, _ in grown[2:]] == [4, 4]  # the new ranks know the new size
    assert grown[2][4] == ex.distributed_init_method
    assert len(ex.worker_pids()) == 4
    assert ex.collective_rpc("length", args=(b"y" * BIG,)) == [BIG] * 4
    assert ex.collective_rpc("echo", args=(1,), unique_reply_rank=3) == (3, 1)
    gone = ex.worker_pids()[1:]
    ex.resize(1)
    assert ex.collective_rpc("who")[0][2] == first[0][2]
    assert ex.world_size == 1 and len(ex.worker_pids()) == 1
    for pid in gone:
        assert not _alive(pid)
    ex.resize(1)  # the same size: nothing happens
    assert [r.rank for r in ex.stats().ranks] == [0]
    ex.resize(2)
    assert [r for r, *_ in ex.collective_rpc("who")] == [0, 1]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("bad", [0, -1, "3", 2.5, True, None])
def test_resize_to_a_bad_size_changes_nothing(executor, bad):
    ex = executor(Member, n=2)
    with pytest.raises(ValueError, match="world_size"):
        ex.resize(bad)
    assert ex.world_size == 2 and len(ex.collective_rpc("who")) == 2


def test_resize_waits_for_the_call_in_flight_or_says_why(impl, executor):
    ex = executor(Member, n=2)
    slow = ex.collective_rpc("nap", args=(2.0,), non_block=True)
    with pytest.raises(mpx.ResizeError, match="in flight"):
        ex.resize(3, timeout=0.2)
    assert ex.world_size == 2 and slow.result(timeout=30) == [0, 1]
    short = ex.collective_rpc("nap", args=(0.3,), non_block=True)
    ex.resize(3, timeout=30)  # waits for it
    assert short.result(timeout=1) == [0, 1]  # answered by the group it was sent to
    assert ex.collective_rpc("echo", args=(2,)) == [(0, 2), (1, 2), (2, 2)]


def test_calls_made_during_a_resize_go_to_the_new_group(impl, executor):
    ex = executor(Member, n=2)
    made = []
    done = threading.Event()

    def caller():
        while not done.is_set():
            made.append(ex.collective_rpc("echo", args=(len(made),), non_block=True))
            time.sleep(0.002)

    t = threading.Thread(target=caller)
    t.start()
    try:
        time.sleep(0.05)
        ex.resize(3)
        time.sleep(0.05)
    finally:
        done.set()
        t.join()
    sizes = {len(f.result(timeout=30)) for f in made}
    assert sizes <= {2, 3} and 3 in sizes
    for i, f in enumerate(made):
        assert [tag for _, tag in f.result()] == [i] * len(f.result())


def test_a_new_rank_whose_init_raises_leaves_the_executor_as_it_was(impl, executor):
    ex = executor(Member, n=2, worker_kwargs=dict(fail_from_rank=3))
    with pytest.raises(mpx.WorkerStartupError) as ei:
        ex.resize(4)
    assert ei.value.ranks == [3] and "refuses to join" in str(ei.value)
    assert ex.world_size == 2 and not ex.is_failed
    assert [r for r, *_ in ex.collective_rpc("who")] == [0, 1]
    ex.resize(3)
    assert len(ex.collective_rpc("who")) == 3


def test_torch_distributed_reforms_after_a_restart_and_a_resize(executor):
    """docs/restart.md's recipe: the group formed in one collective call, after the start,
    from a restart callback, and after a resize."""
    pytest.importorskip("torch")

    def join_all(ex, **kw):
        return ex.collective_rpc("reform", args=(ex.distributed_init_method, ex.world_size),
                                 timeout=60, **kw)

    ex = executor(Member, n=2, max_restarts=1)
    assert join_all(ex) == [3.0, 3.0]  # (each rank's all-reduce of rank + 1)
    rejoined = []
    ex.register_restart_callback(lambda rank: rejoined.append(join_all(ex, non_block=True)))
    _kill(ex, 1)
    deadline = time.monotonic() + 60
    while not rejoined:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert rejoined[0].result(timeout=60) == [3.0, 3.0]
    ex.resize(3)
    assert join_all(ex) == [6.0] * 3


def _cycles(ex, n_cycles, seed):
    """Kill a random rank ``n_cycles`` times while two threads keep calls in flight: every
    call gets its own result (its tag from every rank) or WorkerDiedError."""
    rnd = random.Random(seed)
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"ok": 0, "died": 0}

    def caller(me):
        i = 0
        while not stop.is_set():
            tag = (me, i)
            i += 1
            try:
                if i % 2:
                    out = ex.collective_rpc("echo", args=(tag,), timeout=60)
                else:
                    out = ex.collective_rpc("echo", args=(tag,), non_block=True).result(60)
                assert out == [(r, tag) for r in range(ex.world_size)], (out, tag)
                counts["ok"] += 1
            except mpx.WorkerDiedError as e:
                assert not isinstance(e, mpx.WorkerRestartError)
                counts["died"] += 1
            except BaseException as e:
                errors.append(e)
                return

    restarted = []
    ex.register_restart_callback(restarted.append)
    threads = [threading.Thread(target=caller, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        for cycle in range(n_cycles):
            time.sleep(rnd.random() * 0.05)
            rank = rnd.randrange(ex.world_size)
            _kill(ex, rank)
            deadline = time.monotonic() + 60
            while len(restarted) <= cycle and not errors:
                assert time.monotonic() < deadline, "no restart within 60 s"
                time.sleep(0.005)
            assert restarted[cycle] == rank
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors[0]
    assert not ex.is_failed and counts["ok"]
    assert ex.collective_rpc("echo", args=("end",)) == [(r, "end") for r in range(ex.world_size)]
    return counts


def test_kill_and_restart_cycles_with_calls_in_flight(impl, executor):
    ex = executor(Member, n=2, max_restarts=100, **RING)
    _cycles(ex, 4, seed=1)


@pytest.mark.slow
def test_soak_100_kill_and_restart_cycles(executor):
    import psutil
    ex = executor(Member, n=3, max_restarts=110, **RING)
    _cycles(ex, 10, seed=1)
    me = psutil.Process()
    fds, threads = me.num_fds(), me.num_threads()
    counts = _cycles(ex, 100, seed=2)
    print(f"100 kill-and-restart cycles: {counts}; driver fds {fds} -> {me.num_fds()}, "
          f"threads {threads} -> {me.num_threads()}")
    assert len(ex.worker_pids()) == 3
    assert me.num_fds() <= fds + 2 and me.num_threads() <= threads  # nothing kept per cycle


def test_an_event_loop_keeps_running_through_a_restart(impl, executor):
    import asyncio
    ex = executor(Member, n=2, max_restarts=1, **RING)
    restarted_at: list[float] = []
    ex.register_restart_callback(lambda rank: restarted_at.append(time.monotonic()))

    async def main():
        ticks: list[float] = []
        stop = False

        async def ticker():
            while not stop:
                await asyncio.sleep(0.002)
                ticks.append(time.monotonic())

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        killed_at = time.monotonic()
        old = _kill(ex, 1)
        outcomes = []
        for i in range(10_000):
            try:
                outcomes.append(await ex.collective_rpc("echo", args=(i,), non_block=True))
            except mpx.WorkerDiedError as e:
                assert e.rank == 1
                outcomes.append(None)
            if restarted_at and outcomes[-1] is not None:
                break
        stop = True
        await tick
        return old, outcomes, [t for t in ticks if killed_at < t < restarted_at[0]]

    old, outcomes, ticks_meanwhile = asyncio.run(main())
    assert ex.worker_pids()[1] != old
    assert all(o is None or o == [(0, o[0][1]), (1, o[0][1])] for o in outcomes)
    assert outcomes[-1] is not None
    # the restart (a process start: tens of ms at least) ran beside the loop, not in it
    assert len(ticks_meanwhile) >= 3, ticks_meanwhile
