"""The stats socket (``Config.stats_socket``) and its client ``python -m mpx top``: mpx
removes only what it created and binds before any worker starts; the socket answers a burst
of clients and outlives a snapshot that raises and clients that misbehave; ``top`` reads
with one deadline and a size cap. (Its figures: test_stats.py.)"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from _stats_procs import FakeServer, Marked

from mpx._driver import stats_server
from mpx._driver.stats_server import StatsServer, fetch


def _top(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpx", "top", path, "--once"],
                          capture_output=True, text=True, timeout=60)


# ------------------------------------------------------------------ what is at the path

def _regular(path):
    with open(path, "w") as f:
        f.write("precious")
    return "a regular file"


def _directory(path):
    os.mkdir(path)
    _regular(os.path.join(path, "inside"))
    return "a directory"


def _symlink(path):
    _regular(path + ".target")
    os.symlink(path + ".target", path)
    return "a symbolic link"


def _fifo(path):
    os.mkfifo(path)
    return "a FIFO"


def _as_it_was(path) -> str:
    st = os.lstat(path)
    if os.path.islink(path):
        return "link:" + os.readlink(path) + ":" + _as_it_was(os.readlink(path))
    if os.path.isdir(path):
        return "dir:" + ",".join(sorted(os.listdir(path)))
    if os.path.isfile(path):
        with open(path) as f:
            return "file:" + f.read()
    return f"mode:{st.st_mode:o} ino:{st.st_ino}"


@pytest.mark.parametrize("make", [_regular, _directory, _symlink, _fifo])
def test_a_path_holding_anything_but_a_socket_is_refused_and_left_before_workers_start(
        executor, tmp_path, make):
    path = str(tmp_path / "stats.sock")
    what = make(path)
    before = _as_it_was(path)
    marks = tmp_path / "marks"
    marks.mkdir()
    with pytest.raises(FileExistsError) as ei:
        executor(Marked, n=2, stats_socket=path, worker_kwargs={"marks": str(marks)})
    assert "Config.stats_socket" in str(ei.value) and repr(path) in str(ei.value)
    assert what in str(ei.value) and "removes nothing" in str(ei.value)
    assert _as_it_was(path) == before  # nothing removed, nothing changed
    assert list(marks.iterdir()) == []  # no worker was started


def test_a_socket_of_another_user_is_not_replaced(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to make a socket file of another user")
    path = str(tmp_path / "stats.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    os.chown(path, 12345, 12345)
    with pytest.raises(FileExistsError, match="user id 12345"):
        StatsServer(path, dict)
    assert os.stat(path).st_uid == 12345


@pytest.mark.parametrize("path, why", [
    ("/" + "x" * 200, "most 107"),
    ("/nonexistent-dir-of-mpx-tests/stats.sock", "not an existing directory"),
    ("/tmp/mpx-stats\0.sock", "NUL byte"),
])
def test_bind_errors_name_the_setting_and_the_path(path, why):
    with pytest.raises((OSError, ValueError)) as ei:
        StatsServer(path, dict)
    assert f"Config.stats_socket {path!r}" in str(ei.value) and why in str(ei.value)
    assert "None" not in str(ei.value)
    assert not os.path.exists("/tmp/mpx-stats")  # (the path up to the NUL)


def test_shutdown_removes_only_the_socket_it_bound(executor, tmp_path):
    path = str(tmp_path / "stats.sock")
    ex = executor(n=1, stats_socket=path)
    assert fetch(path)["ranks"][0]["alive"]
    os.unlink(path)
    _regular(path)  # someone else's file at the path now
    ex.shutdown()
    assert _as_it_was(path) == "file:precious"


# ------------------------------------------------------------------ serving

def test_a_burst_of_64_clients_is_answered(executor, tmp_path):
    path = str(tmp_path / "stats.sock")
    ex = executor(n=2, stats_socket=path)
    ex.collective_rpc("noop")
    start = threading.Barrier(64)
    got: list = []

    def client() -> None:
        start.wait(30)
        try:
            got.append(fetch(path, timeout=20)["calls"])
        except Exception as e:
            got.append(e)

    threads = [threading.Thread(target=client) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == [{"noop": {"ok": 1, "error": 0, "timeout": 0}}] * 64


def test_a_snapshot_that_raises_is_answered_logged_once_and_serving_goes_on(tmp_path, caplog):
    path = str(tmp_path / "stats.sock")
    answers = iter([ValueError("bad figures"), {"odd": object()}, ValueError("bad again"),
                    {"odd": object()}])

    def snapshot() -> dict:
        a = next(answers, {"fine": True})
        if isinstance(a, Exception):
            raise a
        return a

    server = StatsServer(path, snapshot)
    server.serve()
    try:
        with caplog.at_level(logging.DEBUG, logger="mpx"):
            with pytest.raises(RuntimeError, match="snapshot failed: ValueError: bad figures"):
                fetch(path)
            with pytest.raises(RuntimeError, match="TypeError"):  # (not JSON-able)
                fetch(path)
            top = _top(path)  # ValueError again
            assert top.returncode == 1 and "snapshot failed: ValueError: bad again" in \
                top.stderr, top.stderr
            with pytest.raises(RuntimeError, match="TypeError"):
                fetch(path)
            assert fetch(path) == {"fine": True}
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 2, [r.getMessage() for r in warnings]  # once per kind
        assert all("snapshot raised" in r.getMessage() for r in warnings)
    finally:
        server.stop()
    assert not os.path.exists(path)


def test_clients_that_never_read_or_hang_up_hold_nothing_up(tmp_path):
    path = str(tmp_path / "stats.sock")
    server = StatsServer(path, lambda: {"pad": "x" * (8 << 20)})  # past the socket's buffer
    server.serve()
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    try:
        for s in idle:
            s.connect(path)  # and never reads
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
            gone.connect(path)  # and hangs up at once
        t0 = time.monotonic()
        assert len(fetch(path, timeout=30)["pad"]) == 8 << 20
        # each idle client is dropped after _ANSWER_S
        assert time.monotonic() - t0 < 4 * stats_server._ANSWER_S + 10
    finally:
        for s in idle:
            s.close()
        server.stop()


# ------------------------------------------------------------------ mpx top's reads

@pytest.mark.parametrize("mode, says", [
    ("drip", "no full answer within 2 s"),
    ("silent", "no full answer within 2 s"),
    ("endless", "over 16 MiB without an end of line"),
    ("alien", "not an mpx stats snapshot"),
])
def test_top_gives_up_on_a_server_that_misbehaves(tmp_path, mode, says):
    path = str(tmp_path / "stats.sock")
    fake = FakeServer(path, mode)
    try:
        t0 = time.monotonic()
        top = _top(path)
        took = time.monotonic() - t0
    finally:
        fake.close()
    assert top.returncode == 1 and says in top.stderr, top.stderr
    assert took < stats_server.FETCH_S + 10  # one deadline for the whole read
