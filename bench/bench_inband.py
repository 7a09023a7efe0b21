"""In-band payloads through mpx.Executor, against baselines measured in the same run.

    python bench/bench_inband.py [--quick] [--sections fst] [--png out.png] [--json out.json]

f. a call with 1 MiB of ``bytes`` inside its args to 1 worker (the reply is its len), vs
   the Pipe RPC loop of bench_executor.py with the same call.     target: <= 0.5x Pipe
   Informational: minor page faults per call of the driver.
s. the scheduler-step dict of bench/_step.py (~150 KB pickled, two small tensors) as the
   argument of a call to 1 worker, vs an in-process pickle.dumps + loads of the same
   call tuple.                                                     target: <= 1.15x
   Informational: a no-op call to a worker that once replied with the step dict, vs one to
   a worker that never sent a large message (each process keeps its picklers, and one kept
   with a large memo table made every later message pay for clearing it).
t. the out-of-band threshold: one process writes a message of [bytes(n)] into a
   MessageQueue and reads it back (encode, ring write, ring read, decode), with
   ``serde.OOB_MIN_BYTES`` at its value and with it out of reach (everything in band), for
   n around the threshold: informational, the measurement behind the threshold.
p. unpickling from the ring slot: one process writes an in-band ("x", bytes(n)) into a
   MessageQueue and reads it back, with ``transport.shm.IN_PLACE_MIN_BYTES`` at its value
   and out of reach (every message copied out of its slot first), for n around it:
   informational, the measurement behind it.

Calls are timed in alternating blocks (bench/_report.py interleaved), so drift hits every
side. It is a benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import os
import pickle
import resource
import sys
import time

import torch
from _report import (
    MiB,
    finish,
    interleaved,
    parse_args,
    row,
    timed_us,
)
from _step import make_step, pickled_size
from bench_executor import CALL_TIMEOUT, SETTLE_S, new_executor, pipe_rpc

import mpx
from mpx import serde
from mpx._cli.benchkit import cleanup_procs, print_header, stats
from mpx.transport import shm as shm_transport


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def bench_bytes(size, iters, warm):
    """{side: [us]} of a call carrying ``size`` bytes, and the driver's minor faults per
    mpx call."""
    payload = os.urandom(size)
    ex = new_executor(1)
    pipe = pipe_rpc(1)
    try:
        def mpx_call():
            return ex.collective_rpc("nbytes", args=(payload,), timeout=CALL_TIMEOUT)

        def pipe_call():
            return pipe.rpc("nbytes", payload)

        for fn in (mpx_call, pipe_call):
            if fn() != [size]:
                raise RuntimeError(f"{fn.__name__} returned {fn()}, not [{size}]")
        out = interleaved([mpx_call, pipe_call], warm, iters, 4, SETTLE_S)
        f0 = _minflt()
        for _ in range(100):
            mpx_call()
        faults = (_minflt() - f0) / 100
    finally:
        ex.shutdown()
        pipe.close()
    return out[mpx_call], out[pipe_call], faults


def bench_step_dict(iters, warm):
    """([us] of a call with the step dict, [us] of dumps + loads of the same call tuple)."""
    step = make_step()
    n = len(step["req_ids"])
    ex = new_executor(1)
    try:
        def mpx_call():
            return ex.collective_rpc("step", args=(step,), timeout=CALL_TIMEOUT)

        def in_process():
            # what the executor's call message holds: (kind, seq, method, args, kwargs, rank)
            msg = pickle.dumps((0, 1, "step", (step,), None, None), protocol=5)
            return [len(pickle.loads(msg)[3][0]["req_ids"])]

        for fn in (mpx_call, in_process):
            if fn() != [n]:
                raise RuntimeError(f"{fn.__name__} returned {fn()}, not [{n}]")
        out = interleaved([mpx_call, in_process], warm, iters, 4, SETTLE_S)
    finally:
        ex.shutdown()
    return out[mpx_call], out[in_process], pickled_size(step)


def bench_noop_after_step(iters, warm):
    """([us] of a no-op call to a worker that replied with the step dict once, [us] of one
    to a worker that never sent a large message). (The driver's picklers are the same for
    both: they are kept per thread; the call with the step dict is a lambda, which
    cloudpickle pickles with a pickler of its own.)"""
    carried, fresh = new_executor(1), new_executor(1)
    try:
        carried.collective_rpc(lambda w, d: d, args=(make_step(),), timeout=CALL_TIMEOUT)

        def after_step():
            return carried.collective_rpc("noop", timeout=CALL_TIMEOUT)

        def never():
            return fresh.collective_rpc("noop", timeout=CALL_TIMEOUT)

        out = interleaved([after_step, never], warm, iters, 6, SETTLE_S)
    finally:
        carried.shutdown()
        fresh.shutdown()
    return out[after_step], out[never]


def _round_trips_two_ways(sizes, iters, make, at, module, name, on, off):
    """{n: (us with ``module.name = on``, us with ``off``)} of enqueue + dequeue of
    ``make(n)`` in one process (``at``: where the message's n bytes are in it); the two
    settings alternate, so drift hits both."""
    q = mpx.MessageQueue(1, 1)
    r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
    q.wait_until_ready(timeout=10)
    r.wait_until_ready(timeout=10)
    kept = getattr(module, name)
    out = {}
    try:
        for n in sizes:
            msg = make(n)

            def rt(msg=msg, n=n):
                q.enqueue(msg)
                if len(r.dequeue(timeout=10)[at]) != n:
                    raise RuntimeError("message came back wrong")

            res: dict = {}
            for _ in range(3):
                for setting in (on, off):
                    setattr(module, name, setting)
                    for _ in range(max(3, iters // 10)):
                        rt()
                    res.setdefault(setting, []).extend(timed_us(rt, iters // 3))
            out[n] = (stats(res[on]), stats(res[off]))
    finally:
        setattr(module, name, kept)
        r.close()
        q.close()
    return out


def bench_threshold(sizes, iters):
    """{n: (us out of band, us in band)}: encode + write + read + decode of [bytes(n)] in
    one process, with serde.OOB_MIN_BYTES at its value and out of reach."""
    return _round_trips_two_ways(sizes, iters, lambda n: [os.urandom(n)], 0, serde,
                                 "OOB_MIN_BYTES", serde.OOB_MIN_BYTES, 1 << 62)


def bench_in_place(sizes, iters):
    """{n: (us unpickled from the slot, us copied first)}: enqueue + dequeue of an in-band
    ("x", bytes(n)) in one process, every message lent from its slot and none."""
    return _round_trips_two_ways(sizes, iters, lambda n: ("x", os.urandom(n)), 1,
                                 shm_transport, "IN_PLACE_MIN_BYTES", 0, 1 << 62)


def _more_args(ap):
    ap.add_argument("--sections", default="fst", help="which sections to run (default fst)")


def main():
    args = parse_args(__doc__, "fewer repetitions", _more_args)
    quick = args.quick
    iters, warm = (600, 60) if quick else (3000, 200)
    t_start = time.perf_counter()
    header = print_header(quick, "in-band payload benchmark",
                          "the driver and the worker share them with whatever else runs",
                          torch=torch.__version__)
    rows, raw = [], {}
    try:
        if "f" in args.sections:
            print(f"[f] 1 MiB bytes inside the args, 1 worker, {iters} calls each side ...",
                  file=sys.stderr, flush=True)
            m_us, p_us, faults = bench_bytes(MiB, iters, warm)
            m, p = stats(m_us), stats(p_us)
            ratio = m["median"] / p["median"]
            rows.append(row("1 MiB bytes in the args, 1 worker", "us", m, p, ratio,
                            "<= 0.5x Pipe RPC", ratio <= 0.5,
                            note=f"driver minor page faults per mpx call: {faults:.1f}"))
            raw["bytes_1mib_us"] = {"mpx": m_us, "pipe": p_us,
                                    "driver_minflt_per_call": faults}
        if "s" in args.sections:
            print(f"[s] scheduler-step dict as the argument, {iters // 2} calls each side ...",
                  file=sys.stderr, flush=True)
            m_us, b_us, size = bench_step_dict(iters // 2, warm)
            m, b = stats(m_us), stats(b_us)
            ratio = m["median"] / b["median"]
            rows.append(row(f"step dict ({size / 1e3:.0f} KB pickled), 1 worker", "us", m, b,
                            ratio, "<= 1.15x dumps+loads", ratio <= 1.15,
                            note="baseline: pickle.dumps + loads of the call tuple, in process"))
            raw["step_dict_us"] = {"mpx": m_us, "in_process": b_us, "pickled_bytes": size}
            a_us, f_us = bench_noop_after_step(iters * 4, warm)
            a, f = stats(a_us), stats(f_us)
            rows.append(row("  a no-op call to a worker that once replied with it, vs one that never did",
                            "us", a, f, a["median"] / f["median"], "info", None))
            raw["noop_after_step_us"] = {"after_step": a_us, "never": f_us}
        if "t" in args.sections:
            sizes = [32 << 10, 64 << 10, 256 << 10, MiB, 2 * MiB, 4 * MiB, 8 * MiB]
            t_iters = 300 if quick else 1500
            print(f"[t] out of band vs in band, one process, sizes {sizes} ...",
                  file=sys.stderr, flush=True)
            got = bench_threshold(sizes, t_iters)
            for n, (o, i) in got.items():
                note = ("below the pickler's 64 KiB floor: in band either way"
                        if n < 64 << 10 else "")
                rows.append(row(f"round trip of [bytes({n >> 10} KiB)], out of band vs in band",
                                "us", o, i, o["median"] / i["median"], "info", None, note=note))
            raw["threshold_us"] = {str(n): {"oob": o, "inband": i} for n, (o, i) in got.items()}
        if "p" in args.sections:
            sizes = [4 << 10, 8 << 10, 16 << 10, 64 << 10, 256 << 10, 768 << 10]
            p_iters = 600 if quick else 3000
            print(f"[p] unpickled from the ring slot vs copied first, sizes {sizes} ...",
                  file=sys.stderr, flush=True)
            got = bench_in_place(sizes, p_iters)
            for n, (lent, copied) in got.items():
                rows.append(row(f"round trip of (str, bytes({n >> 10} KiB)) in band, from the "
                                "slot vs copied", "us", lent, copied,
                                lent["median"] / copied["median"], "info", None))
            raw["in_place_us"] = {str(n): {"lent": a, "copied": b} for n, (a, b) in got.items()}
    finally:
        cleanup_procs()
    finish(args, header, rows, raw, time.perf_counter() - t_start, timed=None,
           png_title=f"in-band payloads (os.cpu_count()={os.cpu_count()})", png_pad=2.0,
           reap_s=0.2)
    return 0


if __name__ == "__main__":
    main()
    sys.exit(0)
