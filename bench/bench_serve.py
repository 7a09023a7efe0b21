"""Serving: a FastAPI + uvicorn server over mpx, a ProcessPoolExecutor, Ray and no backend.

    python bench/bench_serve.py [--quick] [--out DIR] [--png P] [--json P] [--backends mpx,pool,ray,floor]

Needs fastapi, uvicorn, httptools, psutil, ray (its server is skipped without it) and matplotlib (the
PNG): ``pip install -e '.[bench]'``.

One uvicorn process per backend (its own session, on a socket on 127.0.0.1 that this process bound),
a "model" on 2 workers. ``GET /{mode}/{x}`` answers ``{"r": [3x, 3x + 1]}``, one number from each
rank, and the client checks every answer. Direct mode: the handler awaits one call of its own to both
workers. Engine mode: the handler queues its item, one engine task makes one call per step with
everything waiting, then resolves each request (one step in flight, as an LLM engine's). Backends:
mpx (``await ex.collective_rpc("step", args=(items,), non_block=True)``, default config), pool (two
single-process ProcessPoolExecutors, one a rank, ``loop.run_in_executor``), ray (two actors of a local
Ray on 127.0.0.1), floor (no workers: a step is ``await asyncio.sleep(0.001)`` and the answers are made
in place: what the HTTP stack costs alone). A step sleeps 1 ms (a device's forward pass, which leaves
the CPU free), then does ~5 us of Python per item.

The load: a keep-alive HTTP/1.1 client on asyncio streams in this process, c = 1, 16 and 64
connections each sending one request after another; ``warm`` seconds of load, then the requests
started in the next ``dur`` seconds are timed. requests/s = those requests / (the last one's
completion - the window's start); p50/p99 over them; ``/health`` asked every 100 ms on a side
connection (its slowest answer shows a frozen event loop); ``batch``: the engine's mean; ``CPU srv`` /
``CPU kids``: CPU us per request of the server process and of its descendants (the workers; for Ray
also its raylet, GCS, ...). Then the same on a loaded host, two busy loops running. Quiet and loaded
alternate, and so does the backends' order between rounds. ``--quick``: one round of 0.8 s per
measurement (~1 min); else two rounds of 2.5 s (~4 min).

Targets, on this run's ratios at c=64: engine mode requests/s, mpx >= 1.5x pool and Ray, quiet and
loaded; direct mode p99, mpx <= 1.0x pool, quiet. Teardown (also on Ctrl-C or SIGTERM): SIGTERM to each
server (uvicorn drains, the lifespan shuts its backend down), then SIGKILL to its session and to every
descendant seen. Ray sends nothing off 127.0.0.1 (kit_procs.ray_loopback_env). A benchmark, not a test: the
exit code is 0 whatever the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import kit_args
import kit_plot
import kit_procs
import kit_report

HOST = "127.0.0.1"
STEP_S = 0.001   # a step's fixed part: the device's forward pass (a sleep)
ITEM_ITERS = 50  # a step's part per item: ~5 us of Python here
CONCURRENCY, MODES, HOSTS = (1, 16, 64), ("direct", "engine"), ("quiet", "loaded")
LABEL = {"mpx": "mpx", "pool": "ProcessPool", "ray": "Ray", "floor": "floor"}
SETUP_TIMEOUT = 180.0  # a server's start (Ray takes 5-10 s here, more on a loaded host)
ERRORS = (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, RuntimeError)


def step_work(rank, items):
    """One step on one rank: the fixed part, then the part per item; 3x + rank per item."""
    time.sleep(STEP_S)
    out = []
    for x in items:
        h = x
        for _ in range(ITEM_ITERS):
            h = (h * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(3 * x + rank)
    return out


class ServeWorker:
    """mpx's worker (built with a context) and Ray's actor (with a rank)."""

    def __init__(self, ctx=None, rank=0):
        self.rank = rank if ctx is None else ctx.rank

    def step(self, items):
        return step_work(self.rank, items)


_POOL_RANK = [-1]


def _pool_init(rank):
    _POOL_RANK[0] = rank


def _pool_step(items):
    return step_work(_POOL_RANK[0], items)


# --------------------------------------------------------------------------- the server

def backend(name, tmp):
    """(call(items) -> awaitable of both ranks' answers, close())."""
    if name == "mpx":
        import mpx
        ex = mpx.Executor(ServeWorker, world_size=2)
        return lambda items: ex.collective_rpc("step", args=(items,), non_block=True), ex.shutdown
    if name == "pool":
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        pools = [ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_pool_init,
                                     initargs=(rank,)) for rank in range(2)]
        for p in pools:  # start each pool's process now, not on the first request
            p.submit(_pool_step, [0]).result(SETUP_TIMEOUT)
        return (lambda items: asyncio.gather(*(asyncio.get_running_loop().run_in_executor(
            p, _pool_step, items) for p in pools)), lambda: [p.shutdown(cancel_futures=True) for p in pools])
    if name == "ray":
        env = contextlib.ExitStack()
        env.enter_context(kit_procs.ray_loopback_env())
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray
        # ray.init puts its own SIGTERM handler (sys.exit) in place of uvicorn's, which drains first
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address=HOST, object_store_memory=80 << 20,
                 _temp_dir=os.path.join(tmp, "r"), logging_level="warning", log_to_driver=False)
        for sig, h in handlers.items():
            signal.signal(sig, h)
        actors = [ray.remote(num_cpus=1)(ServeWorker).remote(None, rank) for rank in range(2)]
        ray.get([a.step.remote([0]) for a in actors], timeout=SETUP_TIMEOUT)
        return (lambda items: asyncio.gather(*(a.step.remote(items) for a in actors)),
                lambda: (ray.shutdown(), env.close()))

    async def floor(items):
        await asyncio.sleep(STEP_S)
        return [[3 * x + rank for x in items] for rank in range(2)]
    return floor, lambda: None


