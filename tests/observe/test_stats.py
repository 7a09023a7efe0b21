"""Executor.stats() and the Prometheus collector (mpx.metrics), across real worker
processes, on both implementations and both transports."""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import signal
import time

import _builds
import pytest

import mpx
from mpx._driver import meter as meter_mod
from mpx._driver import stats as stats_mod


def _counts(ex):
    return {m: dict(o) for m, o in ex.stats().calls.items()}


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_stats_count_each_call_by_method_and_outcome(impl, executor, transport):
    ex = executor(n=2, transport=transport, heartbeat_s=1.0)
    for i in range(20):
        assert ex.collective_rpc("mul", args=(i,)) == [i, 2 * i]
    with pytest.raises(mpx.RPCError):
        ex.collective_rpc("fail", args=([1],))
    with pytest.raises(mpx.RPCTimeoutError):
        ex.collective_rpc("sleep", args=(1.0,), timeout=0.1)
    futs = [ex.collective_rpc("noop", non_block=True) for _ in range(5)]
    assert [f.result(10) for f in futs] == [[None, None]] * 5
    s = ex.stats()
    assert _counts(ex) == {"mul": {"ok": 20, "error": 0, "timeout": 0},
                           "fail": {"ok": 0, "error": 1, "timeout": 0},
                           "sleep": {"ok": 0, "error": 0, "timeout": 1},
                           "noop": {"ok": 5, "error": 0, "timeout": 0}}
    assert s.in_flight == 0 and s.queued == 0
    assert [r.rank for r in s.ranks] == [0, 1]
    assert [r.pid for r in s.ranks] == ex.worker_pids
    assert all(r.alive and r.deaths == 0 for r in s.ranks)
    # 20 mul + 1 fail + 5 noop answered by both ranks; the sleep's replies may still come
    assert all(26 <= r.replies <= 27 for r in s.ranks)
    for r in s.ranks:
        lat = r.latency
        assert lat.count == r.replies
        assert 0 < lat.p50_s <= lat.p99_s <= lat.max_s < 5
    assert s.skew.count >= 26 and 0 <= s.skew.p50_s <= s.skew.max_s
    assert s.bytes_sent > 0 and s.bytes_received > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.in_flight = 3  # type: ignore[misc]


def test_bytes_count_the_payloads_both_ways(impl, executor):
    ex = executor(n=2)
    before = ex.stats()
    payload = b"x" * 200_000
    for _ in range(5):
        ex.collective_rpc("ident", args=(payload,))
    after = ex.stats()
    sent = after.bytes_sent - before.bytes_sent
    received = after.bytes_received - before.bytes_received
    assert 5 * 200_000 <= sent < 5 * 200_000 + 5 * 4096        # each call once
    assert 2 * 5 * 200_000 <= received < 2 * (5 * 200_000 + 5 * 4096)  # both ranks reply


def test_latency_tracks_a_slow_rank(impl, executor):
    ex = executor(n=2)
    for _ in range(5):
        ex.collective_rpc("sleep", args=(0.05, [1]))
    r0, r1 = ex.stats().ranks
    assert r1.latency.p50_s >= 0.04
    assert r0.latency.p50_s < 0.04
    assert ex.stats().skew.p50_s >= 0.03  # rank 0 answers first, rank 1 50 ms later


def test_a_dead_worker_shows_in_stats(impl, executor):
    ex = executor(n=2)
    ex.collective_rpc("noop")
    pid = ex.worker_pids[1]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not ex.is_failed and time.monotonic() < deadline:
        time.sleep(0.02)
    s = ex.stats()
    assert s.ranks[1].deaths == 1 and not s.ranks[1].alive
    assert s.ranks[0].deaths == 0  # (stopped by the failure, not found dead)
    assert _counts(ex) == {"noop": {"ok": 1, "error": 0, "timeout": 0}}


