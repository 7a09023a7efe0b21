"""Multi-node executors over loopback: a leader (this process) and `python -m mpx node`
followers in subprocesses, talking over TCP on 127.0.0.1.

(Network namespaces and link cuts: test_netns.py; the executor suite on 2 nodes:
test_executor_topologies.py.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import _workers
import pytest
from _nodes import KEY, TESTS, free_port, start_follower, stop_follower
from _procs import wait_gone

import mpx
from mpx.protocol import wire


@pytest.fixture
def group():
    made = []

    def make(cls=_workers.Echo, world_size=4, **kw):
        port = free_port()
        follower = start_follower(port)
        kw.setdefault("heartbeat_s", 1.0)
        kw.setdefault("startup_timeout_s", 60)
        ex = mpx.Executor(cls, world_size, nnodes=2, master_port=port, auth_key=KEY, **kw)
        made.append((ex, follower))
        return ex, follower

    yield make
    for ex, follower in made:
        ex.shutdown()
        stop_follower(follower)


def test_two_nodes_two_ranks_each(group):
    ex, follower = group()
    where = ex.collective_rpc(_workers.where)
    assert [w[:4] for w in where] == [(0, 0, 0, 2), (1, 1, 0, 2), (2, 0, 1, 2), (3, 1, 1, 2)]
    assert [w[4] for w in where] == ex.worker_pids
    assert ex.collective_rpc("mul", args=(2,)) == [2, 4, 6, 8]
    assert ex.collective_rpc("mul", args=(1,), unique_reply_rank=3) == 4
    with pytest.raises(mpx.RPCError) as ei:
        ex.collective_rpc("fail", kwargs={"ranks": [2]})
    assert ei.value.ranks == [2]
    futs = [ex.collective_rpc("ident", args=(i,), non_block=True) for i in range(20)]
    assert [f.result(timeout=10) for f in futs] == [[i] * 4 for i in range(20)]
    ex.check_health(timeout=10)
    remote = ex.worker_pids[2:]
    ex.shutdown()
    assert follower.wait(10) == 0
    assert wait_gone(remote, 5) == []


def test_tensor_parallel_mlp_across_nodes(group):
    torch = pytest.importorskip("torch")
    from mpx._cli import demo_mlp
    ex, _ = group(cls=demo_mlp.TPWorker)
    x = torch.randn(4, demo_mlp.DIM)
    y, _ = ex.collective_rpc("execute_model", args=(x,), unique_reply_rank=0, timeout=60)
    assert torch.allclose(y, demo_mlp.reference(x), atol=1e-4)
    ex.collective_rpc("close", timeout=30)


def test_remote_worker_killed_is_worker_died(group):
    ex, _ = group()  # (without restarts: tests/nodes/test_remote_restart.py has them)
    with pytest.raises(mpx.ResizeError, match="single-node"):
        ex.resize(6)
    pending = ex.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0, 1, 2]}, non_block=True)
    os.kill(ex.worker_pids[3], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerDiedError) as ei:
        pending.result(timeout=10)
    assert time.monotonic() - t0 < 3
    assert ei.value.rank == 3 and "SIGKILL" in str(ei.value)
    assert ex.is_failed


def test_follower_killed_mid_call_is_node_lost(group):
    ex, follower = group()
    remote = ex.worker_pids[2:]
    pending = ex.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0, 1]}, non_block=True)
    time.sleep(0.2)
    follower.kill()
    t0 = time.monotonic()
    with pytest.raises(mpx.ExecutorFailed) as ei:
        pending.result(timeout=15)
    assert time.monotonic() - t0 < 1.0 + 3  # the heartbeat timeout, plus slack
    assert isinstance(ei.value, (mpx.NodeLostError, mpx.WorkerDiedError))
    assert wait_gone(remote, 5) == []  # the follower's workers die with it


LEADER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import mpx, _workers
    ex = mpx.Executor(_workers.Echo, 4, nnodes=2, master_port={port}, auth_key={key!r},
                      heartbeat_s=1.0)
    print(" ".join(map(str, ex.worker_pids)), flush=True)
    time.sleep(60)
""")


