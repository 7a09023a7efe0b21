"""Benchmark of multi-node mpx.Executors over loopback TCP, against bare pyzmq baselines
measured in the same run.

    python bench/bench_remote.py [--quick] [--png out.png] [--json out.json]

The "remote" node is a follower, ``python -m mpx node --node-rank 1 --nnodes 2``, started
here as a subprocess with MPX_AUTH_KEY set and bench/ on its PYTHONPATH (it imports the
worker class, _remote_workers.RemoteWorker, by name); the driver is the leader. Every byte
to the follower crosses tcp://127.0.0.1, on the same cores as the driver. Measurements
(medians and p90 over repetitions):

1. round trip of a no-op collective_rpc, 2 nodes x 1 rank (world_size=2, nnodes=2: rank 0
   on the driver's node over shared memory, rank 1 on the follower over ZeroMQ), vs a
   bare pyzmq REQ/REP round trip of a 100-byte message over tcp://127.0.0.1 (a child
   process whose REP socket echoes it).                       target: <= 1.5x REQ/REP
   The same with unique_reply_rank=1, and a single-node executor with transport="zmq"
   (its one rank reached over ZeroMQ exactly as a remote one is, no shared-memory rank):
   informational. All are timed in alternating blocks, every process up at once. Then
   REQ/REP again with every thread of the driver and of the REP child pinned to one CPU,
   and to two (informational: the baseline is ~40 us on one CPU, ~60-75 us across two on
   this kind of VM, and the scheduler picks either).
2. a 64 MiB torch.float32 tensor (numpy float32 without torch) as the argument of a call
   to world_size=4, nnodes=2 (ranks 0, 1 local, ranks 2, 3 on the follower); the method
   returns a tiny tuple. GB/s = bytes delivered to the remote ranks / median call time
   = 2 x 64 MiB / t, vs a bare pyzmq PUSH streaming the same bytes to 2 PULL children
   (one 64 MiB message each, sent and received with copy=False, each acked back).
                                                               target: >= 0.6x PUSH/PULL
   Also (informational): the loopback bytes per call (/proc counters of lo, psutil), the
   time at which each rank's method started, and, in the driver, HMAC-SHA256 over 64 MiB
   (mpx signs every message and checks it on every remote reader) and mpx's seal() of the
   whole message (allocate one frame, copy the message in, HMAC it).

3. launchers (needs ray: pip install 'mpx[ray]'; skipped without it): a
   ray.cluster_utils.Cluster of 2 raylets on 127.0.0.1 in this run, and 2 nodes x 2 ranks
   (world_size=4, nnodes=2) started three ways, all up at once and timed in alternating
   blocks: mpx with launcher="ray" (a placement group, a follower actor on the other node),
   mpx with the follower started by `python -m mpx node` as in 1 and 2, and 4 Ray actors
   (2 per node, a STRICT_SPREAD placement group) called with ray.get on 4 actor calls.
   No-op round trip: Ray-placed within 1.1x the `mpx node` one, and at least 5x faster
   than the Ray actors. Then the time from nothing to the first call's answer, each way
   (Ray itself already up): informational.

It is a benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time

import _remote_workers as RW
import numpy as np
import psutil
import zmq
from _report import BIG, MiB, finish, interleaved, last_cpu, parse_args, row, timed_us

import mpx
import mpx._impl
from mpx import serde
from mpx._cli.benchkit import (
    CTX,
    alive,
    child_pids,
    cleanup_procs,
    join,
    print_header,
    progress,
    ray_loopback_env,
    start,
    stats,
    time_calls,
)
from mpx._procinfo import free_tcp_port
from mpx.auth import digest, seal
from mpx.transport.zmq import _HEADER, MAGIC, VERSION, split

try:
    import torch
except ImportError:
    torch = None

SETUP_TIMEOUT = 60.0
CALL_TIMEOUT = 60.0
SETTLE_S = 0.5
SMALL = b"x" * 100
KEY = secrets.token_hex(32)
BENCH = os.path.dirname(os.path.abspath(__file__))
MPX_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mpx.__file__)))

followers: list = []  # (Popen, log file) not waited for yet


# --------------------------------------------------------------------------- follower

def free_port():
    return free_tcp_port("127.0.0.1")


def _follower_log(log):
    log.seek(0)
    text = log.read().decode(errors="replace").strip()
    return "\n".join(text.splitlines()[-20:])


def stop_follower(proc, log, timeout=15.0):
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        print(f"  warning: follower {proc.pid} did not exit, killing it", flush=True)
        proc.kill()
        rc = proc.wait()
    if rc != 0:
        print(f"  warning: follower exited with {rc}; its output:\n{_follower_log(log)}",
              flush=True)
    log.close()
    followers.remove((proc, log))


class Group:
    """A leader executor (this process) with one follower node on loopback."""

    def __init__(self, world_size):
        port = free_port()
        env = dict(os.environ, MPX_AUTH_KEY=KEY,
                   PYTHONPATH=os.pathsep.join([BENCH, MPX_ROOT] + [
                       p for p in [os.environ.get("PYTHONPATH")] if p]))
        log = tempfile.TemporaryFile()  # unlinked already: nothing left behind
        self.follower = subprocess.Popen(
            [sys.executable, "-m", "mpx", "node", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--node-rank", "1", "--nnodes", "2"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        self.log = log
        followers.append((self.follower, log))
        child_pids.add(self.follower.pid)
        try:
            self.ex = mpx.Executor(RW.RemoteWorker, world_size, nnodes=2, master_port=port,
                                   auth_key=KEY, startup_timeout_s=SETUP_TIMEOUT)
        except BaseException:
            self.follower.kill()
            self.follower.wait()
            print(f"follower output:\n{_follower_log(log)}", flush=True)
            log.close()
            followers.remove((self.follower, log))
            raise
        child_pids.update(self.ex.worker_pids)
        self.remote_pids = self.ex.worker_pids[world_size // 2:]

    def close(self):
        self.ex.shutdown()
        stop_follower(self.follower, self.log)
        deadline = time.monotonic() + 5
        while alive(self.remote_pids) and time.monotonic() < deadline:
            time.sleep(0.02)


def cleanup_followers():
    for proc, log in list(followers):
        if proc.poll() is None:
            proc.kill()
        stop_follower(proc, log, 5.0)


# --------------------------------------------------------------------------- baselines

class ReqRep:
    """A REQ socket to a child's echoing REP, over tcp://127.0.0.1."""

    def __init__(self):
        a, b = CTX.Pipe()
        self.proc = start(RW.rep_echo_child, (b,))
        b.close()
        if not a.poll(SETUP_TIMEOUT):
            raise RuntimeError("REP child did not come up")
        port = a.recv()
        a.close()
        self.ctx = zmq.Context()
        self.req = self.ctx.socket(zmq.REQ)
        self.req.setsockopt(zmq.LINGER, 0)
        self.req.connect(f"tcp://127.0.0.1:{port}")

    def call(self):
        self.req.send(SMALL)
        if len(self.req.recv()) != len(SMALL):
            raise RuntimeError("REP child echoed something else")

    def close(self):
        try:
            self.req.send(b"")
            if self.req.poll(5000):
                self.req.recv()
        finally:
            join(self.proc, 10, what="REP child")
            self.req.close()
            self.ctx.term()


