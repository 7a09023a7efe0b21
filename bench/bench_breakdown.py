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

Each side's share, in one process (real queues over shared memory, nothing to wait for):
  driver     the call table's send and blocking wait: encode and write the call, read and
             decode the reply, settle the call (its reply put in the ring beforehand)
  worker     the worker loop: read and decode the call, dispatch, encode and write the
             reply (calls put in the ring beforehand, 8 per run of the loop)
  (the best of 15 interleaved blocks of each; the harness's own ring writes and reads
  are timed alone the same way and taken off)

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

from _report import finish, interleaved, parse_args, row, stats, timed_us

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


# --------------------------------------------------------------------------- each side


class _CallThenStop:
    """The worker loop's broadcast queue, standing in: ``n`` calls from the real queue's
    reading end, then a STOP."""

    def __init__(self, q, n):
        self.end, self.left = q.reading_end(), n

    def reading_end(self):
        return self

    def read_into(self, *args):
        if self.left:
            self.left -= 1
            return self.end.read_into(*args)
        return (wire.STOP, 0)


BLOCKS = 15


def _side_times(iters, per_run=8):
    """{"driver": [us per call], "worker": [us per call]}, as the module docstring says:
    each the best of BLOCKS interleaved blocks, less its harness's best."""
    import tempfile

    from mpx._driver.calls import CallTable
    from mpx._driver.stalls import StallDiagnosis
    from mpx._worker.main import _serve
    from mpx._worker.output import InlineOutput, Replies

    cfg = mpx.Config()
    calls_q = mpx.MessageQueue(1, 1)
    calls_in = mpx.MessageQueue.create_from_handle(calls_q.export_handle(), 0)
    replies_q = mpx.MessageQueue(1, 1)
    replies_in = mpx.MessageQueue.create_from_handle(replies_q.export_handle(), 0)
    # the harness's own side of each queue: the rings under them, without their Python
    put_call = calls_q._writer.ends[0]._ring.write
    take_call = calls_in._reader._ring.read
    put_reply = replies_q._writer.ends[0]._ring.write
    take_reply = replies_in._reader._ring.read
    table = CallTable(1, StallDiagnosis(cfg, lambda: [os.getpid()], lambda r: True),
                      lambda rank, e: None)
    table.attach(calls_q, [replies_in])
    worker = NoopWorker()
    dump_dir = tempfile.TemporaryDirectory(prefix="mpx-breakdown-")
    wd = Watchdog(0, 0, dump_dir.name, lambda info: None)
    out = InlineOutput(Replies(replies_q), worker)
    reply = serde.encode((0, wire.OK, None), local_only=True)
    calls = [serde.encode(wire.call(i, "noop", (), None, None), local_only=True)
             for i in range(per_run)]

    def driver():
        put_reply(*serde.encode((table.next_seq, wire.OK, None), True), -1)  # its reply
        call = table.send("noop", "noop", (), None, None, None, None, False)
        table.wait(call)
        take_call(-1, -1)

    def driver_harness():
        put_reply(*serde.encode((table.next_seq, wire.OK, None), True), -1)
        take_reply(-1, -1)
        put_call(*calls[0], -1)
        take_call(-1, -1)

    def worker_run():
        for kind, parts in calls:
            put_call(kind, parts, -1)
        _serve(worker, 0, _CallThenStop(calls_in, per_run), out, wd)
        for _ in range(per_run):
            take_reply(-1, -1)

    def worker_harness():
        for kind, parts in calls:
            put_call(kind, parts, -1)
            take_call(-1, -1)
            put_reply(*reply, -1)
            take_reply(-1, -1)

    # (fn, calls it makes): timed in interleaved blocks, the best block of each kept, so
    # that the VM's drift (up to 2x within minutes) hits all four alike
    fns = {"driver": (driver, 1), "driver harness": (driver_harness, 1),
           "worker": (worker_run, per_run), "worker harness": (worker_harness, per_run)}
    per = max(1, iters // per_run // BLOCKS)
    try:
        timed = interleaved([fn for fn, _ in fns.values()], 200, per * BLOCKS, BLOCKS, 0)
        best = {k: min(sum(timed[fn][i:i + per]) for i in range(0, per * BLOCKS, per))
                / (per * n) for k, (fn, n) in fns.items()}
        return {"driver": [max(0.0, best["driver"] - best["driver harness"])],
                "worker": [max(0.0, best["worker"] - best["worker harness"])]}
    finally:
        for q in (calls_in, calls_q, replies_in, replies_q):
            q.close()
        dump_dir.cleanup()


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
    progress(f"each side's share in process, {iters} calls each ...")
    sides = {k: stats(v) for k, v in _side_times(iters).items()}
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
        row("  the driver's share, in process", "us", sides["driver"], rts["executor"],
            sides["driver"]["median"] / full, "info", None,
            note="the call table's send and wait with real queues; baseline: the round trip"),
        row("  the worker's share, in process", "us", sides["worker"], rts["executor"],
            sides["worker"]["median"] / full, "info", None,
            note="the worker loop with real queues; baseline: the round trip"),
    ]
    raw = {"stages_us": st, "sides_us": sides, "round_trips_us": {k: v for k, v in rts.items()}}
    finish(args, header, rows, raw, time.perf_counter() - t_start, timed=None,
           png_title="no-op breakdown", png_pad=1.5, reap_s=0.3)


if __name__ == "__main__":
    sys.exit(main())
