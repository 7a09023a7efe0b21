"""What waiting costs: the driver's and the workers' CPU per call, and the call's time, for
calls whose method takes 0, 0.3, 1.3 and 3 ms, with the default wait (spin, then an adaptive
yield budget of at most ``yield_us``, then a futex park) against ``yield_us=0`` (park at
once), in the same run.

    python bench/bench_wait_cpu.py [--quick]

The adaptive budget should cost about what parking at once costs when calls are long (a
yield phase that never finds the reply is halved away), and keep the microsecond wake when
they are short (a reply within the window is found while yielding: no futex wake). Each
case: 2 workers, blocking calls from one thread (``collective_rpc``), and the same awaited
from asyncio (``await collective_rpc(..., non_block=True)``); CPU from psutil (the driver:
every thread of this process; the workers: both processes). A benchmark, not a test: the
exit code is 0 whatever the results.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import psutil

import mpx
from mpx._cli.benchkit import print_cleanup, print_header, print_table

STEPS_MS = (0.0, 0.3, 1.3, 3.0)


class Sleeper:
    """A worker whose method takes ``ms`` milliseconds and leaves the CPU (a device's step)."""

    def __init__(self, ctx: mpx.WorkerContext) -> None:
        self.ctx = ctx

    def step(self, ms: float) -> int:
        if ms:
            time.sleep(ms / 1e3)
        return self.ctx.rank


def _cpu(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def _measure(ex: mpx.Executor, ms: float, n: int, mode: str) -> tuple[float, float, float]:
    """(us per call, driver CPU us per call, workers' CPU us per call) over ``n`` calls."""
    me = psutil.Process()
    workers = [psutil.Process(pid) for pid in ex.worker_pids]

    async def awaited():
        for _ in range(n):
            await ex.collective_rpc("step", args=(ms,), non_block=True)

    for _ in range(20):  # warm: the wait adapts to these calls
        ex.collective_rpc("step", args=(ms,))
    d0, w0, t0 = _cpu([me]), _cpu(workers), time.monotonic()
    if mode == "blocking":
        for _ in range(n):
            ex.collective_rpc("step", args=(ms,))
    else:
        asyncio.run(awaited())
    dt = time.monotonic() - t0
    return dt / n * 1e6, (_cpu([me]) - d0) / n * 1e6, (_cpu(workers) - w0) / n * 1e6


def main() -> None:
    quick = "--quick" in sys.argv[1:]
    print_header(quick, "wait CPU benchmark", "the driver and the 2 workers share them")
    budget_s = 0.6 if quick else 2.0
    lines, seen = [], []
    for ms in STEPS_MS:
        n = max(50, int(budget_s / (ms / 1e3 + 30e-6)))
        for mode in ("blocking", "asyncio"):
            got = {}
            for label, yield_us in (("default", None), ("park at once", 0)):
                kw = {} if yield_us is None else {"yield_us": yield_us}
                with mpx.Executor(Sleeper, 2, **kw) as ex:
                    seen += ex.worker_pids
                    got[label] = _measure(ex, ms, n, mode)
            d, p = got["default"], got["park at once"]
            lines.append((f"{ms:g}", mode, f"{d[0]:.0f}", f"{p[0]:.0f}", f"{d[0] / p[0]:.2f}x",
                          f"{d[1]:.0f}", f"{p[1]:.0f}", f"{d[2]:.0f}", f"{p[2]:.0f}"))
    print()
    print_table(("step ms", "calls", "us/call", "us/call (park)", "time ratio",
                 "driver CPU us", "driver CPU us (park)", "workers CPU us",
                 "workers CPU us (park)"), lines)
    print(f"\n(us per call; CPU per call; 'park': yield_us=0; {os.cpu_count()} CPUs)")
    print_cleanup(seen)


if __name__ == "__main__":
    main()
