"""An LLM engine's step through mpx.Executor, against the same loop in one process and over
Pipes, measured in the same run.

    python bench/bench_engine_step.py [--quick] [--tp 2,4] [--ab REV] [--png P] [--json P]

Every step the driver broadcasts a scheduler step (kit_step.make_step: request ids, token lists,
block tables, ~150 KB pickled, two small tensors) to TP workers. Each runs a fixed compute
(a 1-thread 192x192 matmul), all-reduces 4096 floats over gloo (joined through
``ctx.distributed_init_method``), and rank 0 replies with 512 sampled token ids
(``unique_reply_rank=0``). Rows:

- us per step of mpx, ``async_output`` off and on, TP=2 and TP=4;
- the same loop in one process (one worker, a 1-rank gloo group, no messages): the floor.
  mpx's overhead over it is split into the messages' own cost (the call and the reply each
  put through a MessageQueue in this process: encode, ring write and read, decode) and the
  rest (the wake, the processes sharing the cores, the cross-process all-reduce);
- the Pipe RPC loop with the same workers;
- TP=2's step split as the demo splits it: delivery (the driver's call until rank 0's method
  starts), compute and all-reduce (rank 0's method), return (until the driver has the reply);
  delivery + return, judged against a no-op call carrying the same step and a reply of the
  same size (``echo``), the two taking turns (one clock in two processes: this host only);
- with --ab REV: mpx's TP=2 step vs git revision REV, one child a side taking turns in
  blocks of 5 steps (kit_ab.ab_paired), the median of the blocks' paired ratios;
- steps/s against the step's size (the request count scaled 1/4x..4x), TP=2: --png.

With more processes than cores (TP=4 on 2 cores) the numbers measure sharing, not speed.
A benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import kit_ab
import kit_args
import kit_plot
import kit_procs
import kit_report
import kit_rpc
import kit_stats
import kit_step
import kit_timing
import numpy as np
import torch

DIM, REDUCE, SAMPLED = 192, 4096, 512
SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)


class EngineWorker:
    """One TP rank: mpx builds it with a context, the Pipe and in-process loops with ``rank``,
    ``world`` and ``init``."""

    def __init__(self, ctx=None, rank=0, world=1, init=None):
        import torch.distributed as dist
        torch.set_num_threads(1)
        if ctx is not None:
            rank, world, init = ctx.rank, ctx.world_size, ctx.distributed_init_method
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        self.dist, self.rank = dist, rank
        g = torch.Generator().manual_seed(rank)
        self.w, self.x = torch.randn(DIM, DIM, generator=g), torch.randn(DIM, DIM, generator=g)
        self.buf = torch.zeros(REDUCE)
        self.sampler = np.random.default_rng(rank)

    def execute_model(self, step):
        n = len(step["req_ids"])
        if int(step["positions"][-1]) != n - 1:
            raise RuntimeError("the step's tensors came through wrong")
        self.buf.fill_(float((self.x @ self.w)[0, 0]) + n)
        self.dist.all_reduce(self.buf)
        return self.sampler.integers(0, 152_000, SAMPLED).tolist() if self.rank == 0 else None

    def execute_model_timed(self, step):
        """execute_model, and when it began and ended (perf_counter: one clock on a host)."""
        began = time.perf_counter()
        ids = self.execute_model(step)
        return ids, began, time.perf_counter()

    def echo(self, step):
        """A no-op that takes the step and replies as much as execute_model does."""
        now = time.perf_counter()
        return (list(range(SAMPLED)) if self.rank == 0 else None), now, now

    def close(self):
        self.dist.destroy_process_group()


class PipeEngine:
    """A PipePeers handler for one rank: its EngineWorker, built on the first call (every rank gets
    it at once, as gloo's setup needs)."""

    def __init__(self, rank, world, init):
        self.args, self.worker = (rank, world, init), None

    def __call__(self, msg):
        if self.worker is None:
            self.worker = EngineWorker(None, *self.args)
        method, args, kwargs = msg
        return getattr(self.worker, method)(*args, **kwargs)


def _checked(call):
    def one():
        if len(call()) != SAMPLED:
            raise RuntimeError("rank 0 replied another number of ids")
    return one


@contextlib.contextmanager
def _engine(tp, **kw):
    """An executor of TP EngineWorkers, their process group closed and the executor shut down
    on the way out."""
    ex = kit_rpc.new_executor(tp, EngineWorker, **kw)
    try:
        yield ex
    finally:
        ex.collective_rpc("close", timeout=kit_rpc.CALL_TIMEOUT)
        ex.shutdown()


def run_mpx(tp, steps, warm, async_output=False, scale=1.0):
    step = kit_step.make_step(scale=scale)
    with _engine(tp, async_output=async_output) as ex:
        return kit_timing.timed_us(_checked(lambda: ex.collective_rpc(
            "execute_model", args=(step,), timeout=kit_rpc.CALL_TIMEOUT, unique_reply_rank=0)), steps, warm)


def run_split(tp, steps, warm):
    """({"delivery", "compute", "return", "overhead"}: us per step, us per echo): model steps and
    echoes take turns."""
    step = kit_step.make_step()
    legs, echoes = {"delivery": [], "compute": [], "return": [], "overhead": []}, []
    with _engine(tp) as ex:
        for i in range(2 * (steps + warm)):
            method = "echo" if i % 2 else "execute_model_timed"
            t = time.perf_counter()
            ids, began, ended = ex.collective_rpc(method, args=(step,), timeout=kit_rpc.CALL_TIMEOUT,
                                                  unique_reply_rank=0)
            got = time.perf_counter()
            if len(ids) != SAMPLED:
                raise RuntimeError("rank 0 replied another number of ids")
            if i < 2 * warm:
                continue
            if method == "echo":
                echoes.append((got - t) * 1e6)
                continue
            for k, v in (("delivery", began - t), ("compute", ended - began), ("return", got - ended),
                         ("overhead", began - t + got - ended)):
                legs[k].append(v * 1e6)
    return legs, echoes


def run_pipe(tp, steps, warm, scale=1.0):
    step, init = kit_step.make_step(scale=scale), f"tcp://127.0.0.1:{kit_procs.free_port()}"
    pipe = kit_rpc.PipePeers(tp, [PipeEngine(rank, tp, init) for rank in range(tp)])
    try:
        return kit_timing.timed_us(_checked(lambda: pipe.rpc("execute_model", step)[0]), steps, warm)
    finally:
        pipe.close()


def run_in_process(steps, warm, scale=1.0):
    """(us per step of the loop in this process, us of the call and the reply each put through a
    MessageQueue in this process)."""
    step, w = kit_step.make_step(scale=scale), EngineWorker(None, 0, 1, f"tcp://127.0.0.1:{kit_procs.free_port()}")
    try:
        loop = kit_timing.timed_us(lambda: w.execute_model(step), steps, warm)
        reply = w.execute_model(step)
    finally:
        w.close()
    call = (0, 1, "execute_model", (step,), None, 0)  # shaped as the executor's call, and its reply
    return loop, kit_rpc.queue_round_trip(lambda: [call, (1, 0, reply)], max(20, steps // 2), 5)


def ab_child(tp, block, warm):
    """--ab-child: this mpx's (or PYTHONPATH's) side of the TP step A/B."""
    step = kit_step.make_step()
    with _engine(tp) as ex:
        kit_ab.serve_ab(lambda: ex.collective_rpc("execute_model", args=(step,), timeout=kit_rpc.CALL_TIMEOUT,
                                                  unique_reply_rank=0), block, warm, pids=ex.worker_pids)


def _fmt(st):
    return f"{st['median']:9.1f} (p90 {st['p90']:9.1f})"


def main():
    args = kit_args.parse_args(
        __doc__, "fewer steps, 3 sizes in the sweep (~1 min)",
        lambda ap: ap.add_argument("--tp", default="2,4", help="TP sizes (default 2,4)"),
        ab=("also A/B mpx's TP=2 step against git revision REV", "--ab-child", ab_child))
    steps, warm = (60, 10) if args.quick else (600, 60)
    tps = [int(t) for t in args.tp.split(",")]
    header = kit_report.print_header(args.quick, "engine step benchmark",
                                     "the TP workers and the driver share them", torch=torch.__version__)
    step = kit_step.make_step()
    print(f"step: {len(step['req_ids'])} requests, {kit_step.pickled_size(step) / 1e3:.0f} "
          f"KB pickled; compute {DIM}x{DIM} matmul + all-reduce of {REDUCE} floats; reply {SAMPLED} ids")
    raw, lines = {"header": header}, []
    try:
        kit_report.progress("[1] the loop in one process ...")
        loop, msgs = run_in_process(steps, warm)
        base, s = kit_stats.stats(loop), kit_stats.stats(msgs)
        raw["in_process"], raw["messages_in_process"] = base, s
        lines.append(("in one process (floor)", base, False))
        for tp in tps:
            for ao in (False, True):
                name = f"mpx TP={tp} async_output={'on' if ao else 'off'}"
                kit_report.progress(f"[2] {name}, {steps} steps ...")
                raw[name] = m = kit_stats.stats(run_mpx(tp, steps, warm, ao))
                lines.append((name, m, True))
            kit_report.progress(f"[3] Pipe RPC TP={tp}, {steps} steps ...")
            raw[f"Pipe RPC TP={tp}"] = p = kit_stats.stats(run_pipe(tp, steps, warm))
            lines.append((f"Pipe RPC TP={tp}", p, False))
        kit_report.progress(f"[3b] mpx TP=2 split, {steps} steps and as many echoes ...")
        legs, echoes = run_split(2, steps, warm)
        raw["split TP=2"] = {k: kit_stats.stats(v) for k, v in legs.items()} | \
            {"echo": kit_stats.stats(echoes)}
        if args.ab:
            blocks = 60 if args.quick else 150
            kit_report.progress(f"[4] A/B TP=2 vs {args.ab}, {blocks} blocks of 5 steps a side ...")
            new, old, pairs = kit_ab.ab_paired(args.ab, __file__, "--ab-child", f"2,5,{warm}", blocks, 600)
            raw["ab"] = {"rev": args.ab, "new": new, "old": old, "paired": pairs}
        kit_report.progress("[5] steps/s against the step's size, TP=2 ...")
        sweep, n = {"mpx TP=2": [], "Pipe RPC TP=2": [], "one process": []}, max(30, steps // 3)
        for sc in SCALES[::2] if args.quick else SCALES:
            kb = kit_step.pickled_size(kit_step.make_step(scale=sc)) / 1e3
            for name, us in (("mpx TP=2", run_mpx(2, n, warm // 2, False, sc)),
                             ("Pipe RPC TP=2", run_pipe(2, n, warm // 2, sc)),
                             ("one process", run_in_process(n, warm // 2, sc)[0])):
                sweep[name].append((kb, kit_stats.stats(us)["median"]))
        raw["sweep_us"] = sweep
    finally:
        kit_procs.cleanup_procs()

    print(f"\nus per step: median (p90); overhead = step - the one-process loop ({base['median']:.1f} us); "
          f"messages = the call and the reply through a MessageQueue in this process ({s['median']:.1f} us);"
          " rest = overhead - messages")
    print(f"{'':36s} {'us/step':>25s} {'steps/s':>8s} {'overhead':>9s} {'messages':>9s} {'rest':>8s}")
    for name, st, split in lines:
        over = st["median"] - base["median"]
        extra = ("" if st is base else f" {over:9.1f}") + (
            f" {s['median']:9.1f} {over - s['median']:8.1f}" if split else "")
        print(f"{name:36s} {_fmt(st)} {1e6 / st['median']:8.0f}{extra}")
    for tp in tps:
        m, p = raw[f"mpx TP={tp} async_output=off"]["median"], raw[f"Pipe RPC TP={tp}"]["median"]
        print(f"TP={tp}: mpx / Pipe RPC = {m / p:.3f}x per step (async_output off)")
    sp = {k: v["median"] for k, v in raw["split TP=2"].items()}
    print(f"TP=2 split (medians): delivery to rank 0 {sp['delivery']:.1f} + compute and all-reduce "
          f"{sp['compute']:.1f} + return {sp['return']:.1f} us; overhead (delivery + return) "
          f"{sp['overhead']:.1f} us = {sp['overhead'] / sp['echo']:.2f}x the round trip of a no-op "
          f"carrying the same step and reply ({sp['echo']:.1f} us; target <= 3x)")
    if args.ab:
        ab = raw["ab"]
        print(f"A/B TP=2: this tree {_fmt(ab['new'])} us, {args.ab} {_fmt(ab['old'])} us: "
              f"{statistics.median(ab['paired']):.3f}x (the median of the blocks' paired ratios)")
    print("steps/s against the step's size (TP=2): " + "; ".join(
        f"{k}: " + ", ".join(f"{kb:.0f} KB {1e6 / us:.0f}" for kb, us in pts) for k, pts in sweep.items()))
    if args.json:
        kit_report.write_json(args.json, raw)
    if args.png:
        def draw(fig, ax):
            for name, pts in sweep.items():
                ax.plot([kb for kb, _ in pts], [1e6 / us for _, us in pts], marker="o", label=name)
            ax.set(xscale="log", yscale="log", xlabel="scheduler step, KB pickled", ylabel="steps/s (median)")
            ax.set_title(f"engine step, TP=2 ({header['affinity']} CPUs)", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        kit_plot.write_png(args.png, draw, figsize=(7, 4.5))


if __name__ == "__main__":
    main()