def make_app(name, tmp):
    from fastapi import FastAPI
    state = {"steps": 0, "items": 0}

    async def engine(call, queue):
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            try:
                res = await call([x for x, _ in batch])
            except Exception as e:  # every request of the step gets the error
                res = e
            state["steps"] += 1
            state["items"] += len(batch)
            for i, (_, fut) in enumerate(batch):
                if not fut.done():  # (its handler may have been cancelled)
                    fut.set_exception(res) if isinstance(res, Exception) else fut.set_result(
                        [res[0][i], res[1][i]])

    @contextlib.asynccontextmanager
    async def lifespan(app):
        (state["call"], close), state["queue"] = backend(name, tmp), asyncio.Queue()
        task = asyncio.create_task(engine(state["call"], state["queue"]))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            close()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/stats")
    async def stats():
        return {"steps": state["steps"], "items": state["items"]}

    @app.get("/direct/{x}")
    async def direct(x: int):
        res = await state["call"]([x])
        return {"r": [res[0][0], res[1][0]]}

    @app.get("/engine/{x}")
    async def engine_mode(x: int):
        fut = asyncio.get_running_loop().create_future()
        state["queue"].put_nowait((x, fut))
        return {"r": await fut}

    return app


def server_main():
    """A server: ``-c 'import bench_serve; bench_serve.server_main()' BACKEND FD TMP``."""
    name, fd, tmp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with contextlib.suppress(OSError, AttributeError):  # SIGTERM when the bench dies
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)
    import uvicorn
    uvicorn.Server(uvicorn.Config(make_app(name, tmp), loop="asyncio", http="auto", lifespan="on",
                                  log_level="warning", access_log=False, timeout_graceful_shutdown=3)
                   ).run(sockets=[socket.socket(fileno=fd)])


# --------------------------------------------------------------------------- the client

