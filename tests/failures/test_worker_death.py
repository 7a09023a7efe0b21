"""A worker process that dies under the executor: killed while idle or while a future waits
for it, the failure seen within a second, its call failed with WorkerDiedError naming the
rank and the signal, the failure callbacks run. (How a death by signal is reported and
how shutdown escalates to SIGKILL: tests/failures/test_signals.py; deaths at every step
of a call: tests/failures/test_matrix.py; deaths in restart: tests/membership/.)"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import _procs
import pytest

import mpx


def test_idle_worker_sigkilled_is_seen_within_a_second(executor):
    e = executor(n=2)
    seen, failed = threading.Event(), threading.Event()
    e.register_failure_callback(seen.set)
    pending = e.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0]}, non_block=True)
    pending.add_done_callback(lambda f: failed.set())  # nobody calls result()
    survivor = e.worker_pids[0]
    os.kill(e.worker_pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    assert failed.wait(2)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(mpx.WorkerDiedError, match="SIGKILL") as ei:
        pending.result(timeout=0)
    assert ei.value.rank == 1 and ei.value.exitcode == -signal.SIGKILL
    # then the survivor, busy in its call, is stopped, and the failure callbacks run
    assert seen.wait(e.config.shutdown_grace_s + e.config.terminate_grace_s + 2)
    assert not _procs.running(survivor)


def test_sigkill_while_a_future_is_pending_runs_its_callback(executor):
    e = executor()
    fut = e.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0]}, non_block=True)
    seen = concurrent.futures.Future()
    fut.add_done_callback(lambda f: seen.set_result((time.monotonic(), f.exception(0))))
    os.kill(e.worker_pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    at, exc = seen.result(timeout=2)
    assert at - t0 < 2
    assert isinstance(exc, mpx.WorkerDiedError) and exc.rank == 1 and "SIGKILL" in str(exc)