class PushPull:
    """A PUSH to ``n`` PULL children; each acks every message on a PUSH back to us."""

    def __init__(self, n):
        self.n = n
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.acks = self.ctx.socket(zmq.PULL)
        for s in (self.push, self.acks):
            s.setsockopt(zmq.LINGER, 0)
        push_port = self.push.bind_to_random_port("tcp://127.0.0.1")
        ack_port = self.acks.bind_to_random_port("tcp://127.0.0.1")
        self.procs = []
        for i in range(n):
            a, b = CTX.Pipe()
            self.procs.append(start(RW.pull_ack_child, (i, push_port, ack_port, b)))
            b.close()
            if not a.poll(SETUP_TIMEOUT):
                raise RuntimeError("PULL child did not come up")
            a.recv()
            a.close()
        # PUSH deals round-robin over the connected PULLs: probe until every child answers.
        seen = set()
        deadline = time.monotonic() + SETUP_TIMEOUT
        while len(seen) < n:
            if time.monotonic() > deadline:
                raise RuntimeError("PULL children never all connected")
            self.push.send(b"p")
            if self.acks.poll(100):
                seen.add(self._ack()[0])
        time.sleep(0.1)
        while self.acks.poll(0):
            self._ack()

    def _ack(self):
        a = self.acks.recv()
        return int.from_bytes(a[:4], "little"), int.from_bytes(a[4:], "little")

    def round(self, buf, nbytes):
        """One message of ``buf`` to each child; returns once every child acked it."""
        for _ in range(self.n):
            self.push.send(buf, copy=False)
        got = sorted(self._ack() for _ in range(self.n))
        if got != [(i, nbytes) for i in range(self.n)]:
            raise RuntimeError(f"PULL children acked {got}, expected one {nbytes}-byte "
                               "message each")

    def close(self):
        for _ in range(self.n):
            self.push.send(b"")
        for p in self.procs:
            join(p, 10, what="PULL child")
        self.push.close()
        self.acks.close()
        self.ctx.term()


