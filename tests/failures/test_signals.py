"""Signals across real processes: the driver decides when its workers stop.

A SIGINT or SIGTERM to the driver's whole process group (Ctrl-C in a terminal, ``kill
-TERM -PGID``) never reaches the workers, which lead process groups of their own; one that
reaches a worker anyway (systemd's control-group stop, a ``kill`` of its pid) is ignored,
with one warning, while its driver holds it. The driver's own shutdown escalation (death
pipe, SIGTERM, SIGKILL) still ends every worker, and a worker ended by a signal is reported
as "killed by SIG...", never "exit code 0".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import _env
import _procs
import _workers
import pytest
from _env import START_METHOD

import mpx

TESTS = _env.TESTS


class Signals(_workers.Echo):
    """Echo with the methods these tests need."""

    def die_of_sigterm(self, ranks):
        """Give SIGTERM its default action back, then take one: a worker's own code
        ending it by a signal."""
        if self.ctx.rank in ranks:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        return self.ctx.rank

    def stderr_to(self, path):
        """Send this worker's fd 2 to ``path`` (a fork server's workers write to whatever
        stderr the fork server got, not to the test's)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 2)
        os.close(fd)

    def stuck_in_c(self):
        """Sleep in C holding the GIL, not woken by SIGTERM (blocked in this thread; were
        it not, the sleep would return early and the handler run): no Python signal
        handler or timer can run."""
        import ctypes
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        ctypes.PyDLL(None).sleep(1000)


def _exitcodes(e):
    return [p.exitcode for p in e._group.procs]


# ----------------------------------------------------------------- the driver's group

# A server-like driver: its own handler for SIGINT and SIGTERM (a server drains, then
# stops), an executor of 2 workers and a call in flight when the test signals the group.
SERVER = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import mpx, _workers

    got = []

    def on_signal(signum, frame):
        got.append(signum)

    if __name__ == "__main__":
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        ex = mpx.Executor(_workers.Echo, 2, start_method={method!r})
        print("pids", *ex.worker_pids, flush=True)
        fut = ex.collective_rpc("sleep", args=(1.5,), non_block=True)
        print("in flight", flush=True)
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        print("got", *got, flush=True)
        try:
            print("result", *fut.result(timeout=30), flush=True)
            print("again", *ex.collective_rpc("mul", args=(3,), timeout=30), flush=True)
        except Exception as e:
            print("error", type(e).__name__, e, flush=True)
            ex.shutdown()
            sys.exit(3)
        t0 = time.monotonic()
        ex.shutdown()
        print("shutdown took", round(time.monotonic() - t0, 2), flush=True)
