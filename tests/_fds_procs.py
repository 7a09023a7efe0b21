"""Processes that hold 1,100 file descriptors before mpx opens one (test_many_fds.py), so
that every descriptor mpx opens is numbered past select()'s FD_SETSIZE (1024).

Run as a script (``PYTHONPATH`` holding tests/), in a process of its own so that the test
process is not the one holding them; each check prints ``OK ...`` and exits 0:

- ``driver TRANSPORT STATS_PATH``: an executor of ``FdWorker``s (which hold 1,100 more in
  ``__init__``) with a stats socket; calls, idle spells long enough to park every reader,
  a broadcast ring full enough that the driver waits for room, and ``python -m mpx top
  --once`` (itself holding 1,100) on its stats socket;
- ``queue``: a MessageQueue with two local readers (one attaching late, so the other's
  ``wait_until_ready`` waits) and one remote reader, all parked before the message comes;
- ``leader PORT``: an executor of 2 nodes x 2 ranks whose followers the test started;
- ``run -m MODULE ARGS`` or ``run PATH ARGS``: hold them, then run MODULE or PATH as
  ``__main__`` (``python -m mpx node``, ``python -m mpx launch``, the launched program).

A worker that multiprocessing spawns from a ``driver`` or ``queue`` process imports this
file as ``__mp_main__`` before anything else: it holds its 1,100 before mpx opens its ends.
"""

from __future__ import annotations

import os
import resource
import runpy
import subprocess
import sys
import time

import _workers

N_FDS = 1100
FD_SETSIZE = 1024
HERE = os.path.abspath(__file__)