# --------------------------------------------------------------------------- helpers

def lo_bytes():
    c = psutil.net_io_counters(pernic=True).get("lo")
    return None if c is None else c.bytes_sent


def bw_stats2(ts, nbytes):
    """GB/s stats for ``nbytes`` per call: median, and 'p90' = GB/s at the p90 (slow) time."""
    s = stats(ts)
    return {"median": nbytes / s["median"] / 1e9, "p90": nbytes / s["p90"] / 1e9,
            "best": nbytes / s["min"] / 1e9, "n": s["n"], "median_ms": s["median"] * 1e3}


def ms_stats(ts):
    s = stats(ts)
    return {k: (v * 1e3 if k != "n" else v) for k, v in s.items()}


# --------------------------------------------------------------------------- 1. no-op

def bench_noop(iters, warm, blocks=4):
    """Every side up at once; timed in alternating blocks so that drift hits all."""
    group = zgrp = base = None
    try:
        group = Group(2)
        zex = mpx.Executor(RW.RemoteWorker, 1, transport="zmq", startup_timeout_s=SETUP_TIMEOUT)
        zgrp = zex
        child_pids.update(zex.worker_pids)
        base = ReqRep()
        ex = group.ex

        def mpx_call():
            ex.collective_rpc("noop", timeout=CALL_TIMEOUT)

        def uniq_call():
            ex.collective_rpc("noop", timeout=CALL_TIMEOUT, unique_reply_rank=1)

        def zmq_call():
            zex.collective_rpc("noop", timeout=CALL_TIMEOUT)

        if ex.collective_rpc("noop") != [None, None] or zex.collective_rpc("noop") != [None]:
            raise RuntimeError("no-op call returned something else than None")
        fns = [mpx_call, base.call, uniq_call, zmq_call]
        out = interleaved(fns, warm, iters, blocks, SETTLE_S)
        pinned = {}
        if len(os.sched_getaffinity(0)) >= 2:
            pinned = _pinned_reqrep(base, max(500, iters // 4))
        return {"mpx": out[mpx_call], "reqrep": out[base.call], "unique": out[uniq_call],
                "zmq_only": out[zmq_call], "pinned": pinned,
                "cpus": {"driver": last_cpu(os.getpid()), "REP child": last_cpu(base.proc.pid),
                         "follower worker": last_cpu(group.remote_pids[0])}}
    finally:
        if base is not None:
            base.close()
        if zgrp is not None:
            zgrp.shutdown()
        if group is not None:
            group.close()


def _pinned_reqrep(base, iters):
    """REQ/REP medians with every thread of the driver on one CPU and every thread of the
    REP child on the same CPU, or on another: the placement the scheduler picks moves the
    baseline a lot (no cross-CPU wake-up when both share a CPU)."""
    pids = (os.getpid(), base.proc.pid)
    saved = {t.id: os.sched_getaffinity(t.id) for pid in pids
             for t in psutil.Process(pid).threads()}
    a, b = sorted(os.sched_getaffinity(0))[:2]
    out = {}
    try:
        for place, cpu in (("same CPU", a), ("different CPUs", b)):
            for pid, c in zip(pids, (a, cpu)):
                for t in psutil.Process(pid).threads():
                    os.sched_setaffinity(t.id, {c})
            out[place] = stats(timed_us(base.call, iters, warm=iters // 5))
    finally:
        for tid, cpus in saved.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass
    return out


# --------------------------------------------------------------------------- 2. 64 MiB

def make_tensor():
    if torch is not None:
        return torch.arange(BIG // 4, dtype=torch.float32), "torch.float32"
    return np.arange(BIG // 4, dtype=np.float32), "numpy float32"


def bench_tensor(tensor, reps, warm):
    """mpx calls and PUSH/PULL rounds, interleaved (order alternating), both sides up."""
    n = int(tensor.shape[0])
    arr = tensor.numpy() if torch is not None else tensor
    group = base = None
    try:
        group = Group(4)
        base = PushPull(2)
        ex = group.ex
        out = {"mpx_s": [], "base_s": [], "mpx_lo": [], "base_lo": [], "arrive_ms": []}

        def mpx_call(timed):
            b0, t0 = lo_bytes(), time.perf_counter()
            res = ex.collective_rpc("take", args=(tensor,), timeout=CALL_TIMEOUT)
            t1, b1 = time.perf_counter(), lo_bytes()
            if [r[1] for r in res] != [n] * 4:
                raise RuntimeError(f"ranks received {[r[1] for r in res]} elements, "
                                   f"expected {n}")
            if timed:
                out["mpx_s"].append(t1 - t0)
                out["arrive_ms"].append([(r[0] - t0) * 1e3 for r in res])
                if b0 is not None:
                    out["mpx_lo"].append(b1 - b0)

        def base_round(timed):
            b0, t0 = lo_bytes(), time.perf_counter()
            base.round(arr, BIG)
            t1, b1 = time.perf_counter(), lo_bytes()
            if timed:
                out["base_s"].append(t1 - t0)
                if b0 is not None:
                    out["base_lo"].append(b1 - b0)

        for i in range(warm + reps):
            pair = (mpx_call, base_round) if i % 2 == 0 else (base_round, mpx_call)
            for fn in pair:
                fn(i >= warm)
        return out
    finally:
        if base is not None:
            base.close()
        if group is not None:
            group.close()


def bench_breakdown(tensor, reps):
    """In the driver: HMAC-SHA256 of 64 MiB under the key (as mpx.auth.digest);
    seal() of every chunk of the call's message (what ZmqWriter.write does once per call),
    and the bytes of those frames; and the reassembly of 64 MiB from 1 MiB chunks into a
    fresh buffer (what each remote reader does after checking each chunk's HMAC)."""
    key = KEY.encode()
    msg = (0, 0, "take", (tensor,), None, None)  # the executor's CALL tuple
    kind, parts = serde.encode(msg)
    size = mpx.Config.from_env().max_chunk_bytes
    total = sum(memoryview(p).nbytes for p in parts)
    count = -(-total // size)
    payload = memoryview(tensor.numpy() if torch is not None else tensor).cast("B")
    hmac_ts = time_calls(lambda: digest(key, payload), reps, warm=1)
    frame_len = [0]

    def do_seal():
        frame_len[0] = sum(len(seal(key, _HEADER.pack(MAGIC, VERSION, kind, 0, 0, i, count,
                                                       total), chunk))
                           for i, chunk in enumerate(split(parts, size, total)))
    seal_ts = time_calls(do_seal, reps, warm=1)
    buffers = mpx._impl.buffers_module()

    def reassemble():
        out = buffers.Assembler(BIG, False)
        for i in range(0, BIG, size):
            out.add(payload[i:i + size])
        return out.result()
    copy_ts = time_calls(reassemble, reps, warm=1)
    return hmac_ts, seal_ts, copy_ts, frame_len[0]


# --------------------------------------------------------------------------- 3. launchers

RAY_NODE_CPUS = 4  # logical: the mpx bundles (2 CPUs a node) and the actors' (2) at once


def _ray_cluster():
    """(ray, Cluster) with 2 raylets on 127.0.0.1, this process connected to the head.
    Call it inside ray_loopback_env()."""
    # read by ray at import: keep a cluster without addresses on loopback
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # the raylets' workers import mpx and _remote_workers by name
    os.environ["PYTHONPATH"] = os.pathsep.join([BENCH, MPX_ROOT] + [
        p for p in [os.environ.get("PYTHONPATH")] if p])
    import ray
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=RAY_NODE_CPUS, node_ip_address="127.0.0.1", include_dashboard=False))
    cluster.add_node(num_cpus=RAY_NODE_CPUS, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, logging_level="warning")
    cluster.wait_for_nodes(timeout=SETUP_TIMEOUT)
    return ray, cluster


class RayActors:
    """``n`` RW.RayNoop actors, half on each node of a STRICT_SPREAD placement group."""

    def __init__(self, ray, n):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.ray = ray
        self.pg = placement_group([{"CPU": n // 2}] * 2, strategy="STRICT_SPREAD")
        ray.get(self.pg.ready(), timeout=SETUP_TIMEOUT)
        cls = ray.remote(num_cpus=1)(RW.RayNoop)
        self.actors = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=i // (n // 2))).remote() for i in range(n)]

    def call(self):
        if self.ray.get([a.noop.remote() for a in self.actors], timeout=CALL_TIMEOUT) \
                != [None] * len(self.actors):
            raise RuntimeError("a Ray actor's no-op returned something else than None")

    def close(self):
        from ray.util.placement_group import remove_placement_group
        for a in self.actors:
            self.ray.kill(a)
        remove_placement_group(self.pg)


def _first_call(make):
    """(seconds from nothing to the first no-op's answer, what make() returned)."""
    t0 = time.perf_counter()
    obj = make()
    ex = obj.ex if isinstance(obj, Group) else obj
    ex.collective_rpc("noop", timeout=CALL_TIMEOUT)
    return time.perf_counter() - t0, obj


def _ray_executor():
    ex = mpx.Executor(RW.RemoteWorker, 4, nnodes=2, launcher="ray", ray_cpus_per_worker=1.0,
                      startup_timeout_s=SETUP_TIMEOUT)
    child_pids.update(ex.worker_pids[:2])  # (the follower's are the actor's children)
    return ex


def bench_launchers(iters, warm, reps, blocks=4):
    """No-op round trips, the three ways interleaved; then the startup of each, ``reps``
    times alternating. Ray actor calls are slower: they run iters // 10 calls a block."""
    with ray_loopback_env():
        return _bench_launchers(iters, warm, reps, blocks)


def _bench_launchers(iters, warm, reps, blocks):
    ray, cluster = _ray_cluster()
    started: list = []
    try:
        t_ray, rex = _first_call(_ray_executor)
        started.append(rex)
        t_node, group = _first_call(lambda: Group(4))
        started.append(group)
        t0 = time.perf_counter()
        actors = RayActors(ray, 4)
        started.append(actors)
        actors.call()
        t_actors = time.perf_counter() - t0

        def ray_placed():
            rex.collective_rpc("noop", timeout=CALL_TIMEOUT)

        def node_started():
            group.ex.collective_rpc("noop", timeout=CALL_TIMEOUT)

        fns = [(ray_placed, iters), (node_started, iters), (actors.call, max(50, iters // 10))]
        end = time.perf_counter() + SETTLE_S
        i = 0
        while i < warm or time.perf_counter() < end:
            for fn, _ in fns:
                fn()
            i += 1
        out: dict = {fn: [] for fn, _ in fns}
        for b in range(blocks):
            for fn, n in (fns if b % 2 == 0 else fns[::-1]):
                out[fn].extend(timed_us(fn, max(1, n // blocks)))
        for obj in started:
            obj.close() if not isinstance(obj, mpx.Executor) else obj.shutdown()
        started.clear()
        startup: dict = {"ray": [t_ray], "node": [t_node]}
        for _ in range(reps - 1):
            for name, make in (("node", lambda: Group(4)), ("ray", _ray_executor)):
                t, obj = _first_call(make)
                startup[name].append(t)
                obj.close() if isinstance(obj, Group) else obj.shutdown()
        return {"ray": out[ray_placed], "node": out[node_started], "actors": out[actors.call],
                "startup_s": startup, "actors_startup_s": t_actors}
    finally:
        for obj in started:
            try:
                obj.close() if not isinstance(obj, mpx.Executor) else obj.shutdown()
            except Exception as e:
                print(f"  warning: could not close {obj}: {e}", flush=True)
        ray.shutdown()
        cluster.shutdown()


def launcher_rows(r):
    rs, ns, acts = stats(r["ray"]), stats(r["node"]), stats(r["actors"])
    rows = []
    ratio = rs["median"] / ns["median"]
    rows.append(row("no-op, 2 nodes x 2 ranks, launcher='ray' vs `mpx node`", "us", rs, ns,
                    ratio, "<= 1.10x mpx node", ratio <= 1.1,
                    note=("the same executor and queues; only who started the follower "
                          "differs (a Ray actor in a placement group, or a subprocess)")))
    ratio = rs["median"] / acts["median"]
    rows.append(row("  launcher='ray' vs Ray actors (ray.get on 4 actor calls, 2 per node)",
                    "us", rs, acts, ratio, "<= 0.20x (mpx >= 5x faster)", ratio <= 0.2,
                    note=(f"mpx is {1 / ratio:.1f}x faster than the same 4 workers as Ray "
                          "actors")))
    for name, key in (("launcher='ray'", "ray"), ("`python -m mpx node`", "node")):
        ts = [t * 1e3 for t in r["startup_s"][key]]
        rows.append(row(f"  startup to the first call's answer, {name}", "ms", stats(ts),
                        None, None, "info", None,
                        note=(f"{len(ts)} starts; Ray already up and connected"
                              if key == "ray" else f"{len(ts)} starts, the subprocess "
                              "included")))
    rows.append(row("  startup of 4 Ray actors to the first ray.get", "ms",
                    stats([r["actors_startup_s"] * 1e3]), None, None, "info", None))
    return rows


# --------------------------------------------------------------------------- main

def _more(ap):
    ap.add_argument("--launchers-only", action="store_true",
                    help="run section 3 alone (launcher='ray' against `mpx node` and Ray actors)")


def main():
    args = parse_args(__doc__, "fewer repetitions (~15 s instead of ~35 s)", _more)
    quick = args.quick
    noop_iters, noop_warm = (2000, 200) if quick else (12000, 1000)
    bw_reps, bw_warm = (5, 1) if quick else (15, 2)
    br_reps = 3 if quick else 7

    t_start = time.perf_counter()
    header = print_header(
        quick, "remote (multi-node) executor benchmark",
        "the driver, its local workers, the follower node and its workers, and the "
        "baselines' children all share them; loopback TCP stands in for the network, so "
        "sender and receiver pay their CPU on the same cores",
        torch=torch.__version__ if torch is not None else "not installed",
        pyzmq=zmq.__version__, libzmq=zmq.zmq_version())
    header["loadavg_start"] = os.getloadavg()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in header['loadavg_start'])} "
          "(other busy processes on these cores skew every number)", flush=True)

    rows = []
    raw: dict = {}
    try:
        if args.launchers_only:
            _launchers(rows, raw, noop_iters, noop_warm, 2 if quick else 4)
            return _finish(args, header, rows, raw, t_start)
        # ---- 1. no-op round trip
        progress(f"[1] no-op collective_rpc, 2 nodes x 1 rank, {noop_iters} calls each of 4 "
                 "loops ...")
        r = bench_noop(noop_iters, noop_warm)
        m, b = stats(r["mpx"]), stats(r["reqrep"])
        u, z = stats(r["unique"]), stats(r["zmq_only"])
        ratio = m["median"] / b["median"]
        rows.append(row("no-op round trip, 2 nodes x 1 rank (world_size=2)", "us", m, b, ratio,
                        "<= 1.50x REQ/REP", ratio <= 1.5,
                        note=("rank 0 local over shared memory, rank 1 on the follower over "
                              "ZeroMQ; baseline: pyzmq REQ/REP of 100 bytes, tcp://127.0.0.1")))
        for place, pst in r["pinned"].items():
            rows.append(row(f"  vs REQ/REP pinned, driver and REP child on {place}", "us", m, pst,
                            m["median"] / pst["median"], "info", None))
        rows[-1]["note"] = (f"mpx (unpinned) against the baseline with a fixed placement; last "
                            f"CPUs in the unpinned run: {r['cpus']}")
        rows.append(row("  same, unique_reply_rank=1", "us", u, b, u["median"] / b["median"],
                        "info", None))
        rows.append(row("  1 rank over ZeroMQ only (1 node, transport='zmq')", "us", z, b,
                        z["median"] / b["median"], "info", None,
                        note=("a multi-node executor always has ranks on the driver's node; "
                              "this single-node executor reaches its only rank over ZeroMQ as "
                              "a remote one is (driver -> ROUTER/DEALER -> worker -> "
                              "ROUTER/DEALER -> driver, HMAC both ways)")))
        raw["noop_us"] = {"mpx": m, "reqrep": b, "unique_reply_rank_1": u, "zmq_only_1": z,
                          "reqrep_pinned": r["pinned"], "last_cpus": r["cpus"]}

        # ---- 2. 64 MiB argument
        tensor, tkind = make_tensor()
        progress(f"[2] 64 MiB {tkind} argument to world_size=4, nnodes=2, {bw_reps} calls "
                 f"(+{bw_warm} warm-up), interleaved with PUSH/PULL rounds ...")
        t = bench_tensor(tensor, bw_reps, bw_warm)
        hmac_ts, seal_ts, copy_ts, frame_len = bench_breakdown(tensor, br_reps)
        delivered = 2 * BIG
        s, sb = bw_stats2(t["mpx_s"], delivered), bw_stats2(t["base_s"], delivered)
        ratio = s["median"] / sb["median"]
        arr = np.asarray(t["arrive_ms"])           # (reps, 4) ms after the call started
        arrive = np.median(arr, axis=0)
        hm, sm, cm = ms_stats(hmac_ts), ms_stats(seal_ts), ms_stats(copy_ts)
        rows.append(row("64MiB argument, 2 remote ranks (world_size=4, nnodes=2)", "GB/s", s, sb,
                        ratio, ">= 0.60x PUSH/PULL", ratio >= 0.6, better="higher",
                        note=(f"GB/s = 2 x 64 MiB / call time; median call "
                              f"{s['median_ms']:.1f} ms, PUSH->2 PULL round {sb['median_ms']:.1f}"
                              f" ms; each rank's method started (median, ms after the call "
                              f"began) at rank 0 {arrive[0]:.1f}, 1 {arrive[1]:.1f} (local), "
                              f"2 {arrive[2]:.1f}, 3 {arrive[3]:.1f} (remote)")))
        rows.append(row("  HMAC-SHA256 of 64 MiB, 1 thread (driver)", "ms", hm, None, None,
                        "info", None,
                        note=(f"{BIG / hm['median'] * 1e3 / 1e9:.2f} GB/s; mpx runs it on every "
                              "message: once in seal() on the driver, once in each remote "
                              "reader's unseal() (the 2 remote readers share the cores)")))
        rows.append(row("  seal() of every chunk of the call message (driver)", "ms",
                        sm, None, None, "info", None,
                        note=(f"{frame_len / MiB:.4f} MiB of frames per call (chunks of "
                              "max_chunk_bytes, each copied into a frame and HMACed), each "
                              "frame sent (zero-copy) to every remote rank")))
        rows.append(row("  reassembly of 64 MiB from 1 MiB chunks into a new buffer (driver)",
                        "ms", cm, None, None, "info", None,
                        note=("each remote reader copies every checked chunk into the "
                              "message's buffer (huge-page advice with the compiled ring), "
                              "besides libzmq's own receive buffer")))
        if t["mpx_lo"]:
            lm = stats([x / MiB for x in t["mpx_lo"]])
            lb = stats([x / MiB for x in t["base_lo"]])
            over = lm["median"] * MiB - delivered
            rows.append(row("  loopback bytes per call to the follower", "MiB", lm, lb,
                            lm["median"] / lb["median"], "info", None,
                            note=(("relay (MPX_RELAY=auto with 2 ranks per node, or on): the "
                                   f"follower takes each call once, {over / 1024:.0f} KiB over "
                                   "one 64 MiB copy"
                                   if mpx.Config.from_env().relays(2) else
                                   "direct subscription (MPX_RELAY=off): one copy per remote "
                                   f"rank, 2 x 64 MiB + {over / 1024:.0f} KiB")
                                  + f" (chunk headers and HMACs {frame_len - BIG} B over the tensor, ZMTP, "
                                  "TCP/IP headers, replies, heartbeats; lo tx counter); "
                                  "baseline = the PUSH->2 PULL round")))
        raw["tensor"] = {"kind": tkind, "mpx_ms": [x * 1e3 for x in t["mpx_s"]],
                         "pushpull_ms": [x * 1e3 for x in t["base_s"]],
                         "rank_start_ms": t["arrive_ms"], "lo_bytes_mpx": t["mpx_lo"],
                         "lo_bytes_pushpull": t["base_lo"], "frame_bytes": frame_len,
                         "hmac_64MiB_ms": [x * 1e3 for x in hmac_ts],
                         "seal_ms": [x * 1e3 for x in seal_ts],
                         "new_bytearray_copy_ms": [x * 1e3 for x in copy_ts]}
        del tensor
        _launchers(rows, raw, noop_iters, noop_warm, 2 if quick else 4)
    finally:
        cleanup_procs()
        cleanup_followers()
    return _finish(args, header, rows, raw, t_start)


def _launchers(rows, raw, iters, warm, reps):
    import importlib.util
    if importlib.util.find_spec("ray") is None:  # (not imported yet: see _ray_cluster)
        print("[3] launchers: skipped (ray is not installed: pip install 'mpx[ray]')",
              flush=True)
        return
    print(f"[3] no-op, 2 nodes x 2 ranks: launcher='ray', `mpx node` and Ray actors, {iters} "
          f"calls each ({iters // 10} for the actors); then {reps} starts each ...", flush=True)
    try:
        r = bench_launchers(iters, warm, reps)
    finally:
        cleanup_procs()
        cleanup_followers()
    rows.extend(launcher_rows(r))
    raw["launchers"] = {"ray_noop_us": stats(r["ray"]), "node_noop_us": stats(r["node"]),
                        "ray_actors_us": stats(r["actors"]), "startup_s": r["startup_s"],
                        "ray_actors_startup_s": r["actors_startup_s"]}


def _finish(args, header, rows, raw, t_start):
    elapsed = time.perf_counter() - t_start
    header["loadavg_end"] = os.getloadavg()
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in header['loadavg_end'])}")
    finish(args, header, rows, raw, elapsed,
           timed="call time; the 64MiB row counts 2 x 64 MiB, one per remote rank",
           png_title=(f"mpx multi-node Executor over loopback vs pyzmq (os.cpu_count()="
                      f"{os.cpu_count()}, affinity {len(os.sched_getaffinity(0))})"),
           png_pad=2.0, reap_s=0.2)
    return 0


if __name__ == "__main__":
    main()
    sys.exit(0)
