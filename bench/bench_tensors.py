"""torch tensors over mpx.MessageQueue against baselines measured in the same run.

    python bench/bench_tensors.py [--quick] [--png out.png] [--json out.json]

Every measurement sends one 64 MiB torch.float32 tensor and times from the send until the
reader's answer (its element count) is back: medians and p90 over repetitions.

1. a MessageQueue to 1 reader (kit_rpc.QueueRPC: one copy into the ring, one out into the
   reader's memory), vs one thread's memcpy of 64 MiB (torch copy_ into a pre-touched
   tensor), the two timed in turn.                             target: >= 0.35x memcpy
   2 readers: GB/s per reader (informational).
2. torch.multiprocessing.Queue. It moves a tensor's storage into shared memory (one copy,
   on the sender, the first time that tensor is sent) and sends a file descriptor; the
   reader maps the same pages. "same": the same tensor every put (no copy at all);
   "fresh": a new tensor each put, as each step of an engine makes (one copy); "fresh +
   clone": and the reader .clone()s it, to own private memory as mpx's readers do: the
   like-for-like comparison with 1.                                       informational
3. mpx.share: the tensor travels by reference (segment name, offset, shape, strides); the
   time per send, and mpx.share() itself (one copy into a new segment). informational
4. allocating a fresh 64 MiB destination and copying into it, with MADV_HUGEPAGE advised
   on it and without (what a reader of a large message does).            informational

A benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import ctypes
import mmap
import time

import kit_args
import kit_procs
import kit_report
import kit_rpc
import kit_stats
import kit_timing
import numpy as np
import torch
import torch.multiprocessing as tmp

import mpx

N = kit_stats.BIG // 4  # float32 elements


def _torch_child(q, clone, conn):
    """A torch.multiprocessing.Queue reader: answer every tensor's size over ``conn``."""
    while (t := q.get()) is not None:
        if clone:
            t = t.clone()
        conn.send(t.numel())
        del t
    conn.close()


class TorchReader:
    def __init__(self, clone):
        self.q = tmp.get_context("spawn").Queue()
        self.conn, b = kit_procs.CTX.Pipe()
        self.proc = kit_procs.start(_torch_child, (self.q, clone, b))
        b.close()

    def send(self, t):
        self.q.put(t)
        if not self.conn.poll(60) or self.conn.recv() != N:
            raise RuntimeError("the torch reader did not answer with the size")

    def close(self):
        self.q.put(None)
        kit_procs.join(self.proc)
        self.q.close()
        self.q.join_thread()
        self.conn.close()


def send_times(send, make, reps, warm):
    """Seconds of ``send(make())``, make() not timed."""
    ts = []
    for i in range(warm + reps):
        t = make()
        t0 = time.perf_counter()
        send(t)
        if i >= warm:
            ts.append(time.perf_counter() - t0)
        del t
    return ts


def memcpy(src):
    dst = torch.zeros_like(src)

    def copy():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            dst.copy_(src)
        finally:
            torch.set_num_threads(threads)
    return copy


def mpx_sends(readers, src, reps, warm, memcpy_fn):
    rpc = kit_rpc.QueueRPC(readers)
    try:
        def send(t):
            if rpc.call("take", t) != [N] * readers:
                raise RuntimeError("a reader saw another size")
        copying, mc = kit_timing.in_turn([lambda: send(src), memcpy_fn], reps, warm)
        if readers > 1:
            return copying, mc, None, None
        shared = [mpx.share(src)]
        by_ref = send_times(send, lambda: shared[0], reps, warm)
        shared.clear()  # unlinks the segment
        return copying, mc, by_ref, kit_timing.time_calls(lambda: mpx.share(src), reps, warm=1)
    finally:
        rpc.close()


_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype = ctypes.py_object
_new_bytearray.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def fresh_copy_times(advise, reps):
    """Seconds to allocate an uninitialised 64 MiB bytearray, advise MADV_HUGEPAGE on its
    whole pages or not, and copy 64 MiB into it."""
    src = np.ones(kit_stats.BIG, dtype=np.uint8)

    def once():
        ba = _new_bytearray(None, kit_stats.BIG)
        if advise:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(ba))
            lo, hi = (addr + 4095) & ~4095, (addr + kit_stats.BIG) & ~4095
            _libc.madvise(lo, hi - lo, mmap.MADV_HUGEPAGE)
        np.copyto(np.frombuffer(ba, dtype=np.uint8), src)
    return kit_timing.time_calls(once, reps, warm=1)


def thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def main():
    args = kit_args.parse_args(__doc__, "fewer repetitions (~30 s)")
    reps, warm = (5, 1) if args.quick else (12, 2)
    header = kit_report.print_header(args.quick, "tensor benchmark", "the writer and the readers share "
                                     "them", torch=torch.__version__, thp=thp_mode())
    src = torch.arange(N, dtype=torch.float32)
    rows, raw = [], {}
    try:
        kit_report.progress(f"[1] MessageQueue, 64 MiB float32 tensor x {reps} (+{warm} warm-up) ...")
        one, mc1, by_ref, make = mpx_sends(1, src, reps, warm, memcpy(src))
        two, mc2, _, _ = mpx_sends(2, src, reps, warm, memcpy(src))
        s1, m1 = kit_stats.gbps(one), kit_stats.gbps(mc1)
        rows.append(kit_report.row("mpx 64MiB tensor, 1 reader", "GB/s", s1, m1, ">= 0.35x memcpy",
                                   s1["median"] / m1["median"] >= 0.35,
                                   note=f"median {s1['median_ms']:.1f} ms per tensor; baseline torch "
                                        "copy_, 1 thread, into a pre-touched tensor"))
        rows.append(kit_report.row("mpx 64MiB tensor, 2 readers (per reader)", "GB/s", kit_stats.gbps(two),
                                   kit_stats.gbps(mc2)))

        kit_report.progress("[2] torch.multiprocessing.Queue: same tensor, fresh, fresh + clone ...")
        torch_ts = {}
        for mode, make_t, clone in (("same", lambda: src, False),
                                    ("fresh", src.clone, False), ("fresh+clone", src.clone, True)):
            tr = TorchReader(clone)
            try:
                torch_ts[mode] = send_times(tr.send, make_t, reps, warm)
            finally:
                tr.close()
        for mode, what in (("fresh+clone", "the reader clones: private memory, like mpx"),
                           ("fresh", "the reader maps the sender's shared copy"),
                           ("same", "no copy at all")):
            b = kit_stats.gbps(torch_ts[mode])
            rows.append(kit_report.row(f"vs torch mp.Queue, {mode}", "GB/s", s1, b,
                                       note=f"torch {b['median_ms']:.1f} ms per tensor ({what})"))

        kit_report.progress("[3] mpx.share: by reference ...")
        ref, copy_us, same = (kit_stats.stats([t * 1e6 for t in ts])
                              for ts in (by_ref, one, torch_ts["same"]))
        rows.append(kit_report.row("mpx.share send vs mpx copying send", "us", ref, copy_us,
                                   note=f"mpx.share() itself (one copy into a new segment): "
                                        f"{kit_stats.stats(make)['median'] * 1e3:.1f} ms"))
        rows.append(kit_report.row("mpx.share send vs torch mp.Queue same tensor", "us", ref, same))

        kit_report.progress("[4] huge-page advice on a fresh 64 MiB destination ...")
        plain, advised = [], []
        for _ in range(3):  # alternating, so that drift hits both
            plain += fresh_copy_times(False, 3 if args.quick else 5)
            advised += fresh_copy_times(True, 3 if args.quick else 5)
        rows.append(kit_report.row("fresh-destination copy, MADV_HUGEPAGE vs none", "GB/s",
                                   kit_stats.gbps(advised), kit_stats.gbps(plain),
                                   note=f"THP mode '{header['thp']}' (the advice matters in 'madvise')"))
        raw["seconds"] = {"mpx_1": one, "mpx_2": two, "memcpy": mc1, "share_ref": by_ref,
                          "share_make": make, "fresh_plain": plain, "fresh_advised": advised,
                          **{f"torch_{k}": v for k, v in torch_ts.items()}}
    finally:
        kit_procs.cleanup_procs()
    kit_report.finish(args, header, rows, raw, "mpx tensors vs baselines")


if __name__ == "__main__":
    main()
