"""What an executor checks before it starts a worker, and python -m mpx doctor with it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import mpx
from mpx.mechanism import segments


def _too_big(free):
    """Ring geometry whose 2 rings (an executor of 1 worker) exceed ``free`` bytes, while
    one ring alone might not."""
    chunk = 1 << 30
    return dict(max_chunk_bytes=chunk, max_chunks=max(1, free // chunk // 2 + 1))


def test_too_little_shared_memory_is_shm_error_before_any_worker(executor):
    free = segments.free_bytes("/dev/shm")
    t0 = time.monotonic()
    with pytest.raises(mpx.ShmError) as ei:
        executor(n=1, transport="shm", **_too_big(free))
    assert time.monotonic() - t0 < 1.0  # no worker was started
    text = str(ei.value)
    assert "2 rings" in text and "free" in text and "MPX_MAX_CHUNKS" in text


def test_doctor_fails_where_an_executor_cannot_start():
    free = segments.free_bytes("/dev/shm")
    geo = _too_big(free)
    env = dict(os.environ, MPX_TRANSPORT="shm", MPX_MAX_CHUNK_BYTES=str(geo["max_chunk_bytes"]),
               MPX_MAX_CHUNKS=str(geo["max_chunks"]))
    out = subprocess.run([sys.executable, "-m", "mpx", "doctor", "--no-torch"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[FAIL] executor shared memory" in out.stdout, out.stdout


@pytest.mark.parametrize("var,raw", [("MPX_NNODES", "0"), ("MPX_SHUTDOWN_GRACE_S", "inf"),
                                     ("MPX_DUMP_DIR", "/proc/no-such-dir")])
def test_doctor_fails_on_settings_an_executor_refuses(var, raw):
    env = dict(os.environ, **{var: raw})
    out = subprocess.run([sys.executable, "-m", "mpx", "doctor", "--no-torch"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[FAIL]" in out.stdout and (var in out.stdout or raw in out.stdout), out.stdout


def test_an_unwritable_dump_dir_fails_before_any_worker(executor):
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerStartupError, match="MPX_DUMP_DIR"):
        executor(n=1, dump_dir="/proc/no-such-dir")
    assert time.monotonic() - t0 < 1.0


def _in_daemon(conn):
    try:
        mpx.Executor(object, 1)
    except mpx.WorkerStartupError as e:
        conn.send(str(e))
    except BaseException as e:
        conn.send(f"unexpected {type(e).__name__}: {e}")


def test_an_executor_in_a_daemonic_child_says_what_to_do(ctx):
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_in_daemon, args=(child,), daemon=True)
    p.start()
    try:
        assert parent.poll(60)
        text = parent.recv()
    finally:
        p.join(10)
    assert "daemonic" in text and "daemon=False" in text, text


def test_many_more_workers_than_cores_warn(monkeypatch):
    from mpx._driver import preflight
    from mpx.config import Config
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.warns(RuntimeWarning, match="9 workers on 2 core"):
        preflight.warn_crowding(Config(), 9)
