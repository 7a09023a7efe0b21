"""Multi-node mpx.Executors over loopback TCP, against bare pyzmq baselines measured in the same run.

    python bench/bench_remote.py [--quick] [--zmq-only | --launchers-only] [--ab REV] [--png P] [--json P]

The "remote" node is a follower, ``python -m mpx node --node-rank 1 --nnodes 2``, started here with
MPX_AUTH_KEY set and bench/ on its PYTHONPATH (its workers import kit_rpc.Worker by name); the driver is
the leader. Every byte to the follower crosses tcp://127.0.0.1, on the same cores as the driver.
``MPX_RELAY=off`` (or ``on``) is passed on to the follower. Medians and p90 over repetitions:

1. a no-op's round trip, 2 nodes x 1 rank (rank 0 over shared memory, rank 1 on the follower over
   ZeroMQ), vs a pyzmq REQ/REP round trip of 100 bytes over tcp://127.0.0.1 to a child that echoes
   it.                                                                target: <= 1.5x REQ/REP
   The same with unique_reply_rank=1: informational. Then a single-node executor with
   transport="zmq" (its one rank reached over ZeroMQ as a remote one is: HMAC-signed frames over
   tcp://127.0.0.1 both ways) vs a pyzmq REQ/REP loop of the same call, pickled, to a child that
   unpickles it, calls kit_rpc.Worker's method and sends the pickled reply: what ZeroMQ, pickle and
   the method cost by themselves.                                     target: <= 1.10x that REQ/REP
   Every side is up at once and timed in alternating blocks. Then where those two spend their
   time (informational): the CPU per call of the driver's and the worker's main and ZeroMQ I/O
   threads (schedstat, over blocks taking turns), and both round trips again with every thread
   of both sides on one CPU (kit_cpus.on_one_cpu), where a round trip is what its threads' work costs
   one after the other, with no idle CPU to wake. ``--zmq-only`` runs this comparison alone
   (~15 s). With ``--ab REV``, the transport="zmq" no-op also against git revision REV
   (kit_ab.ab_paired: one child a side, taking turns in blocks of AB_BLOCK calls; the median of
   the blocks' paired ratios).
2. a 64 MiB torch.float32 tensor (numpy without torch) as the argument of a call to 2 nodes x 2
   ranks: GB/s = the bytes delivered to the remote ranks (2 x 64 MiB) / call time, vs a pyzmq PUSH
   streaming the same bytes to 2 PULL children (copy=False, each acked back).
                                                                      target: >= 0.6x PUSH/PULL
3. launchers (needs ray: pip install 'mpx[ray]'; skipped without it): a ray.cluster_utils.Cluster of
   2 raylets on 127.0.0.1, and 2 nodes x 2 ranks started three ways, all up at once, timed in
   alternating blocks: launcher="ray", the follower started by `python -m mpx node` as in 1 and 2,
   and 4 Ray actors (2 per node) called with ray.get. No-op round trip: Ray-placed within 1.1x the
   `mpx node` one, and at least 5x faster than the Ray actors. Then the time from nothing to the
   first call's answer, each way (Ray itself already up): informational.

A benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

import kit_ab
import kit_args
import kit_cpus
import kit_procs
import kit_report
import kit_rpc
import kit_stats
import kit_timing
import zmq

import mpx
from mpx.protocol import wire

KEY = secrets.token_hex(32)
# Where a transport="zmq" no-op's time goes: the CPU per call of each process's threads, measured in
# this many blocks a side (its rows, in this order).
SPLIT_BLOCKS = 6
SPLIT_ROWS = (("driver", "main"), ("driver", "ZeroMQ I/O"), ("worker", "main"), ("worker", "ZeroMQ I/O"))
# --ab: the calls in a block of a side, and how many blocks a side (--quick: fewer)
AB_BLOCK = 300
AB_BLOCKS = (30, 100)
PATH = os.pathsep.join([kit_procs.BENCH, kit_procs.ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])


class Group:
    """A leader executor (this process) with one follower node on loopback."""

    def __init__(self, world_size):
        port, self.log = kit_procs.free_port(), tempfile.TemporaryFile()
        self.follower = subprocess.Popen(
            [sys.executable, "-m", "mpx", "node", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--node-rank", "1", "--nnodes", "2"], env=dict(os.environ, MPX_AUTH_KEY=KEY, PYTHONPATH=PATH),
            stdout=self.log, stderr=subprocess.STDOUT)
        kit_procs.child_pids.add(self.follower.pid)
        try:
            self.ex = kit_rpc.new_executor(world_size, nnodes=2, master_port=port, auth_key=KEY,
                                           startup_timeout_s=kit_rpc.SETUP_TIMEOUT)
        except BaseException:
            self.follower.kill()
            self.close()
            raise

    def close(self):
        if hasattr(self, "ex"):
            remote = self.ex.worker_pids[self.ex.world_size // 2:]
            self.ex.shutdown()
            deadline = time.monotonic() + 5
            while kit_procs.alive(remote) and time.monotonic() < deadline:
                time.sleep(0.02)
        try:
            rc = self.follower.wait(15)
        except subprocess.TimeoutExpired:
            self.follower.kill()
            rc = self.follower.wait()
        if rc:
            self.log.seek(0)
            print(f"  warning: the follower exited with {rc}:\n{self.log.read().decode()[-2000:]}")
        self.log.close()


def _rep_child(conn):
    """A REP socket on tcp://127.0.0.1 echoing every message; stops on an empty one."""
    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    conn.send(rep.bind_to_random_port("tcp://127.0.0.1"))
    conn.close()
    while msg := rep.recv():
        rep.send(msg)
    rep.send(b"")
    rep.close(linger=0)
    ctx.term()


