"""``python -m mpx launch`` keeps its word when a job goes wrong: a program that ends before
every node checked in, a follower killed alone, Ctrl-C and SIGKILL of node 0's launcher,
keys and node counts that differ between nodes, bad numbers in the environment; and the
leader's own refusals (a second follower for a joined node, a node rank beyond its count).

Each "node" is a ``python -m mpx launch`` subprocess on 127.0.0.1 started with torchrun's or
Slurm's variables (see test_launch.py); node 0 runs tests/_launch_app.py.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

import psutil
import pytest
import zmq
from _nodes import KEY, free_port
from _procs import wait_gone
from test_launch import ROOT, _finish, _node, _slurm_env, _torchrun_env

import mpx
from mpx._node import control
from mpx._node.leader import Leader
from mpx.protocol import wire


def _wait_line(proc: subprocess.Popen, prefix: str, timeout: float) -> tuple[str, float]:
    """The first line of ``proc``'s stdout that starts with ``prefix`` and when it came
    (time.monotonic()); AssertionError after ``timeout``. Reads the pipe's file descriptor
    itself, so that communicate() later finds nothing half read."""
    fd, text, deadline = proc.stdout.fileno(), "", time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in text.splitlines(keepends=True):
            if line.startswith(prefix) and line.endswith("\n"):
                return line.strip(), time.monotonic()
        if select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(fd, 65536).decode()
            if not chunk:
                break
            text += chunk
    raise AssertionError(f"no {prefix!r} line within {timeout} s; stdout so far: {text[-2000:]}")


def _follower_of(node: subprocess.Popen) -> psutil.Process:
    """The follower (``python -m mpx node``) that node ``node``'s launcher runs."""
    for child in psutil.Process(node.pid).children():
        if "node" in child.cmdline():
            return child
    raise AssertionError("the launcher runs no follower")


# --------------------------------------------------------------------------- the promises

def test_a_program_that_ends_at_once_tells_the_nodes_that_come_later():
    port = free_port(2)
    late = {"MPX_STARTUP_TIMEOUT_S": "10"}  # how long node 1 waits for node 0, and back
    node0 = _node(dict(_torchrun_env(0, port), **late), "3", "--no-executor")
    nodes = [node0]
    try:
        _wait_line(node0, "DONE", 30)
        time.sleep(1.5)  # the program has ended well before node 1 starts
        t0 = time.monotonic()
        nodes.append(_node(dict(_torchrun_env(1, port), **late), "0"))
        (rc0, _, err0), (rc1, _, err1) = _finish(nodes, timeout=30)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert rc0 == 3, err0[-3000:]
    assert rc1 == 3, err1[-3000:]  # the program's status, not "no mpx launch on node 0"
    assert time.monotonic() - t0 < 8  # told when it checked in, not at its deadline


def test_a_killed_follower_is_a_lost_node_within_heartbeat_s():
    port = free_port(2)
    # a heartbeat longer than the restarted follower's hellos, which kept the node looking alive
    beat = {"MPX_HEARTBEAT_S": "3"}
    nodes = [_node(dict(_torchrun_env(0, port), **beat), "5", "--call-hang"),
             _node(dict(_torchrun_env(1, port), **beat), "0")]
    try:
        _wait_line(nodes[0], "HANG", 60)
        time.sleep(0.3)  # the call is out
        follower = _follower_of(nodes[1])
        follower.kill()  # as the OOM killer would: the launcher and the program stay
        t0 = time.monotonic()
        line, t1 = _wait_line(nodes[0], "ERROR", 20)
        (rc0, _, err0), (rc1, _, err1) = _finish(nodes)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert line == "ERROR NodeLostError node=1 ranks=[2, 3]", err0[-3000:]
    assert t1 - t0 < 3.0 + 2.0  # heartbeat_s, and a loaded machine's slack
    assert "was killed by SIGKILL; starting another" in err1, err1[-3000:]
    assert (rc0, rc1) == (5, 5), err0[-3000:] + err1[-3000:]


@pytest.mark.parametrize("target", ["group", "launcher"])
def test_ctrl_c_on_node_0_ends_every_node_with_130(target):
    port = free_port(2)
    nodes = [_node(_torchrun_env(0, port), "0", "--hang"), _node(_torchrun_env(1, port), "0")]
    try:
        _wait_line(nodes[0], "HANG", 60)
        if target == "group":  # Ctrl-C on node 0's terminal
            os.killpg(nodes[0].pid, signal.SIGINT)
        else:
            os.kill(nodes[0].pid, signal.SIGINT)
        (rc0, _, err0), (rc1, _, err1) = _finish(nodes, timeout=30)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert rc0 == 130 and "Traceback" not in err0, err0[-3000:]
    assert rc1 == 130 and "Traceback" not in err1, err1[-3000:]


def test_sigkill_of_node_0s_launcher_takes_its_program_along():
    port = free_port(2)
    nodes = [_node(_torchrun_env(0, port), "0", "--hang"), _node(_torchrun_env(1, port), "0")]
    below: list[psutil.Process] = []  # the program and its processes
    try:
        line, _ = _wait_line(nodes[0], "HANG", 60)
        program = psutil.Process(int(line.split()[1]))
        below = [program] + program.children(recursive=True)
        os.kill(nodes[0].pid, signal.SIGKILL)  # the launcher alone
        assert wait_gone([p.pid for p in below], 10) == [], "the program outlived its launcher"
        (_, _, _), (rc1, _, err1) = _finish(nodes, timeout=30)
        assert rc1 == 1 and "node 0 (127.0.0.1) sent nothing" in err1, err1[-3000:]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in below:  # no longer this test's descendants: the teardown cannot see them
            with contextlib.suppress(psutil.Error):
                p.kill()  # (psutil checks that the pid was not reused)


