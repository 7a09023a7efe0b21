"""Workers and helper processes of tests/ring/test_ring_limits.py (module level so that every
start method imports them); ``main()`` runs a helper process (see the test)."""

from __future__ import annotations

import json
import pickle
import resource
import sys
import time

import psutil

import mpx

BIG = 256 << 20       # a message the capped process cannot allocate
HEADROOM = 96 << 20   # what the capped process may map beyond what it maps when capped
KEY = "limits-test-key-" + "x" * 16


def cap_address_space(headroom: int = HEADROOM) -> None:
    """Lower this process's RLIMIT_AS to what it maps now plus ``headroom`` bytes."""
    limit = psutil.Process().memory_info().vms + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


class Replies:
    """A worker whose replies may be larger than the driver can hold."""

    def __init__(self, ctx: mpx.WorkerContext) -> None:
        self.ctx = ctx

    def rank(self) -> int:
        return self.ctx.rank

    def blob(self, nbytes: int, ranks=None):
        """``nbytes`` of reply on ``ranks`` (None: all), the rank elsewhere."""
        if ranks is None or self.ctx.rank in ranks:
            return bytearray(nbytes)
        return self.ctx.rank


def _outcome(fn) -> list:
    try:
        return ["ok", fn()]
    except Exception as e:
        return [type(e).__name__, str(e), getattr(e, "ranks", None), getattr(e, "exc_type", None)]


def driver(start_method: str, transport: str) -> dict:
    """An executor whose driver cannot allocate one rank's reply: that call's outcome, and
    those of the calls after it."""
    with mpx.Executor(Replies, 2, start_method=start_method, max_chunk_bytes=1 << 20,
                      max_chunks=8, transport=transport, auth_key=KEY) as e:
        out = {"impl": mpx.ring_implementation(), "before": _outcome(lambda: e.collective_rpc("rank"))}
        cap_address_space()  # (the workers, started already, keep their limit)
        out["big"] = _outcome(lambda: e.collective_rpc("blob", args=(BIG,), kwargs={"ranks": [1]},
                                                       timeout=60))
        out["after"] = _outcome(lambda: e.collective_rpc("rank", timeout=30))
        out["big_future"] = _outcome(lambda: e.collective_rpc(
            "blob", args=(BIG,), kwargs={"ranks": [0]}, non_block=True).result(60))
        out["last"] = _outcome(lambda: e.collective_rpc("blob", args=(1000,), timeout=30))
        return out


def reader(handle) -> dict:
    """A queue reader that cannot allocate some of the messages (see the test)."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    try:
        q.wait_until_ready(30)
        cap_address_space()
        out = {"impl": mpx.ring_implementation(), "dequeue": []}
        for _ in range(3):
            out["dequeue"].append(_outcome(lambda: q.dequeue(30)))
        got: list = []
        deadline = time.monotonic() + 60
        while len(got) < 4 and time.monotonic() < deadline:
            got += q.dequeue_ready(lambda e: ["skipped", type(e).__name__, e.nbytes])
            time.sleep(0.001)
        out["dequeue_ready"] = got
        return out
    finally:
        q.close()


def main() -> None:
    """``driver START_METHOD TRANSPORT`` or ``reader`` (the handle pickled on stdin): the
    outcomes as one JSON line on stdout."""
    if sys.argv[1] == "driver":
        result = driver(sys.argv[2], sys.argv[3])
    else:
        result = reader(pickle.load(sys.stdin.buffer))
    print(json.dumps(result, default=repr), flush=True)