def _call_rep_child(conn):
    """A REP socket on tcp://127.0.0.1 answering every pickled wire.call on kit_rpc.Worker, as an mpx
    worker does: unpickle, call the method, pickle ``(seq, OK, result)``; stops on an empty
    message."""
    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    conn.send(rep.bind_to_random_port("tcp://127.0.0.1"))
    conn.close()
    worker, loads, dumps = kit_rpc.Worker(), pickle.loads, pickle.dumps
    while msg := rep.recv():
        _, seq, method, args, kwargs, _ = loads(msg)
        rep.send(dumps((seq, wire.OK, getattr(worker, method)(*args, **(kwargs or {}))), 5))
    rep.send(b"")
    rep.close(linger=0)
    ctx.term()


def _pull_child(idx, push_port, ack_port):
    """A PULL from the driver's PUSH; acks each message with (idx, bytes); stops on b""."""
    ctx = zmq.Context()
    pull, ack = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(f"tcp://127.0.0.1:{push_port}")
    ack.connect(f"tcp://127.0.0.1:{ack_port}")
    while n := len(pull.recv(copy=False).buffer):
        ack.send(idx.to_bytes(4, "little") + n.to_bytes(4, "little"))
    pull.close(linger=0)
    ack.close(linger=0)
    ctx.term()


class ReqRep:
    """A REQ to a REP child: ``call()`` a 100-byte echo (with _rep_child), ``rpc(method)`` a pickled
    wire.call (with _call_rep_child)."""

    def __init__(self, child=_rep_child):
        a, b = kit_procs.CTX.Pipe()
        self.proc = kit_procs.start(child, (b,))
        self.seq = 0
        b.close()
        if not a.poll(kit_rpc.SETUP_TIMEOUT):
            raise RuntimeError("the REP child did not come up")
        self.ctx = zmq.Context()
        self.req = self.ctx.socket(zmq.REQ)
        self.req.connect(f"tcp://127.0.0.1:{a.recv()}")
        a.close()

    def call(self):
        self.req.send(b"x" * 100)
        if len(self.req.recv()) != 100:
            raise RuntimeError("the REP child echoed something else")

    def rpc(self, method):
        self.seq += 1
        self.req.send(pickle.dumps(wire.call(self.seq, method, (), None, None), 5))
        seq, status, result = pickle.loads(self.req.recv())
        if seq != self.seq or status != wire.OK:
            raise RuntimeError(f"the REP child answered {seq, status, result}")
        return result

    def close(self):
        self.req.send(b"")
        if self.req.poll(5000):
            self.req.recv()
        kit_procs.join(self.proc, 10, what="REP child")
        self.req.close(linger=0)
        self.ctx.term()


