"""Serving benchmark: a FastAPI + uvicorn server over mpx, a ProcessPoolExecutor and Ray.

    python bench/bench_serve.py [--quick] [--out DIR] [--png PATH] [--json PATH]
                                [--backends mpx,pool,ray,floor]

Needs fastapi, uvicorn, httptools (uvicorn's fast HTTP parser; without it uvicorn falls
back to the pure-Python h11 and the HTTP stack's share of each request grows), psutil, ray
(the Ray server is skipped without it) and matplotlib (for the PNG): all in ``pip install
-e '.[bench]'``.

The server. One uvicorn process per backend (started here, in its own session, serving on
a listening socket on 127.0.0.1 that this process bound to a free port and hands over),
FastAPI app on asyncio's event loop, a "model" on 2 workers (ranks 0 and 1). Each request
``GET /{mode}/{x}`` is answered with ``{"r": [3x, 3x + 1]}``, one number from each rank, and
the client checks every answer. Two modes, both in every server:

- direct: the handler awaits one call to both workers with its one item;
- engine: the handler puts its item in a queue and awaits its own future; one engine task
  takes everything waiting, makes one call to both workers with the whole batch, resolves
  each request's future and starts again (one step in flight, like an LLM engine's step).

The backends, each a call to both ranks, awaited on the event loop:

- mpx: ``await ex.collective_rpc("step", args=(items,), non_block=True)``, ``mpx.Executor``
  with 2 workers and the default config;
- ProcessPool: two single-process ``concurrent.futures.ProcessPoolExecutor`` (spawn), one
  per rank, ``asyncio.gather`` of ``loop.run_in_executor(pool, step, items)`` on both;
- Ray: two actors (1 CPU each) of a local Ray on 127.0.0.1 (``ray.init(num_cpus=2,
  include_dashboard=False, _node_ip_address="127.0.0.1")``), ``asyncio.gather`` of
  ``actor.step.remote(items)``;
- floor (informational): no workers, a step is ``await asyncio.sleep(0.001)`` and the
  answers are made in place: what the HTTP stack and the app cost by themselves, the most
  any backend's server could reach.

The work, the same function in every backend: a step sleeps 1 ms (the device's forward
pass, which leaves the CPU to the rest, as a GPU would), then does a fixed 4-6 us of Python
per item (the per-request bookkeeping and sampling of a step), and returns one number per
item. So at concurrency 1 a request is bound by the 1 ms step and the backend's round trip;
at 64, direct mode queues 64 one-item calls per rank (the workers run them one after
another: what counts is how the backend and the event loop carry the calls in flight),
while engine mode makes one call per step for the whole batch (what counts is the CPU a
call costs the server, which shares 2 cores with the client and the workers).

The load. A minimal HTTP/1.1 keep-alive client on asyncio streams in this process (its own
CPU cost per request is a fraction of the server's, which matters on 2 cores), ``c``
connections each sending one request after another (closed loop) at c = 1, 16 and 64:
``warm`` seconds of load first, then the requests started in the next ``dur`` seconds are
timed, to their completion. requests/s = those requests / (the last one's completion - the
window's start); p50/p99 latency over them. Every request has a timeout; a timeout, an error
or a wrong answer is counted, never timed. A side connection asks ``/health`` every 100 ms:
its slowest answer shows a frozen event loop. ``batch`` is the engine's mean batch size.
``CPU srv`` and ``CPU kids``: the CPU time per timed request of the server process (all its
threads: HTTP, the app, the backend's driver side) and of its descendants (the workers; for
Ray also its raylet, GCS and agents), from psutil: they tell the backend's cost from the
HTTP stack's, which is the same in every server.
The same again on a loaded host: two busy-loop processes (``while True: pass``) run during
those measurements. The three servers run all along (an idle Ray costs a few percent of a
core); quiet and loaded alternate, and the backends' order alternates between rounds, so
the VM's drift hits all of them.

Targets (issue 27), judged on this run's ratios; informational rows have no target:

- engine mode, c=64, requests/s: mpx >= 1.5x ProcessPool and >= 1.5x Ray, on the quiet and
  on the loaded host;
- direct mode, c=64, p99 latency: mpx <= 1.0x ProcessPool (quiet host).

Teardown: each server is sent SIGTERM (uvicorn drains, the app's lifespan shuts its backend
down), then SIGKILL for its process group and every descendant seen; the busy loops are
killed; the run's temporary directories removed. The cleanup line lists any child still
alive and any /dev/shm ``mpx-*`` segment of the run left behind. Ctrl-C (or SIGTERM) at any
point tears down the same way; a server and a busy loop also get SIGTERM (SIGKILL) if this
process dies. Ray: its usage reporting is off (RAY_USAGE_STATS_ENABLED=0), and its API
server's cloud-provider probe (an HTTP request to 169.254.169.254 made by every
``ray.init`` even then) is answered from a cluster config in a temporary HOME, so that no
traffic leaves 127.0.0.1.

It is a benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.metadata
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

from _report import parse_args

from mpx._cli.benchkit import (
    print_cleanup,
    print_header,
    print_table,
    progress,
    ray_loopback_env,
)

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
HOST = "127.0.0.1"

STEP_S = 0.001          # a step's fixed part: the device's forward pass (sleep)
ITEM_ITERS = 50         # a step's part per item: 4-6 us of Python on this VM
CONCURRENCY = (1, 16, 64)
MODES = ("direct", "engine")
BACKENDS = ("mpx", "pool", "ray", "floor")
LABEL = {"mpx": "mpx", "pool": "ProcessPool", "ray": "Ray", "floor": "floor"}
SETUP_TIMEOUT = 180.0   # a server's start (Ray takes 5-10 s here, more on a loaded host)
SHUTDOWN_S = 20.0       # SIGTERM to SIGKILL (Ray's shutdown takes ~2 s)
HEALTH_EVERY_S = 0.1
RAY_OBJECT_STORE = 80 << 20  # Ray's minimum: nothing goes through its object store

PR_SET_PDEATHSIG = 1


# --------------------------------------------------------------------------- the work

def step_work(rank: int, items: list) -> list:
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
    """mpx's worker."""

    def __init__(self, ctx):
        self.rank = ctx.rank

    def step(self, items):
        return step_work(self.rank, items)


