"""``python -m mpx bench [--quick] [--png PATH] [--json PATH]``: mpx.Executor next to the
usual ways of reaching worker processes.

Each cell is the median round trip of one collective call: the driver sends the same
payload to each of N workers and waits until every worker has answered with a tiny reply
(the payload's size). Methods:

- ``mpx``          ``Executor.collective_rpc("take", args=(payload,))`` (one shared-memory
                   broadcast ring, one reply ring per worker)
- ``Pipe``         one ``multiprocessing.Pipe`` per worker: send to all, then receive from all
- ``mp.Queue``     one ``multiprocessing.Queue`` per worker for calls, one shared for replies
- ``zmq ipc``      per worker a PUSH/PULL pair each way over ``ipc://`` (payload frames sent
                   zero-copy from 64 KiB up, received as zero-copy frames)
- ``ProcessPool``  ``concurrent.futures.ProcessPoolExecutor``: one task per worker carrying
                   the payload, then wait for all (the pool does not promise that the N tasks
                   land on N different processes)

Payloads are numpy uint8 arrays (a bytearray without numpy): mpx sends them out of band,
zmq as raw frames, the others pickle them in band. Every process is started with spawn.
The child entry points live here so that spawn can import them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
SIZES = [100, 64 * KiB, 1 * MiB, 64 * MiB]
WORKERS = [1, 2, 4]
METHODS = ["mpx", "Pipe", "mp.Queue", "zmq ipc", "ProcessPool"]
SETUP_TIMEOUT = 60.0
CALL_TIMEOUT = 120.0
ZMQ_ZERO_COPY_FROM = 64 * KiB

# (iterations, warm-up, time budget in seconds) per payload size; the budget stops a cell
# early on slow methods, after at least MIN_SAMPLES timed calls.
PLAN_FULL = {100: (5000, 100, 4.0), 64 * KiB: (2000, 50, 4.0), 1 * MiB: (500, 10, 4.0),
             64 * MiB: (15, 2, 10.0)}
PLAN_QUICK = {100: (400, 30, 0.4), 64 * KiB: (200, 10, 0.4), 1 * MiB: (40, 5, 0.5),
              64 * MiB: (3, 1, 2.0)}
MIN_SAMPLES = 3
# Small calls for this long after the processes start, before anything is timed: the
# first few hundred round trips after a spawn are slower (1.5x here) until the scheduler
# has spread the processes over the cores.
SETTLE_S = {False: 0.5, True: 0.2}

CTX = mp.get_context("spawn")


def _size(obj: Any) -> int:
    return int(getattr(obj, "nbytes", None) or len(obj))


# ---------------------------------------------------------------------- child processes


class BenchWorker:
    """The mpx.Executor worker."""

    def __init__(self, ctx: Any = None, **kw: Any) -> None:
        pass

    def take(self, payload: Any) -> int:
        return _size(payload)


def _serve(recv: Callable[[], Any], reply: Callable[[int], None]) -> None:
    """Answer each payload from ``recv`` with its size, until None arrives."""
    while True:
        obj = recv()
        if obj is None:
            break
        n = _size(obj)
        del obj
        reply(n)


def _pipe_child(conn: Any) -> None:
    try:
        _serve(conn.recv, conn.send)
    finally:
        conn.close()


def _queue_child(rank: int, q_in: Any, q_out: Any) -> None:
    _serve(q_in.get, lambda n: q_out.put((rank, n)))


def _zmq_child(req_addr: str, rep_addr: str) -> None:
    import zmq
    zctx = zmq.Context()
    pull = zctx.socket(zmq.PULL)
    push = zctx.socket(zmq.PUSH)
    pull.connect(req_addr)
    push.connect(rep_addr)
    try:
        while True:
            frame = pull.recv(copy=False)
            n = len(frame.buffer)
            if n == 0:  # stop
                break
            try:
                import numpy as np
                n = np.frombuffer(frame.buffer, dtype=np.uint8).nbytes
            except ImportError:
                pass
            del frame
            push.send(n.to_bytes(8, "little"))
    finally:
        pull.close(linger=0)
        push.close(linger=1000)
        zctx.term()


def _ppe_take(payload: Any) -> int:
    return _size(payload)


def _ppe_sleep(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


# ---------------------------------------------------------------------- methods


class _Method:
    name = ""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pids: list[int] = []

    def call(self, payload: Any) -> list[int]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _stop(procs: list, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            print(f"  warning: child {p.pid} did not exit, terminating it", flush=True)
            p.terminate()
            p.join(5)


class MpxMethod(_Method):
    name = "mpx"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        import mpx
        self.ex = mpx.Executor(BenchWorker, world_size=n, start_method="spawn")
        self.pids = self.ex.worker_pids

    def call(self, payload: Any) -> list[int]:
        return self.ex.collective_rpc("take", args=(payload,), timeout=CALL_TIMEOUT)

    def close(self) -> None:
        self.ex.shutdown()


class PipeMethod(_Method):
    name = "Pipe"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.conns, self.procs = [], []
        for _ in range(n):
            a, b = CTX.Pipe()
            p = CTX.Process(target=_pipe_child, args=(b,), daemon=True)
            p.start()
            b.close()
            self.conns.append(a)
            self.procs.append(p)
        self.pids = [p.pid for p in self.procs if p.pid is not None]

    def call(self, payload: Any) -> list[int]:
        for c in self.conns:
            c.send(payload)
        return [c.recv() for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        _stop(self.procs)
        for c in self.conns:
            c.close()


class QueueMethod(_Method):
    name = "mp.Queue"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.ins = [CTX.Queue() for _ in range(n)]
        self.out = CTX.Queue()
        self.procs = [CTX.Process(target=_queue_child, args=(r, self.ins[r], self.out),
                                  daemon=True) for r in range(n)]
        for p in self.procs:
            p.start()
        self.pids = [p.pid for p in self.procs if p.pid is not None]

    def call(self, payload: Any) -> list[int]:
        for q in self.ins:
            q.put(payload)
        got = [0] * self.n
        for _ in range(self.n):
            rank, size = self.out.get(timeout=CALL_TIMEOUT)
            got[rank] = size
        return got

    def close(self) -> None:
        for q in self.ins:
            q.put(None)
        _stop(self.procs)
        for q in self.ins + [self.out]:
            q.close()
            q.join_thread()


class ZmqMethod(_Method):
    name = "zmq ipc"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        import zmq
        self.zmq = zmq
        self.dir = tempfile.mkdtemp(prefix="mpx-bench-zmq-")
        self.zctx = zmq.Context()
        self.push, self.pull, self.procs = [], [], []
        for r in range(n):
            req, rep = f"ipc://{self.dir}/req{r}", f"ipc://{self.dir}/rep{r}"
            s = self.zctx.socket(zmq.PUSH)
            s.bind(req)
            t = self.zctx.socket(zmq.PULL)
            t.bind(rep)
            self.push.append(s)
            self.pull.append(t)
            p = CTX.Process(target=_zmq_child, args=(req, rep), daemon=True)
            p.start()
            self.procs.append(p)
        self.pids = [p.pid for p in self.procs if p.pid is not None]

    def call(self, payload: Any) -> list[int]:
        zero_copy = _size(payload) >= ZMQ_ZERO_COPY_FROM
        for s in self.push:
            s.send(payload, copy=not zero_copy)
        out = []
        for t in self.pull:
            if not t.poll(int(CALL_TIMEOUT * 1000)):
                raise TimeoutError("zmq worker did not answer")
            out.append(int.from_bytes(t.recv(), "little"))
        return out

    def close(self) -> None:
        for s in self.push:
            s.send(b"")
        _stop(self.procs)
        for s in self.push + self.pull:
            s.close(linger=0)
        self.zctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


class PoolMethod(_Method):
    name = "ProcessPool"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.pool = concurrent.futures.ProcessPoolExecutor(max_workers=n, mp_context=CTX)
        # Start all n processes (the pool spawns them on demand).
        pids = {f.result(SETUP_TIMEOUT) for f in
                [self.pool.submit(_ppe_sleep, 0.3) for _ in range(n)]}
        procs = getattr(self.pool, "_processes", None) or {}
        self.pids = sorted(procs) if procs else sorted(pids)

    def call(self, payload: Any) -> list[int]:
        futs = [self.pool.submit(_ppe_take, payload) for _ in range(self.n)]
        return [f.result(CALL_TIMEOUT) for f in futs]

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _zmq_available() -> str | None:
    try:
        import zmq  # noqa: F401
    except ImportError as e:
        return f"pyzmq not importable: {e}"
    return None


METHOD_CLASSES: dict[str, Callable[[int], _Method]] = {
    "mpx": MpxMethod, "Pipe": PipeMethod, "mp.Queue": QueueMethod, "zmq ipc": ZmqMethod,
    "ProcessPool": PoolMethod,
}


# ---------------------------------------------------------------------- measuring


def make_payload(size: int) -> Any:
    try:
        import numpy as np
    except ImportError:
        return bytearray(b"\xa5") * size
    a = np.empty(size, dtype=np.uint8)
    a[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)  # pre-touched, not constant
    return a


def measure(method: _Method, payload: Any, iters: int, warm: int, budget_s: float) -> list[float]:
    """Round-trip times in seconds: ``iters`` calls, or fewer once ``budget_s`` is spent."""
    size = _size(payload)
    expect = [size] * method.n
    for _ in range(warm):
        got = method.call(payload)
        if got != expect:
            raise RuntimeError(f"{method.name}: workers answered {got}, expected {expect}")
    out: list[float] = []
    clock = time.perf_counter
    gc.disable()
    try:
        start = clock()
        for _ in range(iters):
            t0 = clock()
            method.call(payload)
            t1 = clock()
            out.append(t1 - t0)
            if t1 - start > budget_s and len(out) >= MIN_SAMPLES:
                break
    finally:
        gc.enable()
    got = method.call(payload)
    if got != expect:
        raise RuntimeError(f"{method.name}: workers answered {got}, expected {expect}")
    return out


def settle(method: _Method, seconds: float) -> None:
    payload = make_payload(SIZES[0])
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        method.call(payload)


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state not in ("Z", "X"):
                alive.append(pid)
        except (OSError, IndexError):
            pass
    return alive


def _my_segments(pids: set[int]) -> list[str]:
    out = []
    try:
        for e in os.listdir("/dev/shm"):
            parts = e.split("-")
            if e.startswith("mpx-") and len(parts) > 1 and parts[1].isdigit() \
                    and int(parts[1]) in pids:
                out.append(e)
    except OSError:
        pass
    return sorted(out)


# ---------------------------------------------------------------------- report


def human_size(n: int) -> str:
    if n >= MiB:
        return f"{n // MiB} MiB"
    if n >= KiB:
        return f"{n // KiB} KiB"
    return f"{n} B"


def _fmt_time(s: float, unit: str) -> str:
    return f"{s * 1e6:.1f}" if unit == "us" else f"{s * 1e3:.2f}"


def print_tables(results: dict, methods: list[str], skipped: dict[str, str]) -> None:
    """results[(method, n, size)] = {"median": s, "p90": s, "n": k}."""
    for n in WORKERS:
        over = (f" (oversubscribes the {len(os.sched_getaffinity(0))} cores)"
                if n > len(os.sched_getaffinity(0)) else "")
        print(f"{n} worker{'s' if n > 1 else ''}{over}: median round trip (p90)")
        hdr = ["payload"] + methods + ["mpx vs best other"]
        lines = []
        for size in SIZES:
            cells = [results.get((m, n, size)) for m in methods]
            known = [c["median"] for c in cells if c is not None]
            unit = "us" if known and min(known) < 1e-3 else "ms"
            line = [f"{human_size(size)} [{unit}]"]
            for c in cells:
                line.append("-" if c is None else
                            f"{_fmt_time(c['median'], unit)} ({_fmt_time(c['p90'], unit)})")
            mine = results.get(("mpx", n, size))
            others = [results[(m, n, size)]["median"] for m in methods
                      if m != "mpx" and (m, n, size) in results]
            if mine is not None and others:
                best = min(others)
                who = [m for m in methods if m != "mpx" and (m, n, size) in results
                       and results[(m, n, size)]["median"] == best][0]
                line.append(f"{mine['median'] / best:.2f}x {who}")
            else:
                line.append("-")
            lines.append(line)
        w = [max(len(h), *(len(li[i]) for li in lines)) for i, h in enumerate(hdr)]
        fmt = "  ".join(f"{{:<{x}}}" for x in w)
        print("  " + fmt.format(*hdr))
        print("  " + fmt.format(*("-" * x for x in w)))
        for li in lines:
            print("  " + fmt.format(*li))
        print()
    for m, why in skipped.items():
        print(f"skipped {m}: {why}")


def write_png(results: dict, methods: list[str], path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed (pip install matplotlib, or "
              f"pip install 'mpx[bench]'); --png {path} skipped")
        return
    fig, axes = plt.subplots(1, len(WORKERS), figsize=(5 * len(WORKERS), 4.5), sharey=True)
    for ax, n in zip(axes, WORKERS):
        for m in methods:
            xs = [s for s in SIZES if (m, n, s) in results]
            if not xs:
                continue
            ys = [results[(m, n, s)]["median"] * 1e6 for s in xs]
            ax.plot(xs, ys, marker="o", lw=2.5 if m == "mpx" else 1.2, label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(SIZES)
        ax.set_xticklabels([human_size(s) for s in SIZES])
        ax.set_xlabel("payload (broadcast to every worker)")
        usable = len(os.sched_getaffinity(0))
        ax.set_title(f"{n} worker{'s' if n > 1 else ''}" +
                     (f" (oversubscribes {usable} cores)" if n > usable else ""))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median round trip [us]")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


# ---------------------------------------------------------------------- entry point


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions (under a minute instead of ~4)")
    parser.add_argument("--png", metavar="PATH",
                        help="also plot latency against payload size (needs matplotlib)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")


def run(args: argparse.Namespace) -> int:
    import mpx

    plan = PLAN_QUICK if args.quick else PLAN_FULL
    methods = list(METHODS)
    skipped: dict[str, str] = {}
    why = _zmq_available()
    if why:
        methods.remove("zmq ipc")
        skipped["zmq ipc"] = why
    try:
        import numpy as np
        payload_kind = f"numpy uint8 arrays (numpy {np.__version__})"
    except ImportError:
        payload_kind = "bytearrays (numpy not installed)"
    cpus, usable = os.cpu_count(), len(os.sched_getaffinity(0))
    print(f"mpx {mpx.__version__} bench: mpx.Executor vs Pipe, mp.Queue, zmq ipc, "
          f"ProcessPoolExecutor  (python {platform.python_version()}, {platform.platform()})")
    print(f"os.cpu_count()={cpus}  len(os.sched_getaffinity(0))={usable}  start method=spawn  "
          f"ring={mpx.ring_implementation()}  mode={'quick' if args.quick else 'full'}")
    print(f"payloads: {payload_kind}; each cell: broadcast to all N workers, each answers "
          f"its size; median (p90) round trip")
    if max(WORKERS) > usable:
        print(f"note: only {usable} usable CPUs: the driver and its workers share them, and "
              f"{max(WORKERS)} workers oversubscribe the {usable} cores")
    print(flush=True)

    t_start = time.perf_counter()
    results: dict = {}
    all_pids: set[int] = {os.getpid()}
    failures: list[str] = []
    for n in WORKERS:
        for m in methods:
            t0 = time.perf_counter()
            method = None
            try:
                method = METHOD_CLASSES[m](n)
                all_pids.update(method.pids)
                settle(method, SETTLE_S[bool(args.quick)])
                for size in SIZES:
                    iters, warm, budget = plan[size]
                    payload = make_payload(size)
                    ts = measure(method, payload, iters, warm, budget)
                    del payload
                    results[(m, n, size)] = {"median": statistics.median(ts), "p90": _p90(ts),
                                             "n": len(ts)}
            except Exception as e:
                failures.append(f"{m} with {n} workers: {type(e).__name__}: {e}")
                print(f"  error: {failures[-1]}", flush=True)
            finally:
                if method is not None:
                    method.close()
            cells = ", ".join(f"{human_size(s)} {results[(m, n, s)]['median'] * 1e6:.0f} us"
                              for s in SIZES if (m, n, s) in results)
            print(f"  {m:<11} {n} worker{'s' if n > 1 else ' '}  {cells}  "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    elapsed = time.perf_counter() - t_start
    print()
    print_tables(results, methods, skipped)
    time.sleep(0.1)
    alive = _alive(sorted(all_pids - {os.getpid()}))
    segs = _my_segments(all_pids)
    print(f"cleanup: child processes alive: {alive or 'none'}; /dev/shm mpx segments left by "
          f"this run: {segs or 'none'}")
    print(f"done in {elapsed:.0f} s on {usable} CPUs" +
          (f"; {len(failures)} method(s) failed: {'; '.join(failures)}" if failures else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu_count": cpus, "affinity": usable, "quick": args.quick,
                       "elapsed_s": elapsed, "failures": failures,
                       "results": [{"method": m, "workers": n, "bytes": s, **v}
                                   for (m, n, s), v in results.items()]}, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        write_png(results, methods, args.png,
                  f"mpx bench: median round trip of a broadcast to N workers, "
                  f"{usable} usable CPUs{', quick run' if args.quick else ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpx bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