def test_stats_after_shutdown_keep_the_last_figures(executor):
    ex = executor(n=1)
    ex.collective_rpc("noop")
    ex.shutdown()
    s = ex.stats()
    assert s.calls["noop"]["ok"] == 1 and not s.ranks[0].alive
    assert s.ranks[0].replies == 1


def test_quantiles_from_buckets():
    core = meter_mod
    h = core.Histogram()
    for v in [1e-6 * (i + 1) for i in range(100)]:  # 1..100 us
        h.observe(v)
    lat = stats_mod.latency(h)
    assert lat.count == 100 and lat.max_s == pytest.approx(100e-6)
    assert 40e-6 < lat.p50_s < 60e-6
    assert 85e-6 < lat.p99_s <= 100e-6
    empty = stats_mod.latency(core.Histogram())
    assert empty == mpx.Latency(0, 0.0, 0.0, 0.0)
    h.observe(1e6)  # beyond the last bound: the overflow bucket
    assert h.buckets[core.N_BUCKETS - 1] == 1
    h.clear()
    assert h.count == 0 and sum(h.buckets) == 0


def test_compiled_and_plain_histograms_count_each_value_in_the_same_bucket():
    # (both from the value's binary exponent: C's frexp compiled, math.frexp plain)
    cores = {meter_mod, _builds.plain("mpx._driver.meter")}
    bounds = meter_mod.BOUNDS
    values = [-1.0, 0.0, 5e-324, 1e-9, 1e6, 1e300, float("inf")] + [
        v for b in bounds
        for v in (math.nextafter(b, 0), b, math.nextafter(b, math.inf), b * 1.1)]
    got = []
    for core in cores:
        at = []
        for v in values:
            h = core.Histogram()
            h.observe(v)
            at.append(list(h.buckets).index(1))
        got.append(at)
        for v, i in zip(values, at):  # bucket i: the values at most BOUNDS[i]
            assert (i == core.N_BUCKETS - 1 or v <= bounds[i]) and (i == 0 or v > bounds[i - 1])
    assert all(g == got[0] for g in got)


def test_the_window_rotates():
    meter = meter_mod.Meter(1, TimeoutError, 0.05)
    started = time.monotonic()
    assert started <= meter.reply(0, started, 0.0, True) <= time.monotonic()
    assert meter.recent[0].count == 1
    time.sleep(0.06)
    meter.reply(0, time.monotonic(), 0.0, True)  # a new window: the old one is `previous`
    assert meter.recent[0].count == 1 and meter.previous[0].count == 1
    time.sleep(0.06)
    meter.reply(0, time.monotonic(), 0.0, True)
    assert [h.count for h in stats_mod.rank_histograms(meter, 0)] == [1, 1, 1]


def test_the_meter_records_skew_and_outcomes():
    for core in (meter_mod, _builds.plain("mpx._driver.meter")):
        meter = core.Meter(2, TimeoutError)
        started = time.monotonic()
        first = meter.reply(1, started, 0.0, False)
        last = meter.reply(0, started, first, True)
        assert meter.skew_recent.count == 1 and meter.skew_recent.sum == last - first
        meter.settled("m", None, started, last)
        meter.settled("m", TimeoutError(), started, 0.0)  # (not every rank answered)
        meter.settled("m", KeyError(), started, 0.0)
        m = meter.methods["m"]
        assert (m.ok, m.timeout, m.error) == (1, 1, 1)
        assert m.durations.count == 1 and m.durations.sum == last - started


# ------------------------------------------------------------------ Prometheus

prometheus_client = pytest.importorskip("prometheus_client")