class RayServeWorker:
    """Ray's actor (decorated with ray.remote in the server)."""

    def __init__(self, rank):
        self.rank = rank

    def step(self, items):
        return step_work(self.rank, items)


_POOL_RANK = -1


def _pool_init(rank):
    global _POOL_RANK
    _POOL_RANK = rank


def _pool_step(items):
    return step_work(_POOL_RANK, items)


# --------------------------------------------------------------------------- the backends
# (in the server process)

class MpxBackend:
    def __init__(self, tmp):
        import mpx
        self.ex = mpx.Executor(ServeWorker, world_size=2)

    async def call(self, items):
        return await self.ex.collective_rpc("step", args=(items,), non_block=True)

    def close(self):
        self.ex.shutdown()


class PoolBackend:
    def __init__(self, tmp):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        ctx = mp.get_context("spawn")
        self.pools = [ProcessPoolExecutor(1, mp_context=ctx, initializer=_pool_init,
                                          initargs=(rank,)) for rank in range(2)]
        for p in self.pools:  # start each pool's process now, not on the first request
            p.submit(_pool_step, [0]).result(SETUP_TIMEOUT)

    async def call(self, items):
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(p, _pool_step, items)
                                      for p in self.pools))

    def close(self):
        for p in self.pools:
            p.shutdown(wait=True, cancel_futures=True)


class RayBackend:
    def __init__(self, tmp):
        # (Ray's head asks the cloud's metadata address which cloud it runs on, unless...:
        # see ray_loopback_env, which keeps every byte on 127.0.0.1)
        self.env = contextlib.ExitStack()
        self.env.enter_context(ray_loopback_env())
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray
        self.ray = ray
        # ray.init puts its own SIGTERM handler (sys.exit) in place of uvicorn's, which
        # drains the server first: keep uvicorn's
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address=HOST,
                 object_store_memory=RAY_OBJECT_STORE, _temp_dir=os.path.join(tmp, "r"),
                 logging_level="warning", log_to_driver=False)
        for sig, h in handlers.items():
            signal.signal(sig, h)
        cls = ray.remote(num_cpus=1)(RayServeWorker)
        self.actors = [cls.remote(rank) for rank in range(2)]
        ray.get([a.step.remote([0]) for a in self.actors], timeout=SETUP_TIMEOUT)

    async def call(self, items):
        return await asyncio.gather(*(a.step.remote(items) for a in self.actors))

    def close(self):
        for a in self.actors:
            self.ray.kill(a)
        self.ray.shutdown()
        self.env.close()


