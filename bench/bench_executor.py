"""mpx.Executor.collective_rpc against baselines measured in the same run.

    python bench/bench_executor.py [--quick] [--sections abd] [--ab REV] [--png P] [--json P]

The baseline is a minimal multiprocessing.Pipe RPC loop (kit_rpc.PipePeers): the driver sends (method,
args, kwargs) to each child, which looks the method up, calls it and sends the result back; the same
loop on bare MessageQueues (kit_rpc.QueueRPC) tells the Executor's own cost from the transport's.
Medians and p90 over repetitions:

a. a no-op's round trip, 1, 2 and 4 workers (4: 5 processes on this machine's 2 cores), vs the Pipe
   loop over as many pipes.                                   targets: <= 0.35x, 0.40x, 0.30x Pipe
   4 workers vs the bare MessageQueues.                       target: <= 1.5x bare
   Informational: the 1-worker case with the driver and the worker pinned to one CPU and to two, the
   4-worker case with the driver sharing its CPU with 1, 2 or no workers; and where a 1-worker
   no-op's microseconds go: the call and the reply each through a MessageQueue in this process
   (encode, ring write and read, decode), and in each placement the wake (the bare queues' round
   trip less those) and the Executor's own part (its round trip less the bare queues').
b. the first call after 2 s idle, 1 worker, vs the Pipe loop's.      target: <= 0.8x Pipe
   (with --ab REV: the first call after 0.5 s idle vs REV's, paired: informational);
   CPU of each of 2 idle workers over 3 s, and of the driver while a call sleeps 3 s in the workers.
                                                                     target: < 2% of a core
d. futures, 1 worker: from a reply landing (stamped by the worker) to the done callback of a call
   nobody waits on, vs the blocking round trip.                      target: <= 2x blocking
   asyncio, 64 calls in flight from one loop, vs blocking calls from one thread (paired blocks).
                                                                     target: >= 1x blocking
   Done callbacks keeping 64 in flight, no event loop: informational.
   With --ab REV, against git revision REV (kit_ab.ab_paired: one child a side taking turns in short
   blocks; the median of the blocks' paired ratios): the blocking no-op with 1 and 2 workers, a call
   carrying 1 MiB of bytes, one carrying a 64 MiB tensor, 640 asyncio no-ops with 64 in flight; then
   the no-ops (1 and 2 workers, asyncio) again with metrics on (scraped every 0.1 s).
                                                                     target: <= 1.05x REV

A benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time

import kit_ab
import kit_args
import kit_cpus
import kit_procs
import kit_report
import kit_rpc
import kit_stats
import kit_timing

AB_IDLE_MS = 500  # the first-call-after-idle A/B: as cold as after 2 s here, 4x the rounds

# --------------------------------------------------------------------------- a. no-op


def placements(n):
    """{name: (the driver's CPU, each child's)} worth pinning ``n`` children to."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    a, b = cpus[:2]
    if n == 1:
        return {"driver and worker on one CPU": (a, [a]), "driver and worker on two CPUs": (a, [b])}
    if n == 4 and len(cpus) == 2:
        return {"driver with 1 worker, 3 on the other CPU": (a, [a, b, b, b]),
                "driver with 2 workers, 2 on the other CPU": (a, [a, a, b, b]),
                "driver alone, 4 workers on the other CPU": (a, [b, b, b, b])}
    return {}


