"""How long a rank restarted in place (Config.max_restarts) takes to serve again, against
the time the executor took to start, measured in the same run.

    python bench/bench_restart.py [--quick]

Each repetition builds an executor (the baseline: construction until every worker is
ready), then SIGKILLs one rank and times from the kill to the first call answered by every
rank (the calls in between fail with WorkerDiedError; the executor does not). Two worker
kinds: one with an empty ``__init__``, and one whose ``__init__`` loads a "model" (imports
torch and builds a 2-layer MLP), where the start-up of a real engine goes. Target (issue
32): the restart under 3x the start. Then the same on 2 nodes (issue 52): a follower node
(``python -m mpx node`` on loopback, started before each executor) runs ranks 2 and 3, and
the rank killed is one of them, restarted by its follower.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import kit_args
import kit_procs
import kit_report
import kit_stats

import mpx

WORLD = 4
KEY = secrets.token_hex(32)


class Empty:
    def __init__(self, ctx):
        self.ctx = ctx

    def who(self):
        return self.ctx.rank, os.getpid()


class Model(Empty):
    def __init__(self, ctx):
        super().__init__(ctx)
        import torch
        torch.manual_seed(ctx.rank)
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                       torch.nn.Linear(1024, 256))


def _one(cls: type, nnodes: int = 1) -> tuple[float, float]:
    """(seconds to start the executor, seconds from a SIGKILL of its last rank to the next
    full answer); on ``nnodes`` 2, with a follower node started first."""
    follower = None
    kw: dict = {}
    if nnodes == 2:
        port = kit_procs.free_port()
        follower = subprocess.Popen(
            [sys.executable, "-m", "mpx", "node", "--master-addr", "127.0.0.1", "--master-port",
             str(port), "--node-rank", "1", "--nnodes", "2"],
            env=dict(os.environ, MPX_AUTH_KEY=KEY), stderr=subprocess.DEVNULL)
        kit_procs.child_pids.add(follower.pid)
        kw = dict(nnodes=2, master_port=port, auth_key=KEY)
    t0 = time.monotonic()
    try:
        ex = mpx.Executor(cls, WORLD, max_restarts=1, **kw)
    except BaseException:
        if follower is not None:
            follower.kill()
            follower.wait()
        raise
    try:
        started = time.monotonic() - t0
        ex.collective_rpc("who")
        victim = ex.worker_pids[WORLD - 1]
        t1 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while True:
            try:
                out = ex.collective_rpc("who", timeout=60)
                break
            except mpx.WorkerDiedError:
                continue
        back = time.monotonic() - t1
        assert out[WORLD - 1][1] != victim and not ex.is_failed
        return started, back
    finally:
        ex.shutdown()
        if follower is not None:
            follower.wait(15)


def main() -> None:
    args = kit_args.parse_args(__doc__, "3 repetitions per worker kind instead of 7")
    reps = 3 if args.quick else 7
    header = kit_report.print_header(args.quick, "restart benchmark",
                                     f"the driver and its {WORLD} workers share them")
    rows, raw = [], {}
    kinds = [("empty __init__", Empty)]
    try:
        import torch  # noqa: F401
        kinds.append(("__init__ loads torch and an MLP", Model))
    except ImportError:
        print("note: torch is not installed; the model row is left out")
    for nnodes in (1, 2):
        where = "" if nnodes == 1 else ", 2 nodes (the rank on the follower)"
        for label, cls in kinds:
            kit_report.progress(f"{reps} x (start {WORLD} workers, SIGKILL one, wait for a full "
                                f"answer): {label}{where} ...")
            _one(cls, nnodes)  # (warm: imports, the page cache)
            runs = [_one(cls, nnodes) for _ in range(reps)]
            start = kit_stats.stats([1e3 * s for s, _ in runs])
            back = kit_stats.stats([1e3 * b for _, b in runs])
            raw[label + where] = runs
            rows.append(kit_report.row(f"executor start, {WORLD} ranks, {label}{where}", "ms",
                                       start))
            rows.append(kit_report.row(f"SIGKILL to the next full answer, {label}{where}", "ms",
                                       back, start, "< 3x the start",
                                       back["median"] < 3 * start["median"]))
    kit_report.finish(args, header, rows, raw, "restart in place")


if __name__ == "__main__":
    main()
