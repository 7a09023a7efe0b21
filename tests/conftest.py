"""Fixtures shared by the suites.

- ``impl``: runs a test against the compiled ring and the pure-Python twin (restrict with
  ``MPX_TEST_IMPL=cython|python``).
- ``ctx``: the multiprocessing context (``MPX_TEST_START_METHOD``, default spawn).
- an autouse check that a test leaves no /dev/shm segment, child process or thread behind,
  and, when mpx's debug counters are on (built with MPX_DEBUG=1, or MPX_DEBUG=1 set), no
  segment mapping, ring or mpx thread open in this process.
- SIGINT restored to Python's handler when the run was started ignoring it (a shell without
  job control starts ``pytest &`` so, and every child would inherit it): the Ctrl-C tests
  send SIGINT to the drivers they start.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import psutil
import pytest
from _env import IMPLS, START_METHOD

from mpx import _debug
from mpx._procinfo import pid_alive
from mpx.mechanism import segments

# Predicates over psutil.Process for long-lived children a module-scoped fixture started on
# purpose (test_ray_launcher.py's Ray cluster: its GCS, raylets and idle Ray workers). The
# fixture adds one while it runs and removes it when it has shut down what it started.
ALLOWED_CHILDREN: list = []

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Select the ring implementation for this test and the processes it starts."""
    if request.param == "python":
        monkeypatch.setenv("MPX_PURE_PYTHON", "1")
    else:
        monkeypatch.delenv("MPX_PURE_PYTHON", raising=False)
        pytest.importorskip("mpx._ring", reason="compiled ring not built")
    return request.param


@pytest.fixture
def ctx():
    return multiprocessing.get_context(START_METHOD)


def _mpx_segments() -> set[str]:
    """This run's mpx segments: made by this process, a descendant, or a process that is
    gone. Those of another live process (a test run beside this one) are not ours to judge
    or remove."""
    try:
        names = [e for e in os.listdir("/dev/shm") if e.startswith(segments.PREFIX)]
    except OSError:
        return set()
    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    out = set()
    for name in names:
        creator = name.split("-")[1]
        if not creator.isdigit() or int(creator) in ours or not pid_alive(int(creator)):
            out.add(name)
    return out


def _children() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            # the forkserver and the resource tracker are multiprocessing's own, long-lived
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "forkserver" in cmd or "resource_tracker" in cmd:
            continue
        if any(allowed(p) for allowed in ALLOWED_CHILDREN):
            continue
        if p.status() == psutil.STATUS_ZOMBIE:
            continue
        out.append(p)
    return out


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves an mpx segment, a child process or a thread behind."""
    segs = _mpx_segments()
    threads = set(threading.enumerate())
    counts = _debug.counts()
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        kids = _children()
        # pyzmq's zero-copy garbage collector is one thread per process, like the
        # multiprocessing resource tracker: not a leak of the test
        new_threads = [t for t in threading.enumerate() if t not in threads and t.is_alive()
                       and type(t).__name__ != "GarbageCollectorThread"]
        new_segs = _mpx_segments() - segs
        held = {k: v - counts[k] for k, v in _debug.counts().items() if v != counts[k]}
        if not kids and not new_threads and not new_segs and not held:
            break
        time.sleep(0.05)
    for k in kids:
        k.kill()
    for s in new_segs:
        segments.unlink("/" + s)
    assert not new_segs, f"test left shared-memory segments behind: {sorted(new_segs)}"
    assert not kids, f"test left child processes behind: {kids}"
    assert not new_threads, f"test left threads behind: {new_threads}"
    assert not held, f"test left mpx resources open (debug counters): {held}"


@pytest.fixture
def executor():
    """A factory of executors over tests/_workers.Echo (``executor(cls, n, **config)``),
    started with the suite's start method; every one is shut down after the test."""
    import _workers

    import mpx
    made = []

    def make(cls=None, n=2, **kw):
        kw.setdefault("start_method", START_METHOD)
        e = mpx.Executor(cls or _workers.Echo, n, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()
