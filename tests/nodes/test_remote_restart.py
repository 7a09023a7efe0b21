"""A rank on a follower node restarted in place after its process dies
(``Config.max_restarts``), over loopback: with the follower relaying (2 ranks a node) and
without (1 rank a node). The new process reads the driver's broadcast directly; the calls
it never answered fail with WorkerDiedError, the next ones reach every rank; the death
after the last restart fails the executor."""

from __future__ import annotations

import time

import _workers
import pytest
from _nodes import KEY, free_port, start_follower, stop_follower

import mpx


@pytest.fixture
def remote_group():
    made = []

    def make(world_size, **kw):
        port = free_port()
        follower = start_follower(port)
        ex = mpx.Executor(_workers.Echo, world_size, nnodes=2, master_port=port, auth_key=KEY,
                          heartbeat_s=1.0, startup_timeout_s=60, **kw)
        made.append((ex, follower))
        return ex

    yield make
    for ex, follower in made:
        ex.shutdown()
        stop_follower(follower)


def _two_nodes(port, startup_timeout_s):
    """A 2-node, 4-rank Echo executor with a restart a rank; its follower is started
    (on ``port``) by the test."""
    return mpx.Executor(_workers.Echo, 4, nnodes=2, master_port=port, auth_key=KEY,
                        heartbeat_s=1.0, startup_timeout_s=startup_timeout_s, max_restarts=1)


@pytest.mark.parametrize("world_size", [4, 2], ids=["relayed", "direct"])
def test_a_remote_rank_is_restarted_in_place(remote_group, world_size):
    ex = remote_group(world_size, max_restarts=1)
    restarted = []
    ex.register_restart_callback(restarted.append)
    last = world_size - 1
    ranks = list(range(world_size))
    assert ex.collective_rpc("rank") == ranks
    old = ex.worker_pids[last]
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerDiedError) as ei:
        ex.collective_rpc("exit", args=(3, [last]), timeout=30)
    assert ei.value.rank == last
    # calls made while it restarts wait for it, and reach every rank
    assert ex.collective_rpc("rank", timeout=60) == ranks
    took = time.monotonic() - t0
    assert ex.worker_pids[last] != old
    assert restarted == [last]
    assert ex.stats().ranks[last].deaths == 1 and ex.stats().ranks[last].alive
    futs = [ex.collective_rpc("ident", args=(i,), non_block=True) for i in range(20)]
    assert [f.result(timeout=10) for f in futs] == [[i] * world_size for i in range(20)]
    assert ex.collective_rpc("mul", args=(1,), unique_reply_rank=last) == last + 1
    assert took < 30
    # no restart left: the next death fails the executor
    with pytest.raises(mpx.WorkerDiedError):
        ex.collective_rpc("exit", args=(3, [last]), timeout=30)
    with pytest.raises(mpx.ExecutorFailed):
        ex.collective_rpc("rank", timeout=30)


def test_a_lost_node_rejoins_as_a_restart_of_its_ranks():
    """A follower killed (its workers die with it) is lost; with restarts left, `python -m
    mpx node` started again for that node joins, and its ranks serve again; the calls in
    flight on them fail, those made meanwhile wait for the node."""
    port = free_port()
    followers = [start_follower(port)]
    ex = _two_nodes(port, startup_timeout_s=60)
    try:
        restarted = []
        ex.register_restart_callback(restarted.append)
        assert ex.collective_rpc("rank") == [0, 1, 2, 3]
        old = ex.worker_pids[2:]
        pending = ex.collective_rpc("sleep", args=(30,), kwargs={"ranks": [2]}, non_block=True)
        followers[0].kill()
        followers[0].wait()
        with pytest.raises(mpx.WorkerDiedError, match="lost with its node"):
            pending.result(timeout=30)
        waiting = ex.collective_rpc("rank", non_block=True)  # (waits for the node)
        time.sleep(0.5)
        assert not waiting.done()
        followers.append(start_follower(port))
        assert waiting.result(timeout=60) == [0, 1, 2, 3]
        new = ex.worker_pids[2:]
        assert not set(new) & set(old)
        assert sorted(restarted) == [2, 3]
        assert [r.deaths for r in ex.stats().ranks] == [0, 0, 1, 1]
        assert ex.collective_rpc("mul", args=(2,)) == [2, 4, 6, 8]
    finally:
        ex.shutdown()
        for f in followers:
            stop_follower(f)


def _lost_node(startup_timeout_s):
    """A 2-node executor whose follower was killed, its call then failed as its node was
    lost: (executor, the dead follower), for the test to shut down and reap."""
    port = free_port()
    follower = start_follower(port)
    ex = _two_nodes(port, startup_timeout_s=startup_timeout_s)
    try:
        assert ex.collective_rpc("rank") == [0, 1, 2, 3]
        follower.kill()
        follower.wait()
        with pytest.raises(mpx.WorkerDiedError, match="lost with its node"):
            ex.collective_rpc("rank", timeout=30)
    except BaseException:
        ex.shutdown()
        stop_follower(follower)
        raise
    return ex, follower


def test_a_lost_node_that_does_not_come_back_fails_the_executor():
    ex, follower = _lost_node(startup_timeout_s=4)
    try:
        t0 = time.monotonic()
        with pytest.raises(mpx.WorkerRestartError, match="no follower joined for it again"):
            ex.collective_rpc("rank", timeout=30)  # (waits for the node, startup_timeout_s)
        assert time.monotonic() - t0 < 4 + 2
        assert ex.is_failed
    finally:
        ex.shutdown()
        stop_follower(follower)


def test_shutdown_while_a_lost_node_is_awaited_ends_at_once():
    ex, follower = _lost_node(startup_timeout_s=60)
    try:
        waiting = ex.collective_rpc("rank", non_block=True)  # (held for the node)
    finally:
        t0 = time.monotonic()
        ex.shutdown()
        took = time.monotonic() - t0
        stop_follower(follower)
    assert took < 5, f"shutdown took {took:.1f} s while the node's restart waited"
    with pytest.raises(mpx.ExecutorFailed):
        waiting.result(timeout=5)