class FloorBackend:
    """No workers: a step is a 1 ms sleep on the event loop and the answers are made in
    place. What the server costs without any backend, the floor the others stand on."""

    def __init__(self, tmp):
        pass

    async def call(self, items):
        await asyncio.sleep(STEP_S)
        return [[3 * x + rank for x in items] for rank in range(2)]

    def close(self):
        pass


BACKEND_CLS = {"mpx": MpxBackend, "pool": PoolBackend, "ray": RayBackend,
               "floor": FloorBackend}


# --------------------------------------------------------------------------- the server

def _die_with_parent(parent: int, sig: int) -> None:
    """Get ``sig`` when the process that started this one dies (Linux); exit if it did."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def make_app(backend_name: str, tmp: str):
    from fastapi import FastAPI

    state: dict = {"steps": 0, "items": 0}

    async def engine(backend, queue: asyncio.Queue):
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            try:
                res = await backend.call([x for x, _ in batch])
            except Exception as e:  # every request of the step gets the error
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            state["steps"] += 1
            state["items"] += len(batch)
            for i, (_, fut) in enumerate(batch):
                if not fut.done():  # (its handler may have been cancelled)
                    fut.set_result([res[0][i], res[1][i]])

    @contextlib.asynccontextmanager
    async def lifespan(app):
        backend = BACKEND_CLS[backend_name](tmp)
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(engine(backend, queue))
        state["backend"], state["queue"] = backend, queue
        print(f"server {backend_name}: ready", file=sys.stderr, flush=True)
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            backend.close()
            print(f"server {backend_name}: backend shut down", file=sys.stderr, flush=True)

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/stats")
    async def stats():
        return {"steps": state["steps"], "items": state["items"]}

    @app.get("/direct/{x}")
    async def direct(x: int):
        res = await state["backend"].call([x])
        return {"r": [res[0][0], res[1][0]]}

    @app.get("/engine/{x}")
    async def engine_mode(x: int):
        fut = asyncio.get_running_loop().create_future()
        state["queue"].put_nowait((x, fut))
        return {"r": await fut}

    return app


def server_main() -> None:
    """The server process: ``-c 'import bench_serve; bench_serve.server_main()' BACKEND FD
    PARENT_PID TMPDIR``."""
    backend_name, fd, parent, tmp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    _die_with_parent(parent, signal.SIGTERM)
    import uvicorn
    sock = socket.socket(fileno=fd)
    config = uvicorn.Config(make_app(backend_name, tmp), loop="asyncio", http="auto",
                            lifespan="on", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])


# --------------------------------------------------------------------------- the client

class Conn:
    """One keep-alive HTTP/1.1 connection: ``get(path)`` -> (status, body)."""

    def __init__(self, port: int):
        self.port = port
        self.r = self.w = None

    async def open(self):
        self.r, self.w = await asyncio.open_connection(HOST, self.port)

    def close(self):
        if self.w is not None:
            self.w.close()
            self.r = self.w = None

    async def reopen(self):
        self.close()
        with contextlib.suppress(OSError):
            await self.open()

    async def get(self, path: str):
        if self.w is None:
            await self.open()
        self.w.write(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = await self.r.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        i = head.lower().find(b"content-length:")
        if i < 0:
            raise ValueError(f"no content-length in {head[:200]!r}")
        n = int(head[i + 15:head.index(b"\r\n", i)])
        return status, await self.r.readexactly(n)


async def get_json(port: int, path: str, timeout: float):
    c = Conn(port)
    try:
        status, body = await asyncio.wait_for(c.get(path), timeout)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {body[:200]!r}")
        return json.loads(body)
    finally:
        c.close()


_ids = itertools.count(1)


async def measure(port: int, mode: str, conc: int, warm_s: float, dur_s: float,
                  req_timeout: float, cpu=None) -> dict:
    """One closed-loop load of ``conc`` connections on ``/{mode}/x``; see the docstring.
    ``cpu()``: (the server's CPU seconds, its descendants'), read as the timed window opens
    and once every request is done."""
    conns = [Conn(port) for _ in range(conc)]
    await asyncio.gather(*(c.open() for c in conns))
    probe = Conn(port)
    before = await get_json(port, "/stats", req_timeout)
    lat: list[float] = []
    errors: dict[str, int] = {}
    health: list[float] = []
    t0 = time.perf_counter()
    t_meas, t_end = t0 + warm_s, t0 + warm_s + dur_s
    last = [t_end]
    cpu0: list = []
    if cpu is not None:
        asyncio.get_running_loop().call_later(warm_s, lambda: cpu0.append(cpu()))

    def error(kind):
        errors[kind] = errors.get(kind, 0) + 1

    async def client(conn: Conn):
        while True:
            ts = time.perf_counter()
            if ts >= t_end:
                return
            x = next(_ids)
            try:
                status, body = await asyncio.wait_for(conn.get(f"/{mode}/{x}"), req_timeout)
                ok = status == 200 and json.loads(body) == {"r": [3 * x, 3 * x + 1]}
                kind = None if ok else f"HTTP {status}" if status != 200 else "wrong answer"
            except asyncio.TimeoutError:
                kind = f"timeout ({req_timeout:.0f} s)"
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                kind = type(e).__name__
            te = time.perf_counter()
            if kind is None:
                if ts >= t_meas:
                    lat.append(te - ts)
                    last[0] = max(last[0], te)
            else:
                if ts >= t_meas:
                    error(kind)
                await conn.reopen()  # the connection's state is unknown now
                await asyncio.sleep(0.05)

    async def health_probe():
        while time.perf_counter() < t_end:
            ts = time.perf_counter()
            try:
                await asyncio.wait_for(probe.get("/health"), req_timeout)
            except (asyncio.TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
                await probe.reopen()
            if ts >= t_meas:
                health.append(time.perf_counter() - ts)
            await asyncio.sleep(HEALTH_EVERY_S)

    try:
        await asyncio.gather(*(client(c) for c in conns), health_probe())
    finally:
        for c in conns + [probe]:
            c.close()
    cpu1 = cpu() if cpu is not None else None
    after = await get_json(port, "/stats", req_timeout)
    steps = after["steps"] - before["steps"]
    per_req = [None, None]
    if cpu0 and cpu1 and lat:
        per_req = [(b - a) / len(lat) * 1e6 for a, b in zip(cpu0[0], cpu1)]
    lat.sort()
    return {
        "n": len(lat), "seconds": last[0] - t_meas,
        "rps": len(lat) / (last[0] - t_meas) if lat else 0.0,
        "p50_ms": _pct(lat, 50) * 1e3, "p99_ms": _pct(lat, 99) * 1e3,
        "health_max_ms": max(health) * 1e3 if health else None,
        "batch": (after["items"] - before["items"]) / steps if steps else None,
        "server_cpu_us": per_req[0], "children_cpu_us": per_req[1],
        "errors": errors, "lat": lat,
    }


def _pct(xs: list, q: float) -> float:
    """The q-th percentile of sorted ``xs`` (nearest rank); nan if empty."""
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


# --------------------------------------------------------------------------- processes

TMP_PREFIX = "mpxserve-"


def _reap_tmp() -> None:
    """Remove the temporary directories of earlier runs whose process is gone."""
    for e in os.listdir("/tmp"):
        if e.startswith(TMP_PREFIX):
            try:
                pid = int(e[len(TMP_PREFIX):].split("-")[0])
            except ValueError:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join("/tmp", e), ignore_errors=True)
            except PermissionError:
                pass


class Children:
    """Every process this run started (servers, busy loops) and what they started."""

    def __init__(self):
        self.servers: dict[str, dict] = {}
        self.busy: list[subprocess.Popen] = []
        self.pids: dict[int, float] = {}  # pid: its start time
        # short: Ray's socket paths under it must fit AF_UNIX's 107 bytes; named after this
        # process, so that a later run removes it if this one was SIGKILLed
        _reap_tmp()
        self.tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir="/tmp")

    def start_server(self, name: str) -> dict:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((HOST, 0))
        sock.listen(2048)
        port = sock.getsockname()[1]
        tmp = os.path.join(self.tmp, name)
        os.mkdir(tmp)
        log = open(os.path.join(self.tmp, f"{name}.log"), "w+")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [BENCH, ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        proc = subprocess.Popen(
            [sys.executable, "-c", "import bench_serve; bench_serve.server_main()", name,
             str(sock.fileno()), str(os.getpid()), tmp],
            pass_fds=[sock.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp)
        sock.close()
        self.note(proc.pid)
        s = {"name": name, "proc": proc, "port": port, "log": log, "tmp": tmp}
        self.servers[name] = s
        return s

    def log_tail(self, s: dict, n: int = 30) -> str:
        s["log"].flush()
        with open(s["log"].name) as f:
            return "".join(f.readlines()[-n:])

    def note(self, pid: int):
        import psutil
        with contextlib.suppress(psutil.Error):
            self.pids.setdefault(pid, psutil.Process(pid).create_time())

    def cpu(self, s: dict) -> tuple[float, float]:
        """(CPU seconds of server ``s``'s process, of its descendants now running)."""
        import psutil
        try:
            p = psutil.Process(s["proc"].pid)
            own = sum(p.cpu_times()[:2])
            kids = p.children(recursive=True)
        except psutil.Error:
            return (0.0, 0.0)
        total = 0.0
        for k in kids:
            with contextlib.suppress(psutil.Error):
                total += sum(k.cpu_times()[:2])
        return (own, total)

    def note_descendants(self):
        import psutil
        for s in self.servers.values():
            with contextlib.suppress(psutil.Error):
                for c in psutil.Process(s["proc"].pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        self.pids.setdefault(c.pid, c.create_time())

    def start_busy(self, n=2):
        code = ("import ctypes, os, signal, sys; "
                f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, signal.SIGKILL, 0, 0, 0); "
                f"os.getppid() == {os.getpid()} or sys.exit(1)\n"
                "while True: pass")
        for _ in range(n):
            p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                                 stdin=subprocess.DEVNULL)
            self.note(p.pid)
            self.busy.append(p)

    def stop_busy(self):
        for p in self.busy:
            with contextlib.suppress(OSError):
                p.kill()
        for p in self.busy:
            p.wait()
        self.busy.clear()

    def stop_server(self, s: dict):
        proc = s["proc"]
        self.note_descendants()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # uvicorn drains; the lifespan shuts down
            try:
                proc.wait(SHUTDOWN_S)
            except subprocess.TimeoutExpired:
                print(f"  warning: server {s['name']} did not exit {SHUTDOWN_S:.0f} s after "
                      "SIGTERM: SIGKILL", flush=True)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)  # its session: whatever is still in it
        proc.wait()
        s["log"].close()

    def teardown(self):
        """Stop everything, whatever state it is in; a second Ctrl-C is ignored meanwhile."""
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.stop_busy()
            for s in list(self.servers.values()):
                self.stop_server(s)
            # a descendant that left the servers' sessions: a moment to go by itself, then
            # SIGKILL
            deadline = time.monotonic() + 3
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            for pid, p in self.alive():
                print(f"  warning: {pid} ({' '.join(p.cmdline())[:80]}) still alive: SIGKILL",
                      flush=True)
                with contextlib.suppress(Exception):
                    p.kill()
                    p.wait(5)
        finally:
            signal.signal(signal.SIGINT, old)

    def alive(self) -> list:
        """[(pid, psutil.Process)] of the run's processes still running (same pid, same
        start time: not a later process that got the pid; not a zombie)."""
        import psutil
        out = []
        for pid, created in sorted(self.pids.items()):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append((pid, p))
        return out


