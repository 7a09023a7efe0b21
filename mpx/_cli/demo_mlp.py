"""``python -m mpx demo``: a tensor-parallel MLP served by two mpx workers.

Each worker holds half of a small MLP (columns of the first layer, rows of the second),
joins a gloo process group through ``ctx.distributed_init_method`` and all-reduces its
partial output. The driver runs a few hundred ``execute_model`` steps through
``collective_rpc(unique_reply_rank=0)``, checks every output against the same MLP run in
this process, and splits each step's latency into delivery (the driver's call until rank 0's
method starts), compute and all-reduce (rank 0's method), and return (until the driver has
the reply). Between the steps it makes as many no-op calls carrying the same tensors
(``echo``): delivery + return, the step's RPC overhead, is judged against their round trip.
The split reads one clock in two processes (``time.perf_counter``, CLOCK_MONOTONIC on
Linux): it holds for workers on this host.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

WORLD = 2
DIM, HIDDEN, BATCH = 256, 1024, 8
STEPS = 300


@functools.lru_cache(maxsize=1)
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
        """This rank's half of the MLP, all-reduced; and when the method began and ended."""
        began = time.perf_counter()
        y = self.torch.relu(x @ self.w1) @ self.w2
        self.dist.all_reduce(y)
        return y, (began, time.perf_counter())

    def echo(self, x):
        """A no-op that carries the step's tensors: ``x`` back, and when the method ran."""
        now = time.perf_counter()
        return x, (now, now)

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
        steps_t: list[tuple[float, float, float]] = []  # delivery, compute, return
        echoes: list[float] = []
        worst = 0.0
        for step in range(2 * steps):  # model steps and echoes take turns
            x = torch.randn(BATCH, DIM)
            method = "execute_model" if step % 2 == 0 else "echo"
            t = time.perf_counter()
            y, (began, ended) = ex.collective_rpc(method, args=(x,), unique_reply_rank=0,
                                                  timeout=60)
            got = time.perf_counter()
            if method == "echo":
                echoes.append(got - t)
                worst = max(worst, (y - x).abs().max().item())
                continue
            steps_t.append((began - t, ended - began, got - ended))
            worst = max(worst, (y - reference(x)).abs().max().item())
            if len(steps_t) % 10 == 0 or len(steps_t) == steps:
                print("\r" + _bar(len(steps_t), steps), end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        ex.collective_rpc("close")
    if worst > 1e-4:
        print(f"demo FAILED: outputs differ from the single-process MLP by {worst:.2e}",
              file=sys.stderr)
        return 1
    print(f"outputs match the single-process MLP (max abs diff {worst:.1e})")
    _report(steps_t, echoes)
    print("demo OK")
    return 0


def _report(steps_t: list[tuple[float, float, float]], echoes: list[float]) -> None:
    def med(xs) -> float:
        return statistics.median(xs) * 1e6
    deliver, compute, back = (med(c) for c in zip(*steps_t))
    total = med([sum(s) for s in steps_t])
    overhead = sorted((d + r) * 1e6 for d, _, r in steps_t)
    echo = med(echoes)
    print(f"per step, median of {len(steps_t)}: {total:.0f} us = delivery to rank 0 "
          f"{deliver:.0f} us + compute and all-reduce {compute:.0f} us + return {back:.0f} us")
    print(f"RPC overhead (delivery + return) {statistics.median(overhead):.0f} us (p90 "
          f"{overhead[int(0.9 * len(overhead))]:.0f} us): "
          f"{statistics.median(overhead) / echo:.1f}x the round trip of a no-op carrying the "
          f"same tensors ({echo:.0f} us)")
