"""What a worker does with awkward results and with exceptions that are no Exception, across
real worker processes, with replies sent inline and from the output thread (async_output).

The rule (mpx/_worker/main.py's docstring): whatever a call raises fails that call alone,
``BaseException`` subclasses included (asyncio.CancelledError, GeneratorExit, a user's
own), whether the method, its result's get_output() or the pickling of the result raised
it; SystemExit and KeyboardInterrupt end the worker, and the driver reports its death at
once, in either output mode. Probing a result for get_output() never fails it.
"""

from __future__ import annotations

import time

import _fault_workers as FW
import pytest

import mpx

# A worker's death is reported within a second; twice that here (see tests/failures/test_matrix.py).
DEATH_BOUND = 2.0
# Long enough that a call answered late (or never) shows as a timeout, not as a death.
CALL_TIMEOUT_S = 10.0

pytestmark = pytest.mark.parametrize("async_output", [False, True], ids=["inline", "async"])


@pytest.fixture
def ex(executor, async_output):
    return lambda: executor(FW.Awkward, async_output=async_output)


def _still_serves(e: mpx.Executor, pids: list[int]) -> None:
    assert e.collective_rpc("ident", args=("next",), timeout=CALL_TIMEOUT_S) == ["next"] * 2
    assert e.worker_pids == pids and not e.is_failed


def test_a_result_whose_getattr_raises_is_delivered(ex):
    """``__getattr__ = lambda self, k: self[k]``: looking for get_output raises KeyError."""
    e = ex()
    pids = e.worker_pids
    got = e.collective_rpc("attrdict", kwargs={"a": 1}, timeout=CALL_TIMEOUT_S)
    assert got == [{"a": 1, "rank": 0}, {"a": 1, "rank": 1}]
    assert all(type(r) is FW.AttrDict and r.a == 1 for r in got)
    assert e.collective_rpc("attrdict", unique_reply_rank=1, timeout=CALL_TIMEOUT_S).rank == 1
    _still_serves(e, pids)


@pytest.mark.parametrize("what,exc_type", [("cancelled", "CancelledError"),
                                           ("generator_exit", "GeneratorExit"),
                                           ("custom", "Custom")])
def test_a_method_that_raises_a_base_exception_fails_that_call_alone(ex, what, exc_type):
    e = ex()
    pids = e.worker_pids
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("raise_", args=(what,), kwargs={"ranks": [1]}, timeout=CALL_TIMEOUT_S)
    assert ei.value.ranks == [1] and ei.value.exc_type == exc_type, str(ei.value)
    assert "in raise_" in ei.value.remote_traceback
    _still_serves(e, pids)


@pytest.mark.parametrize("kind", ["get_output", "pickle"])
def test_a_result_that_raises_a_base_exception_fails_that_call_alone(ex, kind):
    e = ex()
    pids = e.worker_pids
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("result", args=(kind, "cancelled"), kwargs={"ranks": [1]},
                         timeout=CALL_TIMEOUT_S)
    assert ei.value.ranks == [1] and ei.value.exc_type == "CancelledError", str(ei.value)
    assert ("in get_output" if kind == "get_output" else "in __reduce__") \
        in ei.value.remote_traceback
    _still_serves(e, pids)


@pytest.mark.parametrize("where", ["method", "get_output", "pickle"])
@pytest.mark.parametrize("what,says", [("system_exit", "exit code 6"),
                                       ("keyboard_interrupt", "exit code 1")])
def test_system_exit_and_keyboard_interrupt_end_the_worker(ex, where, what, says):
    """In the method or in sending its result, from the RPC loop or the output thread: the
    worker exits (with SystemExit's code) and the call fails with its death at once."""
    e = ex()
    pid = e.worker_pids[1]
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerDiedError) as ei:
        if where == "method":
            e.collective_rpc("raise_", args=(what,), kwargs={"ranks": [1]},
                             timeout=CALL_TIMEOUT_S)
        else:
            e.collective_rpc("result", args=(where, what), kwargs={"ranks": [1]},
                             timeout=CALL_TIMEOUT_S)
    took = time.monotonic() - t0
    assert ei.value.rank == 1 and ei.value.pid == pid and says in str(ei.value), str(ei.value)
    assert took < DEATH_BOUND, f"the death took {took:.3f} s to show"
    assert e.is_failed


def _is_undecodable(err: mpx.RPCError, ranks: list[int], exc_type: str) -> None:
    """``err`` says the message of ``ranks`` could not be unpickled, naming ``exc_type``."""
    assert err.ranks == ranks and err.exc_type == "DeserializationError", str(err)
    assert exc_type in str(err), str(err)


@pytest.mark.parametrize("what,exc_type", [("cancelled", "CancelledError"),
                                           ("generator_exit", "GeneratorExit"),
                                           ("custom", "Custom")])
def test_an_argument_whose_unpickling_raises_a_base_exception_fails_that_call_alone(
        ex, what, exc_type):
    e = ex()
    pids = e.worker_pids
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("ident", args=(FW.RaisesOnUnpickle(what),), timeout=CALL_TIMEOUT_S)
    _is_undecodable(ei.value, [0, 1], exc_type)
    _still_serves(e, pids)


@pytest.mark.parametrize("what,exc_type", [("cancelled", "CancelledError"),
                                           ("custom", "Custom")])
def test_a_result_whose_unpickling_in_the_driver_raises_a_base_exception_fails_that_call(
        ex, what, exc_type):
    e = ex()
    pids = e.worker_pids
    with pytest.raises(mpx.RPCError) as ei:
        e.collective_rpc("unpicklable_in_driver", args=(what,), kwargs={"ranks": [1]},
                         timeout=CALL_TIMEOUT_S)
    _is_undecodable(ei.value, [1], exc_type)
    fut = e.collective_rpc("unpicklable_in_driver", args=(what,), kwargs={"ranks": [0]},
                           non_block=True)
    with pytest.raises(mpx.RPCError, match=exc_type):
        fut.result(timeout=CALL_TIMEOUT_S)
    _still_serves(e, pids)