def _scrape(registry) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    text = prometheus_client.generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_collector_exports_the_named_metrics(impl, executor):
    import mpx.metrics
    ex = executor(n=2)
    registry = prometheus_client.CollectorRegistry()
    registry.register(mpx.metrics.Collector(ex))
    for i in range(7):
        ex.collective_rpc("mul", args=(i,))
    with pytest.raises(mpx.RPCError):
        ex.collective_rpc("fail")
    got = _scrape(registry)
    assert got[("mpx_rpc_calls_total", (("method", "mul"), ("outcome", "ok")))] == 7
    assert got[("mpx_rpc_calls_total", (("method", "fail"), ("outcome", "error")))] == 1
    assert got[("mpx_rpc_calls_total", (("method", "mul"), ("outcome", "timeout")))] == 0
    assert got[("mpx_rpc_duration_seconds_count", (("method", "mul"),))] == 7
    assert got[("mpx_rpc_duration_seconds_bucket", (("le", "+Inf"), ("method", "mul")))] == 7
    assert got[("mpx_rank_reply_seconds_count", (("rank", "1"),))] == 8
    assert got[("mpx_rank_reply_seconds_sum", (("rank", "0"),))] > 0
    # cumulative buckets, non-decreasing, ending at the count
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in got.items()
                     if k[0] == "mpx_rank_reply_seconds_bucket" and dict(k[1])["rank"] == "0")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1][1] == 8
    assert got[("mpx_rpc_bytes_total", (("direction", "sent"),))] > 0
    assert got[("mpx_rpc_bytes_total", (("direction", "received"),))] > 0
    assert got[("mpx_calls_in_flight", ())] == 0
    assert got[("mpx_worker_up", (("rank", "0"),))] == 1
    assert got[("mpx_worker_deaths_total", (("rank", "1"),))] == 0
    ex.shutdown()
    after = _scrape(registry)  # the last values, never an error
    assert after[("mpx_rpc_calls_total", (("method", "mul"), ("outcome", "ok")))] == 7
    assert after[("mpx_worker_up", (("rank", "0"),))] == 0


def test_the_collector_of_a_collected_executor_reports_nothing():
    import _workers
    from _env import START_METHOD

    import mpx.metrics
    ex = mpx.Executor(_workers.Echo, 1, start_method=START_METHOD)
    collector = mpx.metrics.Collector(ex)
    ex.collective_rpc("noop")
    assert list(collector.collect())
    ex.shutdown()
    del ex
    gc.collect()
    assert list(collector.collect()) == []


# ------------------------------------------------------------------ mpx top


