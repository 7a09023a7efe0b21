"""Benchmark of mpx.Executor.collective_rpc against baselines measured in the same run.

    python bench/bench_executor.py [--quick] [--png out.png] [--json out.json]

The baseline is a minimal multiprocessing.Pipe RPC loop: the driver sends
("method", args, kwargs) to a child, which looks the method up on its worker object, calls
it and sends the result back. Measurements (medians and p90 over repetitions):

a. round trip of a no-op call, 1 worker, vs the Pipe RPC loop.   target: <= 0.35x Pipe
   2 workers, vs the loop over 2 pipes (send to both, then receive from both).
                                                                   target: <= 0.40x Pipe
   4 workers (crowded: 5 processes on this machine's 2 cores), vs the loop over 4 pipes.
                                                                   target: <= 0.30x Pipe
   and vs the same loop on bare MessageQueues.                     target: <= 1.5x bare
b. first call after 2 s idle (1 worker), vs the Pipe RPC loop's first call after the
   same idle.                                                      target: <= 0.8x Pipe
   (a. and b. also time the same RPC loop on bare MessageQueues, without the Executor,
   to tell the Executor's own cost from the ring's, and a. repeats the 1-worker case with
   the driver and the worker pinned to the same CPU and to different CPUs, and the
   4-worker case with the driver sharing its CPU with 1, 2 or no workers, since the
   placement the scheduler picks moves every side a lot: informational.)
   With --ab REV, also the first call after 0.5 s idle of this tree vs REV's, paired
   (see d.; one call a turn): informational.
   CPU of each idle worker over 3 s (psutil, ex.worker_pids).     target: < 2% of a core
   CPU of the driver (time.process_time, every driver thread) while it waits for a call
   that sleeps 3 s in the worker.                                 target: < 2% of a core
c. a 64 MiB torch.float32 tensor as the argument of a call to 1 worker (the reply is
   t.shape[0]): GB/s = 64 MiB / median call time, vs single-thread memcpy (torch
   dst.copy_(src) into a pre-touched tensor, torch.set_num_threads(1)).
                                                                   target: >= 0.3x memcpy
   2 workers, and the Pipe RPC loop with the same bytes (as a numpy array, pickled in
   band): informational.
d. the driver's futures (1 worker):
   - time from a reply landing (the worker stamps CLOCK_MONOTONIC as it returns) to the
     done callback of a non-blocking call that nobody waits on, vs the blocking round trip
     measured in the same run.                                     target: <= 2x blocking
   - asyncio: calls/s with 64 calls in flight from one event loop (64 coroutines, each
     awaiting one call after another), vs blocking calls/s from one thread.
                                                                   target: >= 1x blocking
   - with --ab REV: the blocking no-op round trip, 1 and 2 workers, of this tree vs git
     revision REV (checked out and built in a temporary worktree): one child process a
     side, both alive, taking turns in short blocks (the host's speed drifts by a third
     within seconds here, so children run one after the other compared drift, not code);
     the figure is the median of the blocks' paired ratios.
                                                             target: <= 1.05x of REV's

Only some sections: --sections d (any of a, b, c, d).

It is a benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import psutil
import torch
from _report import (
    BIG,
    bw_stats,
    finish,
    interleaved,
    last_cpu,
    parse_args,
    pct_row,
    row,
    timed_us,
)

import mpx
from mpx._cli import benchkit
from mpx._cli.benchkit import (
    CTX,
    CallOn,
    PipePeers,
    child_pids,
    cleanup_procs,
    join,
    print_header,
    progress,
    settle,
    start,
    stats,
    time_calls,
)

SETUP_TIMEOUT = 60.0
CALL_TIMEOUT = 60.0
SETTLE_S = 0.5

# --------------------------------------------------------------------------- workers
# Module-level so that "spawn" children can import them.


class BenchWorker:
    """The worker of both sides: mpx.Executor builds it with a context, the Pipe child
    with ``ctx=None``."""

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
        """len() of a bytes-like argument (bench_inband.py)."""
        return len(b)

    def step(self, d):
        """The number of requests in a scheduler-step dict (bench_inband.py)."""
        return len(d["req_ids"])

    def stamp(self):
        """CLOCK_MONOTONIC (system-wide) as the reply leaves: when the reply lands."""
        return time.monotonic_ns()


def _mq_rpc_child(handle, rank, conn):
    """Diagnosis: the same RPC loop as the executor's workers, straight on MessageQueues
    (reader ``rank`` of the broadcast queue in, a one-reader queue back), without the
    Executor around it."""
    worker = BenchWorker()
    q_in = mpx.MessageQueue.create_from_handle(handle, rank)
    back = mpx.MessageQueue(1, 1)
    conn.send(back.export_handle())
    try:
        back.wait_until_ready(timeout=SETUP_TIMEOUT)
        q_in.wait_until_ready(timeout=SETUP_TIMEOUT)
        while True:
            msg = q_in.dequeue(indefinite=True)
            if msg is None:
                break
            _, seq, method, args, kwargs, _ = msg
            back.enqueue((seq, 0, getattr(worker, method)(*args, **(kwargs or {}))))
    finally:
        back.close()
        q_in.close()
        conn.close()


# --------------------------------------------------------------------------- harness

def pipe_rpc(n):
    """The baseline: ``n`` children each serving BenchWorker over a multiprocessing Pipe."""
    return PipePeers(n, CallOn(BenchWorker()))


class QueueRPC:
    """``n`` ``_mq_rpc_child`` readers of one broadcast queue; ``call`` sends the executor's
    message tuple and reads every reply, rank by rank."""

    def __init__(self, n=1):
        self.q = mpx.MessageQueue(n, n)
        self.procs, self.back = [], []
        for rank in range(n):
            a, b = CTX.Pipe()
            self.procs.append(start(_mq_rpc_child, (self.q.export_handle(), rank, b)))
            b.close()
            if not a.poll(SETUP_TIMEOUT):
                raise RuntimeError("MessageQueue RPC child did not come up")
            self.back.append(mpx.MessageQueue.create_from_handle(a.recv(), 0))
            a.close()
        self.q.wait_until_ready(timeout=SETUP_TIMEOUT)
        for back in self.back:
            back.wait_until_ready(timeout=SETUP_TIMEOUT)
        self.pids = [p.pid for p in self.procs]
        self.seq = 0

    def call(self, method, *args):
        self.q.enqueue((0, self.seq, method, args, None, None))
        self.seq += 1
        out = [back.dequeue(timeout=CALL_TIMEOUT)[2] for back in self.back]
        return out[0] if len(out) == 1 else out

    def close(self):
        self.q.enqueue(None, timeout=SETUP_TIMEOUT)
        for proc in self.procs:
            join(proc, 10, what=None)
        for back in self.back:
            back.close()
        self.q.close()


def new_executor(n):
    ex = mpx.Executor(BenchWorker, world_size=n, start_method="spawn")
    child_pids.update(ex.worker_pids)
    return ex


# --------------------------------------------------------------------------- a. no-op

def bench_noop(n, iters, warm, blocks=4, pin_iters=0):
    """Both sides up at once; timed in alternating blocks so that drift hits both."""
    ex = new_executor(n)
    pipe = pipe_rpc(n)
    mq = QueueRPC(n)
    try:
        def mpx_call():
            ex.collective_rpc("noop", timeout=CALL_TIMEOUT)

        def pipe_call():
            pipe.rpc("noop")

        def mq_call():
            mq.call("noop")

        if ex.collective_rpc("noop") != [None] * n or pipe.rpc("noop") != [None] * n:
            raise RuntimeError("no-op call returned something else than None")
        fns = [mpx_call, pipe_call, mq_call]
        # At least `warm` calls each and SETTLE_S of calls: the first few hundred round
        # trips after a spawn are slower until the scheduler has spread the processes.
        out = interleaved(fns, warm, iters, blocks, SETTLE_S)
        cpus = {"driver": last_cpu(os.getpid()),
                "mpx workers": [last_cpu(p) for p in ex.worker_pids],
                "pipe children": [last_cpu(p) for p in pipe.pids]}
        pinned = {}
        places = _placements(n)
        if pin_iters and places:
            pinned = _pinned_noop(fns, {mpx_call: ex.worker_pids, pipe_call: pipe.pids,
                                        mq_call: mq.pids}, places, pin_iters)
            pinned = {place: (r[mpx_call], r[pipe_call], r[mq_call])
                      for place, r in pinned.items()}
    finally:
        ex.shutdown()
        pipe.close()
        mq.close()
    return out[mpx_call], out[pipe_call], out[mq_call], cpus, pinned


def _placements(n):
    """{name: (driver's CPU, each child's CPU)}: the placements a. pins ``n`` children to,
    where they tell something (1 child; 4 children on 2 CPUs), else {}."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    a, b = cpus[:2]
    if n == 1:
        return {"driver and worker on same CPU": (a, [a]),
                "driver and worker on different CPUs": (a, [b])}
    if n == 4 and len(cpus) == 2:
        return {"driver with 1 worker, 3 workers on the other CPU": (a, [a, b, b, b]),
                "driver with 2 workers, 2 on the other CPU": (a, [a, a, b, b]),
                "driver alone, 4 workers on the other CPU": (a, [b, b, b, b])}
    return {}


