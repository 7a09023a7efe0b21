"""How a worker's end is reported: at startup (it dies after it sent its queue's handle,
or its ``__init__`` raises), after startup (its real exit status, also when it exits a
while after closing its queues), and the ``torch.distributed`` port every executor hands
its workers (held by the driver until shutdown, rank 0 binds it anyway; many executors
starting at once)."""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import time

import _startup_workers as SW
import pytest
from _env import START_METHOD

import mpx
from mpx._procinfo import reserve_tcp_port

# Rounds of the racy cases in the default run (the bar: 10 out of 10).
ROUNDS = 10


def _executor(cls, n=2, **kw):
    kw.setdefault("start_method", START_METHOD)
    return mpx.Executor(cls, n, **kw)


# ----------------------------------------------------------------- startup

@pytest.mark.parametrize("how,code,says", [
    ("os._exit", 7, "exit code 7"),
    ("sys.exit", 0, "exit code 0"),  # (its queues close, and the segment goes, before it exits)
    ("signal", signal.SIGKILL, "killed by SIGKILL"),
])
def test_worker_dies_after_its_handle_while_the_driver_waits(how, code, says):
    """Rank 0 dies right after its handle went out, while rank 1 is still in __init__ (it
    is stopped there: rank 0's response queue, which no one attached to, goes too)."""
    with pytest.raises(mpx.WorkerStartupError) as ei:
        _executor(SW.ExitsAfterReady, worker_kwargs=dict(how=how, code=code, slow_s=3))
    err = ei.value
    assert err.ranks == [0] and err.pid and err.exitcode == (-code if how == "signal" else code)
    assert f"worker rank 0 (pid {err.pid}) died during startup: {says}" in str(err), str(err)


@pytest.mark.parametrize("how", ["os._exit", "sys.exit"])
def test_worker_dies_after_its_handle_while_the_driver_attaches(how):
    """Rank 0 dies right after its handle went out, as the driver attaches to its queue:
    never a bare ShmError from the attach, always the death of rank 0 with its status."""
    for _ in range(ROUNDS):
        try:
            e = _executor(SW.ExitsAfterReady, worker_kwargs=dict(how=how, code=7))
        except mpx.WorkerStartupError as err:
            assert err.ranks == [0] and err.exitcode == 7, str(err)
            assert f"worker rank 0 (pid {err.pid}) died during startup: exit code 7" in str(err)
            continue
        # (it was still alive when the group came up: then its death is the group's)
        try:
            with pytest.raises(mpx.WorkerDiedError, match="exit code 7") as ei:
                e.collective_rpc("pid", timeout=30)
            assert ei.value.rank == 0
        finally:
            e.shutdown()


def test_init_failure_names_the_pid():
    with pytest.raises(mpx.WorkerStartupError) as ei:
        _executor(SW.FailsInInit)
    err = ei.value
    assert err.ranks == [1] and err.pid
    assert f"worker rank 1 (pid {err.pid}) failed in __init__: ValueError: no good" in str(err)


# ----------------------------------------------------------------- after startup

@pytest.mark.parametrize("transport", ["shm", "zmq"])
@pytest.mark.parametrize("how,code,linger_s,exitcode,says", [
    ("sys.exit", 0, 0, 0, "exit code 0"),
    ("sys.exit", 5, 0, 5, "exit code 5"),
    ("signal", signal.SIGABRT, 0, -signal.SIGABRT, "killed by SIGABRT"),
    # its process outlives its closed queues by 2 s
    ("sys.exit", 0, 2, 0, "exit code 0"),
    ("sys.exit", 5, 2, 5, "exit code 5"),
    ("signal", signal.SIGKILL, 2, -signal.SIGKILL, "killed by SIGKILL"),
])
def test_exit_is_reported_as_it_was(transport, how, code, linger_s, exitcode, says):
    # heartbeat_s: over zmq the driver reads the closed queue as lost after it, well before
    # a lingering worker exits
    e = _executor(SW.Exits, transport=transport, heartbeat_s=0.5)
    try:
        pid = e.worker_pids[1]
        with pytest.raises(mpx.WorkerDiedError) as ei:
            e.collective_rpc("end", args=(how, code, 1, linger_s), timeout=30)
        err = ei.value
        assert (err.rank, err.pid, err.exitcode) == (1, pid, exitcode), str(err)
        assert str(err).endswith(f"worker rank 1 (pid {pid}) died: {says}"), str(err)
    finally:
        e.shutdown()


# ----------------------------------------------------------------- torch.distributed

def test_reserved_port_is_taken_for_others_but_not_for_tcpstore():
    """What the executors rely on (Linux): while the driver holds the port, a bind to port
    0 never gets it and a plain bind fails, but torch's TCPStore (both backends) binds and
    listens on it."""
    import datetime

    dist = pytest.importorskip("torch.distributed")
    held = reserve_tcp_port()
    port = held.getsockname()[1]
    try:
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", port))
        for _ in range(200):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                assert s.getsockname()[1] != port
        for libuv in (True, False):
            store = dist.TCPStore("127.0.0.1", port, 1, True, use_libuv=libuv,
                                  timeout=datetime.timedelta(seconds=10))
            store.set("k", "v")
            assert store.get("k") == b"v"
            del store
    finally:
        held.close()


def test_distributed_port_is_held_for_rank_0():
    """The port of ctx.distributed_init_method stays taken while the executor runs: no
    other process can bind it (torch's TCPStore in rank 0 can: the test above)."""
    e = _executor(SW.Exits, 1)
    try:
        host, port = e.collective_rpc("init_method")[0].rsplit("/", 1)[1].rsplit(":", 1)
        with socket.socket() as s, pytest.raises(OSError, match="in use"):
            s.bind((host, int(port)))
    finally:
        e.shutdown()
    with socket.socket() as s:  # released at shutdown
        s.bind((host, int(port)))


def _gloo_round(n_executors: int) -> list:
    def one(i):
        e = _executor(SW.GlooAllReduce, 2, startup_timeout_s=120)
        try:
            return e.collective_rpc("all_reduce", args=(float(i),), timeout=60)
        finally:
            e.shutdown()

    with concurrent.futures.ThreadPoolExecutor(n_executors) as pool:
        futures = [pool.submit(one, i) for i in range(n_executors)]
        return [f.exception() or f.result() for f in futures]


# Rounds of the gloo case: the first in the default run, all of them under -m slow (each
# takes ~40 s on 2 cores: 16 workers that import torch).
GLOO_ROUNDS = 10
GLOO_ROUNDS_DEFAULT = 1


@pytest.mark.parametrize("round_", [
    pytest.param(i, marks=[pytest.mark.slow] if i >= GLOO_ROUNDS_DEFAULT else [])
    for i in range(GLOO_ROUNDS)])
def test_eight_executors_at_once_each_get_their_own_port(round_):
    """8 executors start at once; each one's workers join a gloo group through
    ctx.distributed_init_method and all-reduce: every one of them succeeds."""
    pytest.importorskip("torch.distributed")
    t0 = time.monotonic()
    results = _gloo_round(8)
    assert results == [[2.0 * i] * 2 for i in range(8)], results
    print(f"\n8 executors with gloo: {time.monotonic() - t0:.1f} s")