def test_top_shows_a_running_group(executor, tmp_path):
    import subprocess
    import sys

    from mpx._driver.stats_server import fetch
    path = str(tmp_path / "stats.sock")
    ex = executor(n=4, stats_socket=path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    for _ in range(10):
        ex.collective_rpc("noop")
    snap = fetch(path)
    assert [r["pid"] for r in snap["ranks"]] == ex.worker_pids
    assert snap["calls"] == {"noop": {"ok": 10, "error": 0, "timeout": 0}}
    assert all(r["cpu_s"] is not None and r["alive"] for r in snap["ranks"])
    out = subprocess.run([sys.executable, "-m", "mpx", "top", path, "--once"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "in flight 0" in lines[0]
    for rank, pid in enumerate(ex.worker_pids):
        row = next(line for line in lines if line.split()[:2] == [str(rank), str(pid)])
        assert " up " in row and row.rstrip().endswith("%")
    assert any(line.startswith("noop") for line in lines)
    ex.shutdown()
    assert not os.path.exists(path)  # removed with the executor
    gone = subprocess.run([sys.executable, "-m", "mpx", "top", path, "--once"],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "cannot read the stats socket" in gone.stderr


def test_a_stale_stats_socket_is_replaced_and_a_live_one_refused(executor, tmp_path):
    import socket as socket_mod
    path = str(tmp_path / "stats.sock")
    stale = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
    stale.bind(path)  # bound, never listening: what a killed executor leaves
    stale.close()
    ex = executor(n=1, stats_socket=path)
    with pytest.raises(OSError, match="another executor serves it"):
        executor(n=1, stats_socket=path)
    ex.collective_rpc("noop")
    from mpx._driver.stats_server import fetch
    assert fetch(path)["calls"]["noop"]["ok"] == 1


# ------------------------------------------------------------------ OpenTelemetry

def _driver_spans():
    """The driver's spans, into memory (one SDK provider for the whole test process)."""
    import _otel
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    global _EXPORTER
    if _EXPORTER is None:
        _EXPORTER = InMemorySpanExporter()
        _otel.provider().add_span_processor(SimpleSpanProcessor(_EXPORTER))
    _EXPORTER.clear()
    return _EXPORTER


_EXPORTER = None


def _worker_spans(out_dir, rank):
    import json
    path = out_dir / f"{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_tracing_spans_cross_into_the_workers(executor, tmp_path):
    pytest.importorskip("opentelemetry.sdk")
    import _trace_workers
    from opentelemetry import trace
    exporter = _driver_spans()
    ex = executor(_trace_workers.Traced, n=2, worker_kwargs={"out_dir": str(tmp_path)},
                  tracing=True)
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("request") as request:
        assert ex.collective_rpc("work", args=(10,)) == [10, 11]
        assert ex.collective_rpc("work", args=(1,), non_block=True).result(10) == [1, 2]
        with pytest.raises(mpx.RPCError):
            ex.collective_rpc("boom")
    deadline = time.monotonic() + 5
    while len(exporter.get_finished_spans()) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)  # (the future's span ends on the callback thread)
    spans = {s.name: s for s in exporter.get_finished_spans() if s.name != "mpx.collective_rpc work"}
    works = [s for s in exporter.get_finished_spans() if s.name == "mpx.collective_rpc work"]
    assert len(works) == 2
    client, failed = works[0], spans["mpx.collective_rpc boom"]
    assert client.kind == trace.SpanKind.CLIENT
    assert client.parent.span_id == request.get_span_context().span_id
    assert client.attributes["rpc.system.name"] == "mpx"
    assert client.attributes["rpc.method"] == "work"
    assert client.attributes["mpx.world_size"] == 2
    assert failed.status.status_code == trace.StatusCode.ERROR
    assert failed.attributes["error.type"] == "RPCError"
    ids = {s.context.span_id: s for s in works + [failed]}
    for rank in (0, 1):
        got = _worker_spans(tmp_path, rank)
        assert [s["name"] for s in got] == ["mpx.worker work", "mpx.worker work",
                                            "mpx.worker boom"]
        for s in got:
            assert s["kind"] == "SERVER" and s["attributes"]["mpx.rank"] == rank
            assert s["parent_id"] in ids  # a child of the driver's span of that call
            assert s["trace_id"] == request.get_span_context().trace_id
        assert got[2]["status"] == "ERROR" and got[2]["attributes"]["error.type"] == "KeyError"


def test_no_tracing_no_span(executor, tmp_path):
    pytest.importorskip("opentelemetry.sdk")
    import _trace_workers
    exporter = _driver_spans()
    ex = executor(_trace_workers.Traced, n=1, worker_kwargs={"out_dir": str(tmp_path)})
    assert ex.collective_rpc("work", args=(1,)) == [1]
    assert exporter.get_finished_spans() == ()
    assert _worker_spans(tmp_path, 0) == []


def test_the_stats_socket_reads_cpu_of_local_ranks_only():
    from mpx._driver.stats_server import to_json
    lat = mpx.Latency(0, 0.0, 0.0, 0.0)
    ranks = tuple(mpx.RankStats(r, os.getpid(), True, 0, 0, lat) for r in range(2))
    s = mpx.Stats(calls={}, in_flight=0, queued=0, bytes_sent=0, bytes_received=0, ranks=ranks,
                  skew=lat, window_s=60.0)
    out = to_json(s, lambda rank: rank == 0, os.getpid())
    assert out["ranks"][0]["cpu_s"] is not None
    # rank 1 runs on a follower node: its pid names a process there, not here
    assert out["ranks"][1]["cpu_s"] is None