def pinned(fns, places, iters):
    """{place: [stats of each fn]}, the driver and each fn's children (fns: {fn: pids}) pinned as
    each place says."""
    mine, out = os.sched_getaffinity(0), {}
    try:
        for place, (driver_cpu, cpus) in places.items():
            os.sched_setaffinity(0, {driver_cpu})
            for pids in fns.values():
                for pid, cpu in zip(pids, cpus):
                    os.sched_setaffinity(pid, {cpu})
            out[place] = [kit_stats.stats(kit_timing.timed_us(fn, iters, iters // 5)) for fn in fns]
    finally:
        os.sched_setaffinity(0, mine)
        for pid in (pid for pids in fns.values() for pid in pids):
            try:
                os.sched_setaffinity(pid, mine)
            except OSError:
                pass
    return out


def noop_case(n, iters, warm, pin_iters):
    """(stats of mpx, of the Pipe loop, of the bare queues, the last CPUs, the pinned figures)."""
    ex, pipe, mq = kit_rpc.new_executor(n), kit_rpc.pipe_rpc(n), kit_rpc.QueueRPC(n)
    try:
        fns = {lambda: ex.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT): ex.worker_pids,
               lambda: pipe.rpc("noop"): pipe.pids, lambda: mq.call("noop"): mq.pids}
        out = kit_timing.interleaved(list(fns), warm, iters, 4)
        where = {"driver": kit_cpus.last_cpu(os.getpid()),
                 "workers": [kit_cpus.last_cpu(p) for p in ex.worker_pids]}
        return (*(kit_stats.stats(v) for v in out.values()), where, pinned(fns, placements(n), pin_iters))
    finally:
        ex.shutdown()
        pipe.close()
        mq.close()


def section_a(rows, raw, quick):
    iters, warm = (4000, 400) if quick else (20000, 2000)
    cpus = len(os.sched_getaffinity(0))
    for n, limit in ((1, 0.35), (2, 0.40), (4, 0.30)):
        kit_report.progress(f"[a] no-op, {n} worker(s), {iters} calls each of mpx, Pipe, bare queues ...")
        m, b, q, where, pins = noop_case(n, iters, warm, 2000 if quick else 5000)
        label = f"no-op round trip, {n} worker{'s' if n > 1 else ''}" + (
            f" ({n + 1} processes on {cpus} CPUs)" if n + 1 > cpus else "")
        rows.append(kit_report.row(label, "us", m, b, f"<= {limit:.2f}x Pipe RPC",
                                   m["median"] / b["median"] <= limit, note=f"last CPUs {where}"))
        rows.append(kit_report.row("  same loop on bare MessageQueues (no Executor)", "us", q, b,
                                   note=f"the Executor's own part: {m['median'] - q['median']:.1f} us"))
        rows.append(kit_report.row("  Executor vs those bare MessageQueues", "us", m, q,
                                   *(("<= 1.5x bare", m["median"] / q["median"] <= 1.5) if n == 4 else ())))
        for place, (pm, pb, pq) in pins.items():
            rows.append(kit_report.row(f"  pinned, {place}", "us", pm, pb,
                                       note=f"bare queues {pq['median']:.1f} us; Executor "
                                       f"{pm['median'] / pq['median']:.2f}x bare"))
        raw[f"noop_{n}"] = {"mpx": m, "pipe": b, "bare_queues": q, "pinned": pins}
        if n == 1:
            cases = {"unpinned": (m, q), **{p: (pm, pq) for p, (pm, _, pq) in pins.items()}}
            breakdown(rows, raw, cases, iters)


def breakdown(rows, raw, cases, iters):
    """Where a 1-worker no-op's microseconds go, from public figures (see a.); ``cases``: {placement:
    (the executor's round trip, the bare queues')}."""
    call = kit_stats.stats(kit_rpc.queue_round_trip(lambda: [(0, 1, "noop", (), None, None)], iters, 200))
    reply = kit_stats.stats(kit_rpc.queue_round_trip(lambda: [(1, 0, None)], iters, 200))
    rows.append(kit_report.row("  breakdown: the call through a MessageQueue, in one process", "us", call,
                               note="encode, ring write, ring read, decode"))
    rows.append(kit_report.row("  breakdown: the reply likewise", "us", reply))
    raw["breakdown_us"] = {"call": call, "reply": reply}
    for place, (whole, bare) in cases.items():
        wake, own = bare["median"] - call["median"] - reply["median"], whole["median"] - bare["median"]
        rows.append(kit_report.row(f"  breakdown, {place}: the wake both ways", "us",
                                   {"median": wake, "p90": wake}, whole,
                                   note=f"the bare queues' round trip less the two above; the Executor's own "
                                   f"part (its round trip less the bare queues') {own:.1f} us; baseline: "
                                   "the executor's round trip"))
        raw["breakdown_us"][place] = {"wake": wake, "executor": own}


# --------------------------------------------------------------------------- b. idle

def section_b(rows, raw, quick, ab):
    rounds, idle_s = (5, 2.0) if quick else (9, 2.0)
    kit_report.progress(f"[b] first call after {idle_s:.0f} s idle, {rounds} rounds each of mpx, Pipe, bare "
                        f"queues (~{3 * rounds * idle_s:.0f} s) ...")
    ex, pipe, mq = kit_rpc.new_executor(1), kit_rpc.pipe_rpc(1), kit_rpc.QueueRPC()
    calls = {"mpx": (lambda: ex.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT), ex.worker_pids),
             "pipe": (lambda: pipe.rpc("noop"), pipe.pids), "queue": (lambda: mq.call("noop"), mq.pids)}
    out, together = {k: [] for k in calls}, dict.fromkeys(calls, 0)  # (rounds on the driver's CPU)
    try:
        kit_timing.settle([fn for fn, _ in calls.values()], 0.5)
        for r in range(rounds):
            for k in list(calls)[r % 3:] + list(calls)[:r % 3]:
                time.sleep(idle_s)
                fn, pids = calls[k]
                out[k] += kit_timing.timed_us(fn, 1)
                together[k] += kit_cpus.last_cpu(pids[0]) == kit_cpus.last_cpu(os.getpid())
    finally:
        ex.shutdown()
        pipe.close()
        mq.close()
    m, b, q = (kit_stats.stats(v) for v in out.values())
    rows.append(kit_report.row(f"first call after {idle_s:.0f}s idle, 1 worker", "us", m, b,
                               "<= 0.8x Pipe RPC", m["median"] / b["median"] <= 0.8,
                               note=f"rounds of {rounds} in which the child ran on the driver's CPU: "
                               f"{together}"))
    rows.append(kit_report.row("  same loop on bare MessageQueues (no Executor)", "us", q, b))
    raw["idle_wake_us"] = {**out, "on_the_drivers_cpu": together}
    if ab:
        rounds = 30 if quick else 60
        kit_report.progress(f"[b] A/B first call after {AB_IDLE_MS} ms idle vs {ab}, {rounds} rounds ...")
        new, old, pairs = kit_ab.ab_paired(ab, __file__, "--ab-child", f"0,1,1,400,{AB_IDLE_MS}", rounds)
        rows.append(kit_report.row(f"  first call after {AB_IDLE_MS} ms idle, vs {ab}", "us", new, old,
                                   note=f"paired: median {statistics.median(pairs):.3f}x, quartiles "
                                        f"{kit_stats.quartiles(pairs)}"))
        raw["ab_idle"] = {"rev": ab, "new": new, "old": old, "paired": pairs}

    import psutil
    idle_s = call_s = 3.0
    kit_report.progress(f"[b] CPU of 2 idle workers over {idle_s:.0f} s, then of the driver during a "
                        f"{call_s:.0f} s call ...")
    ex = kit_rpc.new_executor(2)
    try:
        for _ in range(100):
            ex.collective_rpc("noop")
        workers = [psutil.Process(pid) for pid in ex.worker_pids]
        before, t0 = [sum(p.cpu_times()[:2]) for p in workers], time.monotonic()
        time.sleep(idle_s)
        wall = time.monotonic() - t0
        pct = [100 * (sum(p.cpu_times()[:2]) - c) / wall for p, c in zip(workers, before)]
        c0, t0 = time.process_time(), time.monotonic()
        ex.collective_rpc("sleep", args=(call_s,), timeout=call_s + kit_rpc.CALL_TIMEOUT)
        drv = 100 * (time.process_time() - c0) / (time.monotonic() - t0)
    finally:
        ex.shutdown()
    for rank, p in enumerate(pct):
        rows.append(kit_report.row(f"idle worker {rank} CPU ({idle_s:.0f}s)", "%", {"median": p}, None,
                                   "< 2% of a core", p < 2.0))
    rows.append(kit_report.row(f"driver CPU during a {call_s:.0f}s call, 2 workers", "%", {"median": drv},
                               None, "< 2% of a core", drv < 2.0,
                               note="time.process_time: every thread of the driver"))
    raw["idle_cpu_pct"] = {"workers": pct, "driver": drv}


# --------------------------------------------------------------------------- d. futures

def callback_latency(ex, iters):
    """([us from the reply landing to its done callback], [us of a blocking round trip])."""
    lat, landed = [], threading.Event()

    def on_done(f):
        lat.append((time.monotonic_ns() - f.result(0)[0]) / 1e3)
        landed.set()

    def non_block():
        landed.clear()
        ex.collective_rpc("stamp", non_block=True).add_done_callback(on_done)
        if not landed.wait(kit_rpc.CALL_TIMEOUT):
            raise RuntimeError("a done callback never ran")

    kit_timing.settle([non_block, lambda: ex.collective_rpc("noop")], 0.3, min_rounds=200)
    lat.clear()
    rtt = []
    for _ in range(4):
        rtt += kit_timing.timed_us(lambda: ex.collective_rpc("noop"), iters // 4)
        for _ in range(iters // 4):
            non_block()
    return lat, rtt


def blocking_rate(ex, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        ex.collective_rpc("noop")
    return calls / (time.perf_counter() - t0)


def asyncio_rate(ex, calls, in_flight=64, loop=None):
    """Calls/s of ``calls`` no-ops kept ``in_flight`` from one event loop (``loop``, kept
    from block to block; None: a new one)."""
    async def caller(k):  # each keeps one call in flight, as an engine's request does
        for _ in range(k):
            await ex.collective_rpc("noop", non_block=True)

    async def run():
        t0 = time.perf_counter()
        await asyncio.gather(*[caller(calls // in_flight) for _ in range(in_flight)])
        return calls // in_flight * in_flight / (time.perf_counter() - t0)
    return loop.run_until_complete(run()) if loop is not None else asyncio.run(run())


def callback_rate(ex, calls, in_flight=64):
    """Calls/s with ``in_flight`` calls kept in flight by their done callbacks."""
    slots, left, lock, done = threading.Semaphore(in_flight), [calls], threading.Lock(), threading.Event()

    def on_done(_):
        slots.release()
        with lock:
            left[0] -= 1
            if not left[0]:
                done.set()

    t0 = time.perf_counter()
    for _ in range(calls):
        if not slots.acquire(timeout=kit_rpc.CALL_TIMEOUT):
            raise TimeoutError("no done callback ran")
        ex.collective_rpc("noop", non_block=True).add_done_callback(on_done)
    if not done.wait(kit_rpc.CALL_TIMEOUT):
        raise TimeoutError(f"{left[0]} done callbacks did not run")
    return calls / (time.perf_counter() - t0)


def paired_row(name, unit, new, old, pairs, target=None, ok=None, note=""):
    r = kit_report.row(name, unit, new, old, *((target, ok) if target else ()), note=(
        f"{note}ratio = the median of the blocks' paired ratios (quartiles {kit_stats.quartiles(pairs)})"))
    r["ratio"] = statistics.median(pairs)
    return r


def section_d(rows, raw, quick, ab, ab_only=None):
    iters = 2000 if quick else 8000
    # blocks of ~0.1-0.2 s, so that a loop's start and the pipeline's ramp are a small share
    calls, blocks = (6400, 5) if quick else (12800, 9)
    kit_report.progress(f"[d] done-callback latency, {iters} calls; asyncio and done callbacks with 64 in "
                        f"flight vs blocking, {blocks} blocks of {calls} calls ...")
    aio, cbs = ([], []), ([], [])
    ex, with_cb = kit_rpc.new_executor(1), kit_rpc.new_executor(1)  # (with_cb: no event loop ever used)
    try:
        lat, rtt = callback_latency(ex, iters)
        asyncio_rate(ex, calls)  # (its warm-up: the event loop's first use)
        callback_rate(with_cb, calls)
        for _ in range(blocks):
            aio[0].append(asyncio_rate(ex, calls))
            aio[1].append(blocking_rate(ex, calls))
            cbs[0].append(callback_rate(with_cb, calls))
            cbs[1].append(blocking_rate(with_cb, calls))
    finally:
        ex.shutdown()
        with_cb.shutdown()
    m, b = kit_stats.stats(lat), kit_stats.stats(rtt)
    rows.append(kit_report.row("reply landed -> done callback, nobody waits", "us", m, b,
                               "<= 2x blocking round trip", m["median"] / b["median"] <= 2.0,
                               note="baseline: the blocking no-op round trip, same executor"))
    for name, (mine, blk), target in (("asyncio calls/s, 64 in flight, 1 worker", aio, 1.0),
                                      ("done callbacks, 64 in flight, no event loop", cbs, None)):
        pairs = kit_stats.paired(mine, blk)
        rows.append(paired_row(name, "calls/s", kit_stats.stats(mine), kit_stats.stats(blk), pairs,
                               target and ">= 1x blocking calls/s", statistics.median(pairs) >= 1.0,
                               note="baseline: blocking calls, same executor; "))
    raw["futures"] = {"callback_latency_us": m, "blocking_rtt_us": b, "asyncio": aio, "callbacks": cbs}
    for kind, n, block, metrics in ((0, 1, 100, 0), (0, 2, 100, 0), (1, 1, 10, 0), (2, 1, 1, 0),
                                    (3, 1, 1, 0), (0, 1, 100, 1), (0, 2, 100, 1),
                                    (3, 1, 1, 1)) if ab else ():
        what = f"{AB_CALLS[kind]}, {n} worker{'s' if n > 1 else ''}" + \
            (", metrics on" if metrics else "")
        if ab_only and not any(word in what for word in ab_only.split("|")):
            continue
        k = 100 if quick else 300
        kit_report.progress(f"[d] A/B {what} vs {ab}, {k} blocks of {block} a side ...")
        new, old, pairs = kit_ab.ab_paired(ab, __file__, "--ab-child",
                                           f"{kind},{n},{block},30,0,{metrics}", k)
        rows.append(paired_row(f"{what}, vs {ab}", "us", new, old, pairs, f"<= 1.05x {ab}",
                               statistics.median(pairs) <= 1.05, note="one child a side, taking turns; "))
        raw[f"ab {what}"] = {"rev": ab, "new": new, "old": old, "paired": pairs}


# What an A/B child times: a blocking no-op; a call carrying 1 MiB of bytes; one carrying a 64 MiB
# tensor; 640 no-ops from asyncio, 64 in flight (one block's us is theirs). Tracing is off; with
# metrics on, a Prometheus registry holds the executor's collector and a thread scrapes it every
# METRICS_SCRAPE_S, as a server's /metrics endpoint would be.
AB_CALLS = ("blocking no-op", "1 MiB bytes in the args", "64MiB tensor argument",
            "640 asyncio no-ops, 64 in flight")


METRICS_SCRAPE_S = 0.1


def _scrape(ex, stop):
    """Scrape ``ex``'s metrics every METRICS_SCRAPE_S until ``stop`` is set."""
    import prometheus_client

    import mpx.metrics
    registry = prometheus_client.CollectorRegistry()
    registry.register(mpx.metrics.Collector(ex))
    while not stop.wait(METRICS_SCRAPE_S):
        prometheus_client.generate_latest(registry)


def ab_child(kind, n, block, warm, idle_ms, metrics=0):
    """--ab-child: this mpx's (or PYTHONPATH's) side of an A/B, timing AB_CALLS[kind] (with
    the metrics scraped meanwhile if ``metrics``)."""
    ex = kit_rpc.new_executor(n)
    stop = threading.Event()
    scraper = threading.Thread(target=_scrape, args=(ex, stop), daemon=True)
    if metrics:
        scraper.start()
    payload = os.urandom(1 << 20)
    if kind == 2:
        import torch
        payload = torch.arange(kit_stats.BIG // 4, dtype=torch.float32)
    calls = (lambda: ex.collective_rpc("noop", timeout=kit_rpc.CALL_TIMEOUT),
             lambda: ex.collective_rpc("nbytes", args=(payload,), timeout=kit_rpc.CALL_TIMEOUT),
             lambda: ex.collective_rpc("take", args=(payload,), timeout=kit_rpc.CALL_TIMEOUT),
             lambda: asyncio_rate(ex, 640, loop=loop))
    loop = asyncio.new_event_loop()  # (one for every block: a new loop per block is noise)
    try:
        kit_ab.serve_ab(calls[kind], block, warm, idle_ms / 1e3, pids=ex.worker_pids)
    finally:
        stop.set()
        if metrics:
            scraper.join()
        loop.close()
        ex.shutdown()


def main():
    def more(ap):
        ap.add_argument("--sections", default="abd", help="which sections (default abd)")
        ap.add_argument("--ab-only", metavar="TEXT", help="section d's A/B rows whose name holds "
                        "one of these |-separated words only (e.g. 'no-op')")

    args = kit_args.parse_args(__doc__, "fewer repetitions (~1 min instead of ~1.5)", more,
        ab=("also A/B against git revision REV", "--ab-child", ab_child))
    header = kit_report.print_header(args.quick, "executor benchmark", "the driver and the workers share "
                                     "them; with 2 workers three processes compete for the cores")
    rows, raw = [], {}
    try:
        for s, run in (("a", section_a), ("b", section_b), ("d", section_d)):
            if s in args.sections:
                run(rows, raw, args.quick, *([args.ab] if s != "a" else []),
                    *([args.ab_only] if s == "d" else []))
    finally:
        kit_procs.cleanup_procs()
    kit_report.finish(args, header, rows, raw, "mpx.Executor vs baselines")


if __name__ == "__main__":
    main()
