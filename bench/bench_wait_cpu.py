"""What waiting costs: the driver's and the workers' CPU per call, and the call's time, for
methods of 0, 0.3, 1.3 and 3 ms, with the default wait (spin, then an adaptive yield budget
of at most ``yield_us``, then a futex park) against ``yield_us=0`` (park at once), in the
same run.

    python bench/bench_wait_cpu.py [--quick] [--json out.json]

The adaptive budget should cost about what parking at once costs when calls are long (a
yield phase that never finds the reply is halved away), and keep the microsecond wake when
they are short. Each case: 2 workers, blocking calls from one thread, and the same awaited
from asyncio (``await collective_rpc(..., non_block=True)``); CPU from psutil (the driver:
every thread of this process; the workers: both processes). A benchmark, not a test: the
exit code is 0 whatever the results.
"""

from __future__ import annotations

import asyncio
import time

import kit_args
import kit_report
import kit_rpc
import psutil

STEPS_MS = (0.0, 0.3, 1.3, 3.0)


class Sleeper:
    """A worker whose method takes ``ms`` milliseconds and leaves the CPU (a device's step)."""

    def __init__(self, ctx):
        self.rank = ctx.rank

    def step(self, ms):
        if ms:
            time.sleep(ms / 1e3)
        return self.rank


def _cpu(procs):
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def measure(ex, ms, n, mode):
    """(us per call, the driver's CPU us per call, the workers' CPU us per call)."""
    me, workers = psutil.Process(), [psutil.Process(pid) for pid in ex.worker_pids]

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


def main():
    args = kit_args.parse_args(__doc__, "about 0.6 s a case instead of 2")
    header = kit_report.print_header(args.quick, "wait CPU benchmark", "the driver and the 2 workers "
                                     "share them")
    budget_s = 0.6 if args.quick else 2.0
    lines, raw = [], []
    for ms in STEPS_MS:
        n = max(50, int(budget_s / (ms / 1e3 + 30e-6)))
        for mode in ("blocking", "asyncio"):
            got = {}
            for label, kw in (("default", {}), ("park at once", {"yield_us": 0})):
                ex = kit_rpc.new_executor(2, Sleeper, **kw)
                try:
                    got[label] = measure(ex, ms, n, mode)
                finally:
                    ex.shutdown()
            d, p = got["default"], got["park at once"]
            raw.append({"ms": ms, "mode": mode, **got})
            lines.append((f"{ms:g}", mode, f"{d[0]:.0f}", f"{p[0]:.0f}", f"{d[0] / p[0]:.2f}x",
                          f"{d[1]:.0f}", f"{p[1]:.0f}", f"{d[2]:.0f}", f"{p[2]:.0f}"))
    kit_report.print_table(("step ms", "calls", "us/call", "us/call (park)", "time ratio",
                            "driver CPU us", "driver CPU us (park)", "workers CPU us",
                            "workers CPU us (park)"), lines)
    print(f"\n(us per call; CPU us per call; 'park': yield_us=0; {header['affinity']} CPUs)")
    kit_report.print_cleanup()
    if args.json:
        kit_report.write_json(args.json, {"header": header, "cases": raw})


if __name__ == "__main__":
    main()
