"""Worker classes of tests/membership/test_restart.py (module level, so that every start method
imports them)."""

from __future__ import annotations

import os
import signal
import time


def full_answer(ex, timeout=60.0):
    """The first ``who`` every rank answers (a rank still being restarted fails the calls
    before it with WorkerDiedError), once the executor has settled: it did not fail, one
    answer per rank, nothing pending."""
    import mpx
    assert not ex.is_failed, "the executor failed"
    deadline = time.monotonic() + timeout
    while True:
        try:
            out = ex.collective_rpc("who", timeout=30)
            break
        except mpx.WorkerDiedError:
            assert time.monotonic() < deadline, f"no full answer within {timeout} s"
    assert len(out) == ex.world_size, out
    assert ex.pending_calls() == (0, 0), ex.pending_calls()
    return out


class Member:
    """Says who it is; sleeps, dies or answers big on demand."""

    def __init__(self, ctx, fail_from_generation=None, fail_from_rank=None, slow_generation=None):
        if ctx.generation == slow_generation:
            time.sleep(2.0)  # (long enough to be killed in)
        if fail_from_generation is not None and ctx.generation >= fail_from_generation:
            raise RuntimeError(f"rank {ctx.rank} refuses generation {ctx.generation}")
        if fail_from_rank is not None and ctx.rank >= fail_from_rank:
            raise RuntimeError(f"rank {ctx.rank} refuses to join")
        self.ctx = ctx
        self.pg = None

    def who(self):
        c = self.ctx
        return c.rank, c.generation, os.getpid(), c.world_size, c.distributed_init_method

    def echo(self, tag):
        return self.ctx.rank, tag

    def nap(self, seconds, rank=None):
        if rank is None or rank == self.ctx.rank:
            time.sleep(seconds)
        return self.ctx.rank

    def die(self, rank, after=0.0):
        if self.ctx.rank == rank:
            time.sleep(after)
            os.kill(os.getpid(), signal.SIGKILL)
        return self.ctx.rank

    def blob(self, n):
        return bytes([self.ctx.rank]) * n

    def length(self, data):
        return len(data)

    def reform(self, init_method, world_size):
        """Form a new gloo group of ``world_size`` on ``init_method`` (dropping the old one)
        and all-reduce this rank's number over it."""
        import torch
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=init_method, rank=self.ctx.rank,
                                world_size=world_size)
        t = torch.tensor([float(self.ctx.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())

    def __del__(self):
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
