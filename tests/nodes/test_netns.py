"""A follower node on its own network host: a Linux network namespace joined to this one by
a veth pair (needs root and iproute2; skipped otherwise, and the loopback variants in
test_multinode.py still run). Covers a link cut mid-call.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import _workers
import pytest
from _procs import wait_gone
from test_multinode import KEY, TESTS, free_port

import mpx

NS = f"mpxt{os.getpid() % 100000}"
HOST_IF, NS_IF = f"{NS}a", f"{NS}b"
LEADER_IP, FOLLOWER_IP = "10.231.77.1", "10.231.77.2"


def _ip(*args, ns=None):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@pytest.fixture
def netns():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2")
    try:
        _ip("netns", "add", NS)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace here: {e.stderr.decode().strip()}")
    try:
        _ip("link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        _ip("link", "set", NS_IF, "netns", NS)
        _ip("addr", "add", f"{LEADER_IP}/24", "dev", HOST_IF)
        _ip("link", "set", HOST_IF, "up")
        _ip("addr", "add", f"{FOLLOWER_IP}/24", "dev", NS_IF, ns=NS)
        _ip("link", "set", NS_IF, "up", ns=NS)
        _ip("link", "set", "lo", "up", ns=NS)
        yield NS
    finally:
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=10)


def start_follower_in(ns, port):
    env = dict(os.environ, MPX_AUTH_KEY=KEY, MPX_HEARTBEAT_S="1.0",
               PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "mpx", "node",
                             "--master-addr", LEADER_IP, "--master-port", str(port),
                             "--node-rank", "1", "--nnodes", "2", "--host", FOLLOWER_IP],
                            env=env)


def test_follower_on_another_host_and_link_cut(netns):
    port = free_port()
    follower = start_follower_in(netns, port)
    ex = None
    try:
        ex = mpx.Executor(_workers.Echo, 4, nnodes=2, master_addr=LEADER_IP, host=LEADER_IP,
                          master_port=port, auth_key=KEY, heartbeat_s=1.0, startup_timeout_s=60)
        where = ex.collective_rpc(_workers.where)
        assert [w[:3] for w in where] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
        assert ex.collective_rpc("mul", args=(3,)) == [3, 6, 9, 12]
        remote = ex.worker_pids[2:]
        pending = ex.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0, 1]},
                                    non_block=True)
        _ip("link", "set", HOST_IF, "down")  # cut the wire mid-call
        t0 = time.monotonic()
        with pytest.raises(mpx.NodeLostError) as ei:
            pending.result(timeout=15)
        assert time.monotonic() - t0 < 1.0 + 3
        assert ei.value.node_rank == 1 and ei.value.ranks == [2, 3]
        # the follower notices the silence too, and takes its workers with it
        assert follower.wait(10) == 1
        assert wait_gone(remote, 5) == []
    finally:
        if ex is not None:
            ex.shutdown()
        if follower.poll() is None:
            follower.kill()
            follower.wait()
