"""Messages that mislead (issue 50, class 5): each error names what happened and what to
do, and never blames a process mpx stopped itself.

- a follower with another ``MPX_AUTH_KEY``: both sides say that the keys did not match
  (naming no key), and the leader still takes a follower with the right key;
- a follower that joined says so once, with its ranks;
- a resize whose staying rank died names that rank and its exit, not a rank mpx stopped
  once the group failed; a shutdown during a resize says so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import _workers
import pytest
from _message_workers import SlowNewcomer
from _nodes import KEY, TESTS, free_port

import mpx

OTHER_KEY = "another-key-fedcba9876543210-not-the-group-s"


def _follower(port: int, key: str, wait_s: float, node_rank: int = 1) -> subprocess.Popen:
    """``python -m mpx node`` for a 2-node group on 127.0.0.1:``port``, its stderr piped."""
    env = dict(os.environ, MPX_AUTH_KEY=key, MPX_HEARTBEAT_S="1.0",
               PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "mpx", "node", "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "--node-rank", str(node_rank),
                             "--nnodes", "2", "--leader-wait-s", str(wait_s)],
                            env=env, stderr=subprocess.PIPE, text=True)


def _stderr_of(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """``proc``'s stderr once it exited (killed after ``timeout``)."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def _no_key_in(text: str) -> None:
    assert KEY not in text and OTHER_KEY not in text, text


# ---------------------------------------------------------------- multi-node


def test_a_wrong_key_is_named_on_both_sides():
    port = free_port()
    follower = _follower(port, OTHER_KEY, wait_s=8.0)
    try:
        with pytest.raises(mpx.WorkerStartupError) as ei:
            mpx.Executor(_workers.Echo, 4, nnodes=2, master_port=port, auth_key=KEY,
                         startup_timeout_s=4.0, shutdown_grace_s=0.5)
        err = _stderr_of(follower)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    leader_says = str(ei.value)
    assert "follower nodes [1] did not join" in leader_says, leader_says
    assert "a node with another MPX_AUTH_KEY tried to join from 127.0.0.1" in leader_says, \
        leader_says
    assert ei.value.ranks == [2, 3]
    _no_key_in(leader_says)
    assert follower.returncode not in (0, None), err
    assert "MPX_AUTH_KEY did not match the leader's" in err, err
    assert "no leader" not in err, err
    _no_key_in(err)


def test_a_follower_says_once_that_it_joined_and_a_wrong_key_changes_nothing():
    """A stranger with another key keeps trying as node 1 while the right follower joins:
    the group starts as usual, the stranger learns only that its key did not match."""
    port = free_port()
    stranger = _follower(port, OTHER_KEY, wait_s=6.0)
    follower = _follower(port, KEY, wait_s=60.0)
    ex = None
    try:
        ex = mpx.Executor(_workers.Echo, 4, nnodes=2, master_port=port, auth_key=KEY,
                          heartbeat_s=1.0, startup_timeout_s=60)
        assert ex.collective_rpc("mul", args=(2,)) == [2, 4, 6, 8]
        ex.shutdown()
        err = _stderr_of(follower)
        assert follower.returncode == 0, err
        stranger_err = _stderr_of(stranger)
    finally:
        if ex is not None:
            ex.shutdown()
        for p in (follower, stranger):
            if p.poll() is None:
                p.kill()
                p.communicate()
    joined = [line for line in err.splitlines() if "joined" in line]
    assert joined == [f"mpx node 1: joined the leader at 127.0.0.1:{port} with ranks 2-3 of 4"], err
    assert "MPX_AUTH_KEY did not match the leader's" in stranger_err, stranger_err
    assert "joined" not in stranger_err, stranger_err
    _no_key_in(err + stranger_err)


# ---------------------------------------------------------------- regroups


def _resize_in_thread(ex, n):
    """Start ``ex.resize(n)`` in a thread: (the thread, a list that gets what it raised)."""
    raised: list = []

    def run():
        try:
            ex.resize(n, timeout=60)
            raised.append(None)
        except BaseException as e:  # noqa: BLE001 (the test looks at it)
            raised.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, raised


def _until(predicate, timeout=30.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not come within {timeout} s"
        time.sleep(0.01)


def _assert_names_the_death(err: BaseException, rank: int, pid: int) -> None:
    text = str(err)
    assert isinstance(err, mpx.ExecutorFailed) and not isinstance(err, mpx.WorkerStartupError), \
        repr(err)
    assert f"worker rank {rank} (pid {pid}) died: killed by SIGKILL" in text, text
    assert "exit code 0" not in text and "create a new one" in text, text
    cause = err.__cause__
    assert isinstance(cause, mpx.WorkerDiedError) and cause.rank == rank, repr(cause)


def test_a_resize_whose_staying_rank_dies_while_new_ranks_start_names_that_rank(impl, executor):
    ex = executor(SlowNewcomer, n=2, worker_kwargs=dict(slow_from_rank=2, slow_s=3.0),
                  shutdown_grace_s=0.5, terminate_grace_s=0.5)
    pid = ex.worker_pids()[1]
    t, raised = _resize_in_thread(ex, 3)
    time.sleep(0.5)  # (rank 2 is in its __init__)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert len(raised) == 1, "the resize did not end"
    _assert_names_the_death(raised[0], 1, pid)
    assert ex.is_failed
    with pytest.raises(mpx.WorkerDiedError, match="rank 1"):
        ex.collective_rpc("who", timeout=10)


def test_a_resize_whose_staying_rank_dies_before_all_attached_names_that_rank(impl, executor):
    """Rank 0 (stopped) has not taken the message that moves it to the new ring when rank
    1 dies; the group's failure then stops rank 0: the resize blames rank 1."""
    ex = executor(SlowNewcomer, n=2, worker_kwargs=dict(slow_from_rank=2, slow_s=0.5),
                  shutdown_grace_s=0.5, terminate_grace_s=0.5, startup_timeout_s=60)
    pids = ex.worker_pids()
    os.kill(pids[0], signal.SIGSTOP)
    try:
        t, raised = _resize_in_thread(ex, 3)
        _until(lambda: ex.world_size == 3 or raised, what="the new ring")  # ranks told
        time.sleep(0.3)  # (rank 1 moves to the new ring; rank 0 cannot)
        os.kill(pids[1], signal.SIGKILL)
        t.join(60)
    finally:
        try:
            os.kill(pids[0], signal.SIGCONT)
        except ProcessLookupError:
            pass  # (the group's failure ended it)
    assert len(raised) == 1, "the resize did not end"
    _assert_names_the_death(raised[0], 1, pids[1])
    assert "rank 0" not in str(raised[0])


def test_a_shutdown_during_a_resize_says_so(impl, executor):
    ex = executor(SlowNewcomer, n=2, worker_kwargs=dict(slow_from_rank=2, slow_s=3.0),
                  shutdown_grace_s=0.5, terminate_grace_s=0.5)
    t, raised = _resize_in_thread(ex, 3)
    time.sleep(0.5)  # (rank 2 is in its __init__)
    ex.shutdown()
    t.join(60)
    assert len(raised) == 1, "the resize did not end"
    err = raised[0]
    assert type(err) is mpx.ExecutorFailed, repr(err)
    assert "resize(3) did not finish: the executor was shut down" in str(err), str(err)
    with pytest.raises(mpx.ExecutorFailed, match="shut down"):
        ex.collective_rpc("who", timeout=10)
