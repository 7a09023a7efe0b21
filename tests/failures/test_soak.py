"""Soak: many calls with mixed payloads, while the RSS, open fds and thread counts of the
driver and of every worker are recorded; after a warm-up they must stay flat.

The default run makes MPX_SOAK_CALLS calls (20000); the slow one (``pytest -m slow``,
``tox -e soak``) makes MPX_SOAK_CALLS or 10^5. The samples are printed (``-s``) and, with
``MPX_MATRIX_REPORT=path``, appended to that file as one JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import time

import psutil
import pytest
from _env import START_METHOD
from _matrix_workers import Faulty

import mpx

np = pytest.importorskip("numpy")

SHORT_CALLS = int(os.environ.get("MPX_SOAK_CALLS", "20000"))
LONG_CALLS = int(os.environ.get("MPX_SOAK_CALLS", "100000"))
SAMPLES = 20
# Growth allowed after the warm-up (the first quarter of the run). Python's allocator keeps
# freed arenas and the 1 MiB arrays come and go, so RSS wanders by a few MiB; a leak of
# the array per call (the largest payload) would grow it by hundreds of MiB.
RSS_SLACK = 48 << 20


# Threads gRPC leaves in a process that ran Ray (tests/nodes/test_ray_launcher.py runs in this
# one): its event-engine pool grows and shrinks on its own, so they are not counted.
GRPC_THREADS = {"event_engine", "grpc_global_tim", "timer_manager", "default-executo",
                "resolver-execut", "client.poll0", "gcs_client_io_s"}


def _threads(p: psutil.Process) -> int:
    """``p``'s threads, but gRPC's (by the name the kernel has for each)."""
    n = 0
    for t in p.threads():
        try:
            with open(f"/proc/{p.pid}/task/{t.id}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # it ended meanwhile
        n += name not in GRPC_THREADS
    return n


def _sample(procs: list[psutil.Process]) -> list[tuple[int, int, int]]:
    return [(p.memory_info().rss, p.num_fds(), _threads(p)) for p in procs]


def _one_round(e: mpx.Executor, i: int, arr) -> int:
    """One of ten kinds of call by ``i``; returns how many calls it made."""
    k = i % 10
    if k < 4:
        assert e.collective_rpc("ident", args=(i,)) == [i, i]
    elif k == 4:
        arr[0] = i
        back = e.collective_rpc("echo_array", args=(arr,), unique_reply_rank=i % 2)
        assert back.shape == arr.shape and back[0] == i and back[-1] == arr[-1]
    elif k == 5:
        with pytest.raises(mpx.RPCError, match="bad value on rank 1"):
            e.collective_rpc("fail", kwargs={"ranks": [1]})
    elif k == 6:
        assert e.collective_rpc("reply_if", args=(i,), unique_reply_rank=1) == (1, i)
    elif k == 7:
        futs = [e.collective_rpc("ident", args=(i + j,), non_block=True) for j in range(8)]
        assert [f.result(timeout=30) for f in futs] == [[i + j] * 2 for j in range(8)]
        return 8
    elif k == 8:
        blob = bytes([i % 256]) * (64 << 10)
        assert e.collective_rpc("ident", args=(blob,), unique_reply_rank=0) == blob
    else:
        obj = {"i": i, "items": list(range(i % 50)), "nested": {"s": "x" * (i % 300)}}
        assert e.collective_rpc("ident", args=(obj,)) == [obj, obj]
    return 1


def soak(calls: int) -> dict:
    e = mpx.Executor(Faulty, 2, start_method=START_METHOD)
    try:
        procs = [psutil.Process()] + [psutil.Process(p) for p in e.worker_pids]
        arr = np.arange(1 << 17, dtype=np.float64)  # 1 MiB
        every = max(1, calls // SAMPLES)
        samples: list[tuple[int, float, list]] = []
        done, i, next_sample = 0, 0, 0
        t0 = time.monotonic()
        while done < calls:
            done += _one_round(e, i, arr)
            i += 1
            if done >= next_sample:
                gc.collect()
                samples.append((done, time.monotonic() - t0, _sample(procs)))
                next_sample += every
        gc.collect()
        samples.append((done, time.monotonic() - t0, _sample(procs)))
        assert not e.is_failed
    finally:
        e.shutdown()
    return dict(calls=done, seconds=time.monotonic() - t0, samples=samples)


def check_flat(result: dict) -> None:
    samples = result["samples"]
    names = ["driver"] + [f"worker {r}" for r in range(len(samples[0][2]) - 1)]
    print(f"\nSOAK {result['calls']} calls in {result['seconds']:.1f} s [{START_METHOD}]")
    print("calls     " + "".join(f"{n:>26}" for n in names))
    for done, _, procs in samples:
        print(f"{done:<10}" + "".join(f"{rss >> 20:>10} MiB {fds:>4} fd {thr:>3} th"
                                      for rss, fds, thr in procs))
    path = os.environ.get("MPX_MATRIX_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(dict(case="soak", start_method=START_METHOD,
                                    impl=mpx.ring_implementation(), calls=result["calls"],
                                    seconds=round(result["seconds"], 2),
                                    samples=[[d, round(t, 2), p] for d, t, p in samples])) + "\n")
    after_warmup = samples[len(samples) // 4:]
    base = after_warmup[0][2]
    for j, name in enumerate(names):
        rss = [s[2][j][0] for s in after_warmup]
        fds = [s[2][j][1] for s in after_warmup]
        threads = [s[2][j][2] for s in after_warmup]
        assert max(fds) <= base[j][1], f"{name}: open fds grew {fds}"
        assert max(threads) <= base[j][2], f"{name}: threads grew {threads}"
        grew = min(rss[-3:]) - base[j][0]
        assert grew < RSS_SLACK, f"{name}: RSS grew {grew >> 20} MiB: {[r >> 20 for r in rss]}"


def test_soak():
    check_flat(soak(SHORT_CALLS))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_long():
    check_flat(soak(LONG_CALLS))
