"""A 2-node group across a link that blips, rots and breaks: what each fault costs a call.

    python bench/bench_links.py [--quick] [--json P] [--png P]

Needs root, iproute2 and /dev/net/tun: the follower node (2 ranks, relayed) runs in a network
namespace joined to this one by tests/_netfault.py's userspace forwarder over two TUN devices,
which cuts, delays and alters packets on command; heartbeat_s = 1 s, so link_grace_s = 2 s.
The baseline is the same call's round trip on the healthy link, measured in the same run.

1. partitions of 0.5 x heartbeat_s (50; 10 with --quick), each with a call sent into it: how
   many calls were lost, doubled, wrong or failed the group (target: 0), and each call's
   extra latency past the heal (target: at most 0.25 s, a probe's period: the end of the cut is
   seen by the liveness probes, which reconnect the links at once, not left to TCP's
   backed-off retransmission).
2. the same for cuts of 1.5 s, 0.75 x link_grace_s (10; 3): TCP alone would wait up to ~1.4 s
   past the heal for its retransmission timer.
3. a byte altered past TCP's checksum in a 300 KB call, each direction (10; 3): the frame fails
   its HMAC, the link is reset and the frame resent; the call's time against the healthy one.
4. a cut past the grace, both ways (3; 1): the time to NodeLostError (target: the grace plus
   at most 0.5 s).
5. partitions of 0.5 x heartbeat_s again (20; 5), with one rank on each node: the follower
   does not relay, and its worker reads the driver directly (the follower tells it when
   the leader is heard again).

A benchmark, not a test: the exit code is 0 whatever the results.
"""

from __future__ import annotations

import os
import sys
import time

import kit_args
import kit_report
import kit_stats

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, TESTS)

import _netfault  # noqa: E402  (the tests' forwarder)
import _nodes  # noqa: E402

import mpx  # noqa: E402

HEARTBEAT_S = 1.0
GRACE_S = 2 * HEARTBEAT_S


def healthy_rtt(ex, n=50):
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        ex.collective_rpc("ident", args=(i,))
        out.append(time.perf_counter() - t0)
    return out


def partitions(link, ex, cut_s, rounds, world=4):
    """``rounds`` cuts of ``cut_s``, a call sent into each (to ``world`` ranks): (extra
    seconds past the heal per call, calls that went wrong)."""
    extra, wrong = [], 0
    for i in range(rounds):
        link.partition(True)
        fut = ex.collective_rpc("ident", args=(("cut", i),), non_block=True)
        time.sleep(cut_s)
        link.partition(False)
        healed = time.perf_counter()
        try:
            if fut.result(timeout=30) != [("cut", i)] * world:
                wrong += 1
        except (mpx.MpxError, TimeoutError):  # (a call that never came back counts)
            wrong += 1
            break
        extra.append(time.perf_counter() - healed)
        if ex.collective_rpc("ident", args=(("after", i),), timeout=10) != [("after", i)] * world:
            wrong += 1
        time.sleep(0.3)
    return extra, wrong


def corruptions(link, ex, rounds):
    """``rounds`` 300 KB calls with a byte altered on the way, each direction: seconds each."""
    blob = os.urandom(300_000)
    out = {"to_follower": [], "to_leader": []}
    wrong = 0
    for _ in range(rounds):
        for direction in out:
            link.corrupt(1, direction, min_payload=1000)
            t0 = time.perf_counter()
            if ex.collective_rpc("ident", args=(blob,), timeout=30) != [blob] * 4:
                wrong += 1
            out[direction].append(time.perf_counter() - t0)
    plain = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ex.collective_rpc("ident", args=(blob,), timeout=30)
        plain.append(time.perf_counter() - t0)
    return out, plain, wrong


def main():
    args = kit_args.parse_args(__doc__, "fewer rounds (~1 min)")
    header = kit_report.print_header(args.quick, "links that blip, rot and break",
                                     "the forwarder and both nodes share these CPUs")
    q = args.quick
    rows, raw = [], {}
    with _netfault.faulty_link(seed=11) as link:
        with _nodes.group_across(link, HEARTBEAT_S) as (ex, _):
            rtt = healthy_rtt(ex)
            base = kit_stats.stats(rtt)
            kit_report.progress(f"healthy round trip {base['median'] * 1e3:.2f} ms")
            for cut, n in ((HEARTBEAT_S / 2, 10 if q else 50), (0.75 * GRACE_S, 3 if q else 10)):
                extra, wrong = partitions(link, ex, cut, n)
                kit_report.progress(f"{n} cuts of {cut:g} s: {wrong} calls wrong")
                raw[f"cut_{cut:g}"] = extra
                rows.append(kit_report.row(f"{n} cuts of {cut:g} s: calls lost or wrong", "calls",
                                           {"median": wrong, "p90": wrong, "n": n}, None, "0",
                                           wrong == 0))
                st = kit_stats.stats(extra)
                rows.append(kit_report.row(f"cuts of {cut:g} s: a call's latency past the heal", "s",
                                           st, None, "<= 0.25 s", st["p90"] <= 0.25,
                                           f"max {max(extra):.3f} s; healthy round trip "
                                           f"{base['median'] * 1e3:.2f} ms"))
            per, plain, wrong = corruptions(link, ex, 3 if q else 10)
            raw["corrupt"] = per
            for direction, ts in per.items():
                rows.append(kit_report.row(f"300 KB call, a byte altered {direction}", "s",
                                           kit_stats.stats(ts), kit_stats.stats(plain), "info",
                                           None, f"{wrong} wrong; links: {ex.stats().links}"))
        lost = []
        for _ in range(1 if q else 3):
            with _nodes.group_across(link, HEARTBEAT_S) as (ex, _):
                fut = ex.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0, 1]},
                                        non_block=True)
                link.partition(True)
                t0 = time.perf_counter()
                try:
                    fut.result(timeout=30)
                except mpx.NodeLostError:
                    lost.append(time.perf_counter() - t0)
                link.partition(False)
        st = kit_stats.stats(lost or [float("inf")])
        rows.append(kit_report.row("a cut past the grace (2 s): NodeLostError after", "s", st, None,
                                   "<= 2.5 s", st["p90"] <= GRACE_S + 0.5))
        n = 5 if q else 20
        with _nodes.group_across(link, HEARTBEAT_S, world=2) as (ex, _):
            extra, wrong = partitions(link, ex, HEARTBEAT_S / 2, n, world=2)
        raw["one_rank_cut_0.5"] = extra
        st = kit_stats.stats(extra or [float("inf")])
        rows.append(kit_report.row(f"one rank per node, {n} cuts of 0.5 s: latency past the heal",
                                   "s", st, None, "<= 0.25 s", st["p90"] <= 0.25 and not wrong,
                                   f"{wrong} calls lost or wrong"))
    kit_report.finish(args, header, rows, raw, "links")


if __name__ == "__main__":
    main()