def test_keys_that_differ_are_named_on_both_nodes():
    port = free_port(2)
    fast = {"MPX_STARTUP_TIMEOUT_S": "3"}
    other = "another-key-0123456789abcdef0123456"
    nodes = [_node(dict(_torchrun_env(0, port), **fast), "0", "--no-executor", "--sleep", "4"),
             _node(dict(_torchrun_env(1, port), **fast), "0", key=other)]
    (rc0, _, err0), (rc1, _, err1) = _finish(nodes, timeout=30)
    assert rc0 == 0, err0[-3000:]
    assert "failed authentication: is MPX_AUTH_KEY the same on every node?" in err0, err0
    assert rc1 == 1 and "MPX_AUTH_KEY differs between the nodes" in err1, err1
    for err in (err0, err1):
        assert KEY not in err and other not in err  # no secret in a message


@pytest.mark.parametrize("counts", [(2, 3), (4, 2)])  # (world size 4)
@pytest.mark.parametrize("job", [_torchrun_env, _slurm_env], ids=["torchrun", "slurm"])
def test_node_counts_that_differ_are_named(job, counts):
    port = free_port(2)
    env = []
    for rank, n in enumerate(counts):
        e = dict(job(rank, port), MPX_STARTUP_TIMEOUT_S="5")
        e["NNODES" if "NNODES" in e else "SLURM_NNODES"] = str(n)
        env.append(e)
    nodes = [_node(env[0], "0"), _node(env[1], "0")]
    (rc0, _, err0), (rc1, _, err1) = _finish(nodes, timeout=60)
    want = f"node 1 was started with nnodes={counts[1]}, node 0 (the leader) with nnodes={counts[0]}"
    assert rc0 == 1 and want in err0 and "died during startup" not in err0, err0[-3000:]
    assert rc1 == 1 and want in err1 and "started no workers" in err1, err1[-3000:]


# --------------------------------------------------------------------------- the leader alone

def _spec(cfg):
    return wire.NodeSpec(node_rank=0, config=cfg, world_size=4,
                         distributed_init_method="tcp://127.0.0.1:1", handle=None,
                         worker_cls=b"", worker_kwargs=b"")


def _join(leader: Leader, node_rank: int) -> zmq.Socket:
    """A follower's socket that said hello as node ``node_rank`` and answered the challenge."""
    key = KEY.encode()
    sock = control.control_socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{leader.config.master_port}")
    sock.send(control.pack(key, wire.Hello(node_rank, 1234)))
    deadline = time.monotonic() + 10
    while not sock.poll(10) and time.monotonic() < deadline:
        leader._recv(10)
    challenge = control.unpack(key, sock.recv())
    sock.send(control.pack(key, wire.Join(node_rank, challenge.nonce)))
    return sock


def test_the_leader_refuses_a_second_follower_for_a_joined_node():
    cfg = mpx.Config(auth_key=KEY, nnodes=2, master_port=free_port(), heartbeat_s=30.0)
    leader = Leader(cfg, 4)
    socks = []
    try:
        socks.append(_join(leader, 1))
        leader.admit(_spec(cfg), time.monotonic() + 10)
        first = leader.nodes[1]
        socks.append(_join(leader, 1))  # its launcher started another follower
        deadline = time.monotonic() + 10
        while (err := leader.poll()) is None and time.monotonic() < deadline:
            pass
        assert isinstance(err, mpx.NodeLostError) and (err.node_rank, err.ranks) == (1, [2, 3])
        assert "another follower joined" in str(err)
        assert leader.nodes[1] == first and leader.poll() is None  # said once
    finally:
        for sock in socks:
            sock.close(0)
        leader.stop()


def test_the_leader_refuses_a_node_rank_beyond_its_count():
    cfg = mpx.Config(auth_key=KEY, nnodes=2, master_port=free_port())
    leader = Leader(cfg, 4)
    sock = None
    try:
        sock = _join(leader, 2)  # a node launched with nnodes=3
        with pytest.raises(mpx.WorkerStartupError, match="node 2 asked to join, but node 0 has "
                           "nnodes=2"):
            leader.admit(_spec(cfg), time.monotonic() + 10)
        assert leader.nodes == {}
    finally:
        if sock is not None:
            sock.close(0)
        leader.stop()


# --------------------------------------------------------------------------- bad numbers

def _mpx(*args: str, timeout: float = 15, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpx", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT,
                                                    MPX_AUTH_KEY=KEY, **env))


@pytest.mark.parametrize("name, value", [("MPX_HEARTBEAT_S", "nan"), ("MPX_HEARTBEAT_S", "inf"),
                                         ("MPX_HEARTBEAT_S", "-1"),
                                         ("MPX_STARTUP_TIMEOUT_S", "nan")])
def test_bad_numbers_in_the_environment_are_exit_2(name, value):
    for cmd in (["launch", "--", sys.executable, "-c", "pass"],
                ["node", "--master-addr", "127.0.0.1", "--master-port", "9", "--node-rank", "1",
                 "--nnodes", "2"]):
        r = _mpx(*cmd, **{name: value})
        assert r.returncode == 2 and name in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_wait_of_nan_seconds_is_exit_2():
    r = _mpx("node", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             "--node-rank", "1", "--nnodes", "2", "--leader-wait-s", "nan")
    assert r.returncode == 2 and "--leader-wait-s" in r.stderr, r.stderr