def hold(n: int = N_FDS) -> list[int]:
    """Open ``n`` descriptors (of /dev/null) and keep them, raising RLIMIT_NOFILE's soft
    limit first where it is too low for them and what the process opens after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(os.listdir("/proc/self/fd")) + n + 4096
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise SystemExit(f"RLIMIT_NOFILE's hard limit {hard} is below the {need} needed")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]
    assert fds[-1] >= FD_SETSIZE, fds[-1]
    return fds


def next_fd() -> int:
    """The number the next descriptor opened here gets."""
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd


if __name__ == "__mp_main__":  # a worker or reader spawned from a check below
    _HELD = hold()


class FdWorker(_workers.Echo):
    """tests/_workers.Echo, holding 1,100 descriptors more from its ``__init__`` on."""

    def __init__(self, ctx, scale: int = 1) -> None:
        self._held = hold()
        super().__init__(ctx, scale)

    def next_fd(self) -> int:
        """The number the next descriptor opened here gets, once the holes below
        FD_SETSIZE are held too: with forkserver (unlike spawn) the worker opened low
        descriptors before its ``__init__`` and closes some after it, and what mpx opens
        from then on would take those numbers."""
        while (fd := next_fd()) < FD_SETSIZE:
            self._held.append(os.open(os.devnull, os.O_RDONLY))
        return fd

    def descriptors(self) -> int:
        """How many descriptors this worker holds."""
        return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------------------- checks

def _top(path: str) -> str:
    out = subprocess.run([sys.executable, HERE, "run", "-m", "mpx", "top", path, "--once"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"mpx top: {out.returncode} {out.stderr[-3000:]}"
    return out.stdout


def driver(transport: str, stats_path: str) -> None:
    import _env
    from _fds_procs import FdWorker  # (by reference: the workers import it)

    import mpx
    assert next_fd() > FD_SETSIZE
    with mpx.Executor(FdWorker, 2, transport=transport, stats_socket=stats_path,
                      start_method=_env.START_METHOD, heartbeat_s=1.0, max_chunks=4,
                      liveness_poll_ms=20, startup_timeout_s=60) as ex:
        assert min(ex.collective_rpc("descriptors")) > FD_SETSIZE
        assert min(ex.collective_rpc("next_fd")) > FD_SETSIZE
        for i in range(3):  # idle spells: the readers park, waking every liveness poll
            time.sleep(0.3)
            assert ex.collective_rpc("mul", args=(i,), timeout=30) == [i, 2 * i]
        # more calls than the broadcast ring holds behind a slow one: the driver waits
        # (and parks) for room, looking after the readers it waits for
        futs = [ex.collective_rpc("sleep", args=(0.3,), non_block=True)]
        futs += [ex.collective_rpc("ident", args=(i,), non_block=True) for i in range(12)]
        assert [f.result(30) for f in futs[1:]] == [[i, i] for i in range(12)]
        table = _top(stats_path)
        for pid in ex.worker_pids:
            assert str(pid) in table, table
        time.sleep(0.3)
        assert ex.collective_rpc("noop", timeout=30) == [None, None]
        stats = ex.stats()
    assert not os.path.exists(stats_path)
    print(f"OK driver {transport} {stats.calls['mul']}", flush=True)


def _reader(handle, rank: int, delay: float, conn) -> None:
    import mpx
    time.sleep(delay)
    fd = next_fd()
    q = mpx.MessageQueue.create_from_handle(handle, rank)
    try:
        q.wait_until_ready(30)
        conn.send(("ready", rank, fd))
        conn.send(("got", rank, q.dequeue(timeout=30)))
    except Exception as e:
        conn.send(("error", rank, f"{type(e).__name__}: {e}"))
    finally:
        q.close()


def queue() -> None:
    import multiprocessing

    import _env

    import mpx
    mp = multiprocessing.get_context(_env.START_METHOD)
    with mpx.MessageQueue(3, 2, config=mpx.Config.from_env(liveness_poll_ms=20)) as q:
        handle = q.export_handle()
        procs, conns = [], []
        for rank, delay in ((0, 0.0), (1, 0.5), (2, 0.0)):  # rank 1 late; rank 2 remote
            parent, child = mp.Pipe()
            p = mp.Process(target=_reader, args=(handle, rank, delay, child), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        q.wait_until_ready(30)
        for conn in conns:
            assert conn.poll(30), "a reader said nothing"
            tag, rank, fd = conn.recv()
            assert tag == "ready" and fd > FD_SETSIZE, (tag, rank, fd)
        time.sleep(0.5)  # every reader parks in its dequeue
        q.enqueue("hello", timeout=30)
        for conn in conns:
            assert conn.poll(30), "a reader said nothing"
            assert conn.recv()[::2] == ("got", "hello")
        for p in procs:
            p.join(30)
            assert p.exitcode == 0, p.exitcode
    print("OK queue", flush=True)


def leader(port: int) -> None:
    import _env
    from _fds_procs import FdWorker
    from _nodes import KEY

    import mpx
    assert next_fd() > FD_SETSIZE
    with mpx.Executor(FdWorker, 4, nnodes=2, master_port=port, auth_key=KEY,
                      heartbeat_s=1.0, startup_timeout_s=60, liveness_poll_ms=20,
                      start_method=_env.START_METHOD) as ex:
        assert min(ex.collective_rpc("descriptors")) > FD_SETSIZE
        assert min(ex.collective_rpc("next_fd")) > FD_SETSIZE
        for _ in range(3):
            time.sleep(0.3)
            assert ex.collective_rpc("mul", args=(1,), timeout=30) == [1, 2, 3, 4]
    print("OK leader", flush=True)


def run(argv: list[str]) -> None:
    """``run -m MODULE ARGS`` / ``run PATH ARGS``: hold, then run it as ``__main__``."""
    global _HELD
    _HELD = hold()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    what, args = sys.argv[1], sys.argv[2:]
    if what == "run":
        run(args)
        return
    global _HELD
    _HELD = hold()
    if what == "driver":
        driver(args[0], args[1])
    elif what == "queue":
        queue()
    elif what == "leader":
        leader(int(args[0]))
    else:
        raise SystemExit(f"unknown check {what!r}")


if __name__ == "__main__":
    main()
