"""mpx.Executor next to the usual ways of reaching worker processes (``python -m mpx bench``).

    python bench/bench_compare.py [--quick] [--png PATH] [--json PATH]

Each cell is the median round trip of one collective call: the driver sends the same payload (100 B,
64 KiB, 1 MiB, 64 MiB) to each of 1, 2 and 4 workers and waits until every worker has answered with
the payload's size. Methods:

- mpx          ``Executor.collective_rpc("nbytes", args=(payload,))``
- Pipe         one ``multiprocessing.Pipe`` per worker: send to all, then receive from all
- mp.Queue     one ``multiprocessing.Queue`` per worker for calls, one shared for replies
- zmq ipc      per worker a PUSH/PULL pair each way over ``ipc://`` (payloads from 64 KiB sent
               zero-copy, received as zero-copy frames)
- ProcessPool  ``concurrent.futures.ProcessPoolExecutor``: one task per worker carrying the payload,
               then wait for all (the pool does not promise one task a process)

Payloads are numpy uint8 arrays (bytearrays without numpy): mpx sends them out of band, zmq as raw
frames, the others pickle them in band. Every process is started with spawn.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import shutil
import sys
import tempfile
import time

import kit_args
import kit_plot
import kit_procs
import kit_report
import kit_rpc
import kit_stats
import kit_timing

KiB = 1 << 10
SIZES = [100, 64 * KiB, 1 << 20, 64 << 20]
WORKERS = [1, 2, 4]
# (iterations, warm-up, time budget in seconds) per payload size: the budget stops a slow method early
PLAN = {False: {100: (5000, 100, 4.0), 64 * KiB: (2000, 50, 4.0), 1 << 20: (500, 10, 4.0),
                64 << 20: (15, 2, 10.0)},
        True: {100: (400, 30, 0.4), 64 * KiB: (200, 10, 0.4), 1 << 20: (40, 5, 0.5), 64 << 20: (3, 1, 2.0)}}


def _queue_child(rank, q_in, q_out):
    kit_rpc.serve(q_in.get, lambda n: q_out.put((rank, n)), kit_rpc.payload_size)


def _zmq_child(req_addr, rep_addr):
    import zmq
    zctx = zmq.Context()
    pull, push = zctx.socket(zmq.PULL), zctx.socket(zmq.PUSH)
    pull.connect(req_addr)
    push.connect(rep_addr)
    while n := len(pull.recv(copy=False).buffer):  # empty: stop
        push.send(n.to_bytes(8, "little"))
    pull.close(linger=0)
    push.close(linger=1000)
    zctx.term()


def _pid_after(seconds):
    time.sleep(seconds)
    return os.getpid()


class Mpx:
    def __init__(self, n):
        self.ex = kit_rpc.new_executor(n)
        self.pids, self.close = self.ex.worker_pids, self.ex.shutdown

    def __call__(self, payload):
        return self.ex.collective_rpc("nbytes", args=(payload,), timeout=kit_rpc.CALL_TIMEOUT)


class Pipe(kit_rpc.PipePeers):
    def __init__(self, n):
        super().__init__(n, kit_rpc.payload_size)

    __call__ = kit_rpc.PipePeers.call


class Queue:
    def __init__(self, n):
        self.ins, self.out = [kit_procs.CTX.Queue() for _ in range(n)], kit_procs.CTX.Queue()
        self.procs = [kit_procs.start(_queue_child, (r, q, self.out)) for r, q in enumerate(self.ins)]
        self.pids = [p.pid for p in self.procs]

    def __call__(self, payload):
        for q in self.ins:
            q.put(payload)
        got = [0] * len(self.ins)
        for _ in self.ins:
            rank, size = self.out.get(timeout=kit_rpc.CALL_TIMEOUT)
            got[rank] = size
        return got

    def close(self):
        for q in self.ins:
            q.put(None)
        for p in self.procs:
            kit_procs.join(p, 10)
        for q in self.ins + [self.out]:
            q.close()
            q.join_thread()


class Zmq:
    def __init__(self, n):
        import zmq
        self.dir, self.zctx = tempfile.mkdtemp(prefix="mpx-bench-zmq-"), zmq.Context()
        self.push, self.pull, self.procs = [], [], []
        for r in range(n):
            req, rep = f"ipc://{self.dir}/req{r}", f"ipc://{self.dir}/rep{r}"
            self.push.append(self.zctx.socket(zmq.PUSH))
            self.push[-1].bind(req)
            self.pull.append(self.zctx.socket(zmq.PULL))
            self.pull[-1].bind(rep)
            self.procs.append(kit_procs.start(_zmq_child, (req, rep)))
        self.pids = [p.pid for p in self.procs]

    def __call__(self, payload):
        for s in self.push:
            s.send(payload, copy=kit_rpc.payload_size(payload) < 64 * KiB)
        out = []
        for t in self.pull:
            if not t.poll(int(kit_rpc.CALL_TIMEOUT * 1000)):
                raise TimeoutError("a zmq worker did not answer")
            out.append(int.from_bytes(t.recv(), "little"))
        return out

    def close(self):
        for s in self.push:
            s.send(b"")
        for p in self.procs:
            kit_procs.join(p, 10)
        for s in self.push + self.pull:
            s.close(linger=0)
        self.zctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


class Pool:
    def __init__(self, n):
        self.n = n
        self.pool = concurrent.futures.ProcessPoolExecutor(max_workers=n, mp_context=kit_procs.CTX)
        # start all n processes now (the pool spawns them on demand)
        self.pids = sorted({f.result(60) for f in [self.pool.submit(_pid_after, 0.3) for _ in range(n)]})

    def __call__(self, payload):
        futs = [self.pool.submit(kit_rpc.payload_size, payload) for _ in range(self.n)]
        return [f.result(kit_rpc.CALL_TIMEOUT) for f in futs]

    def close(self):
        self.pool.shutdown(wait=True)


METHODS = {"mpx": Mpx, "Pipe": Pipe, "mp.Queue": Queue, "zmq ipc": Zmq, "ProcessPool": Pool}


def make_payload(size):
    try:
        import numpy as np
    except ImportError:
        return bytearray(b"\xa5") * size
    return np.arange(size, dtype=np.uint64).astype(np.uint8)  # pre-touched, not constant


def measure(method, n, size, plan):
    """Round-trip seconds; the answers of a call before and of one after are checked."""
    payload, (iters, warm, budget) = make_payload(size), plan[size]

    def check():
        if (got := method(payload)) != [size] * n:
            raise RuntimeError(f"workers answered {got}, expected {[size] * n}")
    check()
    ts = kit_timing.time_calls(functools.partial(method, payload), iters, warm=warm, budget_s=budget)
    check()
    return ts


def human(size):
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB" if size >= KiB else f"{size} B"


def title(n):
    cpus = len(os.sched_getaffinity(0))
    more = f" ({n + 1} processes on {cpus} cores)" if n >= cpus else ""
    return f"{n} worker{'s' if n > 1 else ''}{more}"


def print_tables(results, methods):
    for n in WORKERS:
        print(f"{title(n)}: median round trip (p90)")
        lines = []
        for size in SIZES:
            cells = {m: results.get((m, n, size)) for m in methods}
            known = [c["median"] for c in cells.values() if c]
            unit, k = ("us", 1e6) if known and min(known) < 1e-3 else ("ms", 1e3)
            line = [f"{human(size)} [{unit}]"] + [f"{c['median'] * k:.1f} ({c['p90'] * k:.1f})" if c else "-"
                                                  for c in cells.values()]
            others = {m: c["median"] for m, c in cells.items() if c and m != "mpx"}
            best = min(others, key=others.get) if others else None
            line.append(f"{cells['mpx']['median'] / others[best]:.2f}x {best}" if best and cells.get("mpx")
                        else "-")
            lines.append(line)
        kit_report.print_table(["payload", *methods, "mpx vs best other"], lines, indent="  ")
        print()


def run(args):
    methods = list(METHODS)
    try:
        import zmq  # noqa: F401
    except ImportError as e:
        methods.remove("zmq ipc")
        print(f"skipping zmq ipc: pyzmq not importable: {e}")
    header = kit_report.print_header(args.quick, f"bench: mpx.Executor vs {', '.join(methods[1:])}",
                                     "the driver and its workers share them", min_cpus=max(WORKERS))
    results, failures = {}, []
    for n in WORKERS:
        for m in methods:
            t0, method = time.perf_counter(), None
            try:
                method = METHODS[m](n)
                kit_timing.settle([functools.partial(method, make_payload(SIZES[0]))],
                                  0.2 if args.quick else 0.5)
                for size in SIZES:
                    results[(m, n, size)] = kit_stats.stats(measure(method, n, size, PLAN[args.quick]))
            except Exception as e:
                failures.append(f"{m} with {n} workers: {type(e).__name__}: {e}")
                print(f"  error: {failures[-1]}", flush=True)
            finally:
                if method is not None:
                    method.close()
            cells = ", ".join(f"{human(s)} {results[(m, n, s)]['median'] * 1e6:.0f} us"
                              for s in SIZES if (m, n, s) in results)
            kit_report.progress(f"{m:<11} {n} worker(s)  {cells}  ({time.perf_counter() - t0:.1f} s)")
    print_tables(results, methods)
    time.sleep(0.1)
    kit_report.print_cleanup()
    print("done" + (f"; {len(failures)} failed: {'; '.join(failures)}" if failures else ""))
    if args.json:
        kit_report.write_json(args.json, {**header, "failures": failures, "results": [
            {"method": m, "workers": n, "bytes": s, **v} for (m, n, s), v in results.items()]})
    if args.png:
        def draw(fig, axes):
            for ax, n in zip(axes, WORKERS):
                for m in methods:
                    xs = [s for s in SIZES if (m, n, s) in results]
                    ax.plot(xs, [results[(m, n, s)]["median"] * 1e6 for s in xs], marker="o",
                            lw=2.5 if m == "mpx" else 1.2, label=m)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xticks(SIZES, [human(s) for s in SIZES])
                ax.set_xlabel("payload (broadcast to every worker)")
                ax.set_title(title(n))
                ax.grid(True, which="both", alpha=0.3)
            axes[0].set_ylabel("median round trip [us]")
            axes[0].legend(fontsize=8)
        kit_plot.write_png(args.png, draw, nrows=1, ncols=len(WORKERS), figsize=(15, 4.5), sharey=True)
    return 0


def main(argv=None):
    return run(kit_args.parse_args(__doc__, "fewer repetitions (under a minute instead of ~4)", argv=argv))


if __name__ == "__main__":
    sys.exit(main())