class Conn:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, port):
        self.port, self.r, self.w = port, None, None

    def close(self):
        if self.w is not None:
            self.w.close()
            self.r = self.w = None

    async def get(self, path):
        """(status, body)."""
        if self.w is None:
            self.r, self.w = await asyncio.open_connection(HOST, self.port)
        self.w.write(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = await self.r.readuntil(b"\r\n\r\n")
        if (i := head.lower().find(b"content-length:")) < 0:
            raise ValueError(f"no content-length in {head[:200]!r}")
        return int(head[9:12]), await self.r.readexactly(int(head[i + 15:head.index(b"\r\n", i)]))


async def get_json(port, path, timeout):
    c = Conn(port)
    try:
        status, body = await asyncio.wait_for(c.get(path), timeout)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}")
        return json.loads(body)
    finally:
        c.close()


def pct(xs, q):
    """The q-th percentile of sorted ``xs`` (nearest rank); nan if empty."""
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))] if xs else math.nan


_ids = itertools.count(1)


async def measure(port, mode, conc, warm_s, dur_s, timeout, cpu):
    """One closed-loop load of ``conc`` connections on ``/{mode}/x`` (see the docstring); ``cpu()``:
    (the server's CPU seconds, its descendants')."""
    conns, probe = [Conn(port) for _ in range(conc)], Conn(port)
    before = await get_json(port, "/stats", timeout)
    lat, health, errors, cpu0 = [], [], {}, []
    t_meas = time.perf_counter() + warm_s
    t_end, last = t_meas + dur_s, [t_meas + dur_s]
    asyncio.get_running_loop().call_later(warm_s, lambda: cpu0.append(cpu()))

    async def client(conn):
        while (ts := time.perf_counter()) < t_end:
            x = next(_ids)
            try:
                status, body = await asyncio.wait_for(conn.get(f"/{mode}/{x}"), timeout)
                kind = (f"HTTP {status}" if status != 200 else
                        None if json.loads(body) == {"r": [3 * x, 3 * x + 1]} else "wrong answer")
            except ERRORS as e:
                kind = type(e).__name__
            if kind is None and ts >= t_meas:
                lat.append(time.perf_counter() - ts)
                last[0] = max(last[0], time.perf_counter())
            elif kind is not None:
                errors[kind] = errors.get(kind, 0) + (ts >= t_meas)
                conn.close()  # its state is unknown now
                await asyncio.sleep(0.05)

    async def health_probe():
        while (ts := time.perf_counter()) < t_end:
            try:
                await asyncio.wait_for(probe.get("/health"), timeout)
            except ERRORS:
                probe.close()
            if ts >= t_meas:
                health.append(time.perf_counter() - ts)
            await asyncio.sleep(0.1)

    try:
        await asyncio.gather(*(client(c) for c in conns), health_probe())
    finally:
        for c in conns + [probe]:
            c.close()
    cpu1, after = cpu(), await get_json(port, "/stats", timeout)
    steps, n = after["steps"] - before["steps"], len(lat)
    per_req = [(b - a) / n * 1e6 for a, b in zip(cpu0[0], cpu1)] if n and cpu0 else [None, None]
    return {"n": n, "rps": n / (last[0] - t_meas) if n else 0.0, "lat": sorted(lat), "errors": errors,
            "health_max_ms": max(health) * 1e3 if health else None,
            "batch": (after["items"] - before["items"]) / steps if steps else None,
            "server_cpu_us": per_req[0], "children_cpu_us": per_req[1]}


# --------------------------------------------------------------------------- the servers

