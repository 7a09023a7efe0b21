"""Observers never change a call: tracing (the driver's span processors and the workers'),
and the Prometheus collector. Whatever a hook raises is logged once (per hook and kind of
error, with its traceback) and the call's outcome is what it would have been without it:
its result, or the method's own error. Across real worker processes, on both rings."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

import mpx
from mpx import _observe

pytest.importorskip("opentelemetry.sdk")

DEADLINE_S = 10.0


@pytest.fixture
def reported(monkeypatch):
    """A fresh once-only registry of hook failures for this test (it is per process)."""
    monkeypatch.setattr(_observe, "_reported", set())


_DRIVER_HOOKS = None


@pytest.fixture
def driver_hooks():
    """The driver's raising span processor (on the process's one provider), on for the
    test: ``driver_hooks(("on_start",))``."""
    import _otel
    import _trace_workers
    global _DRIVER_HOOKS
    if _DRIVER_HOOKS is None:
        _DRIVER_HOOKS = _trace_workers.RaisingProcessor()
        _DRIVER_HOOKS.on = False
        _otel.provider().add_span_processor(_DRIVER_HOOKS)

    def arm(hooks):
        _DRIVER_HOOKS.hooks = set(hooks)
        _DRIVER_HOOKS.on = True

    yield arm
    _DRIVER_HOOKS.on = False


def _hook_warnings(caplog, text="HookError"):
    return [r for r in caplog.records
            if r.name == "mpx" and r.levelno == logging.WARNING and text in r.getMessage()]


def _wait_for(predicate):
    deadline = time.monotonic() + DEADLINE_S
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


async def _two_awaited(ex):
    return await asyncio.gather(ex.collective_rpc("work", args=(5,), non_block=True),
                                ex.collective_rpc("work", args=(7,), non_block=True))


def _worker_span_names(out_dir, rank):
    import json
    path = out_dir / f"{rank}.jsonl"
    return [json.loads(line)["name"] for line in path.read_text().splitlines()] \
        if path.exists() else []


@pytest.mark.parametrize("hooks", [("on_start",), ("on_end",)])
def test_a_driver_span_processor_that_raises_changes_no_call(impl, executor, tmp_path, hooks,
                                                             driver_hooks, reported, caplog):
    import _trace_workers
    caplog.set_level(logging.WARNING, logger="mpx")
    ex = executor(_trace_workers.Traced, n=2, worker_kwargs={"out_dir": str(tmp_path)},
                  tracing=True)
    driver_hooks(hooks)
    for i in range(3):
        assert ex.collective_rpc("work", args=(i,)) == [i, i + 1]
    assert ex.collective_rpc("work", args=(1,), non_block=True).result(DEADLINE_S) == [1, 2]
    assert asyncio.run(asyncio.wait_for(_two_awaited(ex), DEADLINE_S)) == [[5, 6], [7, 8]]
    assert ex.collective_rpc(lambda w, x: 2 * x + w.rank, args=(3,)) == [6, 7]
    assert ex.collective_rpc("work", args=(1,), unique_reply_rank=1) == 2
    with pytest.raises(mpx.RPCError, match="KeyError") as failed:
        ex.collective_rpc("boom")
    assert "HookError" not in str(failed.value)
    # (a future's span ends on the callback thread: its hook's warning may come after)
    assert _wait_for(lambda: _hook_warnings(caplog))
    time.sleep(0.1)
    warned = _hook_warnings(caplog)
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert warned[0].exc_info is not None and hooks[0] in warned[0].getMessage()
    # the workers still trace every call (without the driver's context if its span failed)
    for rank in (0, 1):
        assert len(_worker_span_names(tmp_path, rank)) == 9


@pytest.mark.parametrize("hooks", [("on_start",), ("on_end",)])
def test_a_worker_span_processor_that_raises_changes_no_call(impl, executor, tmp_path, hooks,
                                                             reported):
    import _trace_workers
    ex = executor(_trace_workers.RaisingSpans, n=2,
                  worker_kwargs={"out_dir": str(tmp_path), "hooks": hooks}, tracing=True)
    for i in range(3):
        assert ex.collective_rpc("work", args=(i,)) == [i, i + 1]
    assert ex.collective_rpc("work", args=(1,), non_block=True).result(DEADLINE_S) == [1, 2]
    assert asyncio.run(asyncio.wait_for(_two_awaited(ex), DEADLINE_S)) == [[5, 6], [7, 8]]
    with pytest.raises(mpx.RPCError, match="KeyError") as failed:
        ex.collective_rpc("boom")  # the method's own error, not the hook's
    assert "HookError" not in str(failed.value)
    assert ex.collective_rpc("work", args=(2,)) == [2, 3]
    for rank in (0, 1):
        log = (tmp_path / f"{rank}.log").read_text()
        warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
        assert len(warnings) == 1, log
        assert "HookError" in warnings[0] and hooks[0] in warnings[0]
        assert "Traceback" in log


def test_the_collector_that_cannot_read_changes_no_call_nor_fails_a_scrape(
        impl, executor, monkeypatch, reported, caplog):
    import prometheus_client

    import mpx.metrics
    from mpx._driver import stats as stats_mod
    caplog.set_level(logging.WARNING, logger="mpx")
    ex = executor(n=2)
    registry = prometheus_client.CollectorRegistry()
    registry.register(mpx.metrics.Collector(ex))

    def broken(group):
        raise ZeroDivisionError("the snapshot broke")

    monkeypatch.setattr(stats_mod, "snapshot", broken)
    for i in range(3):
        assert ex.collective_rpc("mul", args=(i,)) == [i, 2 * i]
        text = prometheus_client.generate_latest(registry).decode()
        assert "mpx_rpc_calls_total" not in text  # nothing, and no error
    warned = _hook_warnings(caplog, "ZeroDivisionError")
    assert len(warned) == 1 and warned[0].exc_info is not None
    monkeypatch.undo()
    assert 'mpx_rpc_calls_total{method="mul",outcome="ok"} 3.0' in \
        prometheus_client.generate_latest(registry).decode()


def test_a_hook_error_is_logged_once_per_hook_and_kind_and_requests_to_stop_pass(
        reported, caplog):
    caplog.set_level(logging.WARNING, logger="mpx")

    def hook(error):
        raise error

    for _ in range(3):
        assert _observe.run("hook A", hook, ValueError("a")) is None
        assert _observe.run("hook A", hook, KeyError("b")) is None
        assert _observe.run("hook B", hook, ValueError("c")) is None
    assert _observe.run("hook A", lambda x: x + 1, 1) == 2
    assert sorted(r.getMessage().split(" raised")[0] for r in caplog.records) == \
        ["hook A", "hook A", "hook B"]
    for stop in (KeyboardInterrupt, SystemExit):
        with pytest.raises(stop):
            _observe.run("hook A", hook, stop())
