"""mpx._debug: the live-resource counters count (segments, rings, threads), in the driver
and in workers, and go back to zero; ``python -m mpx doctor`` reports and fails as it
should.

The counters are checked in a child interpreter started with MPX_DEBUG=1, so this runs
whether or not the extension here was built with MPX_DEBUG=1 (tox -e debug builds it so,
and then conftest's teardown checks the counters after every test as well).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import _env
import pytest
from _env import START_METHOD

from mpx import _debug
from mpx.mechanism import segments

TESTS = _env.TESTS
ROOT = os.path.dirname(TESTS)

COUNTING = textwrap.dedent("""
    import json, sys, threading
    sys.path.insert(0, {tests!r})
    import mpx, _matrix_workers
    from mpx import _debug
    out = {{"enabled": _debug.ENABLED, "start": _debug.counts()}}
    q = mpx.MessageQueue(1, 1)
    out["queue"] = _debug.counts()
    q.close()
    out["queue closed"] = _debug.counts()
    ex = mpx.Executor(_matrix_workers.Faulty, 2, start_method={method!r})
    out["executor"] = _debug.counts()
    out["executor threads"] = sum(t.name.startswith("mpx-") for t in threading.enumerate())
    out["workers"] = ex.collective_rpc("debug_counts")
    ex.shutdown()
    out["shut down"] = _debug.counts()
    print(json.dumps(out))
""")


@pytest.mark.parametrize("pure", ["0", "1"])
def test_debug_counters_count(pure):
    env = dict(os.environ, MPX_DEBUG="1", MPX_PURE_PYTHON=pure)
    res = subprocess.run([sys.executable, "-c", COUNTING.format(tests=TESTS, method=START_METHOD)],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    zero = dict(segments=0, rings=0, threads=0)
    assert out["enabled"] and out["start"] == zero
    assert out["queue"] == dict(segments=1, rings=1, threads=0)  # the writer's mapping
    assert out["queue closed"] == zero
    # the broadcast ring's writer and a reader of each worker's reply ring; the threads
    # (the monitor, at least) are those alive
    ex = out["executor"]
    assert (ex["segments"], ex["rings"]) == (3, 3)
    assert ex["threads"] == out["executor threads"] >= 1
    # each worker: a reader of the broadcast ring and the writer of its reply ring; the
    # threads (the one that watches for the driver's death, at least) are those alive
    for counts, threads in out["workers"]:
        assert (counts["segments"], counts["rings"]) == (2, 2)
        assert counts["threads"] == threads >= 1
    assert out["shut down"] == zero


def test_debug_counters_in_this_process():
    """In this process the counters are on or off as built; off, they stay at zero."""
    from mpx import MessageQueue
    before = _debug.counts()
    with MessageQueue(1, 1):
        during = _debug.counts()
    if _debug.ENABLED:
        assert during["segments"] == before["segments"] + 1
        assert during["rings"] == before["rings"] + 1
    else:
        assert during == before == dict(segments=0, rings=0, threads=0)
    assert _debug.counts() == before


def _doctor(env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-m", "mpx", "doctor", "--no-torch", *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_doctor_ok():
    res = _doctor({})
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for line in ("ring implementation: ", "futures core: ", "/dev/shm: size ", "start method: ", "pyzmq: ",
                 "CURVE encryption: ", "torch: ", "stale mpx segments: ",
                 "OK: an executor can start here"):
        assert line in out, out
    assert "[FAIL]" not in out


def test_doctor_reports_the_pure_ring():
    res = _doctor({"MPX_PURE_PYTHON": "1"})
    assert res.returncode == 0 and "ring implementation: python (MPX_PURE_PYTHON=1)" in res.stdout
    assert re.search(r"^futures core: +python$", res.stdout, re.M), res.stdout


@pytest.mark.parametrize("env,says", [
    ({"MPX_TRANSPORT": "shm", "MPX_SHM_DIR": "/nonexistent/mpx-shm"}, "/nonexistent/mpx-shm: unusable"),
    ({"MPX_TRANSPORT": "shm", "MPX_MAX_CHUNK_BYTES": str(1 << 40)}, "too small"),
    ({"MPX_START_METHOD": "bogus"}, "config: MPX_* environment is invalid"),
])
def test_doctor_fails_when_an_executor_cannot_start(env, says):
    res = _doctor(env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert says in res.stdout and "[FAIL]" in res.stdout, res.stdout
    assert "FAIL: an executor cannot start here" in res.stdout


def test_doctor_warns_when_auto_falls_back():
    """Too little shared memory with transport 'auto': the executor falls back to ZeroMQ,
    so doctor warns and exits 0."""
    res = _doctor({"MPX_TRANSPORT": "auto", "MPX_MAX_CHUNK_BYTES": str(1 << 40)})
    assert res.returncode == 0, res.stdout
    assert "[WARN] /dev/shm" in res.stdout and "will use ZeroMQ" in res.stdout


def test_doctor_lists_stale_segments():
    """A segment named for a dead pid is listed (in a private /dev/shm where possible: other
    mpx processes on the machine reap stale segments as they start)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60)
    stale = f"/mpx-{int(dead.stdout)}-0123456789abcdef"
    doctor = [sys.executable, "-m", "mpx", "doctor", "--no-torch"]
    private = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm && "
               f'touch /dev/shm{stale} && exec "$0" "$@"'] + doctor
    can = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"],
                         capture_output=True, timeout=30).returncode == 0
    if can:
        res = subprocess.run(private, capture_output=True, text=True, timeout=120, cwd=ROOT)
    else:
        name, mm = segments.create(4096)
        segments.close(mm)
        os.rename("/dev/shm" + name, "/dev/shm" + stale)  # as if that dead process made it
        try:
            res = subprocess.run(doctor, capture_output=True, text=True, timeout=120, cwd=ROOT)
        finally:
            segments.unlink(stale)
    assert res.returncode == 0 and "[WARN] stale mpx segments" in res.stdout, res.stdout
    assert stale in res.stdout and "python -m mpx cleanup" in res.stdout
