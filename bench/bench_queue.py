"""Benchmark of mpx.MessageQueue against baselines measured in the same run.

    python bench/bench_queue.py [--quick] [--png out.png] [--json out.json]

Measurements (medians and p90 over repetitions; each compared with its baseline):

1. ping-pong latency of a ~100-byte tuple (writer -> child -> writer), vs a
   multiprocessing.Pipe echo loop.                         target: mpx <= 0.25x Pipe
2. bandwidth of a 64 MiB numpy array / bytes object to 1 reader (time from enqueue start
   until the reader's ack arrives), vs single-thread memcpy (np.copyto).
                                                           target: >= 0.3x memcpy
   2 readers (per-reader GB/s): informational.
3. first message after the reader sat idle 2 s (parked), one round trip, vs the same
   over a Pipe.                                            target: mpx <= Pipe
4. CPU time of a reader blocked in dequeue for 3 s.       target: < 2% of one core
Items 1 and 2 also run with MPX_PURE_PYTHON=1 (informational).

It is a benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import numpy as np
from _report import BIG, bw_stats, finish, last_cpu, parse_args, pct_row, row, timed_us

from mpx import MessageQueue
from mpx._cli.benchkit import (
    CTX,
    PipePeers,
    cleanup_procs,
    join,
    print_header,
    progress,
    start,
    stats,
    time_calls,
)

SMALL_OBJ = ("generate", 123456789, 3.14159, b"x" * 32, "request-0001", (1, 2, 3))
SETUP_TIMEOUT = 60.0

# --------------------------------------------------------------------------- children
# Module-level so that "spawn" children can import them.


def _mpx_child(handle, rank, mode, conn):
    """Reader ``rank`` of ``handle``; replies on a MessageQueue(1,1) it creates.

    mode "echo": send every object back. mode "ack": send back the object's size.
    Stops on None.
    """
    q_in = MessageQueue.create_from_handle(handle, rank)
    back = MessageQueue(1, 1)
    conn.send((back.export_handle(), q_in.ring_implementation, back.ring_implementation))
    back.wait_until_ready(timeout=SETUP_TIMEOUT)
    q_in.wait_until_ready(timeout=SETUP_TIMEOUT)
    try:
        while True:
            obj = q_in.dequeue(indefinite=True)
            if obj is None:
                break
            if mode == "echo":
                back.enqueue(obj)
            else:
                back.enqueue(obj.nbytes if isinstance(obj, np.ndarray) else len(obj))
            del obj                      # free before the next message arrives
    finally:
        back.close()
        q_in.close()
        conn.close()


def _idle_cpu_child(kind, handle, conn):
    """Block in one receive (mpx dequeue or Pipe recv) and report its CPU and wall time."""
    q = MessageQueue.create_from_handle(handle, 0) if kind == "mpx" else None
    if q is not None:
        q.wait_until_ready(timeout=SETUP_TIMEOUT)
    conn.send("ready")
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if q is not None:
        q.dequeue(indefinite=True)
    else:
        conn.recv()
    t1 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    conn.send({"cpu_s": cpu, "wall_s": t1 - t0,
               "vol_ctx": r1.ru_nvcsw - r0.ru_nvcsw, "invol_ctx": r1.ru_nivcsw - r0.ru_nivcsw})
    if q is not None:
        q.close()
    conn.close()


# --------------------------------------------------------------------------- harness

_queues: list = []


def _track(q):
    _queues.append(q)
    return q


def _cleanup_all():
    for q in _queues:
        try:
            q.close()
        except Exception:
            pass
    _queues.clear()
    cleanup_procs()


class MpxPeers:
    """A writer queue to ``n`` reader children, each replying on its own queue."""

    def __init__(self, n, mode):
        self.q = _track(MessageQueue(n, n))
        self.backs, self.procs = [], []
        self.impl = {"writer": self.q.ring_implementation}
        for rank in range(n):
            a, b = CTX.Pipe()
            self.procs.append(start(_mpx_child, (self.q.export_handle(), rank, mode, b)))
            b.close()
            if not a.poll(SETUP_TIMEOUT):
                raise RuntimeError("mpx child did not come up")
            handle, impl_in, impl_back = a.recv()
            a.close()
            self.impl[f"reader{rank}"] = impl_in
            self.impl[f"child{rank}_writer"] = impl_back
            back = _track(MessageQueue.create_from_handle(handle, 0))
            self.backs.append(back)
        self.q.wait_until_ready(timeout=SETUP_TIMEOUT)
        for back in self.backs:
            back.wait_until_ready(timeout=SETUP_TIMEOUT)

    def close(self):
        self.q.enqueue(None, timeout=SETUP_TIMEOUT)
        for p in self.procs:
            join(p)
        for back in self.backs:
            back.close()
        self.q.close()


# --------------------------------------------------------------------------- 1. ping-pong

def _pingpong(send, recv, iters, warm):
    """``iters`` round trips of SMALL_OBJ (``send`` it, ``recv`` the echo) after ``warm``
    untimed ones; microseconds each."""
    obj = SMALL_OBJ

    def round_trip():
        send(obj)
        recv()

    return timed_us(round_trip, iters, warm)


def bench_pingpong(iters, warm):
    peers = MpxPeers(1, "echo")
    mpx_us = _pingpong(peers.q.enqueue, peers.backs[0].dequeue, iters, warm)
    impl = dict(peers.impl, cpus=(last_cpu(os.getpid()), last_cpu(peers.procs[0].pid)))
    peers.close()
    peer = PipePeers(1)
    pipe_us = _pingpong(peer.conns[0].send, peer.conns[0].recv, iters, warm)
    pipe_cpus = (last_cpu(os.getpid()), last_cpu(peer.pids[0]))
    peer.close()
    m, b = stats(mpx_us), stats(pipe_us)
    ratio = m["median"] / b["median"]
    note = (f"last CPU (parent, child): mpx {impl['cpus']}, Pipe {pipe_cpus}; a shared CPU "
            "is much slower for a spinning waiter")
    return m, b, ratio, impl, note


# --------------------------------------------------------------------------- 2. bandwidth

def memcpy_baseline(reps):
    src = np.ones(BIG, dtype=np.uint8)
    dst = np.zeros(BIG, dtype=np.uint8)      # pre-touched
    return time_calls(lambda: np.copyto(dst, src), reps, warm=1)


def _bandwidth_mpx(payloads, n_readers, reps, warm):
    """payloads: name -> object; returns name -> list of seconds (enqueue start -> all acks)."""
    peers = MpxPeers(n_readers, "ack")
    out = {}
    for name, obj in payloads.items():
        size = obj.nbytes if isinstance(obj, np.ndarray) else len(obj)
        ts = []
        for i in range(warm + reps):
            t0 = time.perf_counter()
            peers.q.enqueue(obj)
            for back in peers.backs:
                got = back.dequeue()
                if got != size:
                    raise RuntimeError(f"reader got {got} bytes, expected {size}")
            t1 = time.perf_counter()
            if i >= warm:
                ts.append(t1 - t0)
        out[name] = ts
    impl = peers.impl
    peers.close()
    return out, impl


# --------------------------------------------------------------------------- 3. idle wake

def bench_idle_wake(rounds, idle_s):
    peers = MpxPeers(1, "echo")
    pipe = PipePeers(1)
    q, back, c = peers.q, peers.backs[0], pipe.conns[0]
    for _ in range(200):               # warm both paths
        q.enqueue(SMALL_OBJ)
        back.dequeue()
        c.send(SMALL_OBJ)
        c.recv()
    mpx_us, pipe_us = [], []
    clock = time.perf_counter_ns
    for r in range(rounds):
        # Each measurement follows `idle_s` of idleness of both children (and the parent).
        order = ("mpx", "pipe") if r % 2 == 0 else ("pipe", "mpx")
        for which in order:
            time.sleep(idle_s)
            if which == "mpx":
                t0 = clock()
                q.enqueue(SMALL_OBJ)
                back.dequeue()
                mpx_us.append((clock() - t0) / 1e3)
            else:
                t0 = clock()
                c.send(SMALL_OBJ)
                c.recv()
                pipe_us.append((clock() - t0) / 1e3)
    peers.close()
    pipe.close()
    return mpx_us, pipe_us


# --------------------------------------------------------------------------- 4. idle CPU

def bench_idle_cpu(idle_s):
    q = _track(MessageQueue(1, 1))
    a1, b1 = CTX.Pipe()
    a2, b2 = CTX.Pipe()
    p1 = start(_idle_cpu_child, ("mpx", q.export_handle(), b1))
    p2 = start(_idle_cpu_child, ("pipe", None, b2))
    b1.close()
    b2.close()
    q.wait_until_ready(timeout=SETUP_TIMEOUT)
    for a in (a1, a2):
        if not a.poll(SETUP_TIMEOUT):
            raise RuntimeError("idle-cpu child did not come up")
        assert a.recv() == "ready"
    time.sleep(idle_s)                   # both children are blocked in a receive
    q.enqueue("wake")
    a2.send("wake")
    res_mpx = a1.recv()
    res_pipe = a2.recv()
    join(p1)
    join(p2)
    q.close()
    a1.close()
    a2.close()
    return res_mpx, res_pipe


def main():
    args = parse_args(__doc__, "fewer repetitions (~1 min)")

    quick = args.quick
    pp_iters, pp_warm = (5000, 500) if quick else (20000, 2000)
    pp_iters_pure = 2000 if quick else 10000
    bw_reps, bw_warm = (5, 1) if quick else (10, 2)
    idle_rounds, idle_s = (3, 2.0) if quick else (10, 2.0)
    cpu_idle_s = 3.0

    os.environ.pop("MPX_PURE_PYTHON", None)
    t_start = time.perf_counter()
    header = print_header(quick, "benchmark", "writer and readers share them, so spinning "
                          "and multi-reader numbers compete for cores",
                          ring_key="ring_default", ring_label="default ring")

    rows = []
    raw = {}
    try:
        # ---- 1. ping-pong
        progress(f"[1] ping-pong, {pp_iters} round trips of a {len(__import__('pickle').dumps(SMALL_OBJ, 5))}"
                 "-byte pickle ...")
        m, b, ratio, impl, note = bench_pingpong(pp_iters, pp_warm)
        raw["pingpong"] = {"impl": impl}
        rows.append(row("ping-pong latency", "us", m, b, ratio, "<= 0.25x Pipe", ratio <= 0.25,
                        note=note))

        # ---- 2. bandwidth
        progress(f"[2] bandwidth, 64 MiB x {bw_reps} reps (+{bw_warm} warm-up) ...")
        arr = np.arange(BIG // 8, dtype=np.int64)
        payloads = {"numpy": arr, "bytes": arr.tobytes()}
        memcpy_ts = memcpy_baseline(9 if quick else 15)
        mc = bw_stats(memcpy_ts)
        bw1, impl1 = _bandwidth_mpx(payloads, 1, bw_reps, bw_warm)
        for name in payloads:
            s = bw_stats(bw1[name])
            ratio = s["median"] / mc["median"]
            rows.append(row(f"bandwidth 64MiB {name}, 1 reader", "GB/s", s, mc, ratio,
                            ">= 0.3x memcpy", ratio >= 0.3, better="higher"))
        bw2, impl2 = _bandwidth_mpx(payloads, 2, bw_reps, bw_warm)
        for name in payloads:
            s = bw_stats(bw2[name])
            rows.append(row(f"bandwidth 64MiB {name}, 2 readers (per reader)", "GB/s", s, mc,
                            s["median"] / mc["median"], "info", None, better="higher"))
        raw["bandwidth"] = {"impl_1": impl1, "impl_2": impl2,
                            "memcpy_ms": [t * 1e3 for t in memcpy_ts],
                            "one_reader_ms": {k: [t * 1e3 for t in v] for k, v in bw1.items()},
                            "two_readers_ms": {k: [t * 1e3 for t in v] for k, v in bw2.items()}}

        # ---- pure Python (1 and 2, informational)
        progress("[1+2] again with MPX_PURE_PYTHON=1 ...")
        os.environ["MPX_PURE_PYTHON"] = "1"
        try:
            m, b, ratio, impl, note = bench_pingpong(pp_iters_pure, pp_warm // 2)
            rings = {v for k, v in impl.items() if k != "cpus"}
            if rings != {"python"}:
                print(f"  warning: pure-Python run got rings {impl}")
            rows.append(row("ping-pong latency, MPX_PURE_PYTHON=1", "us", m, b, ratio, "info",
                            None, note=note.split(";")[0]))
            bwp, implp = _bandwidth_mpx(payloads, 1, max(3, bw_reps // 2), 1)
            if set(implp.values()) != {"python"}:
                print(f"  warning: pure-Python run got rings {implp}")
            for name in payloads:
                s = bw_stats(bwp[name])
                rows.append(row(f"bandwidth 64MiB {name}, 1 reader, MPX_PURE_PYTHON=1", "GB/s",
                                s, mc, s["median"] / mc["median"], "info", None, better="higher"))
            raw["pure_python"] = {"impl_pingpong": impl, "impl_bw": implp}
        finally:
            os.environ.pop("MPX_PURE_PYTHON", None)
        del arr, payloads

        # ---- 3. idle wake
        progress(f"[3] first message after {idle_s:.0f} s idle, {idle_rounds} rounds each "
                 f"(~{2 * idle_rounds * idle_s:.0f} s) ...")
        mpx_us, pipe_us = bench_idle_wake(idle_rounds, idle_s)
        m, b = stats(mpx_us), stats(pipe_us)
        ratio = m["median"] / b["median"]
        rows.append(row(f"first message after {idle_s:.0f}s idle (round trip)", "us", m, b, ratio,
                        "<= 1.0x Pipe", ratio <= 1.0))
        raw["idle_wake_us"] = {"mpx": mpx_us, "pipe": pipe_us}

        # ---- 4. idle CPU
        progress(f"[4] CPU of a reader blocked {cpu_idle_s:.0f} s ...")
        rm, rp = bench_idle_cpu(cpu_idle_s)
        pm = 100.0 * rm["cpu_s"] / rm["wall_s"]
        pp = 100.0 * rp["cpu_s"] / rp["wall_s"]
        rows.append(pct_row(f"idle reader CPU ({cpu_idle_s:.0f}s blocked)", pm, pp,
                            pm / pp if pp > 0 else None, "< 2% of a core", pm < 2.0,
                            note=(f"mpx {rm['cpu_s'] * 1e3:.2f} ms CPU over {rm['wall_s']:.2f} "
                                  f"s, {rm['vol_ctx']} voluntary ctx switches; Pipe "
                                  f"{rp['cpu_s'] * 1e3:.2f} ms, {rp['vol_ctx']} switches")))
        raw["idle_cpu"] = {"mpx": rm, "pipe": rp}
    finally:
        _cleanup_all()

    elapsed = time.perf_counter() - t_start
    finish(args, header, rows, raw, elapsed, timed="time",
           png_title=f"mpx.MessageQueue vs baselines ({os.cpu_count()} CPUs)", png_pad=1.5)
    return 0


if __name__ == "__main__":
    main()
    sys.exit(0)