class Servers:
    """The servers this run started, and every descendant of theirs seen."""

    def __init__(self):
        self.tmp = tempfile.mkdtemp(prefix="mpxserve-", dir="/tmp")  # short: Ray's AF_UNIX paths
        self.procs, self.seen = {}, {}

    def start(self, name):
        sock = socket.socket()
        sock.bind((HOST, 0))
        sock.listen(2048)
        os.mkdir(tmp := os.path.join(self.tmp, name))
        path = [kit_procs.BENCH, kit_procs.ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        with open(os.path.join(self.tmp, f"{name}.log"), "w") as log:
            self.procs[name] = (subprocess.Popen(
                [sys.executable, "-c", "import bench_serve; bench_serve.server_main()", name,
                 str(sock.fileno()), tmp], pass_fds=[sock.fileno()], env=env, cwd=tmp, stdout=log,
                stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True),
                sock.getsockname()[1])
        sock.close()

    def log_tail(self, name, n=15):
        with open(os.path.join(self.tmp, f"{name}.log")) as f:
            return "".join(f.readlines()[-n:])

    def cpu(self, name):
        """(CPU seconds of the server's process, of its descendants now running)."""
        import psutil
        try:
            p = psutil.Process(self.procs[name][0].pid)
            own, total = sum(p.cpu_times()[:2]), 0.0
            for k in p.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += sum(k.cpu_times()[:2])
                    self.seen.setdefault(k.pid, k)
            return own, total
        except psutil.Error:
            return 0.0, 0.0

    async def ready(self, name):
        proc, port = self.procs[name]
        end = time.monotonic() + SETUP_TIMEOUT
        while proc.poll() is None and time.monotonic() < end:
            with contextlib.suppress(*ERRORS):
                await get_json(port, "/health", 2.0)
                return self.cpu(name)  # (notes its descendants)
            await asyncio.sleep(0.2)
        raise RuntimeError(f"not up (exit code {proc.poll()}):\n{self.log_tail(name)}")

    def teardown(self):
        """Stop everything, whatever state it is in; Ctrl-C is ignored meanwhile."""
        import psutil
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for name, (proc, _) in self.procs.items():
                self.cpu(name)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # uvicorn drains; the lifespan shuts down
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(20)
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)  # whatever is still in its session
                proc.wait()
            time.sleep(1)
            for p in self.seen.values():
                with contextlib.suppress(psutil.Error):
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        print(f"  warning: {p.pid} still alive: SIGKILL", flush=True)
                        p.kill()
        finally:
            signal.signal(signal.SIGINT, old)
            shutil.rmtree(self.tmp, ignore_errors=True)


async def run(quick, servers, backends, live, results, notes):
    rounds, warm_s, dur_s, timeout = (1, 0.3, 0.8, 10.0) if quick else (2, 0.5, 2.5, 15.0)
    kit_report.progress(f"starting the servers: {', '.join(LABEL[b] for b in backends)}")
    for b in backends:
        servers.start(b)
    for b in backends:
        try:
            await servers.ready(b)
            live.append(b)
        except RuntimeError as e:
            notes.append(f"{LABEL[b]}: no server ({e})")
    for rnd, host in itertools.product(range(rounds), HOSTS):
        with kit_procs.busy_loops(2 if host == "loaded" else 0):
            for b in live if rnd % 2 == 0 else live[::-1]:
                proc, port = servers.procs[b]
                for mode, c in itertools.product(MODES, CONCURRENCY):
                    if proc.poll() is not None:
                        notes.append(f"{LABEL[b]}: died ({proc.returncode}):\n{servers.log_tail(b)}")
                        break
                    kit_report.progress(f"round {rnd + 1}/{rounds} {host} {LABEL[b]} {mode} c={c}")
                    try:
                        r = await measure(port, mode, c, warm_s, dur_s, timeout, lambda b=b: servers.cpu(b))
                    except ERRORS as e:
                        r = {"failed": f"{type(e).__name__}: {e}"}
                    results.setdefault((host, mode, c, b), []).append(r)


