"""The executor's deadlines: a call's timeout, asyncio.wait_for around a future, a deadline
that fires with no one waiting, a call that finds no room in time. (The deadline rules under
concurrency are tests/executor/test_driver_rules.py's rule 3; across topologies,
tests/executor/test_executor_topologies.py; across nodes, tests/nodes/test_multinode.py.)"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import _env
import _procs
import pytest
from _env import START_METHOD

import mpx


def test_wait_for_timeouts_then_correct_results_then_clean_shutdown(executor):
    e = executor()

    async def main():
        for _ in range(3):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(
                    e.collective_rpc("sleep", args=(0.3,), non_block=True), 0.05)
        # the late replies of the calls above are never handed to these
        return [await e.collective_rpc("ident", args=(i,), non_block=True) for i in range(5)]

    assert asyncio.run(main()) == [[i, i] for i in range(5)]
    assert e.collective_rpc("ident", args=("blocking",)) == ["blocking", "blocking"]
    pids = e.worker_pids
    e.shutdown()  # never raises because of the cancelled asyncio futures
    assert not _procs.wait_gone(pids, 5)


def test_a_future_with_a_deadline_fails_on_its_own(executor):
    e = executor()
    fut = e.collective_rpc("sleep", args=(1.0,), kwargs={"ranks": [1]}, timeout=0.2,
                           non_block=True)
    failed = threading.Event()
    fut.add_done_callback(lambda f: failed.set())
    assert failed.wait(2)
    with pytest.raises(mpx.RPCTimeoutError) as ei:
        fut.result(timeout=0)
    assert ei.value.ranks == [1]
    assert e.collective_rpc("ident", args=(1,)) == [1, 1]


def test_a_call_that_finds_the_broadcast_ring_full_times_out_unsent(executor):
    """Every worker busy and the broadcast ring full: a call with a timeout waits for room
    up to it, then RPCTimeoutError naming every rank, and nothing of it was sent; the
    calls before it complete and the executor stays usable."""
    e = executor(max_chunks=2)
    busy = e.collective_rpc("sleep", args=(1.0,), non_block=True)
    queued = [e.collective_rpc("ident", args=(i,), non_block=True) for i in range(2)]
    t0 = time.monotonic()
    with pytest.raises(mpx.RPCTimeoutError) as ei:
        e.collective_rpc("ident", args=("late",), timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 0.9
    assert ei.value.ranks == [0, 1] and "could take the call" in str(ei.value)
    assert busy.result(timeout=10) == [0, 1]
    assert [f.result(timeout=10) for f in queued] == [[0, 0], [1, 1]]
    assert e.collective_rpc("ident", args=("after",)) == ["after", "after"]
    assert not e.is_failed


EXIT_AFTER_WAIT_FOR = textwrap.dedent("""
    import asyncio, sys
    sys.path.insert(0, {tests!r})
    import mpx, _workers

    async def main(ex):
        try:
            await asyncio.wait_for(ex.collective_rpc("sleep", args=(30,), non_block=True), 0.2)
        except asyncio.TimeoutError:
            print("timed out", flush=True)

    if __name__ == "__main__":
        with mpx.Executor(_workers.Echo, 2, start_method={method!r},
                          shutdown_grace_s=0.5, terminate_grace_s=0.5) as ex:
            print("pids", *ex.worker_pids, flush=True)
            asyncio.run(main(ex))
            fut = ex.collective_rpc("sleep", args=(30,), non_block=True)
        print("exited the with block", flush=True)
""")


def test_leaving_the_with_block_after_a_wait_for_timeout_never_hangs(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(EXIT_AFTER_WAIT_FOR.format(tests=_env.TESTS, method=START_METHOD))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stdout + out.stderr
    assert "timed out" in out.stdout and "exited the with block" in out.stdout, out.stdout
    assert "InvalidStateError" not in out.stderr, out.stderr
    pids = [int(p) for p in next(ln for ln in out.stdout.splitlines()
                                 if ln.startswith("pids")).split()[1:]]
    assert not _procs.wait_gone(pids, 2)
    assert took < 30
