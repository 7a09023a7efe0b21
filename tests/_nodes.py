"""Starting follower nodes (``python -m mpx node``) on loopback for multi-node tests."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys

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
