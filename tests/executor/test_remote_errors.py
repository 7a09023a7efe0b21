"""A worker's exception in the driver, across real processes: the error the driver raises
(an RPCError for a call, a WorkerStartupError for an ``__init__``) has the worker's
traceback, as text, for its ``__cause__`` (an mpx.errors.RemoteTraceback), as CPython's
concurrent.futures.process and loky chain theirs, so that an uncaught one prints the
worker's traceback above the driver's; on the blocking, future and asyncio paths alike, for
an exception whose type the driver could not rebuild, and after pickling."""

from __future__ import annotations

import asyncio
import inspect
import pickle
import traceback

import _procs
import _workers
import pytest
from _env import START_METHOD

import mpx
from mpx.errors import RemoteTraceback

CHAINED = "The above exception was the direct cause of the following exception"


def _raise_line() -> int:
    """The line of ``_workers.Echo.fail`` that raises (what the remote traceback names)."""
    lines, first = inspect.getsourcelines(_workers.Echo.fail)
    return first + next(i for i, ln in enumerate(lines) if "raise ValueError" in ln)


def _assert_remote_cause(err: BaseException, driver_frame: str) -> None:
    """``err`` is rank 1's failure of Echo.fail, its cause the worker's traceback, and the
    whole chain, formatted, shows the worker's frame first and then the driver's."""
    assert isinstance(err, mpx.RPCError) and err.ranks == [1] and err.exc_type == "ValueError"
    cause = err.__cause__
    assert type(cause) is RemoteTraceback and cause.tb == err.remote_traceback
    where = f'_workers.py", line {_raise_line()}, in fail'
    assert where in cause.tb and "ValueError: bad value on rank 1" in cause.tb
    assert str(cause) == '\n"""\n' + cause.tb + '"""'  # (CPython's form; tb ends in \n)
    text = "".join(traceback.format_exception(err))
    assert text.index(where) < text.index(CHAINED) < text.index(f"in {driver_frame}")
    assert text.rstrip().endswith("ValueError: bad value on rank 1")  # (str(err) is last)


def test_a_blocking_call_raises_the_workers_traceback_as_its_cause(executor):
    e = executor()
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("fail", kwargs={"ranks": [1]})
    _assert_remote_cause(ei.value, "test_a_blocking_call_raises_the_workers_traceback_as")
    assert "Remote traceback (rank 1)" in str(ei.value)  # (str() shows it as before)


def test_a_future_raises_the_workers_traceback_as_its_cause(executor):
    e = executor()
    fut = e.collective_rpc("fail", kwargs={"ranks": [1]}, non_block=True)
    with pytest.raises(mpx.RPCError) as ei:
        fut.result(timeout=10)
    _assert_remote_cause(ei.value, "test_a_future_raises_the_workers_traceback_as_its")
    assert fut.exception() is ei.value


def test_an_awaited_future_raises_the_workers_traceback_as_its_cause(executor):
    e = executor()

    async def main():
        try:
            await e.collective_rpc("fail", kwargs={"ranks": [1]}, non_block=True)
        except mpx.RPCError as err:
            return err
        raise AssertionError("the call did not fail")

    _assert_remote_cause(asyncio.run(main()), "main")


def _raise_unrebuildable(worker):
    """Raise an exception whose class exists only in this worker process and whose
    constructor the pickle protocol cannot call again (two arguments, one kept)."""
    namespace: dict = {}
    exec("class Unrebuildable(Exception):\n"
         "    def __init__(self, what, code):\n"
         "        super().__init__(f'{what} (code {code})')\n", namespace)
    if worker.ctx.rank == 1:
        raise namespace["Unrebuildable"]("only in the worker", 7)
    return worker.ctx.rank


def test_an_exception_the_driver_cannot_rebuild_keeps_its_traceback(executor):
    e = executor()
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc(_raise_unrebuildable)
    err = ei.value
    assert err.exc_type == "Unrebuildable" and err.exc_message == "only in the worker (code 7)"
    assert type(err.__cause__) is RemoteTraceback
    assert "in _raise_unrebuildable" in err.__cause__.tb
    assert "Unrebuildable: only in the worker (code 7)" in err.__cause__.tb
    assert e.collective_rpc("rank") == [0, 1]  # (the executor goes on)


def test_a_worker_error_and_its_cause_cross_a_process_boundary(executor, ctx):
    e = executor()
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("fail", kwargs={"ranks": [1]})
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_procs.echo_object, args=(child,))
    p.start()
    try:
        parent.send(ei.value)
        back = parent.recv()
    finally:
        p.join(10)
    assert type(back) is mpx.RPCError and str(back) == str(ei.value)
    assert back.ranks == [1] and back.exc_type == "ValueError"
    assert "bad value on rank 1" in str(back)
    assert vars(back) == vars(ei.value)
    assert type(back.__cause__) is RemoteTraceback and back.__cause__.tb == back.remote_traceback


def test_only_a_remote_traceback_is_pickled_as_a_cause():
    err = mpx.RPCError([0], "ValueError", "bad", "")
    assert err.__cause__ is None  # (no traceback, no cause: an undecodable reply's stand-in)
    try:
        raise mpx.ExecutorFailed("failed") from OSError("local")
    except mpx.ExecutorFailed as failed:
        assert pickle.loads(pickle.dumps(failed)).__cause__ is None  # (as a builtin's)


def test_a_startup_error_has_the_init_traceback_as_its_cause():
    with pytest.raises(mpx.WorkerStartupError) as ei:
        mpx.Executor(_workers.FailsInInit, 2, start_method=START_METHOD)
    cause = ei.value.__cause__
    assert type(cause) is RemoteTraceback and "in __init__" in cause.tb
    assert "KeyError" in cause.tb
    text = "".join(traceback.format_exception(ei.value))
    assert text.index("in __init__") < text.index(CHAINED)