def test_leader_killed_follower_and_workers_exit():
    port = free_port()
    follower = start_follower(port)
    leader = subprocess.Popen([sys.executable, "-c", LEADER.format(tests=TESTS, port=port,
                                                                   key=KEY)],
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in leader.stdout.readline().split()]
        assert len(pids) == 4
        leader.kill()
        leader.wait(5)
        assert follower.wait(10) == 1  # it noticed the leader's silence
        assert wait_gone(pids, 5) == []
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
                p.wait()
        leader.stdout.close()


def test_follower_with_wrong_key_never_joins():
    port = free_port()
    follower = start_follower(port, key="not-the-key")
    try:
        t0 = time.monotonic()
        with pytest.raises(mpx.WorkerStartupError, match=r"follower nodes \[1\] did not join"):
            mpx.Executor(_workers.Echo, 4, nnodes=2, master_port=port, auth_key=KEY,
                         startup_timeout_s=2.0, shutdown_grace_s=0.5)
        assert time.monotonic() - t0 < 10
    finally:
        follower.kill()
        follower.wait()


def test_multinode_needs_a_key():
    with pytest.raises(ValueError, match="auth_key"):
        mpx.Executor(_workers.Echo, 4, nnodes=2, master_port=free_port(),
                     config=mpx.Config(auth_key=""))
    with pytest.raises(ValueError, match="multiple of nnodes"):
        mpx.Executor(_workers.Echo, 3, nnodes=2, auth_key=KEY)


def test_junk_on_the_control_port_changes_nothing(group):
    import random

    import zmq
    ex, _ = group()
    port = ex.config.master_port
    rnd = random.Random(5)
    for _ in range(30):
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 300))))
    for i in range(10):
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.ROUTING_ID, f"junk{i}".encode())
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send(os.urandom(rnd.randrange(1, 100)))
        d.close(0)
    time.sleep(0.5)
    assert ex.collective_rpc("mul", args=(1,)) == [1, 2, 3, 4]
    assert not ex.is_failed


def _spec(cfg):
    return wire.NodeSpec(node_rank=0, config=cfg,
                         world_size=4, distributed_init_method="tcp://127.0.0.1:1",
                         handle=None, worker_cls=b"", worker_kwargs=b"")


def test_the_key_never_crosses_the_wire():
    from mpx._node.leader import Leader
    port = free_port()
    follower = start_follower(port)
    try:
        cfg = mpx.Config(auth_key=KEY, nnodes=2, master_port=port, heartbeat_s=1.0)
        leader = Leader(cfg, 4)
        sent = []
        real_send = leader.send
        leader.send = lambda n, msg: (sent.append(msg), real_send(n, msg))[1]
        leader.admit(_spec(cfg), time.monotonic() + 30)
        spec = next(m for m in sent if isinstance(m, wire.NodeSpec))
        assert spec.node_rank == 1
        assert spec.config.auth_key == "" and KEY not in repr(spec)
        leader.stop()
    finally:
        follower.kill()
        follower.wait()


def test_replayed_hello_gets_no_spec():
    import zmq

    from mpx._node import control
    from mpx._node.leader import Leader
    port = free_port()
    cfg = mpx.Config(auth_key=KEY, nnodes=2, master_port=port, heartbeat_s=1.0)
    leader = Leader(cfg, 4)
    key = KEY.encode()
    spy = zmq.Context.instance().socket(zmq.DEALER)
    spy.setsockopt(zmq.LINGER, 0)
    spy.connect(f"tcp://127.0.0.1:{port}")
    try:
        hello = control.pack(key, wire.Hello(1, 1234))  # as captured off the wire
        spy.send(hello)
        with pytest.raises(mpx.WorkerStartupError, match=r"follower nodes \[1\] did not join"):
            leader.admit(_spec(cfg), time.monotonic() + 1.0)
        # it was challenged; a join with a made-up nonce (or a replayed old one) is refused
        got = control.unpack(key, spy.recv())
        assert isinstance(got, wire.Challenge)
        spy.send(control.pack(key, wire.Join(1, b"0" * 16)))
        with pytest.raises(mpx.WorkerStartupError):
            leader.admit(_spec(cfg), time.monotonic() + 0.5)
        assert leader.nodes == {}
    finally:
        spy.close(0)
        leader.stop()


