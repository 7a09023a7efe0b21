"""Starting follower nodes (``python -m mpx node``) on loopback for multi-node tests."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys

import _workers

import mpx

KEY = "multinode-test-key-0123456789abcdef"
TESTS = os.path.dirname(__file__)


def free_port(consecutive: int = 1) -> int:
    """A port p on 127.0.0.1 with p .. p + consecutive - 1 free, below the kernel's ephemeral
    range. A port that bind(0) hands out can be handed out again at once, to another socket
    (a follower's own queue, binding before the leader does), and that test then fails with
    "Address already in use"; the kernel never picks one below the range by itself."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low - consecutive)
        try:
            for p in range(port, port + consecutive):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise AssertionError(f"no {consecutive} consecutive free ports below {low}")


def start_follower(port, node_rank=1, nnodes=2, key=KEY, heartbeat="1.0"):
    env = dict(os.environ, MPX_AUTH_KEY=key, MPX_HEARTBEAT_S=heartbeat,
               PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "mpx", "node", "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "--node-rank", str(node_rank),
                             "--nnodes", str(nnodes)], env=env)


def stop_follower(follower, timeout=10.0) -> None:
    try:
        follower.wait(timeout)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()


@contextlib.contextmanager
def group_across(link, heartbeat_s=1.0, world=4, **kw):
    """A 2-node ``_workers.Echo`` group of ``world`` ranks whose follower (the second half:
    ranks 2, 3 by default) runs across ``link`` (a tests/_netfault.py FaultyLink):
    ``(executor, follower process)``. The executor is shut down and the follower reaped at
    the end."""
    port = free_port()
    env = dict(os.environ, MPX_AUTH_KEY=KEY, MPX_HEARTBEAT_S=str(heartbeat_s),
               PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    follower = link.ns_popen([sys.executable, "-m", "mpx", "node", "--master-addr",
                              link.leader_ip, "--master-port", str(port), "--node-rank", "1",
                              "--nnodes", "2", "--host", link.follower_ip], env=env)
    ex = None
    try:
        ex = mpx.Executor(_workers.Echo, world, nnodes=2, master_addr=link.leader_ip,
                          host=link.leader_ip, master_port=port, auth_key=KEY,
                          heartbeat_s=heartbeat_s, startup_timeout_s=60, **kw)
        yield ex, follower
    finally:
        if ex is not None:
            ex.shutdown()
        try:
            follower.wait(15)
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait()