async def wait_ready(kids: Children, s: dict, timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        if s["proc"].poll() is not None:
            raise RuntimeError(f"server {s['name']} exited with {s['proc'].returncode}:\n"
                               + kids.log_tail(s))
        try:
            await get_json(s["port"], "/health", 2.0)
            return
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, RuntimeError):
            if time.monotonic() > end:
                raise RuntimeError(f"server {s['name']} not ready after {timeout:.0f} s:\n"
                                   + kids.log_tail(s)) from None
            await asyncio.sleep(0.2)


# --------------------------------------------------------------------------- the run

async def run(args, kids: Children, backends: list, live: list, results: dict,
              notes: list) -> None:
    rounds, warm_s, dur_s, req_timeout = ((1, 0.3, 0.8, 10.0) if args.quick else
                                          (2, 0.5, 2.5, 15.0))
    progress(f"starting the servers: {', '.join(LABEL[b] for b in backends)}")
    for b in backends:
        kids.start_server(b)
    for b in backends:
        s = kids.servers[b]
        try:
            await wait_ready(kids, s, SETUP_TIMEOUT)
            live.append(b)
        except RuntimeError as e:
            notes.append(f"{LABEL[b]}: no server ({str(e).splitlines()[0]})")
            print(f"  warning: {e}", flush=True)
    kids.note_descendants()
    progress("servers ready")
    for rnd in range(rounds):
        for host in ("quiet", "loaded"):
            if host == "loaded":
                kids.start_busy(2)
            try:
                order = live if rnd % 2 == 0 else live[::-1]
                for b in order:
                    s = kids.servers[b]
                    for mode in MODES:
                        for c in CONCURRENCY:
                            if s["proc"].poll() is not None:
                                continue
                            progress(f"round {rnd + 1}/{rounds} {host} {LABEL[b]} {mode} c={c}")
                            try:
                                r = await measure(s["port"], mode, c, warm_s, dur_s,
                                                  req_timeout, cpu=lambda s=s: kids.cpu(s))
                            except (OSError, RuntimeError, asyncio.TimeoutError,
                                    asyncio.IncompleteReadError, ValueError) as e:
                                r = {"failed": f"{type(e).__name__}: {e}"}
                            results.setdefault((host, mode, c, b), []).append(r)
                            kids.note_descendants()
                            if r.get("errors"):
                                progress(f"  errors: {r['errors']}")
                            if s["proc"].poll() is not None:
                                notes.append(f"{LABEL[b]}: the server died (exit "
                                             f"{s['proc'].returncode}) during {host} {mode} "
                                             f"c={c}:\n" + kids.log_tail(s, 15))
            finally:
                if host == "loaded":
                    kids.stop_busy()


