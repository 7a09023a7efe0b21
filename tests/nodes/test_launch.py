"""``python -m mpx launch``: one line on every node, with Slurm's or torchrun's variables.

Each "node" is a ``python -m mpx launch`` subprocess on 127.0.0.1 with its own NODE_RANK or
SLURM_NODEID; node 0 runs tests/_launch_app.py. Also: Slurm host lists, and where a node
learns its place.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from _nodes import KEY, TESTS, free_port
from _procs import wait_gone

from mpx._cli.hostlist import expand_hostlist, first_host
from mpx._cli.launch import LaunchError, find_place

ROOT = os.path.dirname(TESTS)
APP = os.path.join(TESTS, "_launch_app.py")
# what a node inherits from a real job's environment, removed from the test's own
JOB_VARS = ("NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT", "SLURM_NODEID",
            "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "MPX_MASTER_PORT",
            "MPX_NNODES", "MPX_MASTER_ADDR", "MPX_HOST", "MPX_AUTH_KEY", "MPX_ALLOW_INSECURE")


# --------------------------------------------------------------------------- host lists

@pytest.mark.parametrize("spec, hosts", [
    ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("a,b,c", ["a", "b", "c"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[1]", ["n1"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("rack[1-2]-node[3,5],login", ["rack1-node3", "rack1-node5", "rack2-node3",
                                   "rack2-node5", "login"]),
    ("node-[1-2].cluster", ["node-1.cluster", "node-2.cluster"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    (" x[1-2] ", ["x1", "x2"]),
])
def test_hostlist_expands_as_scontrol_does(spec, hosts):
    assert expand_hostlist(spec) == hosts
    assert first_host(spec) == hosts[0]


@pytest.mark.parametrize("spec, why", [
    ("", "empty"), ("node[1-3", "without ']'"), ("node1-3]", "without '['"),
    ("node[[1]]", "nested"), ("node[3-1]", "backwards"), ("node[a-b]", "not a number"),
    ("node[1,,2]", "not a number"), ("a,,b", "empty host name"), ("n[1-]", "not a number"),
    ("n[0-99999999]", "over"),
])
def test_hostlist_rejects_malformed_lists(spec, why):
    with pytest.raises(ValueError) as ei:
        expand_hostlist(spec)
    assert why in str(ei.value)


# --------------------------------------------------------------------------- place

def _args(**kw):
    base = dict(node_rank=None, nnodes=None, master_addr=None, master_port=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_place_from_torchrun_variables():
    env = {"NODE_RANK": "1", "NNODES": "4", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "1234"}
    p = find_place(_args(), env)
    assert (p.node_rank, p.nnodes, p.master_addr, p.master_port) == (1, 4, "10.0.0.9", 1234)
    assert p.source == "torchrun variables"
    # flags win
    p = find_place(_args(node_rank=2, master_port=99), env)
    assert (p.node_rank, p.nnodes, p.master_port, p.source) == (2, 4, 99, "flags")


def test_place_from_slurm_variables():
    env = {"SLURM_NODEID": "2", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "gpu[07-09]",
           "MPX_MASTER_PORT": "4321"}
    p = find_place(_args(), env)
    assert (p.node_rank, p.nnodes, p.master_addr, p.master_port) == (2, 3, "gpu07", 4321)
    assert p.source == "Slurm variables"
    # MASTER_PORT, where the job sets it, comes before MPX_MASTER_PORT; no port: 29555
    assert find_place(_args(), dict(env, MASTER_PORT="555")).master_port == 555
    env.pop("MPX_MASTER_PORT")
    assert find_place(_args(), env).master_port == 29555


def test_place_errors_name_what_is_missing():
    with pytest.raises(LaunchError, match="rank is unknown"):
        find_place(_args(nnodes=2), {"MASTER_ADDR": "h"})
    with pytest.raises(LaunchError, match="leader's address is unknown"):
        find_place(_args(nnodes=2, node_rank=1), {})
    with pytest.raises(LaunchError, match=r"node rank 2 is not in \[0, 2\)"):
        find_place(_args(), {"NODE_RANK": "2", "NNODES": "2", "MASTER_ADDR": "h"})
    with pytest.raises(LaunchError, match="NODE_RANK='x' is not an integer"):
        find_place(_args(), {"NODE_RANK": "x"})
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
        find_place(_args(), {"SLURM_NODEID": "0", "SLURM_NNODES": "2",
                             "SLURM_JOB_NODELIST": "n[1-"})
    one = find_place(_args(), {})
    assert (one.node_rank, one.nnodes) == (0, 1)


# --------------------------------------------------------------------------- whole jobs

def _node(job_env: dict, *app_args: str, key: str | None = KEY) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    env.update(MPX_HEARTBEAT_S="1.0", PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
    env.update(job_env)
    if key is not None:
        env["MPX_AUTH_KEY"] = key
    return subprocess.Popen([sys.executable, "-m", "mpx", "launch", "--", sys.executable, APP,
                             *app_args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(procs, timeout=60.0):
    """[(exit status, stdout, stderr)] of every node; kills what is left at the deadline."""
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            so, se = p.communicate()
            raise AssertionError(f"node did not exit in time: {se[-2000:]}") from None
        out.append((p.returncode, so, se))
    return out


def _torchrun_env(rank, port):
    return {"NODE_RANK": str(rank), "NNODES": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def _slurm_env(rank, port):
    # Slurm gives no port: the job sets MPX_MASTER_PORT (or MASTER_PORT) itself
    return {"SLURM_NODEID": str(rank), "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "MPX_MASTER_PORT": str(port)}


@pytest.mark.parametrize("job", [_torchrun_env, _slurm_env], ids=["torchrun", "slurm"])
def test_one_line_on_every_node(job):
    port = free_port(2)  # and port + 1: the executor's and the launchers'
    # the follower node may start first: it waits for node 0
    nodes = [_node(job(1, port), "3"), _node(job(0, port), "3")]
    (rc1, _, err1), (rc0, out0, err0) = _finish(nodes)
    assert rc0 == 3, err0[-3000:]
    assert rc1 == 3, err1[-3000:]  # the program's exit status, on every node
    rounds = [line for line in out0.splitlines() if line.startswith("ROUND")]
    assert len(rounds) == 2, out0  # a second executor finds the follower again
    for line in rounds:
        assert "nnodes=2 ranks=[(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]" in line
        pids = [int(p) for p in line.split("pids=")[1].split()]
        assert wait_gone(pids, 5) == []


def _two_nodes_in_a_hanging_call():
    """Two launched nodes whose program sits in a call that never returns; (nodes, the
    program's "HANG <pid>" line)."""
    port = free_port(2)  # and port + 1: the executor's and the launchers'
    nodes = [_node(_torchrun_env(0, port), "0", "--hang"), _node(_torchrun_env(1, port), "0")]
    line = ""
    deadline = time.monotonic() + 60
    while not line.startswith("HANG") and time.monotonic() < deadline:
        line = nodes[0].stdout.readline()
    assert line.startswith("HANG"), "the program never got to its first call"
    return nodes, line


def test_program_killed_by_a_signal_is_128_plus_n():
    nodes, line = _two_nodes_in_a_hanging_call()
    os.kill(int(line.split()[1]), signal.SIGKILL)
    (rc0, _, err0), (rc1, _, err1) = _finish(nodes)
    assert rc0 == 128 + signal.SIGKILL, err0[-3000:]
    assert rc1 == 128 + signal.SIGKILL, err1[-3000:]


def test_node_0_gone_ends_the_other_nodes():
    nodes, line = _two_nodes_in_a_hanging_call()
    follower_side = [c.pid for c in psutil.Process(nodes[1].pid).children(recursive=True)]
    assert follower_side  # its follower and that follower's workers
    os.killpg(nodes[0].pid, signal.SIGKILL)  # node 0 vanishes: launcher, program, workers
    t0 = time.monotonic()
    (_, _, _), (rc1, _, err1) = _finish(nodes, timeout=30)
    assert rc1 == 1 and "node 0 (127.0.0.1) sent nothing" in err1, err1[-3000:]
    assert time.monotonic() - t0 < 1.0 + 10  # heartbeat, then the follower's own stop
    assert wait_gone(follower_side, 10) == []


def test_no_key_is_a_clear_error():
    port = free_port(2)  # and port + 1: the executor's and the launchers'
    nodes = [_node(_torchrun_env(0, port), "0", key=None),
             _node(_torchrun_env(1, port), "0", key=None)]
    for rc, _, err in _finish(nodes, timeout=30):
        assert rc == 2 and "needs MPX_AUTH_KEY" in err, err


def test_no_program_is_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "mpx", "launch"], capture_output=True,
                       text=True, timeout=30, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 2 and "no program given" in r.stderr