class PushPull:
    """A PUSH to ``n`` PULL children; each acks every message on a PUSH back to us."""

    def __init__(self, n):
        self.n, self.ctx = n, zmq.Context()
        self.push, self.acks = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in (self.push, self.acks)]
        self.procs = [kit_procs.start(_pull_child, (i, *ports)) for i in range(n)]
        seen, deadline = set(), time.monotonic() + kit_rpc.SETUP_TIMEOUT
        while len(seen) < n:  # PUSH deals round-robin: probe until every child answered
            if time.monotonic() > deadline:
                raise RuntimeError("the PULL children never all connected")
            self.push.send(b"p")
            if self.acks.poll(100):
                seen.add(self.acks.recv()[:4])
        time.sleep(0.1)
        while self.acks.poll(0):
            self.acks.recv()

    def round(self, buf):
        for _ in range(self.n):
            self.push.send(buf, copy=False)
        acked = [int.from_bytes(self.acks.recv()[4:], "little") for _ in range(self.n)]
        if acked != [kit_stats.BIG] * self.n:
            raise RuntimeError("a PULL child acked another size")

    def close(self):
        for _ in range(self.n):
            self.push.send(b"")
        for p in self.procs:
            kit_procs.join(p, 10, what="PULL child")
        for s in (self.push, self.acks):
            s.close(linger=0)
        self.ctx.term()


