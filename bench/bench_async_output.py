"""Async output copying (Config.async_output) against inline replies, in the same run.

    python bench/bench_async_output.py [--quick] [--png out.png] [--json out.json]

One worker; each call "computes" for 5 ms (a sleep: it leaves the GIL, as torch kernels and
device work do) and returns an object whose get_output() takes 5 ms more (the wait on a
device-to-host copy). The driver keeps up to 8 calls in flight (non_block=True), as an
engine overlapping step N's output with step N+1 does. Inline, a call costs compute + copy
(~10 ms); with async_output the worker starts the next call while its output thread
resolves the previous reply (~5 ms). Blocks of 40 calls alternate between the two
executors, both up all along.                      target: >= 1.7x the calls/s of inline

A benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import collections
import time

import kit_args
import kit_report
import kit_rpc
import kit_stats

COMPUTE_S = COPY_S = 0.005
IN_FLIGHT = 8


class Deferred:
    def __init__(self, value):
        self.value = value

    def get_output(self):
        time.sleep(COPY_S)
        return self.value


class StepWorker:
    def __init__(self, ctx):
        pass

    def step(self, i):
        time.sleep(COMPUTE_S)
        return Deferred(i)


def run_block(ex, calls):
    """calls/s over ``calls`` calls, IN_FLIGHT at a time."""
    pending = collections.deque()
    t0 = time.perf_counter()
    for i in range(calls):
        pending.append((i, ex.collective_rpc("step", args=(i,), non_block=True)))
        while pending and (len(pending) >= IN_FLIGHT or i == calls - 1):
            j, f = pending.popleft()
            if f.result(timeout=60) != [j]:
                raise RuntimeError("wrong reply")
    return calls / (time.perf_counter() - t0)


def main():
    args = kit_args.parse_args(__doc__, "fewer blocks (~5 s instead of ~20 s)")
    header = kit_report.print_header(args.quick, "async output benchmark",
                                     "the driver and the worker's two threads share them")
    exs, rates = {}, {False: [], True: []}
    try:
        for mode in (False, True):
            exs[mode] = kit_rpc.new_executor(1, StepWorker, async_output=mode)
            run_block(exs[mode], 10)  # warm-up
        for b in range(4 if args.quick else 16):
            for mode in ((False, True) if b % 2 == 0 else (True, False)):
                rates[mode].append(run_block(exs[mode], 40))
    finally:
        for ex in exs.values():
            ex.shutdown()
    a, s = kit_stats.stats(rates[True]), kit_stats.stats(rates[False])
    rows = [kit_report.row("calls/s, 5 ms compute + 5 ms output copy, 1 worker", "calls/s", a, s,
                           ">= 1.70x inline", a["median"] / s["median"] >= 1.7,
                           note=f"async_output=True vs False, {IN_FLIGHT} calls in flight; ideal "
                                f"{1 / max(COMPUTE_S, COPY_S):.0f} vs {1 / (COMPUTE_S + COPY_S):.0f} "
                                "calls/s, 2.0x")]
    kit_report.finish(args, header, rows, {"async": rates[True], "inline": rates[False]},
                      "mpx async output")


if __name__ == "__main__":
    main()
