"""Where the microseconds of a no-op call go: each stage of a 1-worker round trip timed on
its own, next to the whole round trip, the bare rings and a Pipe RPC loop, in one run.

Stages, in the order a call takes them (hot: each timed in a loop, in this process):
  encode     the driver pickles the call message (serde.encode of wire.call(...))
  write      the driver writes it into a ring (RingWriter.write, one slot)
  read       the worker takes it out (RingReader.read: an owned copy)
  decode     the worker unpickles it (serde.decode)
  dispatch   the worker finds and runs the method (getattr, the call, the watchdog marks)
  reply      the worker pickles (seq, OK, None) and writes it, the driver reads and
             unpickles it: encode + write + read + decode of the reply
  wake       two one-way hand-offs between processes: the round trip of 8 bytes over two
             bare rings between two processes (no pickle, no Python policy)
  the rest   the executor round trip minus all of the above: the driver's call table,
             futures and locks, the worker loop's own steps, and what runs cold or waits
             for a core when it runs between processes

Between processes (real round trips, alternating blocks):
  bare rings   8 bytes there and back over two rings, no pickle (the transport's floor)
  executor     Executor.collective_rpc("noop"), 1 worker
  Pipe RPC     the same call over a multiprocessing Pipe (the baseline)

It is a benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import sys
import time
import types

from _report import finish, parse_args, row, stats, timed_us

import mpx
from mpx import layout, serde, wire
from mpx._cli.benchkit import CallOn, PipePeers, child_pids, print_header, progress, settle
from mpx._impl import ring_module
from mpx._worker.main import _call
from mpx._worker.watchdog import Watchdog

RING_ARGS = dict(spin_ns=0, yield_ns=1_000_000, poll_ns=100_000_000)
KIND = 1 | layout.KIND_AS_BYTES


class NoopWorker:
    def __init__(self, ctx=None):
        pass

    def noop(self):
        return None


def _rings(n_rings, chunk=4096, slots=16):
    """Anonymous shared mappings with ring headers (inherited by a forked child)."""
    out = []
    for _ in range(n_rings):
        mm = mmap.mmap(-1, layout.segment_size(chunk, slots, 1))
        layout.init_header(mm, chunk, slots, 1, 1, os.getpid())
        out.append(mm)
    return out


# --------------------------------------------------------------------------- stages


def _stage_times(iters):
    """{stage: [us per call]} of the in-process stages."""
    mod = ring_module()
    (mm,) = _rings(1)
    w = mod.RingWriter(mm, **RING_ARGS)
    r = mod.RingReader(mm, 0, **RING_ARGS)
    worker = NoopWorker()
    wd = types.SimpleNamespace()  # the watchdog's marks, its own code, without its threads
    kind, parts = serde.encode(wire.call(7, "noop", (), None, None), local_only=True)
    received = r.read  # bound once, as the transports do

    def encode():
        serde.encode(wire.call(7, "noop", (), None, None), local_only=True)

    def write():
        w.write(kind, parts, -1)
        received(-1, -1)

    def decode():
        serde.decode(kind, parts[0])

    def dispatch():
        Watchdog.begin(wd, "noop", 7)
        _call(worker, "noop", (), None)
        Watchdog.end(wd)

    def reply():
        k, p = serde.encode((7, wire.OK, None), local_only=True)
        w.write(k, p, -1)
        st, k2, data = received(-1, -1)
        serde.decode(k2, data)

    try:
        out = {}
        out["encode"] = timed_us(encode, iters, iters // 10)
        both = timed_us(write, iters, iters // 10)
        # the read alone: publish outside the timed call
        reads = []
        for _ in range(iters):
            w.write(kind, parts, -1)
            t0 = time.perf_counter_ns()
            received(-1, -1)
            reads.append((time.perf_counter_ns() - t0) / 1e3)
        out["read"] = reads
        med_read = stats(reads)["median"]
        out["write"] = [max(0.0, t - med_read) for t in both]
        out["decode"] = timed_us(decode, iters, iters // 10)
        out["dispatch"] = timed_us(dispatch, iters, iters // 10)
        out["reply"] = timed_us(reply, iters, iters // 10)
        return out
    finally:
        w.release()
        r.release()
        mm.close()


# --------------------------------------------------------------------------- between processes


def _echo_child(mm_in, mm_out):
    mod = ring_module()
    r = mod.RingReader(mm_in, 0, **RING_ARGS)
    w = mod.RingWriter(mm_out, **RING_ARGS)
    while True:
        st, kind, data = r.read(-1, -1)
        if st != layout.OK or data == b"stop----":
            break
        w.write(kind, (data,), -1)
    w.release()
    r.release()


class BareRings:
    """8 bytes there and back over two rings to a forked echo process."""

    def __init__(self):
        mod = ring_module()
        self.mms = _rings(2)
        self.w = mod.RingWriter(self.mms[0], **RING_ARGS)
        self.proc = mp.get_context("fork").Process(target=_echo_child, args=tuple(self.mms),
                                                    daemon=True)
        self.proc.start()
        child_pids.add(self.proc.pid)
        self.r = mod.RingReader(self.mms[1], 0, **RING_ARGS)
        self.msg = (b"ping----",)

    def call(self):
        self.w.write(KIND, self.msg, -1)
        self.r.read(-1, -1)

    def close(self):
        self.w.write(KIND, (b"stop----",), -1)
        self.proc.join(10)
        self.w.release()
        self.r.release()
        for mm in self.mms:
            mm.close()


def _between_processes(iters, blocks):
    rings = BareRings()
    ex = mpx.Executor(NoopWorker, world_size=1, start_method="spawn")
    child_pids.update(ex.worker_pids)
    pipe = PipePeers(1, CallOn(NoopWorker()))
    child_pids.update(pipe.pids)
    fns = {"bare rings": rings.call, "executor": lambda: ex.collective_rpc("noop"),
           "Pipe RPC": lambda: pipe.rpc("noop")}
    try:
        settle(list(fns.values()), 1.0, min_rounds=iters // 10)
        out = {k: [] for k in fns}
        per = max(1, iters // blocks)
        for b in range(blocks):
            for k in (list(fns) if b % 2 == 0 else list(fns)[::-1]):
                out[k].extend(timed_us(fns[k], per))
        return out
    finally:
        rings.close()
        ex.shutdown()
        pipe.close()


# --------------------------------------------------------------------------- main


def main():
    args = parse_args(__doc__, "fewer repetitions (~10 s instead of ~30)")
    t_start = time.perf_counter()
    header = print_header(args.quick, "no-op breakdown",
                          "the driver, the worker and the echo process share them")
    iters = 20000 if args.quick else 100000
    progress(f"stages in process, {iters} calls each ...")
    st = {k: stats(v)["median"] for k, v in _stage_times(iters).items()}
    progress("round trips between processes ...")
    rt = _between_processes(iters // 4, 8)
    rts = {k: stats(v) for k, v in rt.items()}
    full = rts["executor"]["median"]
    wake = rts["bare rings"]["median"]
    staged = sum(st.values())
    st["wake (bare rings' round trip)"] = wake
    st["the rest"] = max(0.0, full - staged - wake)

    print()
    print(f"{'stage':<36}{'us':>8}{'share':>8}")
    print("-" * 52)
    for k, v in st.items():
        print(f"{k:<36}{v:8.2f}{v / full * 100:7.1f}%")
    print("-" * 52)
    print(f"{'executor round trip (measured)':<36}{full:8.2f}{100:7.1f}%")
    rows = [
        row("no-op round trip, executor, 1 worker", "us", rts["executor"], rts["Pipe RPC"],
            full / rts["Pipe RPC"]["median"], "info", None,
            note="baseline: Pipe RPC loop, same run"),
        row("  8 bytes over two bare rings", "us", rts["bare rings"], rts["Pipe RPC"],
            wake / rts["Pipe RPC"]["median"], "info", None,
            note="the transport's floor: no pickle, no Python policy"),
        row("  stages in process, summed", "us", {"median": staged, "p90": staged, "n": 1},
            rts["executor"], staged / full, "info", None,
            note="encode+write+read+decode+dispatch+reply, hot, one process"),
    ]
    raw = {"stages_us": st, "round_trips_us": {k: v for k, v in rts.items()}}
    finish(args, header, rows, raw, time.perf_counter() - t_start, timed=None,
           png_title="no-op breakdown", png_pad=1.5, reap_s=0.3)


if __name__ == "__main__":
    sys.exit(main())
