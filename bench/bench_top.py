"""What `python -m mpx top` costs the executor it watches: the driver's CPU over a stretch
with `mpx top` refreshing a 4-rank group every second, against the same stretch without it.

    python bench/bench_top.py [--quick]

Target (issue 31): under 1% of a core in the executor. The stats thread wakes every 0.2 s to
look for shutdown whether or not anyone reads it; the figure is the driver's whole CPU use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import kit_args
import kit_report
import kit_stats

import mpx


class Idle:
    def __init__(self, ctx):
        self.ctx = ctx

    def noop(self):
        return None


def _cpu_percent(seconds: float) -> float:
    start, t0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    return 100 * (time.process_time() - start) / (time.monotonic() - t0)


def main() -> None:
    args = kit_args.parse_args(__doc__, "3 stretches of 2 s instead of 5 of 4 s")
    n, stretch = (3, 2.0) if args.quick else (5, 4.0)
    header = kit_report.print_header(args.quick, "mpx top benchmark", "the driver, the 4 workers and "
                                     "mpx top share them")
    quiet: list[float] = []
    watched: list[float] = []
    with tempfile.TemporaryDirectory(prefix="mpx-top-") as tmp:
        path = os.path.join(tmp, "stats.sock")
        with mpx.Executor(Idle, 4, stats_socket=path) as ex:
            for _ in range(100):
                ex.collective_rpc("noop")
            kit_report.progress(f"driver CPU, {n} stretches of {stretch:g} s without mpx top ...")
            quiet = [_cpu_percent(stretch) for _ in range(n)]
            top = subprocess.Popen([sys.executable, "-m", "mpx", "top", path],
                                   stdout=subprocess.DEVNULL)
            try:
                time.sleep(1.5)  # (its start-up, and its first refresh)
                kit_report.progress(f"driver CPU, {n} stretches of {stretch:g} s with mpx top "
                                    "refreshing every second ...")
                watched = [_cpu_percent(stretch) for _ in range(n)]
            finally:
                top.terminate()
                top.wait(10)
    q, w = kit_stats.stats(quiet), kit_stats.stats(watched)
    rows = [kit_report.row("driver CPU, idle 4-rank group, no mpx top", "%", q),
            kit_report.row("driver CPU, idle 4-rank group, mpx top every 1 s", "%", w, q,
                           "< 1% of a core", w["median"] < 1.0)]
    kit_report.finish(args, header, rows, {"quiet": quiet, "watched": watched}, "mpx top")


if __name__ == "__main__":
    main()
