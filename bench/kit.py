"""What the benchmarks in bench/ share, on mpx's public API only: child processes and their pids,
the baselines (a multiprocessing.Pipe RPC loop, the same loop on bare MessageQueues), timed loops,
the paired A/B against another git revision, the scheduler-step dict, busy loops for a loaded
host, and the report (header, table, SUMMARY line, cleanup check, JSON, PNG). ``python -m mpx
bench`` runs bench_compare.py with it.

The scripts run as ``python bench/<script>.py``, which puts this folder on sys.path (spawn
children inherit it). Only the standard library and mpx at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import multiprocessing as mp
import os
import pickle
import platform
import random
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import mpx

CTX = mp.get_context("spawn")
MiB = 1 << 20
BIG = 64 * MiB
SETUP_TIMEOUT = CALL_TIMEOUT = 60.0
# The first few hundred round trips after a spawn are slower (1.5x here) until the scheduler
# has spread the processes over the cores: calls for this long come first.
SETTLE_S = 0.5
MIN_SAMPLES = 3  # a timed loop cut short by its time budget still keeps this many
BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
_T0 = time.perf_counter()

# --------------------------------------------------------------------------- processes

procs: list = []              # started by start(), not joined yet
child_pids: set[int] = set()  # every child of this run, for the cleanup check


def start(target, args):
    """Start a daemon spawn child running ``target(*args)``; remember it and its pid."""
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    procs.append(p)
    child_pids.add(p.pid)
    return p


def join(p, timeout=30.0, what="child"):
    """Join ``p``; terminate it (saying so, unless ``what`` is None) if it does not exit."""
    p.join(timeout)
    if p.is_alive():
        if what is not None:
            print(f"  warning: {what} {p.pid} did not exit, terminating it", flush=True)
        p.terminate()
        p.join(5)
    if p in procs:
        procs.remove(p)


def cleanup_procs():
    for p in list(procs):
        join(p, 0.1, what=None)


def _stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def last_cpu(pid):
    """The CPU ``pid`` last ran on, or None."""
    try:
        return int(_stat(pid)[36])
    except (OSError, ValueError, IndexError):
        return None


def alive(pids):
    """The sorted ``pids`` whose process still runs (not gone, not a zombie)."""
    out = []
    for pid in sorted(set(pids)):
        with contextlib.suppress(OSError, IndexError):
            if _stat(pid)[0] not in ("Z", "X"):
                out.append(pid)
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def busy_loops(n):
    """``n`` pure-Python busy loops running inside (a loaded host); SIGKILLed if we die."""
    code = "import ctypes, signal; ctypes.CDLL(None).prctl(1, signal.SIGKILL)\nwhile True: pass"
    loops = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
             for _ in range(n)]
    child_pids.update(p.pid for p in loops)
    try:
        yield loops
    finally:
        for p in loops:
            p.kill()
            p.wait()


def ray_loopback_env():
    """tests/_ray_env.py's ``ray_loopback_env()``: a Ray started inside stays on 127.0.0.1."""
    spec = importlib.util.spec_from_file_location("_ray_env", os.path.join(ROOT, "tests", "_ray_env.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ray_loopback_env()


# --------------------------------------------------------------------------- baselines

class Worker:
    """The worker of most benchmarks: mpx builds it with a context, a Pipe child without."""

    def __init__(self, ctx=None, **kw):
        self.rank = 0 if ctx is None else ctx.rank

    def noop(self):
        return None

    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    def take(self, t):
        return int(t.shape[0])

    def nbytes(self, b):
        return len(b)

    def step(self, d):
        return len(d["req_ids"])

    def stamp(self):  # CLOCK_MONOTONIC (system-wide) as the reply leaves
        return time.monotonic_ns()


def new_executor(n, worker=Worker, **kw):
    ex = mpx.Executor(worker, world_size=n, start_method="spawn", **kw)
    child_pids.update(ex.worker_pids)
    return ex


def payload_size(obj):
    """The payload's size in bytes (an array's nbytes)."""
    return int(getattr(obj, "nbytes", None) or len(obj))


class CallOn:
    """A PipePeers handler: ``(method, args, kwargs)`` calls that method of ``worker``."""

    def __init__(self, worker):
        self.worker = worker

    def __call__(self, msg):
        method, args, kwargs = msg
        return getattr(self.worker, method)(*args, **kwargs)


def serve(recv, reply, handler):
    """Answer each object from ``recv`` with ``reply(handler(obj))``, until None arrives."""
    while (obj := recv()) is not None:
        answer = handler(obj)
        del obj  # free a big payload before the next one arrives
        reply(answer)


def _pipe_child(conn, handler):
    serve(conn.recv, conn.send, handler)
    conn.close()


class PipePeers:
    """``n`` spawn children, each at the end of its own multiprocessing.Pipe, answering every object
    with ``handler(obj)`` (child i with ``handler[i]`` given a list): the baseline. ``rpc(method,
    *args)`` with ``CallOn`` handlers is the Pipe RPC loop: the call to every child, then every
    answer."""

    def __init__(self, n, handler):
        self.conns, self.procs = [], []
        for h in handler if isinstance(handler, list) else [handler] * n:
            a, b = CTX.Pipe()
            self.procs.append(start(_pipe_child, (b, h)))
            b.close()
            self.conns.append(a)
        self.pids = [p.pid for p in self.procs]

    def call(self, obj):
        for c in self.conns:
            c.send(obj)
        return [c.recv() for c in self.conns]

    def rpc(self, method, *args):
        return self.call((method, args, {}))

    def close(self):
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send(None)
        for p in self.procs:
            join(p, 10, what="Pipe child")
        for c in self.conns:
            c.close()


def pipe_rpc(n, worker=Worker):
    return PipePeers(n, CallOn(worker()))


def _queue_child(handle, rank, conn, worker):
    """The RPC loop of an executor's worker straight on MessageQueues: reader ``rank`` of the
    broadcast queue in, a one-reader queue back."""
    worker, q_in, back = worker(), mpx.MessageQueue.create_from_handle(handle, rank), mpx.MessageQueue(1, 1)
    conn.send(back.export_handle())
    back.wait_until_ready(timeout=SETUP_TIMEOUT)
    q_in.wait_until_ready(timeout=SETUP_TIMEOUT)
    while (msg := q_in.dequeue(indefinite=True)) is not None:
        _, seq, method, args, _, _ = msg
        back.enqueue((seq, 0, getattr(worker, method)(*args)))
    back.close()
    q_in.close()


class QueueRPC:
    """The Pipe RPC loop on bare MessageQueues (one broadcast queue, one back from each of ``n``
    children), its messages shaped as the executor's (a 6-tuple call, a 3-tuple reply): what the
    shared-memory transport costs without the Executor."""

    def __init__(self, n=1, worker=Worker):
        self.q, self.back = mpx.MessageQueue(n, n), []
        self.procs = []
        for rank in range(n):
            a, b = CTX.Pipe()
            self.procs.append(start(_queue_child, (self.q.export_handle(), rank, b, worker)))
            b.close()
            if not a.poll(SETUP_TIMEOUT):
                raise RuntimeError("a MessageQueue RPC child did not come up")
            self.back.append(mpx.MessageQueue.create_from_handle(a.recv(), 0))
            a.close()
        for q in [self.q, *self.back]:
            q.wait_until_ready(timeout=SETUP_TIMEOUT)
        self.pids, self.seq = [p.pid for p in self.procs], 0

    def call(self, method, *args):
        self.seq += 1
        self.q.enqueue((0, self.seq, method, args, None, None))
        return [back.dequeue(timeout=CALL_TIMEOUT)[2] for back in self.back]

    def close(self):
        self.q.enqueue(None, timeout=SETUP_TIMEOUT)
        for p in self.procs:
            join(p, 10, what=None)
        for q in [*self.back, self.q]:
            q.close()


def queue_round_trip(make_msgs, iters, warm):
    """us of enqueue + dequeue of each of ``make_msgs()``, in this process, on one MessageQueue with
    its reader here: encode, ring write, ring read, decode, and no wake."""
    q = mpx.MessageQueue(1, 1)
    r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0)
    try:
        q.wait_until_ready(timeout=SETUP_TIMEOUT)
        r.wait_until_ready(timeout=SETUP_TIMEOUT)
        msgs = make_msgs()

        def rt():
            for m in msgs:
                q.enqueue(m)
                r.dequeue(timeout=CALL_TIMEOUT)
        return timed_us(rt, iters, warm)
    finally:
        r.close()
        q.close()


# --------------------------------------------------------------------------- timing

def settle(fns, seconds, min_rounds=0):
    """Call every fn in turn for ``seconds``, and at least ``min_rounds`` rounds."""
    end, i = time.perf_counter() + seconds, 0
    while i < min_rounds or time.perf_counter() < end:
        for fn in fns:
            fn()
        i += 1


def time_calls(fn, iters, warm=0, budget_s=None):
    """Seconds of each of ``iters`` calls of ``fn`` after ``warm`` untimed ones, with the GC off;
    fewer once ``budget_s`` is spent (but at least MIN_SAMPLES)."""
    for _ in range(warm):
        fn()
    out, clock = [], time.perf_counter_ns
    budget = None if budget_s is None else budget_s * 1e9
    gc.disable()
    try:
        begin = clock()
        for _ in range(iters):
            t0 = clock()
            fn()
            out.append((t1 := clock()) - t0)
            if budget is not None and t1 - begin > budget and len(out) >= MIN_SAMPLES:
                break
    finally:
        gc.enable()
    return [x / 1e9 for x in out]


def timed_us(fn, iters, warm=0):
    return [t * 1e6 for t in time_calls(fn, iters, warm)]


def interleaved(fns, warm, iters, blocks, settle_s=SETTLE_S):
    """{fn: [us per call]}: every fn settled first, then ``iters`` timed calls each, in ``blocks``
    alternating in order, so that the host's drift hits all alike."""
    settle(fns, settle_s, min_rounds=warm)
    out = {fn: [] for fn in fns}
    for b in range(blocks):
        for fn in (fns if b % 2 == 0 else fns[::-1]):
            out[fn] += timed_us(fn, max(1, iters // blocks))
    return out


def in_turn(fns, reps, warm):
    """[[seconds of each call] of each fn]: ``warm + reps`` rounds, the fns called in turn (the first
    one alternating), so that drift hits them alike."""
    out = [[] for _ in fns]
    for i in range(warm + reps):
        for f, ts in (zip(fns, out) if i % 2 == 0 else list(zip(fns, out))[::-1]):
            t0 = time.perf_counter()
            f()
            if i >= warm:
                ts.append(time.perf_counter() - t0)
    return out


def stats(samples):
    """{"median", "p90" (linear interpolation), "min", "n"}."""
    xs = sorted(samples)
    p90 = statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]
    return {"median": statistics.median(xs), "p90": p90, "min": xs[0], "n": len(xs)}


def gbps(ts, nbytes=BIG):
    """GB/s stats from seconds per ``nbytes``: 'p90' is the GB/s at the p90 (slow) time."""
    s = stats(ts)
    return {"median": nbytes / s["median"] / 1e9, "p90": nbytes / s["p90"] / 1e9, "n": s["n"],
            "median_ms": s["median"] * 1e3}


def paired(xs, ys):
    """Sorted ratios of paired samples (or of blocks, lists, by their medians)."""
    def med(v):
        return statistics.median(v) if isinstance(v, list) else v
    return sorted(med(x) / med(y) for x, y in zip(xs, ys))


def quartiles(pairs):
    return f"{pairs[len(pairs) // 4]:.3f}-{pairs[3 * len(pairs) // 4]:.3f}x"


# --------------------------------------------------------------------------- paired A/B
# One child process a side (this tree, and git revision REV checked out and built in a temporary
# worktree), both alive, taking turns in short blocks: this VM's speed drifts by a third within
# seconds, so children run one after the other compare the drift, not the code.

# After its block a side sleeps this long, so that its workers park (they yield for yield_us,
# 1 ms) before the other side's block.
AB_REST_S = 0.005


# With MPX_AB_PLACE in the environment (--ab-place), each side places its processes the same
# way: "apart", its driver on the first CPU and its workers on the others; "together", all on
# the first CPU. Left to the scheduler, a side's driver and worker share one CPU in some
# blocks and not in others (on 2 cores 35-45 us a plain-Python no-op against 20-25), and the
# blocks' ratios are that lottery's.
PLACE_ENV = "MPX_AB_PLACE"
PLACES = ("apart", "together")


def place(pids, how):
    """Pin this process's threads to its first CPU and the processes ``pids`` (every thread
    of each) round robin to the others (``how="apart"``) or to that CPU too ("together");
    nothing on a single CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    rest = cpus[1:] if how == "apart" else cpus[:1]
    for pid, cpu in [(os.getpid(), {cpus[0]})] + [(p, {rest[i % len(rest)]}) for i, p in enumerate(pids)]:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), cpu)


@contextlib.contextmanager
def on_one_cpu(pids):
    """Every thread of this process and of the processes ``pids`` on this process's first CPU for the
    block, then back on the CPUs each had: the round trips timed inside measure what their threads'
    work costs, one after the other, with no wake-up of an idle CPU in it."""
    saved = {}
    for pid in (os.getpid(), *pids):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                saved[int(tid)] = os.sched_getaffinity(int(tid))
    place(pids, "together")
    try:
        yield
    finally:
        for tid, cpus in saved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


def serve_ab(call, block, warm, idle_s=0.0, pids=()):
    """One side, in its child: once ``call`` is warm, print this mpx's path as JSON, then for each
    "go" line on stdin the us of ``block`` calls (after ``idle_s`` asleep). ``pids``: the
    workers', placed as MPX_AB_PLACE says (PLACES; unset: by the scheduler)."""
    if os.environ.get(PLACE_ENV) in PLACES:
        place(pids, os.environ[PLACE_ENV])
    settle([call], SETTLE_S, min_rounds=warm)
    print(json.dumps({"mpx": mpx.__file__}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        time.sleep(idle_s)
        us = timed_us(call, block)
        time.sleep(AB_REST_S)
        print(json.dumps({"us": us}), flush=True)


class _Side:
    def __init__(self, tree, args, cwd, timeout):
        self.tree, self.timeout = tree, timeout
        self.proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=cwd,
                                     env=dict(os.environ, PYTHONPATH=tree))

    def answer(self):
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not (line := self.proc.stdout.readline() if ready else ""):
            raise RuntimeError(f"the A/B child of {self.tree} died or hung (exit {self.proc.poll()})")
        return json.loads(line)

    def ask(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.answer()["us"]

    def close(self):
        try:
            self.proc.stdin.close()  # end of input: the child shuts its executor down
            self.proc.wait(self.timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def ab_paired(rev, script, child_flag, child_args, blocks, timeout=120):
    """(stats of this tree's us, of REV's, the blocks' paired ratios): ``script child_flag
    child_args`` run with this tree's mpx and with REV's (this tree's bench/ on both sides), taking
    turns block by block, the first one alternating (both placed as PLACE_ENV says)."""
    out, git = {"new": [], "old": []}, ["git", "-C", ROOT]
    with tempfile.TemporaryDirectory(prefix="mpx-ab-") as tmp:
        old, sides = os.path.join(tmp, "tree"), {}
        subprocess.run([*git, "worktree", "add", "--detach", old, rev], check=True, capture_output=True)
        try:
            subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=old,
                           check=True, capture_output=True)
            for name, tree in (("new", ROOT), ("old", old)):
                sides[name] = _Side(tree, [os.path.abspath(script), child_flag, child_args], tmp, timeout)
                if not sides[name].answer()["mpx"].startswith(tree):
                    raise RuntimeError(f"the {name} side did not import {tree}'s mpx")
            for b in range(blocks):
                for name in (("new", "old") if b % 2 == 0 else ("old", "new")):
                    out[name].append(sides[name].ask())
        finally:
            for side in sides.values():
                side.close()
            subprocess.run([*git, "worktree", "remove", "--force", old], capture_output=True)
    return (stats([us for b in out["new"] for us in b]), stats([us for b in out["old"] for us in b]),
            paired(out["new"], out["old"]))


# --------------------------------------------------------------------------- an engine's step

def make_step(step=0, scale=1.0, seed=0):
    """A scheduler step as an LLM engine's driver broadcasts it: request ids, token lists, block
    tables and sampling parameters in plain containers, and two small tensors. 290 requests (x
    ``scale``) of 16-64 new tokens over 40-120 blocks pickle to ~150 KB."""
    import torch
    rng = random.Random(seed)
    n = max(1, int(290 * scale))
    ids = [f"cmpl-{rng.getrandbits(64):016x}-0" for _ in range(n)]
    tokens = [[rng.randrange(152_000) for _ in range(rng.randrange(16, 64))] for _ in ids]
    blocks = [[rng.randrange(1 << 16) for _ in range(rng.randrange(40, 120))] for _ in ids]
    return {"step": step, "req_ids": ids, "new_token_ids": dict(zip(ids, tokens)),
            "block_tables": dict(zip(ids, blocks)),
            "num_scheduled_tokens": {r: len(t) for r, t in zip(ids, tokens)},
            "sampling": {r: {"temperature": 0.7, "top_p": 0.95, "seed": i} for i, r in enumerate(ids)},
            "finished_req_ids": set(ids[: n // 32]), "positions": torch.arange(n, dtype=torch.int64),
            "slot_mapping": torch.arange(n * 4, dtype=torch.int32)}


def pickled_size(obj):
    return len(pickle.dumps(obj, protocol=5))


# --------------------------------------------------------------------------- report

def progress(msg):
    """One progress line on stderr, with the seconds since the run began."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def parse_args(doc, quick_help, more=None, ab=None, argv=None):
    """--quick, --png, --json; ``more(parser)`` adds a bench's own options. ``ab``: ``(help,
    child_flag, child)`` adds ``--ab REV`` and the hidden ``child_flag``: a run given ``child_flag
    N,N,...`` is one side of the A/B and runs ``child(N, N, ...)``."""
    argv = sys.argv[1:] if argv is None else argv
    if ab is not None and ab[1] in argv:
        ab[2](*map(int, argv[argv.index(ab[1]) + 1].split(",")))
        sys.exit(0)
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[-1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--png", metavar="PATH", help="also plot the results (needs matplotlib)")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    if ab is not None:
        ap.add_argument("--ab", metavar="REV", help=ab[0])
        ap.add_argument("--ab-place", choices=PLACES, help="both A/B sides pin their driver to one "
                        "CPU and their workers to the others (apart) or to the same one (together)")
        ap.add_argument(ab[1], help=argparse.SUPPRESS)
    if more is not None:
        more(ap)
    args = ap.parse_args(argv)
    if getattr(args, "ab_place", None):
        os.environ[PLACE_ENV] = args.ab_place  # (the A/B's children inherit it)
    return args


def version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def print_header(quick, what, note, min_cpus=3, **versions):
    """Print the run's environment (versions, core count, ring, mode); return it as a dict."""
    cpus = len(os.sched_getaffinity(0))
    header = {"python": platform.python_version(), "platform": platform.platform(), "mpx": mpx.__version__,
              "ring": mpx.ring_implementation(), "numpy": version("numpy"), **versions,
              "cpu_count": os.cpu_count(), "affinity": cpus, "quick": quick, "loadavg": os.getloadavg()}
    more = "".join(f"{k} {v}, " for k, v in versions.items())
    print(f"mpx {header['mpx']} {what}  (python {header['python']}, {more}numpy {header['numpy']}, "
          f"{header['platform']})")
    print(f"os.cpu_count()={os.cpu_count()}  usable CPUs={cpus}  ring={header['ring']}  "
          f"mode={'quick' if quick else 'full'}  load average {header['loadavg'][0]:.2f}")
    print(f"config: {mpx.Config.from_env().describe()}")
    if cpus < min_cpus:
        print(f"note: only {cpus} CPUs: {note}")
    print(flush=True)
    return header


def print_table(hdr, lines, indent=""):
    """``lines`` (tuples of strings) under ``hdr`` in left-aligned columns."""
    w = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(hdr)]
    fmt = indent + "  ".join(f"{{:<{x}}}" for x in w)
    for line in (hdr, ["-" * x for x in w], *lines):
        print(fmt.format(*line))


def row(name, unit, m, b=None, target="info", ok=None, note=""):
    """A result: mpx's stats ``m`` against the baseline's ``b`` (the ratio of the medians, m / b);
    ``ok`` None: informational."""
    return {"name": name, "unit": unit, "mpx": m, "baseline": b, "target": target, "passed": ok,
            "ratio": m["median"] / b["median"] if b and b["median"] else None, "note": note}


def _fmt(st, unit):
    if st is None:
        return "-"
    if unit == "%":
        return f"{st['median']:.3f} %"
    d = 2 if unit == "GB/s" else 1
    return f"{st['median']:.{d}f} (p90 {st['p90']:.{d}f})"


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    print(f"wrote {path}")


def write_png(path, draw, **subplots):
    """``draw(fig, axes)`` fills ``matplotlib.pyplot.subplots(**subplots)``, saved to ``path``;
    without matplotlib, say so and skip."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed (pip install 'mpx[bench]'); {path} skipped")
        return
    fig, axes = plt.subplots(**subplots)
    draw(fig, axes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def print_cleanup(pids=()):
    """Say which of the run's children are alive and which /dev/shm segments mpx made in their name
    (``mpx-<creator pid>-<random>``) or in this process's are left."""
    pids = set(pids) | child_pids | {p.pid for p in mp.active_children()}
    mine = {str(p) for p in pids | {os.getpid()}}
    left = alive(pids - {os.getpid()})
    try:
        segments = sorted(e for e in os.listdir("/dev/shm")
                          if e.startswith("mpx-") and e.split("-")[1] in mine)
    except OSError:
        segments = []
    print(f"cleanup: child processes alive: {left or 'none'}; /dev/shm mpx segments left by this run: "
          f"{segments or 'none'}")
    return left, segments


def finish(args, header, rows, raw, title, reap_s=0.2):
    """Print the rows, the cleanup check and the SUMMARY line; write --json and --png."""
    print("\nvalues: median (p90) over repetitions; ratio = mpx / baseline\n")
    print_table(("measurement", "mpx", "baseline", "ratio", "target", "result"), [
        (f"{r['name']} [{r['unit']}]", _fmt(r["mpx"], r["unit"]), _fmt(r["baseline"], r["unit"]),
         "-" if r["ratio"] is None else f"{r['ratio']:.3f}x", r["target"],
         "info" if r["passed"] is None else "PASS" if r["passed"] else "FAIL") for r in rows])
    if notes := [f"  * {r['name'].strip()}: {r['note']}" for r in rows if r["note"]]:
        print("notes:\n" + "\n".join(notes))
    print()
    time.sleep(reap_s)  # let the last children be reaped
    left, segments = print_cleanup()
    judged = [r for r in rows if r["passed"] is not None]
    failed = [r["name"].strip() for r in judged if not r["passed"]]
    elapsed = time.perf_counter() - _T0
    print(f"SUMMARY: {len(judged) - len(failed)}/{len(judged)} targets met"
          + (f"; FAIL: {', '.join(failed)}" if failed else "")
          + f"  ({elapsed:.0f} s, {header['affinity']} CPUs)")
    if args.json:
        write_json(args.json, {"header": header, "elapsed_s": elapsed, "rows": rows, "raw": raw,
                               "leftover_segments": segments, "alive_children": left})
    if args.png and (shown := [r for r in rows if r["ratio"] is not None]):
        def draw(fig, ax):
            ratios = [r["ratio"] for r in shown]
            ax.barh(range(len(shown)), ratios, color=["tab:gray" if r["passed"] is None else "tab:green"
                                                      if r["passed"] else "tab:red" for r in shown])
            for i, r in enumerate(shown):
                ax.text(ratios[i], i, f" {ratios[i]:.3g}x ({r['target']})", va="center", fontsize=8)
            ax.set_yticks(range(len(shown)), [r["name"] for r in shown], fontsize=8)
            ax.invert_yaxis()
            ax.set_xscale("log")
            ax.axvline(1.0, color="k", lw=0.8)
            ax.set_xlabel("mpx / baseline (green PASS, red FAIL, grey informational)")
            ax.set_title(f"{title} ({header['affinity']} CPUs)", fontsize=9)
        write_png(args.png, draw, figsize=(9, 0.45 * len(shown) + 1.5))


def _thread_ns(pid, tid):
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])
    return 0  # the thread ended


def thread_role(pid, tid):
    """What thread ``tid`` of process ``pid`` is: "main" (the process's first thread), "ZeroMQ I/O"
    (libzmq names its I/O threads ZMQbg/IO/N) or "other"."""
    if int(tid) == pid:
        return "main"
    with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
        if f.read().startswith("ZMQbg/IO"):
            return "ZeroMQ I/O"
    return "other"


def cpu_ns_by_role(pids):
    """{(pid, thread_role): CPU nanoseconds its live threads have run} (schedstat: needs a kernel that
    has it, as every Linux of mpx's does)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                key = (pid, thread_role(pid, tid))
                out[key] = out.get(key, 0) + _thread_ns(pid, tid)
    return out


def cpu_s(pids):
    """The CPU seconds the processes ``pids`` have run: where the kernel has schedstat, the sum over
    each one's live threads of /proc/<pid>/task/<tid>/schedstat (nanoseconds; an ended thread's time
    drops out); else /proc/<pid>/stat's utime + stime (clock ticks, 10 ms). A process gone counts 0."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            if os.path.exists("/proc/self/schedstat"):
                total += sum(_thread_ns(pid, t) for t in os.listdir(f"/proc/{pid}/task")) / 1e9
            else:
                total += sum(map(int, _stat(pid)[11:13])) / os.sysconf("SC_CLK_TCK")
    return total
