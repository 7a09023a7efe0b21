"""``Executor.stats()``: a snapshot of what the executor's call table measured (its
compiled ``Meter``, mpx/_driver/meter.py) and of its workers.

Who records what: the thread holding the baton records each reply's latency as it reads
it; the ledger records each call's outcome holding the table's lock; the reply channels
count the bytes they read. A snapshot takes the outcome counters under the table's lock
(exact) and the histograms without it (a reply being recorded at that instant may be
missed). Nothing here runs per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from mpx._driver.meter import BOUNDS

if TYPE_CHECKING:
    from mpx._driver.group import WorkerGroup

OUTCOMES = ("ok", "error", "timeout")


@dataclasses.dataclass(frozen=True)
class Latency:
    """Quantiles of a set of durations, in seconds, estimated from log-spaced buckets (four
    per octave: within ~10% of the exact value); all 0.0 when ``count`` is 0."""

    count: int     #: how many durations
    p50_s: float   #: the median
    p99_s: float   #: the 99th percentile
    max_s: float   #: the largest (exact)


@dataclasses.dataclass(frozen=True)
class RankStats:
    """One worker."""

    rank: int          #: its rank
    pid: int | None    #: its process id (as a follower node reported it, for a remote rank)
    alive: bool        #: False once its process died or the executor stopped it
    replies: int       #: replies read from it since the executor started
    deaths: int        #: how many times its process was found dead
    latency: Latency   #: from each call made to this rank's reply read, over the window


@dataclasses.dataclass(frozen=True)
class LinkStats:
    """What the driver's network links to remote ranks went through (zeros without remote
    ranks; mpx/transport/zmq_link.py): the calls' and the replies' links, as seen here."""

    integrity_failures: int  #: reply frames that failed authentication (each reset its link)
    resumes: int             #: times a broken link was taken up again where it broke
    frames_resent: int       #: call frames sent again to remote readers whose link broke


@dataclasses.dataclass(frozen=True)
class Stats:
    """A snapshot of an executor (``Executor.stats()``)."""

    #: calls that ended, by method name and outcome: ``ok``; ``error`` (the method raised
    #: in a worker, or the call failed otherwise: a worker died, the executor failed);
    #: ``timeout`` (its timeout ran out: RPCTimeoutError, WorkerStalledError)
    calls: Mapping[str, Mapping[str, int]]
    in_flight: int          #: calls sent and not settled
    queued: int             #: calls waiting in the driver for room on the broadcast ring
    bytes_sent: int         #: the encoded bytes of every call sent (once per call)
    bytes_received: int     #: the bytes of every reply read, all ranks together
    ranks: tuple[RankStats, ...]  #: per worker, in rank order
    skew: Latency           #: per call, from its first rank's reply to its last, over the window
    window_s: float         #: the window of the latency figures: the last 1 to 2 times this
    links: LinkStats = LinkStats(0, 0, 0)  #: the links to remote ranks


def quantile(counts: list[int], q: float, largest: float) -> float:
    """The ``q`` quantile of the durations counted in ``counts`` (by the meter's buckets),
    interpolated within its bucket, at most ``largest``."""
    total = sum(counts)
    if not total:
        return 0.0
    rank = q * total
    seen = 0
    bounds = BOUNDS
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            lower = bounds[i - 1] if i else 0.0
            upper = bounds[i] if i < len(bounds) else largest
            value = lower + (upper - lower) * max(0.0, rank - seen) / n
            return min(value, largest)
        seen += n
    return largest


def combined(*histograms: Any) -> list[int]:
    """The bucket counts of the meter's ``histograms`` together."""
    return [sum(c) for c in zip(*[h.buckets for h in histograms])]


def latency(*histograms: Any) -> Latency:
    """The Latency of the durations of ``histograms`` together."""
    counts = combined(*histograms)
    largest = max(h.max for h in histograms)
    total = sum(counts)
    return Latency(total, quantile(counts, 0.5, largest), quantile(counts, 0.99, largest),
                   largest if total else 0.0)


def rank_histograms(meter: Any, rank: int) -> tuple[Any, Any, Any]:
    """The meter's histograms of ``rank``'s reply latency that make up all of them since
    the start (the windows before the last two, the previous one, the current one)."""
    return meter.earlier[rank], meter.previous[rank], meter.recent[rank]


def method_counts(meter: Any, lock: Any) -> dict[str, dict[str, int]]:
    """Per method, its calls by outcome (exact: taken under the table's ``lock``)."""
    with lock:
        return {name: {"ok": m.ok, "error": m.error, "timeout": m.timeout}
                for name, m in meter.methods.items()}


def snapshot(group: WorkerGroup) -> Stats:
    """The Stats of ``group``'s executor now."""
    calls = group.calls
    meter = calls.meter
    with group.members.lock:  # (one membership: its size, pids and the meter's ranks)
        by_method = method_counts(meter, calls.lock)
        in_flight, queued = calls.pending_calls()
        view = group.members.view()
        ranks = tuple(
            RankStats(rank, view.pids[rank], view.alive[rank],
                      sum(h.count for h in rank_histograms(meter, rank)), view.deaths[rank],
                      latency(meter.recent[rank], meter.previous[rank]))
            for rank in range(view.world_size))
    failures, reply_resumes, _ = calls.pump.link_counts()
    broadcast = group.members.broadcast
    _, call_resumes, resent = broadcast.link_counts() if broadcast is not None else (0, 0, 0)
    return Stats(
        calls=MappingProxyType({k: MappingProxyType(v) for k, v in by_method.items()}),
        in_flight=in_flight, queued=queued, bytes_sent=meter.bytes_sent,
        bytes_received=calls.bytes_received(), ranks=ranks,
        skew=latency(meter.skew_recent, meter.skew_previous), window_s=meter.window_s,
        links=LinkStats(failures, reply_resumes + call_resumes, resent))