""")


def _start_server(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER.format(tests=TESTS, method=START_METHOD))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    line = driver.stdout.readline()
    assert line.startswith("pids"), line
    workers = [int(p) for p in line.split()[1:]]
    assert driver.stdout.readline().startswith("in flight")
    return driver, workers


def _finish(driver, workers, timeout=60):
    try:
        out, _ = driver.communicate(timeout=timeout)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        driver.stdout.close()
        for pid in _procs.wait_gone(workers, 5):
            os.kill(pid, signal.SIGKILL)
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_drivers_group_leaves_the_workers_to_the_driver(tmp_path, sig):
    # (with forkserver, the group's SIGTERM also ends multiprocessing's fork server, the
    # workers' parent: the driver must not take that for their deaths)
    driver, workers = _start_server(tmp_path)
    try:
        pgid = os.getpgid(driver.pid)
        assert pgid == driver.pid  # (its own session)
        assert all(os.getpgid(w) != pgid for w in workers), "workers in the driver's group"
        os.killpg(pgid, sig)
    finally:
        out = _finish(driver, workers)
    assert f"got {int(sig)}" in out, out
    assert "result 0 1" in out, out  # the call in flight, with its real result
    assert "again 3 6" in out, out  # and a new one
    took = float(out.split("shutdown took")[1].split()[0])
    assert took < 3, out  # the stop message: no grace, no SIGTERM needed
    assert driver.returncode == 0, out
    assert not _procs.wait_gone(workers, 1)


def test_workers_lead_their_own_process_groups(executor):
    e = executor(n=2)
    pids = e.worker_pids
    assert [os.getpgid(p) for p in pids] == pids
    assert os.getpgrp() not in pids


# ----------------------------------------------------------------- a stray signal

def test_a_stray_sigterm_or_sigint_to_a_worker_is_ignored_while_the_driver_lives(
        executor, tmp_path):
    e = executor(Signals, 2)
    pids = e.worker_pids
    e.collective_rpc("stderr_to", args=(str(tmp_path / "stderr"),))
    fut = e.collective_rpc("sleep", args=(1.0,), non_block=True)
    time.sleep(0.2)
    for _ in range(3):
        os.kill(pids[1], signal.SIGTERM)
        os.kill(pids[0], signal.SIGINT)
        time.sleep(0.05)
    assert fut.result(timeout=30) == [0, 1]  # the call in flight was not cut short
    assert e.collective_rpc("mul", args=(2,), timeout=30) == [2, 4]
    assert all(_procs.running(p) for p in pids)
    os.kill(pids[1], signal.SIGTERM)  # idle, parked in the ring: ignored too
    assert e.collective_rpc("rank", timeout=30) == [0, 1]
    t0 = time.monotonic()
    e.shutdown()
    assert time.monotonic() - t0 < e.config.shutdown_grace_s  # the stop message did it
    assert _exitcodes(e) == [0, 0]
    err = (tmp_path / "stderr").read_text()
    for rank, pid, name in ((0, pids[0], "SIGINT"), (1, pids[1], "SIGTERM")):
        said = f"(mpx worker rank={rank} pid={pid}) mpx: ignoring {name}"
        assert err.count(said) == 1, err  # once per signal


# ----------------------------------------------------------------- the driver's escalation

def test_shutdown_sigterms_a_busy_worker_which_dies_of_it(executor):
    # the death pipe closes, and 0.2 s later (before the worker's own 1 s orphan grace
    # ends it) the driver's SIGTERM comes: that one the worker obeys
    e = executor(Signals, 2, shutdown_grace_s=0.2, terminate_grace_s=5)
    fut = e.collective_rpc("sleep", args=(60,), non_block=True)
    time.sleep(0.3)
    t0 = time.monotonic()
    e.shutdown()
    assert time.monotonic() - t0 < 0.2 + 2
    assert _exitcodes(e) == [-signal.SIGTERM, -signal.SIGTERM]
    with pytest.raises(mpx.ExecutorFailed):
        fut.result(timeout=1)


def test_shutdown_sigkills_a_worker_stuck_in_c(executor):
    e = executor(Signals, 1, shutdown_grace_s=0.2, terminate_grace_s=0.5)
    e.collective_rpc("stuck_in_c", non_block=True)
    time.sleep(0.3)
    t0 = time.monotonic()
    e.shutdown()
    assert time.monotonic() - t0 < 0.2 + 0.5 + 2
    assert _exitcodes(e) == [-signal.SIGKILL]


def test_shutdown_sigkills_a_worker_that_ignores_sigterm():
    e = mpx.Executor(_workers.IgnoresTerm, 1, shutdown_grace_s=0.2, terminate_grace_s=0.5,
                     start_method=START_METHOD)
    e.collective_rpc("stubborn", args=(60,), non_block=True)
    time.sleep(0.3)
    t0 = time.monotonic()
    e.shutdown()
    assert time.monotonic() - t0 < 0.2 + 0.5 + 2
    # (its orphan grace may end it first, after 1 s: either way it is gone in time)
    assert _exitcodes(e)[0] in (-signal.SIGKILL, 0)


# ----------------------------------------------------------------- the error names the signal

def test_a_worker_sigkilled_is_reported_killed_by_sigkill(executor):
    e = executor(Signals, 2)
    fut = e.collective_rpc("sleep", args=(30,), non_block=True)
    os.kill(e.worker_pids[1], signal.SIGKILL)
    with pytest.raises(mpx.WorkerDiedError, match=r"rank 1 \(pid \d+\) died: killed by SIGKILL") as ei:
        fut.result(timeout=10)
    assert ei.value.exitcode == -signal.SIGKILL


def test_a_worker_dead_of_sigterm_is_reported_killed_by_sigterm(executor):
    e = executor(Signals, 2)
    with pytest.raises(mpx.WorkerDiedError, match=r"rank 1 \(pid \d+\) died: killed by SIGTERM") as ei:
        e.collective_rpc("die_of_sigterm", args=([1],), timeout=10)
    assert ei.value.exitcode == -signal.SIGTERM and ei.value.rank == 1


# ----------------------------------------------------------------- the driver's death

KILLED_DRIVER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import mpx, _workers

    if __name__ == "__main__":
        ex = mpx.Executor(_workers.Echo, 2, start_method={method!r})
        ex.collective_rpc("sleep", args=(60,), non_block=True)
        print("pids", *ex.worker_pids, flush=True)
        time.sleep(60)
""")


def test_workers_exit_within_2_s_of_a_sigkill_to_the_drivers_group(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(KILLED_DRIVER.format(tests=TESTS, method=START_METHOD))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    workers = []
    try:
        line = driver.stdout.readline()
        assert line.startswith("pids"), line
        workers = [int(p) for p in line.split()[1:]]
        time.sleep(0.3)  # the call is in the workers
        os.killpg(driver.pid, signal.SIGKILL)  # not the workers: they have their own groups
        t0 = time.monotonic()
        assert not _procs.wait_gone(workers, 3), "workers outlived their driver"
        assert time.monotonic() - t0 < 2.5
    finally:
        driver.kill()
        driver.wait()
        driver.stdout.close()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