def combine(rs: list) -> dict | None:
    """One cell from its rounds: requests/s the mean (and range) of the rounds', latency
    percentiles over every round's requests, errors summed."""
    ok = [r for r in rs if "failed" not in r and r["n"]]
    errors: dict = {}
    for r in rs:
        for k, v in r.get("errors", {}).items():
            errors[k] = errors.get(k, 0) + v
        if "failed" in r:
            errors[r["failed"]] = errors.get(r["failed"], 0) + 1
    if not ok:
        return {"rps": None, "errors": errors}
    lat = sorted(x for r in ok for x in r["lat"])
    batches = [r["batch"] for r in ok if r["batch"] is not None]
    health = [r["health_max_ms"] for r in ok if r["health_max_ms"] is not None]

    def mean(k):
        xs = [r[k] for r in ok if r.get(k) is not None]
        return statistics.mean(xs) if xs else None

    return {"rps": statistics.mean(r["rps"] for r in ok),
            "rps_range": (min(r["rps"] for r in ok), max(r["rps"] for r in ok)),
            "p50_ms": _pct(lat, 50) * 1e3, "p99_ms": _pct(lat, 99) * 1e3, "n": len(lat),
            "batch": statistics.mean(batches) if batches else None,
            "health_max_ms": max(health) if health else None,
            "server_cpu_us": mean("server_cpu_us"), "children_cpu_us": mean("children_cpu_us"),
            "errors": errors}


