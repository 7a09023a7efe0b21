"""The child processes of a benchmark run: starting and joining them, the pids of every child
(for the cleanup check), what /proc says of a process, free ports, busy loops for a loaded
host, and Ray kept on loopback.

The scripts run as ``python bench/<script>.py``, which puts this folder on sys.path (spawn
children inherit it). Only the standard library at import time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import socket
import subprocess
import sys

CTX = mp.get_context("spawn")
# bench/ and the checkout above it: what a child started by hand needs on its path
BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)

procs: list = []              # started by start(), not joined yet
child_pids: set[int] = set()  # every child of this run, for the cleanup check


def start(target, args):
    """Start a daemon spawn child running ``target(*args)``; remember it and its pid."""
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    procs.append(p)
    child_pids.add(p.pid)
    return p


def join(p, timeout=30.0, what="child"):
    """Join ``p``; terminate it (saying so, unless ``what`` is None) if it does not exit."""
    p.join(timeout)
    if p.is_alive():
        if what is not None:
            print(f"  warning: {what} {p.pid} did not exit, terminating it", flush=True)
        p.terminate()
        p.join(5)
    if p in procs:
        procs.remove(p)


def cleanup_procs():
    for p in list(procs):
        join(p, 0.1, what=None)


def proc_stat(pid):
    """The fields of /proc/<pid>/stat after the command name (state first)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pids):
    """The sorted ``pids`` whose process still runs (not gone, not a zombie)."""
    out = []
    for pid in sorted(set(pids)):
        with contextlib.suppress(OSError, IndexError):
            if proc_stat(pid)[0] not in ("Z", "X"):
                out.append(pid)
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def busy_loops(n):
    """``n`` pure-Python busy loops running inside (a loaded host); SIGKILLed if we die."""
    code = "import ctypes, signal; ctypes.CDLL(None).prctl(1, signal.SIGKILL)\nwhile True: pass"
    loops = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
             for _ in range(n)]
    child_pids.update(p.pid for p in loops)
    try:
        yield loops
    finally:
        for p in loops:
            p.kill()
            p.wait()


def ray_loopback_env():
    """tests/_ray_env.py's ``ray_loopback_env()``: a Ray started inside stays on 127.0.0.1."""
    spec = importlib.util.spec_from_file_location("_ray_env", os.path.join(ROOT, "tests", "_ray_env.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ray_loopback_env()