def bench_noop(iters, warm, zmq_only=False):
    """Stats of mpx (2 nodes x 1 rank), REQ/REP, unique_reply_rank=1; then of transport="zmq" and
    REQ/REP of the pickled call (those two alone with ``zmq_only``); then where those two spend
    their time: (cpu_split of each, their stats with every thread on one CPU)."""
    group = zex = base = calls = None
    try:
        zex = kit_rpc.new_executor(1, transport="zmq", startup_timeout_s=kit_rpc.SETUP_TIMEOUT)
        calls = ReqRep(_call_rep_child)
        sides = [(lambda: zex.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT), zex.worker_pids[0]),
                 (lambda: calls.rpc("noop"), calls.proc.pid)]
        fns = [fn for fn, _ in sides]
        if not zmq_only:
            group, base = Group(2), ReqRep()
            ex = group.ex
            fns = [lambda: ex.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT), base.call,
                   lambda: ex.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT, unique_reply_rank=1),
                   *fns]
        timed = [kit_stats.stats(v) for v in kit_timing.interleaved(fns, warm, iters, 4).values()]
        split = cpu_split(sides, max(1, iters // SPLIT_BLOCKS // 2), SPLIT_BLOCKS)
        with kit_cpus.on_one_cpu([pid for _, pid in sides]):
            one_cpu = [kit_stats.stats(v) for v in kit_timing.interleaved([fn for fn, _ in sides], warm,
                                                                         iters // 2, 4).values()]
        return timed, (split, one_cpu)
    finally:
        for obj in (calls, base, group):
            if obj is not None:
                obj.close()
        if zex is not None:
            zex.shutdown()


def cpu_split(sides, iters, blocks):
    """For each side ``(call, its worker's pid)``: {(who, thread role): stats of the CPU us per call
    over ``blocks`` blocks of ``iters`` calls, the sides taking turns}; who is "driver" (this
    process: its main thread makes the calls) or "worker"; roles as kit_cpus.thread_role."""
    me, out = os.getpid(), [{} for _ in sides]
    for b in range(blocks):
        for i in (range(len(sides)) if b % 2 == 0 else reversed(range(len(sides)))):
            fn, peer = sides[i]
            before = kit_cpus.cpu_ns_by_role((me, peer))
            for _ in range(iters):
                fn()
            for (pid, role), ns in kit_cpus.cpu_ns_by_role((me, peer)).items():
                us = (ns - before.get((pid, role), 0)) / iters / 1e3
                out[i].setdefault(("driver" if pid == me else "worker", role), []).append(us)
    return [{key: kit_stats.stats(v) for key, v in side.items()} for side in out]


def zmq_rows(rows, raw, z, c, where):
    rows.append(kit_report.row("no-op round trip, 1 rank over ZeroMQ only (1 node, transport='zmq')", "us",
                               z, c, "<= 1.10x REQ/REP", z["median"] / c["median"] <= 1.1,
                               note="baseline: pyzmq REQ/REP of the pickled call to a child that runs it and "
                                    "pickles the reply, tcp://127.0.0.1"))
    split, one_cpu = where
    rows.append(kit_report.row("  the same, every thread of both sides on one CPU", "us", *one_cpu,
                               note="kit_cpus.on_one_cpu: no idle CPU to wake, so the round trip is what its "
                               "threads' work costs, one after the other"))
    for who, role in SPLIT_ROWS:
        m, b = split[0].get((who, role)), split[1].get((who, role))
        if m is not None and b is not None:
            rows.append(kit_report.row(f"    CPU per call, the {who}'s {role} thread", "us CPU", m, b))
    raw["zmq_only_us"] = {"mpx": z, "reqrep_call": c,
                          "one_cpu": {"mpx": one_cpu[0], "reqrep_call": one_cpu[1]},
                          "cpu_us": [{f"{who} {role}": st for (who, role), st in side.items()}
                                     for side in split]}


def zmq_ab(rows, raw, rev, quick):
    """--ab REV: the transport="zmq" no-op of section 1, this tree against REV, paired."""
    blocks = AB_BLOCKS[0] if quick else AB_BLOCKS[1]
    kit_report.progress(f"[1] A/B transport='zmq' no-op vs {rev}, {blocks} blocks of {AB_BLOCK} a side ...")
    new, old, pairs = kit_ab.ab_paired(rev, __file__, "--ab-child", f"{AB_BLOCK},{AB_BLOCK}", blocks)
    rows.append(kit_report.row(f"  transport='zmq' no-op, vs {rev}", "us", new, old,
                               note=f"one child a side, taking turns; paired: median "
                                    f"{statistics.median(pairs):.3f}x, quartiles "
                                    f"{kit_stats.quartiles(pairs)}"))
    raw["zmq_ab"] = {"rev": rev, "new": new, "old": old, "paired": pairs}


def ab_child(block, warm):
    """--ab-child: this mpx's (or PYTHONPATH's) side of --ab, a transport="zmq" no-op as in section 1."""
    ex = kit_rpc.new_executor(1, transport="zmq", startup_timeout_s=kit_rpc.SETUP_TIMEOUT)
    try:
        kit_ab.serve_ab(lambda: ex.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT), block, warm,
                        pids=ex.worker_pids)
    finally:
        ex.shutdown()


def bench_tensor(tensor, reps, warm):
    """([s] of mpx calls, [s] of PUSH/PULL rounds), in turn, both sides up."""
    arr, n = tensor.numpy() if hasattr(tensor, "numpy") else tensor, int(tensor.shape[0])
    group = base = None
    try:
        group, base = Group(4), PushPull(2)

        def mpx_call():
            if group.ex.collective_rpc("take", args=(tensor,), timeout=kit_rpc.CALL_TIMEOUT) != [n] * 4:
                raise RuntimeError("a rank saw another size")
        return kit_timing.in_turn([mpx_call, lambda: base.round(arr)], reps, warm)
    finally:
        for obj in (base, group):
            if obj is not None:
                obj.close()


def bench_launchers(iters, warm, reps, blocks=4):
    """No-op round trips of the three ways, interleaved; then each way's startup."""
    with kit_procs.ray_loopback_env():
        # read by ray at import: a cluster without addresses stays on loopback; the raylets'
        # workers import mpx and kit by name
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ["PYTHONPATH"] = PATH
        import ray
        from ray.cluster_utils import Cluster
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=4, node_ip_address="127.0.0.1", include_dashboard=False))
        cluster.add_node(num_cpus=4, node_ip_address="127.0.0.1")
        ray.init(address=cluster.address, logging_level="warning")
        cluster.wait_for_nodes(timeout=kit_rpc.SETUP_TIMEOUT)
        started = []

        def first_call(make):
            t0 = time.perf_counter()
            started.append(obj := make())
            (obj.ex if isinstance(obj, Group) else obj).collective_rpc("noop")
            return time.perf_counter() - t0, obj

        def by_ray():
            return mpx.Executor(kit_rpc.Worker, 4, nnodes=2, launcher="ray", ray_cpus_per_worker=1.0,
                                startup_timeout_s=kit_rpc.SETUP_TIMEOUT)

        def close(obj):
            started.remove(obj)
            obj.close() if isinstance(obj, Group) else obj.shutdown()
        try:
            t_ray, rex = first_call(by_ray)
            t_node, group = first_call(lambda: Group(4))
            t0 = time.perf_counter()
            pg = placement_group([{"CPU": 2}] * 2, strategy="STRICT_SPREAD")
            ray.get(pg.ready(), timeout=kit_rpc.SETUP_TIMEOUT)
            actors = [ray.remote(num_cpus=1)(kit_rpc.Worker).options(scheduling_strategy=(
                PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i // 2))).remote()
                for i in range(4)]

            def actor_call():
                ray.get([a.noop.remote() for a in actors], timeout=kit_rpc.CALL_TIMEOUT)
            actor_call()
            t_actors = time.perf_counter() - t0
            fns = [(lambda: rex.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT), iters),
                   (lambda: group.ex.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT), iters),
                   (actor_call, max(50, iters // 10))]
            kit_timing.settle([fn for fn, _ in fns], 0.5, min_rounds=warm)
            out = {fn: [] for fn, _ in fns}
            for b in range(blocks):
                for fn, n in (fns if b % 2 == 0 else fns[::-1]):
                    out[fn] += kit_timing.timed_us(fn, max(1, n // blocks))
            for a in actors:
                ray.kill(a)
            close(rex)
            close(group)
            startup = {"ray": [t_ray], "node": [t_node]}
            for _ in range(reps - 1):
                for name, make in (("node", lambda: Group(4)), ("ray", by_ray)):
                    t, obj = first_call(make)
                    startup[name].append(t)
                    close(obj)
            return [kit_stats.stats(v) for v in out.values()], startup, t_actors
        finally:
            for obj in list(started):
                close(obj)
            ray.shutdown()
            cluster.shutdown()


def launchers(rows, raw, iters, warm, reps):
    if importlib.util.find_spec("ray") is None:
        return print("[3] launchers: skipped (ray is not installed: pip install 'mpx[ray]')")
    kit_report.progress(f"[3] no-op, 2 nodes x 2 ranks: launcher='ray', `mpx node` and Ray actors, {iters} "
                        f"calls each ({iters // 10} for the actors); then {reps} starts each ...")
    try:
        (rs, ns, acts), startup, t_actors = bench_launchers(iters, warm, reps)
    finally:
        kit_procs.cleanup_procs()
    rows.append(kit_report.row("no-op, 2 nodes x 2 ranks, launcher='ray' vs `mpx node`", "us", rs, ns,
                               "<= 1.10x mpx node", rs["median"] / ns["median"] <= 1.1,
                               note="the same executor and queues; only who started the follower differs"))
    rows.append(kit_report.row("  launcher='ray' vs Ray actors (ray.get on 4 actor calls, 2 per node)", "us",
                               rs, acts, "<= 0.20x (mpx >= 5x faster)", rs["median"] / acts["median"] <= 0.2))
    for name, key in (("launcher='ray'", "ray"), ("`python -m mpx node`", "node")):
        rows.append(kit_report.row(f"  startup to the first call's answer, {name}", "ms", kit_stats.stats(
            [t * 1e3 for t in startup[key]]), note=f"{len(startup[key])} starts" + (
                "; Ray already up" if key == "ray" else ", the subprocess's included")))
    rows.append(kit_report.row("  startup of 4 Ray actors to the first ray.get", "ms",
                               {"median": t_actors * 1e3, "p90": t_actors * 1e3}))
    raw["launchers"] = {"ray_us": rs, "node_us": ns, "actors_us": acts, "startup_s": startup,
                        "actors_startup_s": t_actors}


def main():
    def more(ap):
        only = ap.add_mutually_exclusive_group()
        only.add_argument("--launchers-only", action="store_true", help="run section 3 alone")
        only.add_argument("--zmq-only", action="store_true",
                          help="run section 1's transport='zmq' vs REQ/REP of the pickled call alone")
    args = kit_args.parse_args(__doc__, "fewer repetitions (~15 s instead of ~35 s, without Ray)", more,
                               ab=("also A/B section 1's transport='zmq' no-op against git revision REV",
                                   "--ab-child", ab_child))
    iters, warm = (2000, 200) if args.quick else (12000, 1000)
    reps, bw_warm = (5, 1) if args.quick else (15, 2)
    header = kit_report.print_header(
        args.quick, "remote (multi-node) executor benchmark", "the driver, both nodes' workers and the "
        "baselines' children share them; loopback TCP stands in for the network",
        torch=kit_report.version("torch"), pyzmq=zmq.__version__, libzmq=zmq.zmq_version(),
        relay=os.environ.get("MPX_RELAY", "auto"))
    rows, raw = [], {}
    try:
        if args.zmq_only:
            kit_report.progress(f"[1] no-op, transport='zmq' and REQ/REP of the pickled call, {iters} calls "
                                "each ...")
            (z, c), where = bench_noop(iters, warm, zmq_only=True)
            zmq_rows(rows, raw, z, c, where)
            if args.ab:
                zmq_ab(rows, raw, args.ab, args.quick)
        elif not args.launchers_only:
            kit_report.progress(f"[1] no-op, 2 nodes x 1 rank, {iters} calls each of 5 loops ...")
            (m, b, u, z, c), where = bench_noop(iters, warm)
            rows.append(kit_report.row("no-op round trip, 2 nodes x 1 rank (world_size=2)", "us", m, b,
                                       "<= 1.50x REQ/REP", m["median"] / b["median"] <= 1.5,
                                       note="baseline: pyzmq REQ/REP of 100 bytes, tcp://127.0.0.1"))
            rows.append(kit_report.row("  same, unique_reply_rank=1", "us", u, b))
            raw["noop_us"] = {"mpx": m, "reqrep": b, "unique_1": u}
            zmq_rows(rows, raw, z, c, where)
            if args.ab:
                zmq_ab(rows, raw, args.ab, args.quick)
            try:
                import torch
                tensor = torch.arange(kit_stats.BIG // 4, dtype=torch.float32)
            except ImportError:
                import numpy as np
                tensor = np.arange(kit_stats.BIG // 4, dtype=np.float32)
            kit_report.progress(f"[2] 64 MiB argument to 2 nodes x 2 ranks, {reps} calls (+{bw_warm}), in "
                                "turn with PUSH/PULL rounds ...")
            mine, theirs = bench_tensor(tensor, reps, bw_warm)
            s, sb = kit_stats.gbps(mine, 2 * kit_stats.BIG), kit_stats.gbps(theirs, 2 * kit_stats.BIG)
            rows.append(kit_report.row("64MiB argument, 2 remote ranks (world_size=4, nnodes=2)", "GB/s",
                                       s, sb, ">= 0.60x PUSH/PULL", s["median"] / sb["median"] >= 0.6,
                                       note=f"GB/s = 2 x 64 MiB / call time; median call "
                                       f"{s['median_ms']:.1f} ms, a PUSH -> 2 PULL round "
                                       f"{sb['median_ms']:.1f} ms"))
            raw["tensor"] = {"mpx_s": mine, "pushpull_s": theirs}
            del tensor
        if not args.zmq_only:
            launchers(rows, raw, iters, warm, 2 if args.quick else 4)
    finally:
        kit_procs.cleanup_procs()
    kit_report.finish(args, header, rows, raw, "mpx multi-node Executor over loopback vs pyzmq")


if __name__ == "__main__":
    main()
