"""mpx.Executor.collective_rpc on a loaded host: K pure-Python busy loops beside the group, against
the Pipe RPC loop under the same load, in the same run.

    python bench/bench_loaded.py [--quick] [--png P] [--json P]

K = 0 (the quiet host, the reference), os.cpu_count() and twice that busy loops (kit_procs.busy_loops),
started beside groups that live through the whole run: executors of 1, 2 and 4 kit_rpc.Workers and a
TP=2 engine (bench_engine_step's EngineWorker), each with its Pipe RPC loop (kit_rpc.pipe_rpc, and
bench_engine_step's PipeEngine). Under each load mpx and its Pipe loop take turns in blocks (of at
most 0.3 s, 0.5 s of engine steps; 0.1 s and 0.25 s with --quick; the first of each pair
alternating), so that drift hits both alike. For each K:

1. a no-op's round trip, 1, 2 and 4 workers: us per call, the median (p90) of the blocks' medians
   (the notes give the p90 over every call); ratio = the median of the blocks' paired mpx / Pipe
   ratios.                   target: 2 workers with K = cores: <= 0.3x Pipe RPC; the others: info
2. the first call after 2 s idle (0.5 s with --quick), 1 worker, vs the Pipe loop's first call
   after the same idle, taking turns; ratio = the median of the rounds' paired ratios.
                                                           target, every K: <= 0.8x Pipe RPC
3. bench_engine_step's step at TP=2 (kit_step.make_step's ~150 KB scheduler step, a matmul, a gloo
   all-reduce; rank 0 replies: unique_reply_rank=0) vs the same step over its Pipe loop, paired
   as in 1.                                                         info
4. under rows 1 and 3, the CPU per call in us (the median over blocks; ratio of the medians): the
   driver's (time.process_time: every thread of this process) and the workers' (kit_cpus.cpu_s summed
   over ex.worker_pids, or over the Pipe loop's children).          info

With K busy loops the host has K + n + 1 runnable processes on os.cpu_count() cores: the figures
measure how each design shares a crowded CPU, not its speed. A benchmark, not a test: the exit code
is 0 whatever the results.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import bench_engine_step as es
import kit_args
import kit_cpus
import kit_procs
import kit_report
import kit_rpc
import kit_stats
import kit_step
import kit_timing
from bench_executor import paired_row

NOOP_TARGET = (2, 0.3)  # (workers, limit) judged with K = cores
IDLE_LIMIT = 0.8


def in_blocks(sides, blocks, iters, block_s):
    """For each side ``(call, worker pids)``: [(us of each call, the driver's CPU us per call, the
    workers'), one a block]: the sides settled, then ``blocks`` turns of ``iters`` calls or
    ``block_s`` seconds each, the first side alternating."""
    kit_timing.settle([fn for fn, _ in sides], kit_timing.SETTLE_S, min_rounds=3)
    out = [[] for _ in sides]
    for b in range(blocks):
        for i in range(len(sides)) if b % 2 == 0 else reversed(range(len(sides))):
            fn, pids = sides[i]
            w0 = kit_cpus.cpu_s(pids)
            d0 = time.process_time()
            ts = kit_timing.time_calls(fn, iters, budget_s=block_s)
            d1 = time.process_time()
            w1 = kit_cpus.cpu_s(pids)
            out[i].append(([t * 1e6 for t in ts], (d1 - d0) / len(ts) * 1e6, (w1 - w0) / len(ts) * 1e6))
    return out


def after_idle(sides, rounds, idle_s):
    """For each side: [us of its first call after ``idle_s`` asleep, one a round], taking turns."""
    out = [[] for _ in sides]
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            time.sleep(idle_s)
            out[i] += kit_timing.timed_us(sides[i][0], 1)
    return out


def p90_calls(blocks):
    return kit_stats.stats([us for b in blocks for us in b[0]])["p90"]


def compare_rows(name, m, p, target=None, limit=None):
    """The round-trip row (paired blocks) and its two CPU rows, from in_blocks' mpx and Pipe lists."""
    pairs = kit_stats.paired([b[0] for b in m], [b[0] for b in p])
    medians = (kit_stats.stats([statistics.median(b[0]) for b in side]) for side in (m, p))
    out = [paired_row(name, "us", *medians,
                      pairs, target, limit is not None and statistics.median(pairs) <= limit,
                      note=f"p90 over every call: mpx {p90_calls(m):.0f} us, Pipe {p90_calls(p):.0f} us; ")]
    for col, who in ((1, "driver"), (2, "workers'")):
        out.append(kit_report.row(f"    {who} CPU per call", "us CPU", kit_stats.stats([b[col] for b in m]),
                                  kit_stats.stats([b[col] for b in p])))
    return out


def loaded_host(k, tag, groups, rows, raw, quick, cores):
    """Every measurement under ``k`` busy loops; ``rows`` gets (sort key, row) pairs."""
    blocks, iters = (6, 2000) if quick else (10, 5000)
    block_s, step_s = (0.1, 0.25) if quick else (0.3, 0.5)
    rounds, idle_s = (5, 0.5) if quick else (7, 2.0)
    for case, n in enumerate((1, 2, 4)):
        kit_report.progress(f"[{tag}] no-op, {n} worker(s), {blocks} blocks of <= {block_s} s a side ...")
        m, p = in_blocks(groups[n], blocks, iters, block_s)
        judged = (n, k) == (NOOP_TARGET[0], cores)
        name = f"no-op round trip, {n} worker{'s' if n > 1 else ''}, {tag}"
        for sub, r in enumerate(compare_rows(name, m, p, *((f"<= {NOOP_TARGET[1]}x Pipe RPC",
                                                            NOOP_TARGET[1]) if judged else ()))):
            rows.append(((case, k, sub), r))
        raw[name] = {"mpx": m, "pipe": p}

    kit_report.progress(f"[{tag}] first call after {idle_s} s idle, {rounds} rounds a side ...")
    m, p = after_idle(groups[1], rounds, idle_s)
    pairs, name = kit_stats.paired(m, p), f"first call after {idle_s} s idle, 1 worker, {tag}"
    rows.append(((3, k, 0), paired_row(name, "us", kit_stats.stats(m), kit_stats.stats(p), pairs,
                                       f"<= {IDLE_LIMIT}x Pipe RPC", statistics.median(pairs) <= IDLE_LIMIT,
                                       note="a block is one round; ")))
    raw[name] = {"mpx": m, "pipe": p}

    kit_report.progress(f"[{tag}] engine step TP=2, {blocks} blocks of <= {step_s} s a side ...")
    m, p = in_blocks(groups["step"], blocks, iters, step_s)
    name = f"engine step TP=2, {tag}"
    for sub, r in enumerate(compare_rows(name, m, p)):
        rows.append(((4, k, sub), r))
    raw[name] = {"mpx": m, "pipe": p}


def start_groups(stack):
    """{1, 2, 4: [(no-op of an executor, its pids), (the Pipe loop's, its pids)], "step": the same for
    the TP=2 engine step}, each closed by ``stack``."""
    groups = {}
    for n in (1, 2, 4):
        ex, pipe = kit_rpc.new_executor(n), kit_rpc.pipe_rpc(n)
        stack.callback(ex.shutdown)
        stack.callback(pipe.close)
        groups[n] = [(lambda ex=ex: ex.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT), ex.worker_pids),
                     (lambda pipe=pipe: pipe.rpc("noop"), pipe.pids)]
    step, init = kit_step.make_step(), f"tcp://127.0.0.1:{kit_procs.free_port()}"
    ex = kit_rpc.new_executor(2, es.EngineWorker)
    stack.callback(ex.shutdown)
    stack.callback(close_engine, ex)
    pipe = kit_rpc.PipePeers(2, [es.PipeEngine(rank, 2, init) for rank in range(2)])
    stack.callback(pipe.close)
    groups["step"] = [(es._checked(lambda: ex.collective_rpc(
        "execute_model", args=(step,), timeout=kit_rpc.CALL_TIMEOUT, unique_reply_rank=0)), ex.worker_pids),
        (es._checked(lambda: pipe.rpc("execute_model", step)[0]), pipe.pids)]
    return groups


def close_engine(ex):
    """The engine workers' gloo group destroyed, as bench_engine_step does, before the shutdown."""
    with contextlib.suppress(Exception):
        ex.collective_rpc("close", timeout=kit_rpc.CALL_TIMEOUT)


def main():
    args = kit_args.parse_args(__doc__, "fewer, shorter blocks and 0.5 s idle (~1 min instead of ~4)")
    cores = os.cpu_count() or 1
    header = kit_report.print_header(args.quick, "loaded-host benchmark", "the busy loops, the driver and "
                                     "the workers share them", torch=es.torch.__version__)
    loads = (0, cores, 2 * cores)
    print(f"loads: K = {', '.join(map(str, loads))} pure-Python busy loops (os.cpu_count()={cores}), "
          f"each against the Pipe RPC loop under the same load\n", flush=True)
    rows, raw = [], {"loads": loads}
    try:
        with contextlib.ExitStack() as stack:
            kit_report.progress("starting executors of 1, 2, 4 workers, a TP=2 engine and their Pipe "
                                "loops ...")
            groups = start_groups(stack)
            for k in loads:
                tag = "quiet host (K=0)" if k == 0 else f"K={k} busy loops"
                with kit_procs.busy_loops(k):
                    loaded_host(k, tag, groups, rows, raw, args.quick, cores)
    finally:
        kit_procs.cleanup_procs()
    rows = [r for _, r in sorted(rows, key=lambda kr: kr[0])]
    kit_report.finish(args, header, rows, raw, "mpx vs Pipe RPC on a loaded host")


if __name__ == "__main__":
    main()
