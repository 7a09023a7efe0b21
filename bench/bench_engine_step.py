"""An LLM engine's step through mpx.Executor, against the same loop in one process and
over Pipes, measured in the same run.

    python bench/bench_engine_step.py [--quick] [--tp 2,4] [--ab REV] [--png out.png]
                                      [--json out.json]

Every step the driver broadcasts a scheduler step (bench/_step.py: request ids, per-request
token lists, block tables, ~150 KB pickled, plus two small tensors) to TP workers. Each
runs a fixed compute (a 1-thread matmul), all-reduces a tensor over gloo
(torch.distributed, joined through ``ctx.distributed_init_method``), and rank 0 replies
with 512 sampled token ids (``unique_reply_rank=0``). Rows:

- steps/s and us per step of mpx, with ``async_output`` off and on, for TP=2 and TP=4;
- the same loop in one process (one worker object, a 1-rank gloo group, no messages): the
  floor. The overhead per step over it is split into serialization (mpx's serde.encode +
  decode of the call and of the reply, timed in process) and transport (the rest);
- the Pipe RPC loop of bench_executor.py with the same workers;
- with --ab REV: mpx's TP=2 step of this tree vs git revision REV (checked out and built in
  a temporary worktree), one child process a side taking turns in blocks of 5 steps, as
  bench_executor.py --ab does; the figure is the median of the blocks' paired ratios;
- steps/s against the payload's size (the request count scaled 1/4x..4x), TP=2, mpx and
  Pipe: the --png plot, beside the table.

With more processes than cores (TP=4 on 2 cores) the numbers measure sharing, not
parallel speed: the header says how many cores there are. Progress goes to stderr. It is a
benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from _report import parse_args, timed_us
from _step import make_step, pickled_size
from bench_executor import CALL_TIMEOUT, ab_figures, ab_paired, serve_ab

import mpx
from mpx import serde
from mpx._cli.benchkit import PipePeers, cleanup_procs, print_header, stats
from mpx._procinfo import free_tcp_port
from mpx.serde import K_PICKLE_OOB

DIM = 192          # the fixed compute: (DIM x DIM) @ (DIM x DIM), float32, one thread
REDUCE = 4096      # floats all-reduced per step
SAMPLED = 512      # token ids rank 0 replies with
SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)


class EngineWorker:
    """One TP rank: mpx builds it with a context; the Pipe and in-process loops with
    ``rank``, ``world`` and ``init``."""

    def __init__(self, ctx=None, rank=0, world=1, init=None):
        import torch.distributed as dist
        torch.set_num_threads(1)
        if ctx is not None:
            rank, world, init = ctx.rank, ctx.world_size, ctx.distributed_init_method
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        self.dist = dist
        self.rank = rank
        g = torch.Generator().manual_seed(rank)
        self.w = torch.randn(DIM, DIM, generator=g)
        self.x = torch.randn(DIM, DIM, generator=g)
        self.buf = torch.zeros(REDUCE)
        self.sampler = np.random.default_rng(rank)

    def execute_model(self, step):
        n = len(step["req_ids"])
        if int(step["positions"][-1]) != n - 1:
            raise RuntimeError("the step's tensors came through wrong")
        y = self.x @ self.w
        self.buf.fill_(float(y[0, 0]) + n)
        self.dist.all_reduce(self.buf)
        if self.rank == 0:
            return self.sampler.integers(0, 152_000, SAMPLED).tolist()
        return None

    def close(self):
        self.dist.destroy_process_group()


class _PipeEngine:
    """A PipePeers handler for one TP rank: its EngineWorker, built in the child on the first
    call (every rank gets it at once, as gloo's setup needs); only rank 0 replies data."""

    def __init__(self, rank, world, init):
        self.rank, self.world, self.init = rank, world, init
        self.worker = None

    def __call__(self, msg):
        if self.worker is None:
            self.worker = EngineWorker(rank=self.rank, world=self.world, init=self.init)
        method, args, kwargs = msg
        result = getattr(self.worker, method)(*args, **kwargs)
        return result if self.rank == 0 else None


def _executor(tp, async_output):
    """An Executor of ``tp`` EngineWorkers; one retry, said on stderr, when the start fails
    (on a machine shared with test suites, a leak check of theirs may unlink our segment
    before our workers attach)."""
    try:
        return mpx.Executor(EngineWorker, world_size=tp, start_method="spawn",
                            async_output=async_output)
    except mpx.WorkerStartupError as e:
        print(f"  the executor did not start ({e}); retrying once", file=sys.stderr, flush=True)
        return mpx.Executor(EngineWorker, world_size=tp, start_method="spawn",
                            async_output=async_output)


def run_mpx(tp, steps, warm, async_output, scale=1.0):
    step = make_step(scale=scale)
    ex = _executor(tp, async_output)
    try:
        def one():
            out = ex.collective_rpc("execute_model", args=(step,), timeout=CALL_TIMEOUT,
                                    unique_reply_rank=0)
            if len(out) != SAMPLED:
                raise RuntimeError(f"rank 0 replied {len(out)} ids")
        return timed_us(one, steps, warm)
    finally:
        ex.collective_rpc("close", timeout=CALL_TIMEOUT)
        ex.shutdown()


def run_pipe(tp, steps, warm, scale=1.0):
    step = make_step(scale=scale)
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    pipe = PipePeers(tp, [_PipeEngine(rank, tp, init) for rank in range(tp)])
    try:
        def one():
            out = pipe.rpc("execute_model", step)[0]
            if len(out) != SAMPLED:
                raise RuntimeError(f"rank 0 replied {len(out)} ids")
        return timed_us(one, steps, warm)
    finally:
        pipe.close()


def _round_trip(obj):
    kind, parts = serde.encode(obj, local_only=True)
    data = b"".join(parts)
    return serde.decode(kind, bytearray(data) if kind == K_PICKLE_OOB else data)


def run_in_process(steps, warm, scale=1.0):
    """(us per step of the loop in this process, us of pickling the call and the reply)."""
    step = make_step(scale=scale)
    w = EngineWorker(rank=0, world=1, init=f"tcp://127.0.0.1:{free_tcp_port()}")
    try:
        loop = timed_us(lambda: w.execute_model(step), steps, warm)
        reply = w.execute_model(step)

        def serde_once():
            # mpx's own serialization of the call (as the executor's wire tuple) and of
            # rank 0's reply: encode, and decode of the message as a reader receives it
            call = _round_trip((0, 1, "execute_model", (step,), None, 0))
            back = _round_trip((1, 0, reply))
            return call, back
        ser = timed_us(serde_once, max(20, steps // 2), 5)
    finally:
        w.close()
    return loop, ser


def _ab_child(tp, block, warm):
    """--ab-child: this tree's (or PYTHONPATH's) side of the TP step A/B."""
    step = make_step()
    ex = _executor(tp, False)
    try:
        serve_ab(lambda: ex.collective_rpc("execute_model", args=(step,),
                                           timeout=CALL_TIMEOUT, unique_reply_rank=0),
                 block, warm)
    finally:
        ex.collective_rpc("close", timeout=CALL_TIMEOUT)
        ex.shutdown()


def run_ab(rev, tp, block, warm, blocks):
    """This tree's TP step times (us, a list a block) vs ``rev``'s."""
    return ab_paired(rev, __file__, "--ab-child", f"{tp},{block},{warm}", blocks, timeout=600)


def _fmt(st):
    return f"{st['median']:9.1f} (p90 {st['p90']:9.1f})"


def write_png(sweep, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; --png {path} skipped")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in sweep.items():
        xs = [kb for kb, _ in pts]
        ys = [1e6 / us for _, us in pts]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")  # (one process runs ~10x faster than either)
    ax.set_xlabel("scheduler step, KB pickled")
    ax.set_ylabel("steps/s (median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def _more_args(ap):
    ap.add_argument("--tp", default="2,4", help="TP sizes (default 2,4)")


def main():
    args = parse_args(__doc__, "fewer steps", _more_args,
                      ab=("also A/B mpx's TP=2 step against REV", "--ab-child", _ab_child))
    steps, warm = (150, 20) if args.quick else (600, 60)
    tps = [int(t) for t in args.tp.split(",")]
    t_start = time.perf_counter()
    header = print_header(args.quick, "engine step benchmark",
                          "TP workers and the driver share them: TP=4 is 5 processes on "
                          f"{len(os.sched_getaffinity(0))} cores", torch=torch.__version__)
    size = pickled_size(make_step())
    print(f"step: {len(make_step()['req_ids'])} requests, {size / 1e3:.0f} KB pickled; "
          f"compute {DIM}x{DIM} matmul + all-reduce of {REDUCE} floats; reply {SAMPLED} ids")
    raw: dict = {"header": header, "step_bytes": size}
    lines = []
    try:
        print("[1] the loop in one process ...", file=sys.stderr, flush=True)
        loop, ser = run_in_process(steps, warm)
        base, s = stats(loop), stats(ser)
        raw["in_process_us"], raw["serialization_us"] = loop, ser
        lines.append(("in one process (floor)", base, None))
        for tp in tps:
            for ao in (False, True):
                print(f"[2] mpx TP={tp} async_output={'on' if ao else 'off'}, {steps} steps ...",
                      file=sys.stderr, flush=True)
                m = stats(run_mpx(tp, steps, warm, ao))
                raw[f"mpx_tp{tp}_async{int(ao)}"] = m
                lines.append((f"mpx TP={tp} async_output={'on' if ao else 'off'}", m, tp))
            print(f"[3] Pipe RPC TP={tp}, {steps} steps ...", file=sys.stderr, flush=True)
            p = stats(run_pipe(tp, steps, warm))
            raw[f"pipe_tp{tp}"] = p
            lines.append((f"Pipe RPC TP={tp}", p, tp))
        ab = None
        if args.ab:
            blocks = 60 if args.quick else 150
            print(f"[4] A/B TP=2 vs {args.ab}, {blocks} blocks of 5 steps a side ...",
                  file=sys.stderr, flush=True)
            new, old, pairs = ab_figures(run_ab(args.ab, 2, 5, warm, blocks))
            ab = (new, old, statistics.median(pairs))
            raw["ab"] = {"rev": args.ab, "new": new, "old": old, "paired_ratios": pairs}
        print("[5] steps/s against the payload size, TP=2 ...", file=sys.stderr, flush=True)
        sweep: dict = {"mpx TP=2": [], "Pipe RPC TP=2": [], "one process": []}
        for sc in SCALES:
            kb = pickled_size(make_step(scale=sc)) / 1e3
            print(f"  {kb:.0f} KB", file=sys.stderr, flush=True)
            n = max(40, steps // 3)
            sweep["mpx TP=2"].append((kb, stats(run_mpx(2, n, warm // 2, False, sc))["median"]))
            sweep["Pipe RPC TP=2"].append((kb, stats(run_pipe(2, n, warm // 2, sc))["median"]))
            sweep["one process"].append((kb, stats(run_in_process(n, warm // 2, sc)[0])["median"]))
        raw["sweep_us"] = sweep
    finally:
        cleanup_procs()

    print()
    print(f"us per step: median (p90); steps/s from the median; overhead = step - the one-"
          f"process loop ({base['median']:.1f} us); serialization = mpx's encode + decode of "
          f"call and reply in process ({s['median']:.1f} us); transport = overhead - "
          "serialization")
    print(f"{'':40s} {'us/step':>25s} {'steps/s':>9s} {'overhead':>9s} {'serial.':>8s} "
          f"{'transp.':>8s}")
    for name, st, tp in lines:
        over = st["median"] - base["median"]
        extra = "" if tp is None else f" {over:9.1f}"
        if name.startswith("mpx"):  # the split applies to mpx's own serialization
            extra += f" {s['median']:8.1f} {over - s['median']:8.1f}"
        print(f"{name:40s} {_fmt(st)} {1e6 / st['median']:9.0f}{extra}")
    for tp in tps:
        m = raw[f"mpx_tp{tp}_async0"]["median"]
        p = raw[f"pipe_tp{tp}"]["median"]
        print(f"TP={tp}: mpx / Pipe RPC = {m / p:.3f}x per step (async_output off), "
              f"overhead mpx {m - base['median']:.1f} us vs Pipe {p - base['median']:.1f} us")
    if ab is not None:
        print(f"A/B TP=2: this tree {_fmt(ab[0])} us, {args.ab} {_fmt(ab[1])} us: "
              f"{ab[2]:.3f}x (the median of the blocks' paired ratios)")
    print("steps/s against payload (TP=2): " + "; ".join(
        f"{name}: " + ", ".join(f"{kb:.0f} KB {1e6 / us:.0f}" for kb, us in pts)
        for name, pts in sweep.items()))
    print(f"({time.perf_counter() - t_start:.0f} s, os.cpu_count()={os.cpu_count()}, "
          f"affinity {len(os.sched_getaffinity(0))} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        write_png(sweep, args.png, f"engine step, TP=2 (os.cpu_count()={os.cpu_count()})")
    return 0


if __name__ == "__main__":
    main()
    sys.exit(0)
