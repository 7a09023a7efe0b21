"""A driver that dies (SIGKILL) takes its workers along: they exit within seconds whatever
the start method, busy or idle, even while another process holds their death pipe. (A
driver killed during startup: tests/failures/test_matrix.py; a node's launcher killed:
tests/nodes/test_launch_promises.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import _env
import _procs
import pytest
from _env import START_METHOD

DRIVER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import mpx, _workers
    ex = mpx.Executor(_workers.Echo, 2, start_method={method!r})
    print(" ".join(map(str, ex.worker_pids)), flush=True)
    if {busy!r}:
        ex.collective_rpc("sleep", args=(60,), non_block=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("start_method,busy", [("spawn", False), ("spawn", True),
                                               ("forkserver", True), ("fork", False)])
def test_workers_exit_when_driver_is_sigkilled(start_method, busy):
    code = DRIVER.format(tests=_env.TESTS, method=start_method, busy=busy)
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(0.3)
        driver.kill()
        killed = time.monotonic()
        driver.wait(5)
        alive = pids
        while alive and time.monotonic() - killed < 2.0:
            alive = [p for p in alive if _procs.running(p)]
            time.sleep(0.01)
        assert not alive, f"workers outlived the driver by 2 s: {alive}"
    finally:
        driver.kill()
        driver.stdout.close()
        if driver.poll() is None:
            driver.wait(5)


KILLED_DRIVER_WITH_A_HELPER = textwrap.dedent("""
    import ctypes, os, signal, sys, threading, time
    sys.path.insert(0, {tests!r})
    import mpx, _workers

    def build(out):
        out.append(mpx.Executor(_workers.Echo, 2, start_method={method!r}))

    if __name__ == "__main__":
        made = []
        t = threading.Thread(target=build, args=(made,))  # off the main thread: no PDEATHSIG
        t.start(); t.join()
        ex = made[0]
        ex.collective_rpc("sleep", args=(60,), non_block=True)  # calls are out
        how = {how!r}
        if how == "python":
            helper = os.fork()
        else:  # from C: Python's at-fork handlers do not run
            helper = ctypes.CDLL(None).fork()
        if helper == 0:
            os.close(1); os.close(2)  # (so that the test does not wait for it)
            ctypes.CDLL(None).sleep(30)
            os._exit(0)
        print("pids", *ex.worker_pids, helper, flush=True)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("how", ["python", "c"])
def test_workers_outlive_no_sigkilled_driver_whose_helper_holds_the_pipe(tmp_path, how):
    script = tmp_path / "driver.py"
    script.write_text(KILLED_DRIVER_WITH_A_HELPER.format(tests=_env.TESTS, method=START_METHOD,
                                                         how=how))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers, helper = [], None
    try:
        line = driver.stdout.readline()
        assert line.startswith("pids"), line
        *workers, helper = [int(p) for p in line.split()[1:]]
        driver.wait(30)  # it SIGKILLs itself
        t0 = time.monotonic()
        assert not _procs.wait_gone(workers, 3), "workers outlived their driver"
        assert time.monotonic() - t0 < 3
    finally:
        driver.kill()
        driver.wait()
        driver.stdout.close()
        for pid in workers + ([helper] if helper else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