def _f(v, fmt="{:.0f}"):
    return "-" if v is None or v != v else fmt.format(v)


# (host, mode, metric, baseline, target): every ratio is mpx's figure at c=64 over the
# baseline's, in the same run; target None: informational
RATIOS = [
    ("quiet", "engine", "rps", "pool", ">= 1.5x"),
    ("quiet", "engine", "rps", "ray", ">= 1.5x"),
    ("loaded", "engine", "rps", "pool", ">= 1.5x"),
    ("loaded", "engine", "rps", "ray", ">= 1.5x"),
    ("quiet", "direct", "p99_ms", "pool", "<= 1.0x"),
    ("loaded", "direct", "p99_ms", "pool", None),
    ("quiet", "direct", "p99_ms", "ray", None),
    ("quiet", "direct", "rps", "pool", None),
    ("quiet", "direct", "rps", "ray", None),
]
METRIC = {"rps": "requests/s", "p99_ms": "p99"}


def _meets(ratio: float, target: str) -> bool:
    op, bound = target.split()
    return ratio >= float(bound[:-1]) if op == ">=" else ratio <= float(bound[:-1])


def report(cells: dict, backends: list, interrupted: bool = False) -> list:
    """Print the table of every cell and the table of ratios; return the ratios' rows."""
    print()
    print("requests/s: mean of the rounds (range); p50/p99: latency in ms over every round's "
          "requests; batch: the engine's mean batch; /health max: the slowest /health answer "
          "(ms) during the load; CPU srv / CPU kids: CPU us per request of the server process "
          "(every thread) / of its descendants (the workers; for Ray also raylet, GCS, ...)")
    lines = []
    for host in ("quiet", "loaded"):
        for mode in MODES:
            for c in CONCURRENCY:
                for b in backends:
                    cell = cells.get((host, mode, c, b))
                    if cell is None:
                        continue
                    rng = cell.get("rps_range")
                    rps = _f(cell["rps"]) + (f" ({rng[0]:.0f}-{rng[1]:.0f})"
                                             if rng and len(rng) and rng[0] != rng[1] else "")
                    lines.append((host, mode, str(c), LABEL[b], rps,
                                  _f(cell.get("p50_ms"), "{:.2f}"),
                                  _f(cell.get("p99_ms"), "{:.2f}"),
                                  _f(cell.get("batch"), "{:.1f}"),
                                  _f(cell.get("health_max_ms")),
                                  _f(cell.get("server_cpu_us")), _f(cell.get("children_cpu_us")),
                                  str(sum(cell["errors"].values()))))
    print_table(("host", "mode", "c", "backend", "requests/s", "p50 ms", "p99 ms", "batch",
                 "/health max", "CPU srv", "CPU kids", "errors"), lines)
    print()
    rows, tl = [], []
    for host, mode, metric, base, target in RATIOS:
        name = f"{mode} c=64 {METRIC[metric]}, {host}: mpx / {LABEL[base]}"
        m, o = (cells.get((host, mode, 64, x), {}).get(metric) for x in ("mpx", base))
        r = m / o if m and o and m == m and o == o else None
        if base not in backends or "mpx" not in backends:
            if target is None:
                continue
            res = "skipped (no server)"
        elif target is None:
            res = "info"
        elif r is None:
            res = "skipped (interrupted)" if interrupted else "FAIL (no figure)"
        else:
            res = "PASS" if _meets(r, target) else "FAIL"
        rows.append({"name": name, "ratio": r, "target": target, "result": res})
        tl.append((name, _f(r, "{:.2f}x"), target or "-", res))
    print_table(("ratio (same run)", "value", "target", "result"), tl)
    return rows


