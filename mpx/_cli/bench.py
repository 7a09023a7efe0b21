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
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from mpx._cli.benchkit import (
    CTX,
    PipePeers,
    add_arguments,
    child_pids,
    join,
    payload_size,
    print_cleanup,
    print_header,
    print_table,
    progress,
    serve,
    settle,
    start,
    stats,
    time_calls,
    usable_cpus,
    write_json,
    write_png,
)
from mpx._units import human_size

KiB = 1 << 10
MiB = 1 << 20
SIZES = [100, 64 * KiB, 1 * MiB, 64 * MiB]
WORKERS = [1, 2, 4]
METHODS = ["mpx", "Pipe", "mp.Queue", "zmq ipc", "ProcessPool"]
SETUP_TIMEOUT = 60.0
CALL_TIMEOUT = 120.0
ZMQ_ZERO_COPY_FROM = 64 * KiB

# (iterations, warm-up, time budget in seconds) per payload size; the budget stops a cell
# early on slow methods.
PLAN_FULL = {100: (5000, 100, 4.0), 64 * KiB: (2000, 50, 4.0), 1 * MiB: (500, 10, 4.0),
             64 * MiB: (15, 2, 10.0)}
PLAN_QUICK = {100: (400, 30, 0.4), 64 * KiB: (200, 10, 0.4), 1 * MiB: (40, 5, 0.5),
              64 * MiB: (3, 1, 2.0)}
# Small calls for this long after the processes start, before anything is timed: the
# first few hundred round trips after a spawn are slower (1.5x here) until the scheduler
# has spread the processes over the cores.
SETTLE_S = {False: 0.5, True: 0.2}

# ---------------------------------------------------------------------- child processes


class BenchWorker:
    """The mpx.Executor worker."""

    def __init__(self, ctx: Any = None, **kw: Any) -> None:
        pass

    def take(self, payload: Any) -> int:
        return payload_size(payload)


def _queue_child(rank: int, q_in: Any, q_out: Any) -> None:
    serve(q_in.get, lambda n: q_out.put((rank, n)), payload_size)


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
        self.peers = PipePeers(n, payload_size)
        self.pids = self.peers.pids

    def call(self, payload: Any) -> list[int]:
        return self.peers.call(payload)

    def close(self) -> None:
        self.peers.close()


class QueueMethod(_Method):
    name = "mp.Queue"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.ins = [CTX.Queue() for _ in range(n)]
        self.out = CTX.Queue()
        self.procs = [start(_queue_child, (r, self.ins[r], self.out)) for r in range(n)]
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
        for p in self.procs:
            join(p, 10)
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
            self.procs.append(start(_zmq_child, (req, rep)))
        self.pids = [p.pid for p in self.procs if p.pid is not None]

    def call(self, payload: Any) -> list[int]:
        zero_copy = payload_size(payload) >= ZMQ_ZERO_COPY_FROM
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
        for p in self.procs:
            join(p, 10)
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
        futs = [self.pool.submit(payload_size, payload) for _ in range(self.n)]
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


def _check(method: _Method, payload: Any) -> None:
    expect = [payload_size(payload)] * method.n
    got = method.call(payload)
    if got != expect:
        raise RuntimeError(f"{method.name}: workers answered {got}, expected {expect}")


def measure(method: _Method, payload: Any, iters: int, warm: int, budget_s: float) -> list[float]:
    """Round-trip times in seconds: ``iters`` calls, or fewer once ``budget_s`` is spent;
    the answers of a call before and of one after are checked."""
    _check(method, payload)
    out = time_calls(lambda: method.call(payload), iters, warm=warm, budget_s=budget_s)
    _check(method, payload)
    return out


# ---------------------------------------------------------------------- report


def _fmt_time(s: float, unit: str) -> str:
    return f"{s * 1e6:.1f}" if unit == "us" else f"{s * 1e3:.2f}"


def _workers_title(n: int, over: str) -> str:
    usable = usable_cpus()
    return (f"{n} worker{'s' if n > 1 else ''}" +
            (f" ({over} {usable} cores)" if n > usable else ""))


