"""Where a benchmark's processes run and the CPU they use: pinning them (apart, or all on one
CPU), the CPU a process last ran on, and CPU time by process and by thread's role (schedstat).
"""

from __future__ import annotations

import contextlib
import os

from kit_procs import proc_stat


def last_cpu(pid):
    """The CPU ``pid`` last ran on, or None."""
    try:
        return int(proc_stat(pid)[36])
    except (OSError, ValueError, IndexError):
        return None


def place(pids, how):
    """Pin this process's threads to its first CPU and the processes ``pids`` (every thread
    of each) round robin to the others (``how="apart"``) or to that CPU too ("together");
    nothing on a single CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    rest = cpus[1:] if how == "apart" else cpus[:1]
    for pid, cpu in [(os.getpid(), {cpus[0]})] + [(p, {rest[i % len(rest)]}) for i, p in enumerate(pids)]:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), cpu)


@contextlib.contextmanager
def on_one_cpu(pids):
    """Every thread of this process and of the processes ``pids`` on this process's first CPU for the
    block, then back on the CPUs each had: the round trips timed inside measure what their threads'
    work costs, one after the other, with no wake-up of an idle CPU in it."""
    saved = {}
    for pid in (os.getpid(), *pids):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                saved[int(tid)] = os.sched_getaffinity(int(tid))
    place(pids, "together")
    try:
        yield
    finally:
        for tid, cpus in saved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


def _thread_ns(pid, tid):
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])
    return 0  # the thread ended


def thread_role(pid, tid):
    """What thread ``tid`` of process ``pid`` is: "main" (the process's first thread), "ZeroMQ I/O"
    (libzmq names its I/O threads ZMQbg/IO/N) or "other"."""
    if int(tid) == pid:
        return "main"
    with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
        if f.read().startswith("ZMQbg/IO"):
            return "ZeroMQ I/O"
    return "other"


def cpu_ns_by_role(pids):
    """{(pid, thread_role): CPU nanoseconds its live threads have run} (schedstat: needs a kernel that
    has it, as every Linux of mpx's does)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                key = (pid, thread_role(pid, tid))
                out[key] = out.get(key, 0) + _thread_ns(pid, tid)
    return out


def cpu_s(pids):
    """The CPU seconds the processes ``pids`` have run: where the kernel has schedstat, the sum over
    each one's live threads of /proc/<pid>/task/<tid>/schedstat (nanoseconds; an ended thread's time
    drops out); else /proc/<pid>/stat's utime + stime (clock ticks, 10 ms). A process gone counts 0."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            if os.path.exists("/proc/self/schedstat"):
                total += sum(_thread_ns(pid, t) for t in os.listdir(f"/proc/{pid}/task")) / 1e9
            else:
                total += sum(map(int, proc_stat(pid)[11:13])) / os.sysconf("SC_CLK_TCK")
    return total
