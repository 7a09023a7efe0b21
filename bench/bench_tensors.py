"""Benchmark of torch tensors over mpx.MessageQueue against baselines measured in the same run.

    python bench/bench_tensors.py [--quick] [--png out.png] [--json out.json]

Every measurement sends one 64 MiB torch.float32 tensor and times from the send until the
reader's ack (the tensor's byte count) is back: medians and p90 over repetitions.

1. mpx.MessageQueue, 1 reader (one copy into the ring, one out into the reader's memory),
   vs single-thread memcpy of 64 MiB (torch copy_ with 1 thread, into a pre-touched
   tensor), the two timed in turn.                               target: >= 0.35x memcpy
   2 readers: per-reader GB/s (informational).
2. torch.multiprocessing.Queue, the baseline. It pickles a tensor by moving its storage
   into shared memory (one copy, on the sender, the first time a tensor is sent) and
   sending a file descriptor; the reader maps the same pages. Three modes:
     same tensor    every put sends a tensor already in shared memory: no copy at all
     fresh tensor   a new tensor each put (as each step of an engine makes): one copy
     fresh + clone  and the reader .clone()s it, to own private memory as mpx readers do:
                    the like-for-like comparison with 1.                   informational
3. mpx.share: the tensor travels by reference (segment name, offset, shape, strides); the
   reader maps the segment. Time per send vs the copying send of 1, and vs torch's "same
   tensor"; mpx.share() itself (one copy into a new segment) is timed too. informational
4. Huge-page advice on the reader's destination: the mpx ring (Cython) allocates the
   destination of a large message and advises MADV_HUGEPAGE before copying into it. Timed
   here as that step alone: allocate a 64 MiB bytearray as the ring does, advise or not,
   copy 64 MiB into it.                                         informational

It is a benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time

import numpy as np
import torch
import torch.multiprocessing as tmp
from _report import BIG, bw_stats, finish, parse_args, row

import mpx
from mpx import MessageQueue
from mpx._cli.benchkit import (
    CTX,
    cleanup_procs,
    join,
    print_header,
    progress,
    start,
    stats,
    time_calls,
)

SETUP_TIMEOUT = 60.0
N_ELEM = BIG // 4

# --------------------------------------------------------------------------- children
# Module-level so that "spawn" children can import them.


def _mpx_child(handle, rank, conn):
    """Reader ``rank``: ack every tensor with its byte count on a queue of its own."""
    q_in = MessageQueue.create_from_handle(handle, rank)
    back = MessageQueue(1, 1)
    conn.send(back.export_handle())
    back.wait_until_ready(timeout=SETUP_TIMEOUT)
    q_in.wait_until_ready(timeout=SETUP_TIMEOUT)
    try:
        while True:
            t = q_in.dequeue(indefinite=True)
            if t is None:
                break
            back.enqueue(t.numel() * t.element_size())
            del t                         # free before the next message arrives
    finally:
        back.close()
        q_in.close()
        conn.close()


def _torch_child(q, clone, conn):
    """A torch.multiprocessing.Queue reader: ack every tensor over ``conn``."""
    while True:
        t = q.get()
        if t is None:
            break
        if clone:
            t = t.clone()
        conn.send(t.numel() * t.element_size())
        del t
    conn.close()


# --------------------------------------------------------------------------- harness

class MpxReaders:
    """A writer queue to ``n`` reader children, each acking on its own queue."""

    def __init__(self, n):
        self.q = MessageQueue(n, n)
        self.backs, self.procs = [], []
        try:
            for rank in range(n):
                a, b = CTX.Pipe()
                self.procs.append(start(_mpx_child, (self.q.export_handle(), rank, b)))
                b.close()
                if not a.poll(SETUP_TIMEOUT):
                    raise RuntimeError("mpx reader did not come up")
                self.backs.append(MessageQueue.create_from_handle(a.recv(), 0))
                a.close()
            self.q.wait_until_ready(timeout=SETUP_TIMEOUT)
            for back in self.backs:
                back.wait_until_ready(timeout=SETUP_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def send(self, t):
        self.q.enqueue(t)
        for back in self.backs:
            got = back.dequeue(timeout=SETUP_TIMEOUT)
            if got != BIG:
                raise RuntimeError(f"a reader got {got} bytes, expected {BIG}")

    def close(self):
        try:
            self.q.enqueue(None, timeout=5)
        except Exception:
            pass
        for p in self.procs:
            join(p)
        for back in self.backs:
            back.close()
        self.q.close()


class TorchReader:
    """A torch.multiprocessing.Queue to one reader child that acks over a Pipe."""

    def __init__(self, clone):
        self.q = tmp.get_context("spawn").Queue()
        self.conn, b = CTX.Pipe()
        self.proc = start(_torch_child, (self.q, clone, b))
        b.close()

    def send(self, t):
        self.q.put(t)
        if not self.conn.poll(SETUP_TIMEOUT):
            raise RuntimeError("torch reader did not answer")
        got = self.conn.recv()
        if got != BIG:
            raise RuntimeError(f"torch reader got {got} bytes, expected {BIG}")

    def close(self):
        self.q.put(None)
        join(self.proc)
        self.q.close()
        self.q.join_thread()
        self.conn.close()


def send_times(send, make, reps, warm):
    """Seconds of ``reps`` sends (after ``warm``): ``send(make())``, make() not timed."""
    ts = []
    for i in range(warm + reps):
        t = make()
        t0 = time.perf_counter()
        send(t)
        t1 = time.perf_counter()
        del t
        if i >= warm:
            ts.append(t1 - t0)
    return ts


def alternating_times(fns, reps, warm):
    """Seconds of ``reps`` calls of each fn (after ``warm``), called in turn so that drift
    and the other machine load hit every fn alike."""
    out = [[] for _ in fns]
    for i in range(warm + reps):
        for f, ts in zip(fns, out):
            t0 = time.perf_counter()
            f()
            t1 = time.perf_counter()
            if i >= warm:
                ts.append(t1 - t0)
    return out


def memcpy_fn():
    """Single-thread torch copy_ of 64 MiB into a pre-touched tensor, as a callable."""
    src = torch.ones(N_ELEM, dtype=torch.float32)
    dst = torch.zeros(N_ELEM, dtype=torch.float32)

    def copy():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            dst.copy_(src)
        finally:
            torch.set_num_threads(threads)
    return copy


# --------------------------------------------------------------------------- 4. huge pages

_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype = ctypes.py_object
_new_bytearray.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def fresh_copy_times(advise, reps):
    """Seconds to allocate an uninitialised 64 MiB bytearray (as the ring's reader does),
    optionally advise MADV_HUGEPAGE on its whole pages, and copy 64 MiB into it."""
    src = np.ones(BIG, dtype=np.uint8)

    def once():
        ba = _new_bytearray(None, BIG)
        if advise:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(ba))
            lo, hi = (addr + 4095) & ~4095, (addr + BIG) & ~4095
            _libc.madvise(lo, hi - lo, mmap.MADV_HUGEPAGE)
        np.copyto(np.frombuffer(ba, dtype=np.uint8), src)

    return time_calls(once, reps, warm=1)


# --------------------------------------------------------------------------- main

def main():
    args = parse_args(__doc__, "fewer repetitions (~30 s)")
    quick = args.quick
    reps, warm = (5, 1) if quick else (12, 2)
    os.environ.pop("MPX_PURE_PYTHON", None)
    t_start = time.perf_counter()
    header = print_header(quick, "tensor benchmark", "writer and readers share them, so "
                          "streaming numbers compete for cores", ring_key="ring_default",
                          ring_label="default ring", torch=torch.__version__)
    header["thp"] = thp_mode()
    header["torch_threads"] = torch.get_num_threads()
    header["torch_sharing_strategy"] = tmp.get_sharing_strategy()
    print(f"transparent huge pages: {header['thp']}; torch threads {header['torch_threads']}; "
          f"torch sharing strategy {header['torch_sharing_strategy']}\n", flush=True)

    src = torch.arange(N_ELEM, dtype=torch.float32)
    rows, raw = [], {}

    def same():
        return src

    def fresh():
        return src.clone()

    try:
        progress(f"[1] mpx.MessageQueue, 64 MiB float32 tensor x {reps} (+{warm} warm-up) ...")
        memcpy = memcpy_fn()
        readers = MpxReaders(1)
        try:
            mpx1, memcpy_ts = alternating_times([lambda: readers.send(src), memcpy], reps, warm)
            shared = mpx.share(src)
            share_ref = send_times(readers.send, lambda: shared, reps, warm)
            shared = None                 # unlinks the segment
            share_make = time_calls(lambda: mpx.share(src), 5 if quick else 9, warm=1)
        finally:
            readers.close()
        mc = bw_stats(memcpy_ts)
        s1 = bw_stats(mpx1)
        ratio = s1["median"] / mc["median"]
        rows.append(row("mpx 64MiB tensor, 1 reader", "GB/s", s1, mc, ratio, ">= 0.35x memcpy",
                        ratio >= 0.35, better="higher",
                        note=f"median {s1['median_ms']:.1f} ms per tensor; baseline torch "
                             "copy_ with 1 thread into a pre-touched tensor"))
        readers = MpxReaders(2)
        try:
            mpx2, memcpy2_ts = alternating_times([lambda: readers.send(src), memcpy], reps, warm)
        finally:
            readers.close()
        s2 = bw_stats(mpx2)
        mc2 = bw_stats(memcpy2_ts)
        rows.append(row("mpx 64MiB tensor, 2 readers (per reader)", "GB/s", s2, mc2,
                        s2["median"] / mc2["median"], "info", None, better="higher"))

        progress("[2] torch.multiprocessing.Queue: same tensor, fresh tensor, fresh + clone ...")
        torch_ts = {}
        for mode, make, clone in (("same", same, False), ("fresh", fresh, False),
                                  ("fresh+clone", fresh, True)):
            tr = TorchReader(clone)
            try:
                torch_ts[mode] = send_times(tr.send, make, reps, warm)
            finally:
                tr.close()
        for mode, what in (("fresh+clone", "reader clones: private memory, like mpx"),
                           ("fresh", "reader maps the sender's shared copy"),
                           ("same", "no copy at all")):
            b = bw_stats(torch_ts[mode])
            rows.append(row(f"vs torch mp.Queue, {mode}", "GB/s", s1, b,
                            s1["median"] / b["median"], "info", None, better="higher",
                            note=f"torch {b['median_ms']:.1f} ms per tensor ({what})"))

        progress("[3] mpx.share: by reference ...")
        ref_us = stats([t * 1e6 for t in share_ref])
        copy_us = stats([t * 1e6 for t in mpx1])
        same_us = stats([t * 1e6 for t in torch_ts["same"]])
        make_ms = stats([t * 1e3 for t in share_make])
        rows.append(row("mpx.share send vs mpx copying send", "us", ref_us, copy_us,
                        ref_us["median"] / copy_us["median"], "info", None,
                        note=f"mpx.share() itself (one copy into a new segment): "
                             f"{make_ms['median']:.1f} ms"))
        rows.append(row("mpx.share send vs torch mp.Queue same tensor", "us", ref_us, same_us,
                        ref_us["median"] / same_us["median"], "info", None))

        progress("[4] huge-page advice on a fresh 64 MiB destination ...")
        n = 9 if quick else 15
        plain, advised = [], []
        for _ in range(3):               # alternate so that drift hits both
            plain += fresh_copy_times(False, n // 3)
            advised += fresh_copy_times(True, n // 3)
        a, p = bw_stats(advised), bw_stats(plain)
        rows.append(row("fresh-destination copy, MADV_HUGEPAGE vs none", "GB/s", a, p,
                        a["median"] / p["median"], "info", None, better="higher",
                        note=f"THP mode '{header['thp']}' (advice matters only in 'madvise'); "
                             "the Cython ring advises destinations >= 4 MiB, the pure-Python "
                             "ring does not"))
        raw["ms"] = {k: [t * 1e3 for t in v] for k, v in (
            ("memcpy", memcpy_ts), ("memcpy_2", memcpy2_ts), ("mpx_1", mpx1), ("mpx_2", mpx2),
            ("share_ref", share_ref), ("share_make", share_make), ("fresh_plain", plain),
            ("fresh_advised", advised),
            *((f"torch_{k}", v) for k, v in torch_ts.items()))}
    finally:
        cleanup_procs()

    elapsed = time.perf_counter() - t_start
    finish(args, header, rows, raw, elapsed, timed="time from send to the reader's ack",
           png_title=f"mpx tensors vs baselines ({os.cpu_count()} CPUs)", png_pad=1.5,
           reap_s=0.2)
    return 0


if __name__ == "__main__":
    main()
    sys.exit(0)