def test_relay_default_depends_on_ranks_per_node():
    cfg = mpx.Config()
    assert cfg.relay == "auto" and cfg.relays(2) and not cfg.relays(1)
    assert mpx.Config(relay="1").relay == "on" and mpx.Config(relay=False).relay == "off"
    with pytest.raises(ValueError, match="relay"):
        mpx.Config(relay="sometimes")


@pytest.mark.parametrize("relay", ["on", "off"])
def test_relayed_and_direct_followers(group, relay):
    ex, follower = group(relay=relay)
    assert ex.config.relay == relay
    assert ex.collective_rpc("mul", args=(2,)) == [2, 4, 6, 8]
    big = bytes(range(256)) * 8192
    assert ex.collective_rpc("ident", args=(big,), unique_reply_rank=3) == big
    futs = [ex.collective_rpc("ident", args=(i,), non_block=True) for i in range(20)]
    assert [f.result(timeout=10) for f in futs] == [[i] * 4 for i in range(20)]
    remote = ex.worker_pids[2:]
    ex.shutdown()
    assert follower.wait(10) == 0
    assert wait_gone(remote, 5) == []


def test_timeouts_errors_and_late_replies_across_nodes(group):
    ex, _ = group()
    with pytest.raises(mpx.RPCTimeoutError) as ei:
        ex.collective_rpc("sleep", args=(1.0,), kwargs={"ranks": [3]}, timeout=0.3)
    assert ei.value.ranks == [3]
    # the late reply from node 1 is dropped, never handed to this call
    assert ex.collective_rpc("ident", args=("fresh",)) == ["fresh"] * 4
    with pytest.raises(mpx.RPCError) as ei:
        ex.collective_rpc("fail", kwargs={"ranks": [2]}, unique_reply_rank=0)
    assert ei.value.ranks == [2]
    with pytest.raises(mpx.RPCError) as ei:
        ex.collective_rpc("unpicklable_result")
    assert ei.value.exc_type == "SerializationError" and ei.value.ranks == [0, 1, 2, 3]
    with pytest.raises(mpx.SerializationError):
        import threading
        ex.collective_rpc("ident", args=(threading.Lock(),))
    assert ex.collective_rpc("rank") == [0, 1, 2, 3]
    assert not ex.is_failed


def test_dump_stacks_reaches_the_follower_workers(group):
    ex, _ = group()
    pending = ex.collective_rpc("sleep", args=(1.5,), kwargs={"ranks": [3]}, non_block=True)
    time.sleep(0.3)
    stacks = ex.dump_stacks(timeout=5)
    assert sorted(stacks) == [0, 1, 2, 3]
    assert all("most recent call first" in s and "_serve" in s for s in stacks.values())
    assert "in sleep" in stacks[3] and "in sleep" not in stacks[2]
    assert pending.result(timeout=10) == [0, 1, 2, 3]


def test_leader_slower_to_start_than_its_heartbeat(group):
    """The leader beats only once its own workers are up; a follower whose workers were
    ready first must not take that silence for the leader's death."""
    ex, follower = group(cls=_workers.SlowOnNodeZero)  # heartbeat 1 s, node 0 takes 2.5 s
    assert ex.collective_rpc("rank") == [0, 1, 2, 3]
    assert follower.poll() is None and not ex.is_failed