def combine(rs):
    """One cell from its rounds: requests/s the mean (and range) of the rounds', latency percentiles
    over every round's requests, errors summed."""
    ok, errors = [r for r in rs if "failed" not in r and r["n"]], {}
    for r in rs:
        for k, v in r.get("errors", {r.get("failed"): 1}).items():
            errors[k] = errors.get(k, 0) + v
    if not ok:
        return {"rps": None, "errors": errors}
    lat = sorted(x for r in ok for x in r["lat"])

    def mean(k):
        xs = [r[k] for r in ok if r[k] is not None]
        return statistics.mean(xs) if xs else None
    return {"rps": mean("rps"), "rps_range": (min(r["rps"] for r in ok), max(r["rps"] for r in ok)),
            "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "n": len(lat), "batch": mean("batch"),
            "health_max_ms": max((r["health_max_ms"] or 0) for r in ok), "errors": errors,
            "server_cpu_us": mean("server_cpu_us"), "children_cpu_us": mean("children_cpu_us")}


def _f(v, fmt="{:.0f}"):
    return "-" if v is None or v != v else fmt.format(v)


# (host, mode, metric, baseline, target): mpx's figure at c=64 over the baseline's
RATIOS = [("quiet", "engine", "rps", "pool", 1.5), ("quiet", "engine", "rps", "ray", 1.5),
          ("loaded", "engine", "rps", "pool", 1.5), ("loaded", "engine", "rps", "ray", 1.5),
          ("quiet", "engine", "rps", "floor", None), ("quiet", "direct", "p99_ms", "pool", 1.0),
          ("loaded", "direct", "p99_ms", "pool", None), ("quiet", "direct", "p99_ms", "ray", None)]


def report(cells, backends, interrupted):
    """Print every cell and the ratios; return the ratios' rows."""
    print("\nrequests/s: mean of the rounds (range); p50/p99 ms over every round's requests; batch: the "
          "engine's mean; /health max ms; CPU srv / CPU kids: CPU us per request of the server process / "
          "of its descendants")
    lines = []
    for key in itertools.product(HOSTS, MODES, CONCURRENCY, backends):
        if (cell := cells.get(key)) is None:
            continue
        lo, hi = cell.get("rps_range", (0, 0))
        lines.append((*key[:2], str(key[2]), LABEL[key[3]], _f(cell["rps"]) + (
            f" ({lo:.0f}-{hi:.0f})" if lo != hi else ""), *(_f(cell.get(k), "{:.2f}") for k in (
                "p50_ms", "p99_ms")), _f(cell.get("batch"), "{:.1f}"),
            *(_f(cell.get(k)) for k in ("health_max_ms", "server_cpu_us", "children_cpu_us")),
            str(sum(cell["errors"].values()))))
    kit_report.print_table(("host", "mode", "c", "backend", "requests/s", "p50 ms", "p99 ms", "batch",
                            "/health max", "CPU srv", "CPU kids", "errors"), lines)
    rows = []
    for host, mode, metric, base, target in RATIOS:
        if base in backends and "mpx" in backends:
            m, o = (cells.get((host, mode, 64, x), {}).get(metric) for x in ("mpx", base))
            r, up = m / o if m and o and m == m and o == o else None, metric == "rps"
            if target is None or r is None:
                res = "info" if target is None else "skipped (interrupted)" if interrupted else "FAIL (none)"
            else:
                res = "PASS" if (r >= target if up else r <= target) else "FAIL"
            rows.append({"name": f"{mode} c=64 {'requests/s' if up else 'p99'}, {host}: mpx / {LABEL[base]}",
                         "ratio": r, "result": res,
                         "target": "-" if target is None else f"{'>=' if up else '<='} {target}x"})
    print()
    kit_report.print_table(("ratio (same run)", "value", "target", "result"),
                           [(r["name"], _f(r["ratio"], "{:.2f}x"), r["target"], r["result"]) for r in rows])
    return rows


