"""How fast a death is reported while the group is busy re-forming, and what the
membership's one owner costs the calls (issue 49).

    python bench/bench_regroup.py [--quick] [--ab REV] [--json P] [--png P]

1. Death to WorkerDiedError: a rank (with restarts left) is SIGKILLed while a call waits
   for it, and the time from the kill until that call's future fails is taken, in four
   situations: the group otherwise idle; a resize waiting for that call; another rank's
   restart waiting for the survivors' calls in progress; a restart callback running.
   Target: under 1 s in every one (median and worst of the repetitions).
2. With ``--ab REV``: the same workloads on this tree and on git revision REV, each
   measured in a child process of its own, the two sides taking turns (the first one
   alternating) for 5 rounds: a blocking no-op to 1 and to 2 workers, asyncio with 64
   calls in flight, a 64 MiB tensor to one worker (with torch), and a restart (SIGKILL to
   the next full answer). Reported: each side's median, and the median and worst of the
   rounds' paired ratios. Targets: each call workload within 1.05x, the restart within
   1.1x (the median of the paired ratios).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import kit_args
import kit_procs
import kit_report
import kit_stats

import mpx

WORLD = 3
KILL_TO_ERROR_TARGET_S = 1.0


class Member:
    def __init__(self, ctx):
        self.ctx = ctx

    def noop(self):
        return None

    def who(self):
        return self.ctx.rank, os.getpid()

    def nap(self, seconds, ranks=None):
        if ranks is None or self.ctx.rank in ranks:
            time.sleep(seconds)
        return self.ctx.rank

    def size(self, t):
        return t.nbytes if hasattr(t, "nbytes") else len(t)


# --------------------------------------------------------------------------- 1. death to error


def _failed_after(fut, killed_at: float) -> float:
    try:
        fut.result(timeout=60)
    except mpx.WorkerDiedError:
        return time.monotonic() - killed_at
    raise AssertionError("the call did not fail with WorkerDiedError")


def _kill(ex, rank: int) -> float:
    os.kill(ex.worker_pids()[rank], signal.SIGKILL)
    return time.monotonic()


def _wait_answering(ex) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            ex.collective_rpc("who", timeout=30)
            return
        except mpx.WorkerDiedError:
            assert time.monotonic() < deadline


def case_idle(ex) -> float:
    fut = ex.collective_rpc("nap", args=(3.0,), non_block=True)
    time.sleep(0.05)
    return _failed_after(fut, _kill(ex, 1))


def case_resize(ex) -> float:
    fut = ex.collective_rpc("nap", args=(3.0,), non_block=True)
    t = threading.Thread(target=ex.resize, args=(WORLD + 1,), kwargs={"timeout": 60})
    t.start()
    time.sleep(0.2)  # the resize waits for `fut`
    took = _failed_after(fut, _kill(ex, 1))
    t.join(60)
    ex.resize(WORLD, timeout=60)
    return took


def case_restart(ex) -> float:
    fut = ex.collective_rpc("nap", args=(3.0, [0, 1]), non_block=True)  # ranks 0, 1 busy
    time.sleep(0.05)
    _kill(ex, 2)  # rank 2 answered; its restart waits for ranks 0 and 1
    time.sleep(0.3)
    return _failed_after(fut, _kill(ex, 1))


def case_callback(ex) -> float:
    started = threading.Event()

    def slow_callback(rank):
        started.set()
        time.sleep(3.0)

    ex.register_restart_callback(slow_callback)
    _kill(ex, 2)
    assert started.wait(60)
    fut = ex.collective_rpc("nap", args=(3.0,), non_block=True)
    time.sleep(0.05)
    return _failed_after(fut, _kill(ex, 1))


CASES = [("the group otherwise idle", case_idle),
         ("a resize waiting for the call", case_resize),
         ("another rank's restart under way", case_restart),
         ("a restart callback running", case_callback)]


def death_to_error(reps: int) -> tuple[list, dict]:
    rows, raw = [], {}
    for label, case in CASES:
        kit_report.progress(f"death to WorkerDiedError, {label}: {reps} repetitions ...")
        times = []
        for _ in range(reps):
            ex = mpx.Executor(Member, WORLD, max_restarts=100)
            try:
                ex.collective_rpc("who")
                times.append(case(ex))
                _wait_answering(ex)
            finally:
                ex.shutdown()
        st = kit_stats.stats([1e3 * t for t in times])
        worst = max(times)
        raw[label] = times
        rows.append(kit_report.row(f"SIGKILL to WorkerDiedError, {label}", "ms", st,
                                   target="< 1000 ms, worst too",
                                   ok=worst < KILL_TO_ERROR_TARGET_S,
                                   note=f"worst {1e3 * worst:.0f} ms"))
    return rows, raw


# --------------------------------------------------------------------------- 2. the A/B


def _time_per_call(fn, blocks: int, per_block: int) -> float:
    """Microseconds per call: the median over ``blocks`` blocks of ``per_block`` calls."""
    out = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(per_block):
            fn()
        out.append(1e6 * (time.perf_counter() - t0) / per_block)
    return statistics.median(out)


def child(kind: str) -> float:
    """One side's figure for ``kind`` (microseconds a call; milliseconds for the restart)."""
    if kind == "restart":
        ex = mpx.Executor(Member, 4, max_restarts=2)
        try:
            ex.collective_rpc("who")
            t0 = _kill(ex, 3)
            _wait_answering(ex)
            return 1e3 * (time.monotonic() - t0)
        finally:
            ex.shutdown()
    n = 2 if kind == "noop2" else 1
    with mpx.Executor(Member, n) as ex:
        if kind in ("noop1", "noop2"):
            call = lambda: ex.collective_rpc("noop")  # noqa: E731
            _time_per_call(call, 2, 500)  # (warm, and settle the scheduler)
            return _time_per_call(call, 11, 500)
        if kind == "async64":
            async def run() -> float:
                async def batch():
                    await asyncio.gather(*[ex.collective_rpc("noop", non_block=True)
                                           for _ in range(64)])
                for _ in range(20):
                    await batch()
                out = []
                for _ in range(11):
                    t0 = time.perf_counter()
                    for _ in range(10):
                        await batch()
                    out.append(1e6 * (time.perf_counter() - t0) / 640)
                return statistics.median(out)
            return asyncio.run(run())
        if kind == "tensor64":
            import torch
            t = torch.ones(kit_stats.BIG // 4, dtype=torch.float32)
            call = lambda: ex.collective_rpc("size", args=(t,))  # noqa: E731
            _time_per_call(call, 1, 3)
            return _time_per_call(call, 7, 3)
    raise ValueError(kind)


KINDS = [("blocking no-op, 1 worker", "noop1", "us", 1.05),
         ("blocking no-op, 2 workers", "noop2", "us", 1.05),
         ("asyncio, 64 calls in flight", "async64", "us", 1.05),
         ("64 MiB tensor to 1 worker", "tensor64", "us", 1.05),
         ("restart: SIGKILL to the next full answer", "restart", "ms", 1.10)]


def _side(tree: str, kind: str) -> float:
    env = dict(os.environ, PYTHONPATH=tree)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--ab-child", kind],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tree)
    if r.returncode:
        raise RuntimeError(f"the A/B child for {kind} in {tree} failed:\n{r.stderr[-3000:]}")
    answer = json.loads(r.stdout.strip().splitlines()[-1])
    if not answer["mpx"].startswith(tree):
        raise RuntimeError(f"the side of {tree} imported {answer['mpx']}")
    return answer["value"]


def ab(rev: str, rounds: int) -> tuple[list, dict]:
    rows, raw = [], {}
    have_torch = True
    try:
        import torch  # noqa: F401
    except ImportError:
        have_torch = False
    with tempfile.TemporaryDirectory(prefix="mpx-ab-") as tmp:
        old = os.path.join(tmp, "tree")
        git = ["git", "-C", kit_procs.ROOT]
        subprocess.run([*git, "worktree", "add", "--detach", old, rev], check=True,
                       capture_output=True)
        try:
            subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
                           cwd=old, check=True, capture_output=True)
            for label, kind, unit, target in KINDS:
                if kind == "tensor64" and not have_torch:
                    print("note: torch is not installed; the tensor row is left out")
                    continue
                kit_report.progress(f"A/B against {rev}: {label}, {rounds} rounds ...")
                new, base = [], []
                for r in range(rounds):
                    order = (("new", kit_procs.ROOT), ("old", old)) if r % 2 == 0 else \
                        (("old", old), ("new", kit_procs.ROOT))
                    for name, tree in order:
                        (new if name == "new" else base).append(_side(tree, kind))
                ratios = [a / b for a, b in zip(new, base)]
                raw[label] = {"new": new, "old": base, "ratios": ratios}
                med = statistics.median(ratios)
                rows.append(kit_report.row(f"{label}, this tree vs {rev}", unit, kit_stats.stats(new),
                                           kit_stats.stats(base), target=f"<= {target}x (paired median)",
                                           ok=med <= target,
                                           note=f"paired ratios median {med:.3f}, worst "
                                                f"{max(ratios):.3f} over {rounds} rounds"))
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", old], capture_output=True)
    return rows, raw


def _child_main() -> None:
    kind = sys.argv[sys.argv.index("--ab-child") + 1]
    value = child(kind)
    print(json.dumps({"mpx": os.path.dirname(os.path.dirname(mpx.__file__)) + os.sep,
                      "value": value}))


def main() -> None:
    if "--ab-child" in sys.argv:
        _child_main()
        return

    def more(ap):
        ap.add_argument("--ab", metavar="REV", help="also A/B the calls and the restart against "
                        "git revision REV")

    args = kit_args.parse_args(__doc__, "3 repetitions and 3 A/B rounds instead of 5", more)
    reps = 3 if args.quick else 5
    header = kit_report.print_header(args.quick, "regroup benchmark",
                                     "the driver and its workers share them")
    rows, raw = death_to_error(reps)
    if args.ab:
        more_rows, more_raw = ab(args.ab, reps)
        rows += more_rows
        raw.update(more_raw)
    kit_report.finish(args, header, rows, raw, "death reports and the A/B")


if __name__ == "__main__":
    main()
