"""Starting follower nodes (``python -m mpx node``) on loopback for multi-node tests."""

from __future__ import annotations

import os
import subprocess
import sys

from mpx._procinfo import free_tcp_port

KEY = "multinode-test-key-0123456789abcdef"
TESTS = os.path.dirname(__file__)


def free_port() -> int:
    return free_tcp_port("127.0.0.1")


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
