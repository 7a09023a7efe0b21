"""Prometheus metrics of an executor: ``registry.register(mpx.metrics.Collector(ex))``.

Needs ``prometheus_client`` (``pip install mpx[metrics]``); mpx imports this module only when
asked. The collector reads the executor's meter at each scrape (``Executor.stats`` and the
histograms behind it): nothing runs per call for it. The metrics (base units, counters
ending in ``_total``, labels of low cardinality):

- ``mpx_rpc_calls_total{method, outcome}``: calls that ended, ``outcome`` ``ok``, ``error``
  (the method raised in a worker, or the call failed otherwise) or ``timeout``;
- ``mpx_rpc_duration_seconds{method}``: histogram, from the call made to its last reply;
- ``mpx_rank_reply_seconds{rank}``: histogram, from the call made to that rank's reply read;
- ``mpx_rpc_bytes_total{direction}``: ``sent`` (each call once), ``received`` (all replies);
- ``mpx_calls_in_flight``: gauge, calls sent and not settled (``Executor.stats().queued``
  counts those still waiting in the driver);
- ``mpx_worker_up{rank}``: gauge, 1 while the worker lives, 0 once it died or was stopped;
- ``mpx_worker_deaths_total{rank}``: times the worker's process was found dead;
- ``mpx_link_events_total{event}``: the links to remote ranks: ``integrity_failure``
  (a reply frame failed authentication: its link was reset), ``resume`` (a broken link
  taken up again where it broke), ``frame_resent`` (call frames sent again for that).

The histograms' buckets are powers of two seconds, from 2**-20 (~1 us) to 256 s. A
collector whose executor was shut down reports its last values; one whose executor was
garbage-collected reports nothing. A scrape never raises because of the executor
(``prometheus_client`` would end the whole scrape, every other collector's metrics too): a
collector that cannot read it reports nothing, and why is logged once (mpx/_observe.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector as _CollectorBase

from mpx._driver import stats as _stats
from mpx._driver.meter import BOUNDS
from mpx._observe import report

if TYPE_CHECKING:
    from mpx._driver.executor import Executor

__all__ = ["Collector"]

# the exported buckets: every fourth of the meter's (the powers of two)
_EXPORTED = tuple(range(0, len(BOUNDS), 4))


def _buckets(*histograms: Any) -> tuple[list[tuple[str, float]], float]:
    """Meter Histograms together as Prometheus's cumulative ``(le, count)`` pairs, and
    their sum."""
    counts = _stats.combined(*histograms)
    out: list[tuple[str, float]] = []
    seen = 0
    last = 0
    for i in _EXPORTED:
        seen += sum(counts[last:i + 1])
        last = i + 1
        out.append((repr(BOUNDS[i]), seen))
    out.append(("+Inf", sum(counts)))
    return out, sum(h.sum for h in histograms)


class Collector(_CollectorBase):
    """A ``prometheus_client`` collector of one executor's metrics (see the module
    docstring); it holds the executor weakly."""

    def __init__(self, executor: Executor) -> None:
        self._executor = weakref.ref(executor)

    def describe(self) -> list[Metric]:
        """The metric families, without samples (what registering checks)."""
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        """The metrics now; nothing if the executor is gone or cannot be read."""
        ex = self._executor()
        if ex is None:
            return iter(())
        try:
            return iter(self._read(ex))
        except Exception as e:  # (prometheus_client lets it end the whole scrape)
            report("metrics: reading the executor for a scrape", e)
            return iter(())

    @staticmethod
    def _families() -> tuple[Any, ...]:
        return (
            CounterMetricFamily("mpx_rpc_calls_total", "Calls that ended, by method and outcome",
                                labels=["method", "outcome"]),
            HistogramMetricFamily("mpx_rpc_duration_seconds",
                                  "From a call made to its last reply", labels=["method"]),
            HistogramMetricFamily("mpx_rank_reply_seconds",
                                  "From a call made to the rank's reply read", labels=["rank"]),
            CounterMetricFamily("mpx_rpc_bytes_total", "Bytes of calls sent and replies read",
                                labels=["direction"]),
            GaugeMetricFamily("mpx_calls_in_flight", "Calls sent and not settled"),
            GaugeMetricFamily("mpx_worker_up", "1 while the worker lives", labels=["rank"]),
            CounterMetricFamily("mpx_worker_deaths_total",
                                "Times the worker's process was found dead", labels=["rank"]),
            CounterMetricFamily("mpx_link_events_total",
                                "What the links to remote ranks went through: frames that "
                                "failed authentication, links taken up again where they "
                                "broke, frames resent", labels=["event"]),
        )

    def _read(self, ex: Executor) -> tuple[Any, ...]:
        group = ex._group
        meter = group.calls.meter
        calls, durations, replies, nbytes, in_flight, up, deaths, links = self._families()
        with group.members.lock:  # (one membership: a resize waits for this scrape)
            snap = _stats.snapshot(group)
            per_rank = [_buckets(*_stats.rank_histograms(meter, rank.rank))
                        for rank in snap.ranks]
        with group.calls.lock:  # (outcomes and durations change under it: exact together)
            methods = [(name, m.ok, m.error, m.timeout, _buckets(m.durations))
                       for name, m in meter.methods.items()]
        for name, ok, error, timeout, (buckets, total) in methods:
            for outcome, n in (("ok", ok), ("error", error), ("timeout", timeout)):
                calls.add_metric([name, outcome], n)
            durations.add_metric([name], buckets, total)
        for rank, (buckets, total) in enumerate(per_rank):
            replies.add_metric([str(rank)], buckets, total)
        nbytes.add_metric(["sent"], snap.bytes_sent)
        nbytes.add_metric(["received"], snap.bytes_received)
        in_flight.add_metric([], snap.in_flight)
        for r in snap.ranks:
            up.add_metric([str(r.rank)], 1 if r.alive else 0)
            deaths.add_metric([str(r.rank)], r.deaths)
        links.add_metric(["integrity_failure"], snap.links.integrity_failures)
        links.add_metric(["resume"], snap.links.resumes)
        links.add_metric(["frame_resent"], snap.links.frames_resent)
        return calls, durations, replies, nbytes, in_flight, up, deaths, links
