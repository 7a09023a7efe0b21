"""Facts about other processes and this host's ports, and this process's tie to its parent,
asked the same way everywhere in mpx."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def pid_state(pid: int) -> str | None:
    """The state letter of process ``pid`` from ``/proc/<pid>/stat`` ('R', 'S', 'T', 'Z'...),
    '?' when it exists but /proc cannot say (another pid namespace, no /proc), or None when
    there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: it exists
    return "?"


def describe_exit(exitcode: int | None) -> str:
    """'exit code 3', 'killed by SIGKILL', or 'still running'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def describe_stall(pid: int | None) -> str:
    """How a process that has not answered looks from outside: 'alive but stopped
    (SIGSTOP)', 'alive, running (state R)', 'gone'... (from /proc/<pid>/stat on Linux)."""
    if pid is None:
        return "in an unknown state"
    state = pid_state(pid)
    if state is None:
        return "gone"
    if state == "?":
        return "alive"
    if state == "T":
        return "alive but stopped (SIGSTOP or a job-control signal); SIGCONT resumes it"
    if state == "t":
        return "alive but stopped by a debugger (tracing stop)"
    if state in ("Z", "X"):
        return "dead (exit not yet reported)"
    if state == "D":
        return "alive, in uninterruptible sleep (state D: blocked in the kernel, e.g. on I/O)"
    return f"alive (state {state}) but still busy with the call or an earlier one"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie nobody reaped yet has)."""
    return pid_state(pid) not in (None, "Z", "X")


def files_of_dead_pids(directory: str, pattern: re.Pattern[str]) -> list[str]:
    """The paths in ``directory`` whose names match ``pattern`` with the pid of a process
    that is gone as its first group (files a SIGKILLed owner could not remove), sorted."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, name) for name in names
                  if (m := pattern.match(name)) and not pid_alive(int(m.group(1))))


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nobody listens on right now (another process may still
    take it before the caller binds it: :func:`reserve_tcp_port` holds it instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def reserve_tcp_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a free TCP port on ``host``, not listening, with SO_REUSEADDR.

    While it is open the port is taken for everyone else: no bind to port 0 and no
    connect() gets it, and a bind to it without SO_REUSEADDR fails. A server that sets
    SO_REUSEADDR itself can still bind and listen on it (Linux allows that next to bound
    sockets that do not listen): torch's TCPStore does, with either backend (checked with
    torch 2.13: libuv's uv_tcp_bind, and the legacy socket code, set it). Close it once
    that server listens, or when the server will never come."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
    except BaseException:
        s.close()
        raise
    return s


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send this process ``sig`` when its parent thread exits
    (``PR_SET_PDEATHSIG``; inherited by no child, cleared by a setuid exec). Whether it took:
    False where there is no such call."""
    if sys.platform != "linux":
        return False
    try:
        return ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