def _pinned_noop(fns, child_pids, places, iters):
    """Medians with the driver's thread and each side's children pinned as each of
    ``places`` says: how much the placement the scheduler picks moves every side."""
    mine = os.sched_getaffinity(0)
    kids = {pid: os.sched_getaffinity(pid) for pids in child_pids.values() for pid in pids}
    out = {}
    try:
        for place, (driver_cpu, cpus) in places.items():
            os.sched_setaffinity(0, {driver_cpu})
            for pids in child_pids.values():
                for pid, cpu in zip(pids, cpus):
                    os.sched_setaffinity(pid, {cpu})
            res = {}
            for fn in fns:
                res[fn] = stats(timed_us(fn, iters, warm=iters // 5))
            out[place] = res
    finally:
        os.sched_setaffinity(0, mine)
        for pid, cpus in kids.items():
            try:
                os.sched_setaffinity(pid, cpus)
            except OSError:
                pass
    return out


# --------------------------------------------------------------------------- b. idle

def bench_idle_wake(rounds, idle_s):
    """First call after `idle_s` of idleness of every process: mpx, the Pipe loop, and (to
    tell the Executor's part from the queues') the bare-MessageQueue loop, in rotating order.
    Also, for each, in how many rounds its child ran last on the driver's CPU."""
    ex = new_executor(1)
    pipe = pipe_rpc(1)
    mq = QueueRPC()
    try:
        calls = {"mpx": lambda: ex.collective_rpc("noop", timeout=CALL_TIMEOUT),
                 "pipe": lambda: pipe.rpc("noop"), "queue": lambda: mq.call("noop")}
        child = {"mpx": ex.worker_pids[0], "pipe": pipe.pids[0], "queue": mq.pids[0]}
        settle(calls.values(), SETTLE_S)
        out: dict = {k: [] for k in calls}
        together = dict.fromkeys(calls, 0)
        names = list(calls)
        clock = time.perf_counter_ns
        for r in range(rounds):
            for which in names[r % 3:] + names[:r % 3]:
                time.sleep(idle_s)
                fn = calls[which]
                t0 = clock()
                fn()
                out[which].append((clock() - t0) / 1e3)
                together[which] += last_cpu(child[which]) == last_cpu(os.getpid())
    finally:
        ex.shutdown()
        pipe.close()
        mq.close()
    return out["mpx"], out["pipe"], out["queue"], together


def bench_cold_python(idle_s, reps=3):
    """How much slower the first Python work after `idle_s` of sleep runs (this process):
    us for sum(range(200)) right after waking, and hot."""
    clock = time.perf_counter_ns
    hot = []
    for _ in range(200):
        t0 = clock()
        sum(range(200))
        hot.append(clock() - t0)
    cold = []
    for _ in range(reps):
        time.sleep(idle_s)
        t0 = clock()
        sum(range(200))
        cold.append(clock() - t0)
    return float(np.median(cold)) / 1e3, float(np.median(hot)) / 1e3


def _cpu_s(proc):
    t = proc.cpu_times()
    return t.user + t.system


def bench_idle_cpu(n, idle_s, call_s):
    """CPU of ``n`` idle mpx workers (and of an idle Pipe child, for reference) over
    ``idle_s``; then the driver's CPU while a call sleeps ``call_s`` in every worker."""
    ex = new_executor(n)
    pipe = pipe_rpc(1)
    try:
        for _ in range(100):
            ex.collective_rpc("noop")
            pipe.rpc("noop")
        workers = [psutil.Process(pid) for pid in ex.worker_pids]
        pchild = psutil.Process(pipe.pids[0])
        before = [_cpu_s(p) for p in workers] + [_cpu_s(pchild)]
        t0 = time.monotonic()
        time.sleep(idle_s)
        wall = time.monotonic() - t0
        after = [_cpu_s(p) for p in workers] + [_cpu_s(pchild)]
        pct = [100.0 * (a - b) / wall for a, b in zip(after, before)]
        idle = {"wall_s": wall, "mpx_workers_pct": pct[:-1], "pipe_child_pct": pct[-1],
                "mpx_workers_ctx": [p.num_ctx_switches().voluntary for p in workers]}

        # Driver CPU while blocked in a long call, for mpx and for the Pipe loop.
        c0, t0 = time.process_time(), time.monotonic()
        got = ex.collective_rpc("sleep", args=(call_s,), timeout=call_s + CALL_TIMEOUT)
        c1, t1 = time.process_time(), time.monotonic()
        if got != list(range(n)):
            raise RuntimeError(f"sleep call returned {got}")
        d0, s0 = time.process_time(), time.monotonic()
        pipe.rpc("sleep", call_s)
        d1, s1 = time.process_time(), time.monotonic()
        drv = {"mpx_cpu_s": c1 - c0, "mpx_wall_s": t1 - t0, "pipe_cpu_s": d1 - d0,
               "pipe_wall_s": s1 - s0, "driver_threads": psutil.Process().num_threads()}
    finally:
        ex.shutdown()
        pipe.close()
    return idle, drv


# --------------------------------------------------------------------------- c. bandwidth

def memcpy_baseline(reps):
    """Single-thread torch copy_ of 64 MiB into a pre-touched tensor; also numpy copyto."""
    src = torch.ones(BIG // 4, dtype=torch.float32)
    dst = torch.zeros(BIG // 4, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ts = time_calls(lambda: dst.copy_(src), reps, warm=1)
    finally:
        torch.set_num_threads(threads)
    s, d = src.numpy(), dst.numpy()
    return ts, time_calls(lambda: np.copyto(d, s), reps, warm=1)


def _call_times(call, expect, reps, warm, who):
    """Seconds of ``reps`` calls of ``call`` after ``warm`` untimed ones; each must return
    ``expect``."""
    def checked():
        got = call()
        if got != expect:
            raise RuntimeError(f"{who} saw {got} elements, expected {expect}")

    return time_calls(checked, reps, warm)


def bench_tensor(n, tensor, reps, warm):
    ex = new_executor(n)

    def call():
        return ex.collective_rpc("take", args=(tensor,), timeout=CALL_TIMEOUT, unique_reply_rank=0)

    try:
        return _call_times(call, tensor.shape[0], reps, warm, "worker")
    finally:
        ex.shutdown()


def bench_tensor_pipe(tensor, reps, warm):
    """The Pipe loop with the same bytes as a numpy array: a torch tensor sent through a
    multiprocessing Pipe goes through torch's own reducer (moved to shared memory once,
    then passed as a file descriptor), which is not a copy of the payload per call."""
    arr = tensor.numpy()
    pipe = pipe_rpc(1)
    try:
        return _call_times(lambda: pipe.rpc("take", arr)[0], arr.shape[0], reps, warm,
                           "Pipe child")
    finally:
        pipe.close()


# --------------------------------------------------------------------------- d. futures

def bench_callback_latency(iters, warm):
    """(us from reply landing to done callback, us of a blocking round trip), interleaved
    in blocks; the caller of the non-blocking call waits on an Event, not on the future."""
    ex = new_executor(1)
    lat, rtt = [], []
    landed = threading.Event()

    def on_done(f):
        lat.append((time.monotonic_ns() - f.result(0)[0]) / 1e3)
        landed.set()

    def non_block():
        landed.clear()
        ex.collective_rpc("stamp", non_block=True).add_done_callback(on_done)
        if not landed.wait(CALL_TIMEOUT):
            raise RuntimeError("a done callback never ran")

    try:
        for _ in range(warm):
            non_block()
            ex.collective_rpc("noop")
        lat.clear()
        for _ in range(4):
            rtt.extend(timed_us(lambda: ex.collective_rpc("noop"), iters // 4))
            for _ in range(iters // 4):
                non_block()
    finally:
        ex.shutdown()
    return lat, rtt


def _blocking_rate(ex, calls):
    """Calls/s of ``calls`` blocking no-op calls from one thread."""
    t0 = time.perf_counter()
    for _ in range(calls):
        ex.collective_rpc("noop")
    return calls / (time.perf_counter() - t0)


def bench_asyncio_rate(calls, in_flight, blocks=3):
    """([asyncio calls/s per block], [blocking calls/s per block]), alternating."""
    ex = new_executor(1)

    async def pipelined():
        async def caller(n):  # each keeps one call in flight, as an engine's request does
            for _ in range(n):
                await ex.collective_rpc("noop", non_block=True)

        t0 = time.perf_counter()
        await asyncio.gather(*[caller(calls // in_flight) for _ in range(in_flight)])
        return in_flight * (calls // in_flight) / (time.perf_counter() - t0)

    try:
        asyncio.run(pipelined())
        _blocking_rate(ex, calls)
        aio, blk = [], []
        for _ in range(blocks):
            aio.append(asyncio.run(pipelined()))
            blk.append(_blocking_rate(ex, calls))
    finally:
        ex.shutdown()
    return aio, blk


def bench_callback_rate(calls, in_flight, blocks=3):
    """([calls/s per block with done callbacks], [blocking calls/s per block]), alternating,
    on an executor no event loop ever used: ``in_flight`` calls kept in flight by their
    done callbacks (the background reader completes them), then one blocking call at a
    time."""
    ex = new_executor(1)

    def with_callbacks():
        slots = threading.Semaphore(in_flight)  # each call's callback lets the next one go
        left, lock, all_done = [calls], threading.Lock(), threading.Event()

        def done(_):
            slots.release()
            with lock:
                left[0] -= 1
                if not left[0]:
                    all_done.set()

        t0 = time.perf_counter()
        for _ in range(calls):
            if not slots.acquire(timeout=CALL_TIMEOUT):
                raise TimeoutError("no done callback ran within CALL_TIMEOUT")
            ex.collective_rpc("noop", non_block=True).add_done_callback(done)
        if not all_done.wait(CALL_TIMEOUT):
            raise TimeoutError(f"{left[0]} done callbacks did not run within CALL_TIMEOUT")
        return calls / (time.perf_counter() - t0)

    try:
        with_callbacks()
        _blocking_rate(ex, calls)
        cbs, blk = [], []
        for _ in range(blocks):
            cbs.append(with_callbacks())
            blk.append(_blocking_rate(ex, calls))
    finally:
        ex.shutdown()
    return cbs, blk


# After its block a side sleeps this long before it answers, so that its workers have
# parked (they poll with sched_yield for yield_us, 1 ms) before the other side's block.
AB_REST_S = 0.005
AB_IDLE_MS = 500  # the first-call-after-idle A/B: as cold as after 2 s here, 4x the rounds


def serve_ab(call, block, warm, idle_s=0.0):
    """One side of a paired A/B (see ab_paired), in its child process: once ``call`` is
    warm, print this mpx's path as JSON, then, for each "go" line on stdin, the us of
    ``block`` calls (after ``idle_s`` asleep); return at end of input."""
    settle([call], SETTLE_S, min_rounds=warm)
    print(json.dumps({"mpx": mpx.__file__}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        if idle_s:
            time.sleep(idle_s)
        us = timed_us(call, block)
        time.sleep(AB_REST_S)
        print(json.dumps({"us": us}), flush=True)


def _noop_child(n, block, warm, idle_ms=0):
    """--noop-child: this tree's (or PYTHONPATH's) side of the no-op A/B (each block after
    ``idle_ms`` asleep)."""
    ex = mpx.Executor(BenchWorker, world_size=n, start_method="spawn")
    try:
        serve_ab(lambda: ex.collective_rpc("noop", timeout=CALL_TIMEOUT), block, warm,
                 idle_ms / 1e3)
    finally:
        ex.shutdown()


def _checkout(rev, where):
    """Check ``rev`` out into ``where``, build its ring in place and put this tree's
    benchkit into it, so that both sides time with the same loop (and a revision from
    before benchkit runs at all); return the repository's top folder."""
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                         text=True, check=True, cwd=os.path.dirname(__file__)).stdout.strip()
    subprocess.run(["git", "worktree", "add", "--detach", where, rev], cwd=top, check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=where,
                   check=True, capture_output=True)
    cli = os.path.join(where, "mpx", "_cli")
    os.makedirs(cli, exist_ok=True)
    open(os.path.join(cli, "__init__.py"), "a").close()
    shutil.copy(benchkit.__file__, cli)
    return top


class _Side:
    """One side of a paired A/B: a child process that answers each "go" with a JSON line."""

    def __init__(self, tree, args, cwd, timeout):
        self.tree, self.timeout = tree, timeout
        self.proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=cwd,
                                     env=dict(os.environ, PYTHONPATH=tree))

    def answer(self):
        """The child's next JSON line, within the timeout."""
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the A/B child of {self.tree} died or hung "
                               f"(exit code {self.proc.poll()})")
        return json.loads(line)

    def ask(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.answer()["us"]

    def close(self):
        try:
            self.proc.stdin.close()  # (end of input: the child shuts its executor down)
            self.proc.wait(self.timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def ab_paired(rev, script, child_flag, child_args, blocks, timeout=120):
    """{"new": [[us, ...] a block], "old": [...]}: this tree's and git revision ``rev``'s
    children (``script child_flag child_args``, see serve_ab), both alive, taking turns
    block by block (the first one alternating), so that the host's drift hits both alike."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out: dict = {"new": [], "old": []}
    with tempfile.TemporaryDirectory(prefix="mpx-ab-") as tmp:
        old = os.path.join(tmp, "tree")
        top = _checkout(rev, old)
        sides = {}
        try:
            args = [os.path.abspath(script), child_flag, child_args]
            for name, tree in (("new", here), ("old", old)):
                sides[name] = side = _Side(tree, args, tmp, timeout)
                got = side.answer()["mpx"]
                if not got.startswith(tree):
                    raise RuntimeError(f"the {name} side imported {got}")
            for b in range(blocks):
                for name in (("new", "old") if b % 2 == 0 else ("old", "new")):
                    out[name].append(sides[name].ask())
        finally:
            for side in sides.values():
                side.close()
            subprocess.run(["git", "worktree", "remove", "--force", old], cwd=top,
                           capture_output=True)
    return out


def ab_figures(got):
    """(stats of this tree's samples, stats of REV's, the blocks' paired ratios, sorted) of
    what ab_paired returned."""
    pairs = sorted(statistics.median(x) / statistics.median(y)
                   for x, y in zip(got["new"], got["old"]))
    return (stats([us for b in got["new"] for us in b]),
            stats([us for b in got["old"] for us in b]), pairs)


def bench_ab(rev, n, block, warm, blocks, idle_ms=0):
    """This tree's no-op round trips (us, a list a block) vs ``rev``'s, ``n`` workers, each
    block after ``idle_ms`` asleep."""
    return ab_paired(rev, __file__, "--noop-child", f"{n},{block},{warm},{idle_ms}", blocks)


def section_d(rows, raw, quick, ab):
    iters, warm = (2000, 300) if quick else (8000, 1000)
    progress(f"[d] done-callback latency vs blocking round trip, {iters} calls each ...")
    lat, rtt = bench_callback_latency(iters, warm)
    m, b = stats(lat), stats(rtt)
    ratio = m["median"] / b["median"]
    rows.append(row("reply landed -> done callback, nobody waits", "us", m, b, ratio,
                    "<= 2x blocking round trip", ratio <= 2.0,
                    note="baseline: blocking no-op round trip, same executor"))
    raw["callback_latency_us"] = {"callback": m, "blocking_rtt": b}

    # blocks long enough (~0.1-0.2 s) that a new loop's start and the pipeline's ramp up
    # and drain are a small share: the figure is the steady rate with 64 in flight
    calls, blocks = (6400, 5) if quick else (12800, 9)
    progress(f"[d] asyncio, 64 calls in flight vs blocking, {blocks} blocks of {calls} calls ...")
    aio, blk = bench_asyncio_rate(calls, 64, blocks)
    a, bl = stats(aio), stats(blk)
    # each asyncio block against the blocking block right after it: the host's drift
    # (seconds long on a shared VM) moves both of a pair alike
    pairs = sorted(x / y for x, y in zip(aio, blk))
    ratio = statistics.median(pairs)
    rows.append(row("asyncio calls/s, 64 in flight, 1 worker", "calls/s", a, bl, ratio,
                    ">= 1x blocking calls/s", ratio >= 1.0, better="higher",
                    note="baseline: blocking calls from one thread, same executor; ratio = "
                         "median of the blocks' paired ratios (range "
                         f"{pairs[0]:.3f}-{pairs[-1]:.3f}x)"))
    raw["asyncio_calls_per_s"] = {"asyncio": aio, "blocking": blk, "paired_ratios": pairs}
    progress(f"[d] done callbacks, 64 calls in flight, no event loop, vs blocking, {blocks} "
             f"blocks of {calls} calls ...")
    cbs, blk = bench_callback_rate(calls, 64, blocks)
    pairs = sorted(x / y for x, y in zip(cbs, blk))
    ratio = statistics.median(pairs)
    rows.append(row("done callbacks, 64 in flight, no event loop, 1 worker", "calls/s",
                    stats(cbs), stats(blk), ratio, "info", None, better="higher",
                    note="each call's done callback (run by the background reader) lets the "
                         "next one go; baseline: blocking calls, same executor; ratio = median "
                         f"of the blocks' paired ratios (range {pairs[0]:.3f}-{pairs[-1]:.3f}x)"))
    raw["callback_calls_per_s"] = {"callbacks": cbs, "blocking": blk, "paired_ratios": pairs}

    if ab:
        blocks, block = (100, 100) if quick else (300, 100)
        for n in (1, 2):
            progress(f"[d] A/B blocking no-op vs {ab}, {n} worker(s), {blocks} blocks of "
                     f"{block} calls a side ...")
            new, old, pairs = ab_figures(bench_ab(ab, n, block, warm, blocks))
            ratio = statistics.median(pairs)
            rows.append(row(f"no-op round trip, {n} worker{'s' if n > 1 else ''}, vs {ab}",
                            "us", new, old, ratio, f"<= 1.05x {ab}", ratio <= 1.05,
                            note="one child a side, taking turns; ratio = median of the "
                                 "blocks' paired ratios (quartiles "
                                 f"{pairs[len(pairs) // 4]:.3f}-"
                                 f"{pairs[3 * len(pairs) // 4]:.3f}x)"))
            raw[f"ab_{n}"] = {"new": new, "old": old, "rev": ab, "paired_ratios": pairs}


def _more_args(ap):
    ap.add_argument("--sections", default="abcd", help="which sections to run (default abcd)")


def main():
    args = parse_args(__doc__, "fewer repetitions (~1 min instead of ~1.5)", _more_args,
                      ab=("also A/B the no-op round trip against REV", "--noop-child",
                          _noop_child))

    quick = args.quick
    noop_iters, noop_warm = (4000, 400) if quick else (20000, 2000)
    pin_iters = 2000 if quick else 5000
    idle_rounds, idle_s = (5, 2.0) if quick else (9, 2.0)
    cpu_idle_s, call_s = 3.0, 3.0
    bw_reps, bw_warm = (5, 2) if quick else (12, 2)

    t_start = time.perf_counter()
    header = print_header(quick, "executor benchmark",
                          "the driver and the workers share them; with 2 workers three "
                          "processes compete for the cores", torch=torch.__version__)

    rows = []
    raw = {}
    try:
        if "a" in args.sections:
            # ---- a. no-op round trip
            for n, limit in ((1, 0.35), (2, 0.40), (4, 0.30)):
                crowded = n + 1 > len(os.sched_getaffinity(0))
                progress(f"[a] no-op collective_rpc, {n} worker(s), {noop_iters} calls each side ...")
                mpx_us, pipe_us, mq_us, cpus, pinned = bench_noop(n, noop_iters, noop_warm,
                                                                  pin_iters=pin_iters)
                m, b, q = stats(mpx_us), stats(pipe_us), stats(mq_us)
                ratio = m["median"] / b["median"]
                label = f"no-op round trip, {n} worker{'s' if n > 1 else ''}"
                if crowded:
                    label += f" ({n + 1} processes on {len(os.sched_getaffinity(0))} CPUs)"
                rows.append(row(label, "us", m, b, ratio, f"<= {limit:.2f}x Pipe RPC",
                                ratio <= limit, note=f"last CPUs {cpus}"))
                raw[f"noop_{n}"] = {"mpx_us_summary": m, "pipe_us_summary": b, "cpus": cpus,
                                    "bare_queue_us_summary": q}
                rows.append(row("  same loop on bare MessageQueues (no Executor)", "us", q, b,
                                q["median"] / b["median"], "info", None,
                                note=(f"Executor overhead over the bare queues: "
                                      f"{m['median'] - q['median']:.1f} us per call")))
                over = m["median"] / q["median"]
                rows.append(row("  Executor vs those bare MessageQueues", "us", m, q, over,
                                "<= 1.5x bare" if n == 4 else "info",
                                over <= 1.5 if n == 4 else None))
                for place, (pm, pb, pq) in pinned.items():
                    rows.append(row(f"  pinned, {place}", "us", pm, pb,
                                    pm["median"] / pb["median"], "info", None,
                                    note=(f"bare MessageQueues {pq['median']:.1f} us = "
                                          f"{pq['median'] / pb['median']:.3f}x Pipe RPC; "
                                          f"Executor {pm['median'] / pq['median']:.2f}x bare")))
                    raw[f"noop_{n}"][f"pinned {place}"] = {"mpx": pm, "pipe": pb,
                                                           "bare_queue": pq}

        if "b" in args.sections:
            # ---- b. idle
            progress(f"[b] first call after {idle_s:.0f} s idle, {idle_rounds} rounds each of mpx, Pipe "
                     f"and bare queues (~{3 * idle_rounds * idle_s:.0f} s) ...")
            mpx_us, pipe_us, mq_us, together = bench_idle_wake(idle_rounds, idle_s)
            m, b, q = stats(mpx_us), stats(pipe_us), stats(mq_us)
            ratio = m["median"] / b["median"]
            cold, hot = bench_cold_python(0.5)
            rows.append(row(f"first call after {idle_s:.0f}s idle, 1 worker", "us", m, b, ratio,
                            "<= 0.8x Pipe RPC", ratio <= 0.8,
                            note=(f"sum(range(200)) takes {cold:.1f} us right after a 0.5 s sleep, "
                                  f"{hot:.1f} us hot: the first Python work after idle runs "
                                  f"{cold / hot:.0f}x slower here; the child ran on the "
                                  f"driver's CPU in {together['mpx']} (mpx), "
                                  f"{together['pipe']} (Pipe) and {together['queue']} (bare "
                                  f"queues) of {idle_rounds} rounds (a Pipe child woken onto "
                                  "the other CPU took twice as long in scratch runs)")))
            rows.append(row("  same loop on bare MessageQueues (no Executor)", "us", q, b,
                            q["median"] / b["median"], "info", None))
            if args.ab:
                rounds = 30 if quick else 60
                progress(f"[b] A/B first call after {AB_IDLE_MS} ms idle vs {args.ab}, "
                         f"{rounds} rounds a side ...")
                new, old, pairs = ab_figures(bench_ab(args.ab, 1, 1, noop_warm, rounds,
                                                      AB_IDLE_MS))
                rows.append(row(f"  first call after {AB_IDLE_MS} ms idle, vs {args.ab}", "us",
                                new, old, statistics.median(pairs), "info", None,
                                note="one child a side, taking turns; ratio = median of the "
                                     "rounds' paired ratios (quartiles "
                                     f"{pairs[len(pairs) // 4]:.3f}-"
                                     f"{pairs[3 * len(pairs) // 4]:.3f}x)"))
                raw["ab_idle"] = {"new": new, "old": old, "rev": args.ab, "paired_ratios": pairs}
            raw["idle_wake_us"] = {"mpx": mpx_us, "pipe": pipe_us, "bare_queue": mq_us,
                                   "cold_python_us": cold, "hot_python_us": hot,
                                   "rounds_on_the_drivers_cpu": together}

            progress(f"[b] CPU of 2 idle workers over {cpu_idle_s:.0f} s, then of the driver during a "
                     f"{call_s:.0f} s call ...")
            idle, drv = bench_idle_cpu(2, cpu_idle_s, call_s)
            pp = idle["pipe_child_pct"]
            for rank, pm in enumerate(idle["mpx_workers_pct"]):
                rows.append(pct_row(f"idle worker {rank} CPU ({cpu_idle_s:.0f}s)", pm, pp, None,
                                    "< 2% of a core", pm < 2.0))
            rows[-1]["note"] = (f"psutil cpu_times over {idle['wall_s']:.2f} s; baseline = an idle "
                                f"Pipe RPC child; worker voluntary ctx switches (since start) "
                                f"{idle['mpx_workers_ctx']}")
            dm = 100.0 * drv["mpx_cpu_s"] / drv["mpx_wall_s"]
            dp = 100.0 * drv["pipe_cpu_s"] / drv["pipe_wall_s"]
            rows.append(pct_row(f"driver CPU during a {call_s:.0f}s call, 2 workers", dm, dp, None,
                                "< 2% of a core", dm < 2.0,
                                note=(f"time.process_time (all {drv['driver_threads']} driver "
                                      f"threads): mpx {drv['mpx_cpu_s'] * 1e3:.2f} ms over "
                                      f"{drv['mpx_wall_s']:.2f} s; Pipe RPC (1 child) "
                                      f"{drv['pipe_cpu_s'] * 1e3:.2f} ms over {drv['pipe_wall_s']:.2f} s")))
            raw["idle_cpu"] = {"workers": idle, "driver": drv}

        if "c" in args.sections:
            # ---- c. bandwidth
            progress(f"[c] 64 MiB torch.float32 tensor argument, {bw_reps} calls (+{bw_warm} warm-up) "
                     "...")
            tensor = torch.arange(BIG // 4, dtype=torch.float32)
            memcpy_ts, np_ts = memcpy_baseline(9 if quick else 15)
            mc, npc = bw_stats(memcpy_ts), bw_stats(np_ts)
            one = bench_tensor(1, tensor, bw_reps, bw_warm)
            s = bw_stats(one)
            ratio = s["median"] / mc["median"]
            rows.append(row("64MiB tensor argument, 1 worker", "GB/s", s, mc, ratio,
                            ">= 0.3x memcpy", ratio >= 0.3, better="higher",
                            note=(f"median call {s['median_ms']:.1f} ms; baseline torch copy_ 1 "
                                  f"thread {mc['median_ms']:.1f} ms; numpy copyto "
                                  f"{npc['median']:.2f} GB/s")))
            two = bench_tensor(2, tensor, bw_reps, bw_warm)
            s2 = bw_stats(two)
            rows.append(row("64MiB tensor argument, 2 workers (broadcast)", "GB/s", s2, mc,
                            s2["median"] / mc["median"], "info", None, better="higher"))
            pipe_ts = bench_tensor_pipe(tensor, max(3, bw_reps // 2), 1)
            sp = bw_stats(pipe_ts)
            rows.append(row("64MiB as numpy over the Pipe RPC loop, 1 child", "GB/s", sp, mc,
                            sp["median"] / mc["median"], "info", None, better="higher",
                            note=f"mpx / Pipe RPC = {s['median'] / sp['median']:.2f}x the GB/s"))
            raw["bandwidth_ms"] = {"memcpy_torch": [t * 1e3 for t in memcpy_ts],
                                   "memcpy_numpy": [t * 1e3 for t in np_ts],
                                   "mpx_1": [t * 1e3 for t in one], "mpx_2": [t * 1e3 for t in two],
                                   "pipe_numpy_1": [t * 1e3 for t in pipe_ts]}
            del tensor
        if "d" in args.sections:
            section_d(rows, raw, quick, args.ab)
    finally:
        cleanup_procs()

    elapsed = time.perf_counter() - t_start
    finish(args, header, rows, raw, elapsed, timed="call time",
           png_title=(f"mpx.Executor vs baselines (os.cpu_count()={os.cpu_count()}, "
                      f"affinity {len(os.sched_getaffinity(0))})"), png_pad=2.0, reap_s=0.2)
    return 0


if __name__ == "__main__":
    main()
    sys.exit(0)