def draw_png(path: str, cells: dict, backends: list, header: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        print(f"note: matplotlib is not installed (pip install matplotlib); {path} skipped")
        return
    colors = {"mpx": "tab:blue", "pool": "tab:orange", "ray": "tab:green", "floor": "tab:gray"}
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
    for i, host in enumerate(("quiet", "loaded")):
        for j, mode in enumerate(MODES):
            ax = axes[i][j]
            for b in backends:
                pts = [(c, cells.get((host, mode, c, b))) for c in CONCURRENCY]
                pts = [(c, v) for c, v in pts if v and v.get("rps")]
                if not pts:
                    continue
                xs = [c for c, _ in pts]
                ax.plot(xs, [v["p50_ms"] for _, v in pts], "o-", color=colors[b],
                        label=f"{LABEL[b]} p50")
                ax.plot(xs, [v["p99_ms"] for _, v in pts], "s--", color=colors[b],
                        label=f"{LABEL[b]} p99")
            ax.set_xscale("log", base=2)
            ax.set_xticks(CONCURRENCY, [str(c) for c in CONCURRENCY])
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("concurrency (connections)")
            ax.set_ylabel("latency, ms")
            ax.set_title(f"{mode} mode, {host} host", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        ax = axes[i][2]
        for b in backends:
            for mode, style in (("direct", "o-"), ("engine", "s--")):
                pts = [(c, cells.get((host, mode, c, b))) for c in CONCURRENCY]
                pts = [(c, v) for c, v in pts if v and v.get("rps")]
                if pts:
                    ax.plot([c for c, _ in pts], [v["rps"] for _, v in pts], style,
                            color=colors[b], label=f"{LABEL[b]} {mode}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(CONCURRENCY, [str(c) for c in CONCURRENCY])
        ax.set_xlabel("concurrency (connections)")
        ax.set_ylabel("requests/s")
        ax.set_title(f"throughput, {host} host", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"FastAPI + uvicorn over 2 workers (step: sleep {STEP_S * 1e3:g} ms + "
                 f"{header.get('per_item_us', 0):.1f} us of Python per item); "
                 f"os.cpu_count()={header['cpu_count']}, "
                 f"{'quick' if header['quick'] else 'full'} run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    with contextlib.suppress(Exception):  # a 64-colour palette: a third of the file's size
        from PIL import Image
        with Image.open(path) as im:
            small = im.convert("RGB").quantize(64)
        small.save(path, optimize=True)
    print(f"wrote {path}")


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _more_args(ap):
    ap.add_argument("--out", metavar="DIR", help="write the latency PNG (bench_serve.png) here")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="which servers to run (default mpx,pool,ray)")


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    args = parse_args(__doc__, "a short run (~1 min): one round of 0.8 s per measurement",
                      _more_args)
    t_start = time.perf_counter()
    for pkg in ("fastapi", "uvicorn", "psutil"):
        if _version(pkg) == "not installed":
            print(f"{pkg} is not installed: pip install -e '.[bench]' (or pip install fastapi "
                  "uvicorn httptools psutil ray matplotlib)")
            return 0
    backends = [b for b in args.backends.split(",") if b]
    notes: list = []
    if "ray" in backends and _version("ray") == "not installed":
        backends.remove("ray")
        notes.append("Ray is not installed (pip install ray): its server is skipped")
    header = print_header(args.quick, "serving benchmark (FastAPI + uvicorn, 2 workers)",
                          "the server, the load client, 2 workers (and on the loaded host 2 "
                          "busy loops) share them", fastapi=_version("fastapi"),
                          uvicorn=_version("uvicorn"), httptools=_version("httptools"),
                          ray=_version("ray"))
    t = time.perf_counter()
    for i in range(2000):  # the per-item part of step_work, timed here
        h = i
        for _ in range(ITEM_ITERS):
            h = (h * 1103515245 + 12345) & 0x7FFFFFFF
    per_item = header["per_item_us"] = (time.perf_counter() - t) / 2000 * 1e6
    print(f"step (every backend): sleep {STEP_S * 1e3:.0f} ms, then {ITEM_ITERS} rounds of Python "
          f"per item ({per_item:.1f} us per item here); concurrency {CONCURRENCY}; "
          f"{'1 round x 0.8' if args.quick else '2 rounds x 2.5'} s per measurement")
    load_before = os.getloadavg()
    print(f"load average before the run: {load_before[0]:.2f} (1 min), {load_before[1]:.2f} "
          "(5 min)" + ("  <- other jobs are running: the 'quiet' host is not quiet"
                       if load_before[0] > 1.0 else ""))
    print(flush=True)

    kids = Children()
    results: dict = {}
    live: list = []  # the backends whose server came up
    old_term = signal.signal(signal.SIGTERM, _sigterm)
    interrupted = False
    try:
        asyncio.run(run(args, kids, backends, live, results, notes))
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: tearing down", flush=True)
    finally:
        progress("tearing down")
        kids.teardown()
        signal.signal(signal.SIGTERM, old_term)
        for name, s in kids.servers.items():  # a server's errors (its log goes with tmp)
            with contextlib.suppress(OSError), open(s["log"].name) as f:
                said = [ln.rstrip() for ln in f]
            bad = [i for i, ln in enumerate(said) if any(
                w in ln for w in ("Traceback", "Error", "ERROR", "Exception"))]
            if bad:
                notes.append(f"{LABEL[name]} server's log: {len(bad)} error lines, the first:\n"
                             "    " + "\n    ".join(said[bad[0]:bad[0] + 12]))
        shutil.rmtree(kids.tmp, ignore_errors=True)

    cells = {k: combine(v) for k, v in results.items()}
    rows = report(cells, live, interrupted) if cells else []
    if notes:
        print("notes:")
        for n in notes:
            print(f"  * {n}")
    print()
    time.sleep(0.2)
    alive, leftovers = print_cleanup(set(kids.pids))
    judged = [r for r in rows if r["result"] != "info" and not r["result"].startswith("skip")]
    failed = [r["name"] for r in judged if r["result"] != "PASS"]
    elapsed = time.perf_counter() - t_start
    load_after = os.getloadavg()
    print(f"load average after the run: {load_after[0]:.2f} (1 min), {load_after[1]:.2f} (5 min;"
          " the loaded phases' 2 busy loops add ~1 to it)")
    print(f"SUMMARY: {len(judged) - len(failed)}/{len(judged)} targets met"
          + (f"; FAIL: {', '.join(failed)}" if failed else "")
          + (" (interrupted)" if interrupted else "")
          + f"  ({elapsed:.0f} s, {header['affinity']} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "elapsed_s": elapsed, "targets": rows,
                       "loadavg_before": load_before, "loadavg_after": load_after,
                       "cells": [{"host": k[0], "mode": k[1], "c": k[2], "backend": k[3], **v}
                                 for k, v in cells.items()],
                       "rounds": [{"host": k[0], "mode": k[1], "c": k[2], "backend": k[3],
                                   "runs": [{k2: v2 for k2, v2 in r.items() if k2 != "lat"}
                                            for r in v]} for k, v in results.items()],
                       "notes": notes, "leftover_segments": leftovers,
                       "alive_children": alive}, f, indent=1)
        print(f"wrote {args.json}")
    pngs = [p for p in (args.png, args.out and os.path.join(args.out, "bench_serve.png")) if p]
    for p in pngs:
        if cells:
            os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
            draw_png(p, cells, live, header)
    return 0


if __name__ == "__main__":
    main()
    sys.exit(0)