def draw(cells, backends, header):
    """Per host: requests/s and p99 against concurrency, each backend in both modes."""
    def fill(fig, axes):
        for (i, host), (j, metric) in itertools.product(enumerate(HOSTS), enumerate(("rps", "p99_ms"))):
            ax = axes[i][j]
            for (k, b), (mode, style) in itertools.product(enumerate(backends), zip(MODES, ("o--", "s-"))):
                if pts := [(c, v[metric]) for c in CONCURRENCY
                           if (v := cells.get((host, mode, c, b))) and v["rps"]]:
                    ax.plot(*zip(*pts), style, color=f"C{k}", label=f"{LABEL[b]} {mode}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(CONCURRENCY, [str(c) for c in CONCURRENCY])
            ax.set_yscale("log" if j else "linear")
            ax.set(xlabel="concurrency (connections)", ylabel="requests/s" if j == 0 else "p99 latency, ms",
                   title=f"{host} host")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"FastAPI + uvicorn over 2 workers (step: {STEP_S * 1e3:g} ms + "
                     f"{header['per_item_us']:.1f} us per item); {header['affinity']} CPUs, "
                     f"{'quick' if header['quick'] else 'full'} run")
    return fill


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main():
    args = kit_args.parse_args(__doc__, "a short run (~1 min): one round of 0.8 s per measurement",
                               lambda ap: (
                                   ap.add_argument("--out", metavar="DIR",
                                                   help="write the PNG (bench_serve.png) here"),
                                   ap.add_argument("--backends", default="mpx,pool,ray,floor",
                                                   help="which servers (default all)")))
    if missing := [p for p in ("fastapi", "uvicorn", "psutil") if kit_report.version(p) == "not installed"]:
        return print(f"{', '.join(missing)} not installed: pip install -e '.[bench]'")
    backends, notes = [b for b in args.backends.split(",") if b], []
    if "ray" in backends and kit_report.version("ray") == "not installed":
        backends.remove("ray")
        notes.append("Ray is not installed (pip install ray): its server is skipped")
    header = kit_report.print_header(
        args.quick, "serving benchmark (FastAPI + uvicorn, 2 workers)", "the server, the load client, "
        "2 workers (and on the loaded host 2 busy loops) share them",
        **{p: kit_report.version(p) for p in ("fastapi", "uvicorn", "httptools", "ray")})
    t = time.perf_counter()
    step_work(0, list(range(2000)))
    header["per_item_us"] = (time.perf_counter() - t - STEP_S) / 2000 * 1e6
    print(f"step: sleep {STEP_S * 1e3:g} ms, then {header['per_item_us']:.1f} us of Python per item; "
          f"concurrency {CONCURRENCY}\n", flush=True)
    servers, results, live, interrupted = Servers(), {}, [], False
    old_term = signal.signal(signal.SIGTERM, _sigterm)
    try:
        asyncio.run(run(args.quick, servers, backends, live, results, notes))
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: tearing down", flush=True)
    finally:
        kit_report.progress("tearing down")
        servers.teardown()
        signal.signal(signal.SIGTERM, old_term)
    cells = {k: combine(v) for k, v in results.items()}
    rows = report(cells, live, interrupted) if cells else []
    print("".join(f"  * {n}\n" for n in notes))
    left, segments = kit_report.print_cleanup(servers.seen)
    failed = [r["name"] for r in rows if r["result"] not in ("info", "PASS")]
    judged = [r for r in rows if r["result"] != "info"]
    print(f"SUMMARY: {len(judged) - len(failed)}/{len(judged)} targets met" + (
        f"; FAIL: {', '.join(failed)}" if failed else "") + (" (interrupted)" if interrupted else "")
        + f"  ({header['affinity']} CPUs; load average now {os.getloadavg()[0]:.2f})")
    if args.json:
        kit_report.write_json(args.json, {"header": header, "targets": rows, "notes": notes, "cells": [
            {"host": k[0], "mode": k[1], "c": k[2], "backend": k[3], **v} for k, v in cells.items()],
            "leftover_segments": segments, "alive_children": left})
    for p in (args.png, args.out and os.path.join(args.out, "bench_serve.png")):
        if p and cells:
            kit_plot.write_png(p, draw(cells, live, header), nrows=2, ncols=2, figsize=(11, 8))


if __name__ == "__main__":
    main()
