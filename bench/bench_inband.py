"""In-band payloads through mpx.Executor, against baselines measured in the same run.

    python bench/bench_inband.py [--quick] [--sections fs] [--png out.png] [--json out.json]

f. a call with 1 MiB of ``bytes`` in its args to 1 worker (the reply is its len), vs the
   Pipe RPC loop with the same call.                               target: <= 0.5x Pipe
   Informational: the driver's minor page faults per call.
s. the scheduler-step dict (kit_step.make_step: ~150 KB pickled, two small tensors) as the
   argument of a call to 1 worker, vs an in-process pickle.dumps + loads of the same call
   tuple.                                                          target: <= 0.9x
   Informational: a no-op call to a worker that once replied with the step dict, vs one to
   a worker that never sent a large message (a kept pickler's memo table once made every
   later message pay for the largest one).

Calls are timed in alternating blocks, so drift hits every side. A benchmark, not a
test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import os
import pickle
import resource

import kit_args
import kit_procs
import kit_report
import kit_rpc
import kit_stats
import kit_step
import kit_timing


def _minflt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def bench_bytes(size, iters, warm):
    """([us] mpx, [us] Pipe) of a call carrying ``size`` bytes; the driver's faults a call."""
    payload = os.urandom(size)
    ex, pipe = kit_rpc.new_executor(1), kit_rpc.pipe_rpc(1)
    try:
        def mpx_call():
            return ex.collective_rpc("nbytes", args=(payload,), timeout=kit_rpc.CALL_TIMEOUT)

        def pipe_call():
            return pipe.rpc("nbytes", payload)

        if mpx_call() != [size] or pipe_call() != [size]:
            raise RuntimeError("a worker saw another size")
        out = kit_timing.interleaved([mpx_call, pipe_call], warm, iters, 4)
        f0 = _minflt()
        for _ in range(100):
            mpx_call()
        return out[mpx_call], out[pipe_call], (_minflt() - f0) / 100
    finally:
        ex.shutdown()
        pipe.close()


def bench_step_dict(iters, warm):
    """([us] of a call with the step dict, [us] of dumps + loads of the same call tuple)."""
    step = kit_step.make_step()
    ex = kit_rpc.new_executor(1)
    try:
        def mpx_call():
            return ex.collective_rpc("step", args=(step,), timeout=kit_rpc.CALL_TIMEOUT)

        def in_process():  # a call tuple as the executor's: (kind, seq, method, args, ...)
            msg = pickle.dumps((0, 1, "step", (step,), None, None), protocol=5)
            return [len(pickle.loads(msg)[3][0]["req_ids"])]

        if mpx_call() != in_process():
            raise RuntimeError("the worker saw another step")
        out = kit_timing.interleaved([mpx_call, in_process], warm, iters, 4)
        return out[mpx_call], out[in_process]
    finally:
        ex.shutdown()


def bench_noop_after_step(iters, warm):
    """([us] of a no-op to a worker that replied with the step dict once, [us] of one to a
    worker that never sent a large message)."""
    carried, fresh = kit_rpc.new_executor(1), kit_rpc.new_executor(1)
    try:
        carried.collective_rpc(lambda w, d: d, args=(kit_step.make_step(),), timeout=kit_rpc.CALL_TIMEOUT)

        def after_step():
            return carried.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT)

        def never():
            return fresh.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT)

        out = kit_timing.interleaved([after_step, never], warm, iters, 6)
        return out[after_step], out[never]
    finally:
        carried.shutdown()
        fresh.shutdown()


def main():
    args = kit_args.parse_args(__doc__, "fewer repetitions", lambda ap: ap.add_argument(
        "--sections", default="fs", help="which sections to run (default fs)"))
    iters, warm = (600, 60) if args.quick else (3000, 200)
    header = kit_report.print_header(args.quick, "in-band payload benchmark", "the driver and the "
                                     "worker share them with whatever else runs",
                                     torch=kit_report.version("torch"))
    rows, raw = [], {}
    try:
        if "f" in args.sections:
            kit_report.progress(f"[f] 1 MiB bytes in the args, 1 worker, {iters} calls each side ...")
            m_us, p_us, faults = bench_bytes(kit_stats.MiB, iters, warm)
            m, p = kit_stats.stats(m_us), kit_stats.stats(p_us)
            rows.append(kit_report.row("1 MiB bytes in the args, 1 worker", "us", m, p, "<= 0.5x Pipe RPC",
                                       m["median"] / p["median"] <= 0.5,
                                       note=f"driver minor page faults per mpx call: {faults:.1f}"))
            raw["bytes_1mib"] = {"mpx": m, "pipe": p, "minflt_per_call": faults}
        if "s" in args.sections:
            kit_report.progress(f"[s] the scheduler-step dict as the argument, {iters // 2} calls each ...")
            m, b = (kit_stats.stats(v) for v in bench_step_dict(iters // 2, warm))
            size = kit_step.pickled_size(kit_step.make_step())
            rows.append(kit_report.row(f"step dict ({size / 1e3:.0f} KB pickled), 1 worker", "us", m, b,
                                       "<= 0.9x dumps+loads", m["median"] / b["median"] <= 0.9,
                                       note="baseline: pickle.dumps + loads of the call tuple, in process"))
            a, f = (kit_stats.stats(v) for v in bench_noop_after_step(iters * 4, warm))
            rows.append(kit_report.row("  a no-op to a worker that once replied with it, vs one that "
                                       "never did", "us", a, f))
            raw["step_dict"] = {"mpx": m, "in_process": b, "bytes": size, "noop_after": a,
                                "noop_never": f}
    finally:
        kit_procs.cleanup_procs()
    kit_report.finish(args, header, rows, raw, "in-band payloads")


if __name__ == "__main__":
    main()
