"""``python -m mpx demo``: a tensor-parallel MLP served by two mpx workers.

Each worker holds half of a small MLP (columns of the first layer, rows of the second),
joins a gloo process group through ``ctx.distributed_init_method`` and all-reduces its
partial output. The driver runs a few hundred ``execute_model`` steps through
``collective_rpc(unique_reply_rank=0)``, checks every output against the same MLP run in
this process, and splits each step's latency into compute (in the workers) and RPC overhead.
"""

from __future__ import annotations

import statistics
import sys
import time

WORLD = 2
DIM, HIDDEN, BATCH = 256, 1024, 8
STEPS = 300


def _weights():
    import torch
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(DIM, HIDDEN, generator=g) / DIM ** 0.5
    w2 = torch.randn(HIDDEN, DIM, generator=g) / HIDDEN ** 0.5
    return w1, w2


def reference(x):
    """The whole MLP in one process."""
    import torch
    w1, w2 = _weights()
    return torch.relu(x @ w1) @ w2


class TPWorker:
    """Half of the MLP: a column slice of layer 1 and the matching row slice of layer 2."""

    def __init__(self, ctx, dim: int = DIM):
        import torch
        import torch.distributed as dist
        self.ctx = ctx
        dist.init_process_group("gloo", init_method=ctx.distributed_init_method,
                                rank=ctx.rank, world_size=ctx.world_size)
        w1, w2 = _weights()
        part = HIDDEN // ctx.world_size
        cols = slice(ctx.rank * part, (ctx.rank + 1) * part)
        self.w1 = w1[:, cols].contiguous()
        self.w2 = w2[cols, :].contiguous()
        self.torch = torch
        self.dist = dist

    def execute_model(self, x):
        t0 = time.perf_counter()
        y = self.torch.relu(x @ self.w1) @ self.w2
        self.dist.all_reduce(y)
        compute = time.perf_counter() - t0
        return y, compute

    def close(self):
        self.dist.destroy_process_group()


def _bar(done: int, total: int, width: int = 30) -> str:
    n = done * width // total
    return f"[{'#' * n}{'.' * (width - n)}] {done}/{total}"


def run(steps: int = STEPS) -> int:
    try:
        import torch
    except ImportError:
        print("the demo needs torch: pip install torch==2.13.0 (CPU build)", file=sys.stderr)
        return 1
    import mpx

    print(f"mpx {mpx.__version__} demo: tensor-parallel MLP ({DIM}x{HIDDEN}x{DIM}, batch "
          f"{BATCH}) on {WORLD} workers, ring={mpx.ring_implementation()}, gloo all-reduce")
    torch.manual_seed(1)
    t0 = time.perf_counter()
    with mpx.Executor(TPWorker, WORLD) as ex:
        print(f"workers ready in {time.perf_counter() - t0:.2f} s (pids {ex.worker_pids})")
        totals, computes, worst = [], [], 0.0
        for step in range(steps):
            x = torch.randn(BATCH, DIM)
            t = time.perf_counter()
            y, compute = ex.collective_rpc("execute_model", args=(x,), unique_reply_rank=0,
                                           timeout=60)
            totals.append(time.perf_counter() - t)
            computes.append(compute)
            worst = max(worst, (y - reference(x)).abs().max().item())
            if step % 10 == 9 or step == steps - 1:
                print("\r" + _bar(step + 1, steps), end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        ex.collective_rpc("close")
    if worst > 1e-4:
        print(f"demo FAILED: outputs differ from the single-process MLP by {worst:.2e}",
              file=sys.stderr)
        return 1
    us = 1e6
    med_total, med_compute = statistics.median(totals) * us, statistics.median(computes) * us
    overhead = [(t - c) * us for t, c in zip(totals, computes)]
    print(f"outputs match the single-process MLP (max abs diff {worst:.1e})")
    print(f"per step, median of {steps}: {med_total:.0f} us = compute + all-reduce "
          f"{med_compute:.0f} us + RPC overhead {statistics.median(overhead):.0f} us "
          f"(p90 overhead {sorted(overhead)[int(0.9 * len(overhead))]:.0f} us)")
    print("demo OK")
    return 0
