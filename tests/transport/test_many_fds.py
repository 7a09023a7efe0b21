"""A process holding more than 1023 file descriptors (a server with many clients) works on
every surface of mpx: nothing in mpx limits the descriptors a process holds (select()'s
FD_SETSIZE: "filedescriptor out of range in select()").

Each check runs in processes of its own that hold 1,100 descriptors before mpx opens one
(tests/_fds_procs.py), so every descriptor mpx opens there is numbered past 1024: the
driver, its workers, both rings (``impl``), both transports, the stats socket and
``python -m mpx top``, a MessageQueue's readers, ``python -m mpx node`` and ``python -m mpx
launch``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from _nodes import KEY, TESTS, free_port

ROOT = os.path.dirname(TESTS)
PROCS = os.path.join(TESTS, "_fds_procs.py")
APP = os.path.join(TESTS, "_launch_app.py")
# what a process inherits from a real job's environment, removed from the checks' own
JOB_VARS = ("NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT", "SLURM_NODEID",
            "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "MPX_MASTER_PORT",
            "MPX_NNODES", "MPX_MASTER_ADDR", "MPX_HOST", "MPX_AUTH_KEY", "MPX_ALLOW_INSECURE",
            "MPX_STATS_SOCKET", "MPX_TRANSPORT")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, TESTS]), MPX_HEARTBEAT_S="1.0", **extra)
    return env


def _start(args: list[str], **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, PROCS, *args], env=_env(**extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(procs: list[subprocess.Popen], timeout: float = 90.0) -> list[tuple]:
    """[(exit status, stdout, stderr)] of each; kills every one's session at the deadline."""
    out = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            so, se = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out.append((p.returncode, so, se))
    except subprocess.TimeoutExpired:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()
        raise AssertionError(f"a check did not end within {timeout} s") from None
    return out


def _ok(result: tuple, word: str) -> None:
    rc, so, se = result
    assert rc == 0 and f"OK {word}" in so, f"exit {rc}\n{so[-2000:]}\n{se[-4000:]}"


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_an_executor_whose_processes_hold_1100_descriptors(impl, transport, tmp_path):
    # (parked readers, a full broadcast ring, the stats socket and `mpx top`)
    path = str(tmp_path / "stats.sock")
    (result,) = _finish([_start(["driver", transport, path])])
    _ok(result, f"driver {transport}")


def test_a_message_queue_whose_readers_hold_1100_descriptors(impl):
    # (a local reader's wait_until_ready waits for a late one; the remote one over zmq)
    (result,) = _finish([_start(["queue"], MPX_AUTH_KEY=KEY)])
    _ok(result, "queue")


def test_a_follower_node_holding_1100_descriptors(impl):
    port = free_port()
    follower = _start(["run", "-m", "mpx", "node", "--master-addr", "127.0.0.1",
                       "--master-port", str(port), "--node-rank", "1", "--nnodes", "2"],
                      MPX_AUTH_KEY=KEY)
    leader = _start(["leader", str(port)])
    (lead, node) = _finish([leader, follower])
    _ok(lead, "leader")
    assert node[0] == 0, node[2][-4000:]


def test_launch_holding_1100_descriptors(impl):
    # two launchers, and node 0's program, each holding them
    port = free_port(2)  # and port + 1: the executor's and the launchers'

    def node(rank: int) -> subprocess.Popen:
        return _start(["run", "-m", "mpx", "launch", "--", sys.executable, PROCS, "run", APP,
                       "3"], MPX_AUTH_KEY=KEY, NODE_RANK=str(rank), NNODES="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    nodes = [node(1), node(0)]
    (rc1, _, err1), (rc0, out0, err0) = _finish(nodes)
    assert rc0 == 3, err0[-4000:]  # the program's exit status, on every node
    assert rc1 == 3, err1[-4000:]
    rounds = [line for line in out0.splitlines() if line.startswith("ROUND")]
    assert len(rounds) == 2, out0
    assert all("nnodes=2 ranks=[(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]" in line
               for line in rounds), out0