def print_tables(results: dict, methods: list[str], skipped: dict[str, str]) -> None:
    """results[(method, n, size)] = {"median": s, "p90": s, "n": k}."""
    for n in WORKERS:
        print(f"{_workers_title(n, 'oversubscribes the')}: median round trip (p90)")
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
        print_table(hdr, lines, indent="  ")
        print()
    for m, why in skipped.items():
        print(f"skipped {m}: {why}")


def _draw(results: dict, methods: list[str], title: str) -> Callable[[Any, Any], None]:
    """The PNG: per worker count, median round trip against payload size."""
    def draw(fig: Any, axes: Any) -> None:
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
            ax.set_title(_workers_title(n, "oversubscribes"))
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("median round trip [us]")
        axes[0].legend(fontsize=8)
        fig.suptitle(title, fontsize=9)
    return draw


# ---------------------------------------------------------------------- entry point


def run(args: argparse.Namespace) -> int:
    plan = PLAN_QUICK if args.quick else PLAN_FULL
    methods = list(METHODS)
    skipped: dict[str, str] = {}
    why = _zmq_available()
    if why:
        methods.remove("zmq ipc")
        skipped["zmq ipc"] = why
    usable = usable_cpus()
    header = print_header(
        args.quick, "bench: mpx.Executor vs Pipe, mp.Queue, zmq ipc, ProcessPoolExecutor",
        f"the driver and its workers share them, and {max(WORKERS)} workers oversubscribe "
        f"the {usable} cores", min_cpus=max(WORKERS))
    kind = "numpy uint8 arrays" if header["numpy"] != "not installed" else "bytearrays"
    print(f"payloads: {kind}; each cell: broadcast to all N workers, each answers its size; "
          f"median (p90) round trip", flush=True)
    print()

    t_start = time.perf_counter()
    results: dict = {}
    all_pids: set[int] = set()
    failures: list[str] = []
    for n in WORKERS:
        for m in methods:
            t0 = time.perf_counter()
            method = None
            try:
                method = METHOD_CLASSES[m](n)
                all_pids.update(method.pids)
                settle([functools.partial(method.call, make_payload(SIZES[0]))],
                       SETTLE_S[bool(args.quick)])
                for size in SIZES:
                    iters, warm, budget = plan[size]
                    payload = make_payload(size)
                    ts = measure(method, payload, iters, warm, budget)
                    del payload
                    s = stats(ts)
                    results[(m, n, size)] = {"median": s["median"], "p90": s["p90"],
                                             "n": s["n"]}
            except Exception as e:
                failures.append(f"{m} with {n} workers: {type(e).__name__}: {e}")
                print(f"  error: {failures[-1]}", flush=True)
            finally:
                if method is not None:
                    method.close()
            cells = ", ".join(f"{human_size(s)} {results[(m, n, s)]['median'] * 1e6:.0f} us"
                              for s in SIZES if (m, n, s) in results)
            progress(f"{m:<11} {n} worker{'s' if n > 1 else ' '}  {cells}  "
                     f"({time.perf_counter() - t0:.1f} s)")
    elapsed = time.perf_counter() - t_start
    print_tables(results, methods, skipped)
    time.sleep(0.1)
    print_cleanup(all_pids | child_pids)
    print(f"done in {elapsed:.0f} s on {usable} CPUs" +
          (f"; {len(failures)} method(s) failed: {'; '.join(failures)}" if failures else ""))
    if args.json:
        write_json(args.json, {**header, "elapsed_s": elapsed, "failures": failures,
                               "results": [{"method": m, "workers": n, "bytes": s, **v}
                                           for (m, n, s), v in results.items()]})
    if args.png:
        title = (f"mpx bench: median round trip of a broadcast to N workers, "
                 f"{usable} usable CPUs{', quick run' if args.quick else ''}")
        write_png(args.png, _draw(results, methods, title), nrows=1, ncols=len(WORKERS),
                  figsize=(5 * len(WORKERS), 4.5), sharey=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpx bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser, "fewer repetitions (under a minute instead of ~4)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
