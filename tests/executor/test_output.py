"""Replies with get_output(), sent inline or from the async output thread
(Config.async_output), across real worker processes."""

from __future__ import annotations

import functools
import time

import _watchdog_workers as WW
import pytest

import mpx


@pytest.fixture
def make(executor):
    return functools.partial(executor, WW.Outputs)


@pytest.mark.parametrize("async_output", [False, True])
def test_get_output_is_resolved_in_the_sending_thread(make, async_output):
    ex = make(async_output=async_output)
    thread = "mpx-output" if async_output else "MainThread"
    assert ex.collective_rpc("deferred", args=("v",)) == [("v", thread)] * 2
    assert ex.collective_rpc("deferred", args=("u",), unique_reply_rank=1) == ("u", thread)
    assert ex.collective_rpc("plain", args=(5,)) == [5, 5]


@pytest.mark.parametrize("async_output", [False, True])
def test_get_output_error_fails_that_call_only(make, async_output):
    ex = make(async_output=async_output)
    with pytest.raises(mpx.RPCError) as ei:
        ex.collective_rpc("deferred", args=("bad",), kwargs={"fail_ranks": [1]})
    assert ei.value.ranks == [1] and ei.value.exc_type == "RuntimeError"
    assert "copy of 'bad' failed" in str(ei.value) and "get_output" in ei.value.remote_traceback
    # a rank not asked to reply still fails the call
    with pytest.raises(mpx.RPCError):
        ex.collective_rpc("deferred", args=("bad",), kwargs={"fail_ranks": [1]},
                          unique_reply_rank=0)
    assert ex.collective_rpc("plain", args=(1,)) == [1, 1]
    assert not ex.is_failed


def test_async_replies_keep_their_order(make):
    ex = make(async_output=True)
    futs = [ex.collective_rpc("deferred", args=(i,), kwargs={"delay": 0.002 * (i % 3)},
                              non_block=True) for i in range(60)]
    assert [f.result(timeout=30) for f in futs] == [[(i, "mpx-output")] * 2 for i in range(60)]


def test_async_output_overlaps_copy_with_the_next_call(make):
    """10 calls of 50 ms compute + 50 ms output copy: ~1.0 s one after the other, ~0.55 s
    overlapped (bench/bench_async_output.py measures it properly)."""
    times = {}
    for mode in (False, True):
        ex = make(n=1, async_output=mode)
        ex.collective_rpc("plain", args=(0,))
        t0 = time.monotonic()
        futs = [ex.collective_rpc("deferred", args=(i,), kwargs={"compute": 0.05, "delay": 0.05},
                                  non_block=True) for i in range(10)]
        assert [f.result(timeout=30)[0][0] for f in futs] == list(range(10))
        times[mode] = time.monotonic() - t0
        ex.shutdown()
    assert times[True] < 0.8 * times[False], times
