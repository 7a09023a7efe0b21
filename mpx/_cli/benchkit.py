"""What every mpx benchmark needs, in one place: ``python -m mpx bench`` and
``python -m mpx demo --queue`` use it, and so do the scripts in bench/ (internal).

- child processes: ``start`` and ``join``, and the pids of every child of the run;
- the multiprocessing.Pipe baseline: ``PipePeers`` (echo, reply with the size, or RPC);
- timing: ``settle`` and ``time_calls`` (the one timed loop), ``stats``;
- a Ray cluster on loopback only: ``ray_loopback_env`` (the Ray launcher's tests and the
  benchmarks that start Ray);
- the report: ``add_arguments`` (--quick, --png, --json), ``print_header`` (versions and
  core count), ``print_table``, ``print_cleanup`` (leftover children and /dev/shm
  segments), ``write_json``, ``write_png``, and ``progress`` lines on stderr.

Only the standard library and mpx at import time, so that the commands run without
numpy, matplotlib, psutil or torch.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import platform
import shutil
import site
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import mpx
from mpx import segments
from mpx._procinfo import pid_alive

CTX = mp.get_context("spawn")
# A timed loop cut short by its time budget still keeps this many samples.
MIN_SAMPLES = 3

_T0 = time.perf_counter()

# ---------------------------------------------------------------------- child processes

procs: list[BaseProcess] = []    # started by start(), not joined yet
child_pids: set[int] = set()     # every child of this run, for the cleanup check


def start(target: Callable[..., Any], args: tuple, name: str | None = None) -> BaseProcess:
    """Start a daemon spawn child running ``target(*args)``; remember it and its pid."""
    p = CTX.Process(target=target, args=args, name=name, daemon=True)
    p.start()
    procs.append(p)
    assert p.pid is not None
    child_pids.add(p.pid)
    return p


def join(p: BaseProcess, timeout: float = 30.0, what: str | None = "child") -> None:
    """Join ``p``; terminate it (saying so, unless ``what`` is None) if it does not exit."""
    p.join(timeout)
    if p.is_alive():
        if what is not None:
            print(f"  warning: {what} {p.pid} did not exit, terminating it", flush=True)
        p.terminate()
        p.join(5)
    if p in procs:
        procs.remove(p)


def cleanup_procs() -> None:
    """Join, or else terminate, every child that ``start`` started and nobody joined."""
    for p in list(procs):
        join(p, 0.1, what=None)


# ---------------------------------------------------------------------- the Pipe baseline


def echo(obj: Any) -> Any:
    """A ``PipePeers`` handler: answer with the object itself."""
    return obj


def payload_size(obj: Any) -> int:
    """A ``PipePeers`` handler: answer with the payload's size in bytes (an array's nbytes)."""
    return int(getattr(obj, "nbytes", None) or len(obj))


class CallOn:
    """A ``PipePeers`` handler: a message ``(method, args, kwargs)`` calls that method of
    ``worker`` (pickled into the child) and answers with its result."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def __call__(self, msg: tuple) -> Any:
        method, args, kwargs = msg
        return getattr(self.worker, method)(*args, **kwargs)


def serve(recv: Callable[[], Any], reply: Callable[[Any], None],
          handler: Callable[[Any], Any]) -> None:
    """Answer each object from ``recv`` with ``reply(handler(obj))``, until None arrives."""
    while True:
        obj = recv()
        if obj is None:
            break
        answer = handler(obj)
        del obj  # free a big payload before the next one arrives
        reply(answer)


def _pipe_child(conn: Any, handler: Callable[[Any], Any]) -> None:
    try:
        serve(conn.recv, conn.send, handler)
    finally:
        conn.close()


class PipePeers:
    """``n`` spawn children, each at the end of its own ``multiprocessing.Pipe``, answering
    every object with ``handler(obj)`` (or child i with ``handler[i]``, one per child): the
    baseline mpx is measured against."""

    def __init__(self, n: int,
                 handler: Callable[[Any], Any] | Sequence[Callable[[Any], Any]] = echo,
                 name: str | None = None) -> None:
        handlers = list(handler) if isinstance(handler, Sequence) else [handler] * n
        if len(handlers) != n:
            raise ValueError(f"{len(handlers)} handlers for {n} Pipe children")
        self.conns: list = []
        self.procs: list[BaseProcess] = []
        for rank in range(n):
            a, b = CTX.Pipe()
            self.procs.append(start(_pipe_child, (b, handlers[rank]), name=name))
            b.close()
            self.conns.append(a)
        self.pids = [p.pid for p in self.procs if p.pid is not None]

    def call(self, obj: Any, timeout: float | None = None) -> list:
        """Send ``obj`` to every child, then receive every answer (TimeoutError if one
        takes longer than ``timeout``; None waits without a poll)."""
        for c in self.conns:
            c.send(obj)
        if timeout is None:
            return [c.recv() for c in self.conns]
        out = []
        for c in self.conns:
            if not c.poll(timeout):
                raise TimeoutError(f"Pipe child did not answer within {timeout} s")
            out.append(c.recv())
        return out

    def rpc(self, method: str, *args: Any) -> list:
        """``call`` for children serving ``CallOn``: every child's ``method(*args)``."""
        return self.call((method, args, {}))

    def close(self) -> None:
        """Ask every child to stop, join it (terminating it if it hangs), close the pipes."""
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            join(p, 10, what="Pipe child")
        for c in self.conns:
            c.close()


# ---------------------------------------------------------------------- timing


def settle(fns: Iterable[Callable[[], Any]], seconds: float, min_rounds: int = 0) -> None:
    """Call every fn in turn for ``seconds``, and at least ``min_rounds`` rounds: the first
    few hundred round trips after a spawn are slower (1.5x here) until the scheduler has
    spread the processes over the cores."""
    fns = list(fns)
    end = time.perf_counter() + seconds
    i = 0
    while i < min_rounds or time.perf_counter() < end:
        for fn in fns:
            fn()
        i += 1


def time_calls(fn: Callable[[], Any], iters: int, warm: int = 0,
               budget_s: float | None = None) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn`` after ``warm`` untimed ones, with the GC
    off; fewer once ``budget_s`` is spent (but at least MIN_SAMPLES)."""
    for _ in range(warm):
        fn()
    out: list[int] = []
    clock = time.perf_counter_ns
    budget_ns = None if budget_s is None else budget_s * 1e9
    gc.disable()
    try:
        begin = clock()
        for _ in range(iters):
            t0 = clock()
            fn()
            t1 = clock()
            out.append(t1 - t0)
            if budget_ns is not None and t1 - begin > budget_ns and len(out) >= MIN_SAMPLES:
                break
    finally:
        gc.enable()
    return [x / 1e9 for x in out]


def stats(samples: Iterable[float]) -> dict:
    """{"median", "p90" (linear interpolation, as numpy's percentile), "min", "n"}."""
    xs = sorted(samples)
    p90 = statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]
    return {"median": statistics.median(xs), "p90": p90, "min": xs[0], "n": len(xs)}


# ---------------------------------------------------------------------- report


def add_arguments(parser: argparse.ArgumentParser, quick_help: str) -> None:
    """The options every benchmark takes: --quick, --png PATH, --json PATH."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--png", metavar="PATH", help="also plot the results (needs matplotlib)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def print_header(quick: bool, what: str, note: str, *, ring_key: str = "ring",
                 ring_label: str = "ring", min_cpus: int = 3, **versions: str) -> dict:
    """Print the run's environment (versions, core count, ring, mode) and return it as a
    dict (the JSON "header").

    ``versions``: more packages, named after python and before numpy in the first line.
    ``note`` is printed when fewer than ``min_cpus`` CPUs are usable.
    """
    try:
        import numpy as np
        numpy_version = np.__version__
    except ImportError:
        numpy_version = "not installed"
    header = {
        "python": platform.python_version(), "platform": platform.platform(),
        "mpx": mpx.__version__, ring_key: mpx.ring_implementation(),
        "numpy": numpy_version, **versions, "cpu_count": os.cpu_count(),
        "affinity": usable_cpus(), "start_method": "spawn", "quick": quick,
    }
    more = "".join(f"{k} {v}, " for k, v in versions.items())
    print(f"mpx {header['mpx']} {what}  (python {header['python']}, {more}numpy "
          f"{header['numpy']}, {header['platform']})")
    print(f"os.cpu_count()={header['cpu_count']}  len(os.sched_getaffinity(0))="
          f"{header['affinity']}  start method=spawn  {ring_label}={header[ring_key]}"
          f"  mode={'quick' if quick else 'full'}")
    print(f"config: {mpx.Config.from_env().describe()}")
    if header["affinity"] < min_cpus:
        print(f"note: only {header['affinity']} CPUs: {note}")
    print(flush=True)
    return header


def print_table(hdr: tuple | list, lines: list, indent: str = "") -> None:
    """Print ``lines`` (tuples of strings) under ``hdr`` in left-aligned columns."""
    w = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(hdr)]
    fmt = indent + "  ".join(f"{{:<{x}}}" for x in w)
    print(fmt.format(*hdr))
    print(fmt.format(*("-" * x for x in w)))
    for line in lines:
        print(fmt.format(*line))


def alive(pids: Iterable[int]) -> list[int]:
    """The sorted ``pids`` whose process still runs (not gone, not a zombie)."""
    return [pid for pid in sorted(set(pids)) if pid_alive(pid)]


def leftover_segments(pids: Iterable[int]) -> list[str]:
    """The /dev/shm mpx segments still there whose name carries one of ``pids`` or this
    process's pid (mpx names them ``mpx-<creator pid>-<random>``)."""
    mine = set(pids) | {os.getpid()}
    out = []
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    for e in names:
        if e.startswith(segments.PREFIX):
            try:
                pid = int(e.split("-")[1])
            except (IndexError, ValueError):
                continue
            if pid in mine:
                out.append(e)
    return sorted(out)


def print_cleanup(pids: Iterable[int]) -> tuple[list[int], list[str]]:
    """Print which of the run's children (``pids``, and any multiprocessing child still
    running) are alive and which of its /dev/shm segments are left; return both."""
    pids = set(pids) | {p.pid for p in mp.active_children() if p.pid is not None}
    pids.discard(os.getpid())
    left_alive, segments = alive(pids), leftover_segments(pids)
    print(f"cleanup: child processes alive: {left_alive or 'none'}; /dev/shm mpx segments "
          f"left by this run: {segments or 'none'}")
    return left_alive, segments


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` to ``path`` as JSON and say so."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print(f"wrote {path}")


def write_png(path: str, draw: Callable[[Any, Any], None], **subplots: Any) -> None:
    """Draw a figure into ``path``: ``draw(fig, axes)`` fills
    ``matplotlib.pyplot.subplots(**subplots)``. Without matplotlib, say so and skip."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed (pip install matplotlib, or "
              f"pip install 'mpx[bench]'); --png {path} skipped")
        return
    fig, axes = plt.subplots(**subplots)
    draw(fig, axes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def progress(msg: str) -> None:
    """One progress line on stderr, with the seconds since the run began."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- Ray on loopback

# An environment in which a Ray cluster started here sends nothing off 127.0.0.1.
#
# Every Ray head starts the dashboard process (with include_dashboard=False it loads only
# its UsageStatsHead module), and that module, usage stats enabled or not, reads
# ``~/ray_bootstrap_config.yaml`` to learn the cloud provider; when the file is missing it
# asks the cloud metadata address instead: HTTP to 169.254.169.254 (Azure, then AWS) and a
# DNS lookup of metadata.google.internal through the system resolver. A HOME of our own
# holding that file with ``provider: type: local`` answers the question without a packet.
#
# With usage stats disabled, the same module still POSTs a "disabled" notice to
# https://usage-stats.ray.io/ (a DNS lookup first) unless the cluster was started by a bare
# ray.init() -- and ray.cluster_utils.Cluster's is not. Ray takes that URL from
# RAY_USAGE_STATS_REPORT_URL: one with a scheme requests has no adapter for fails before any
# socket is made (even through an http(s)_proxy), and Ray logs it at debug level.
#
# The variables must be in ``os.environ`` before the head node starts: ray.cluster_utils
# starts the GCS, the raylets and the dashboard as subprocesses of this process, and the
# raylets' workers inherit the raylets' environment.

BOOTSTRAP_CONFIG = "provider:\n  type: local\n"
# no connection adapter in requests for file://: the "usage stats disabled" POST goes nowhere
NO_REPORT_URL = "file:///dev/null"


@contextlib.contextmanager
def ray_loopback_env() -> Iterator[str]:
    """An environment in which a Ray cluster started inside sends nothing off 127.0.0.1
    (see above): HOME (a fresh directory holding ``ray_bootstrap_config.yaml``),
    RAY_USAGE_STATS_ENABLED=0 and RAY_USAGE_STATS_REPORT_URL set in ``os.environ``, and
    restored on exit. Yields the HOME."""
    home = tempfile.mkdtemp(prefix="mpx-ray-home-")
    with open(os.path.join(home, "ray_bootstrap_config.yaml"), "w") as f:
        f.write(BOOTSTRAP_CONFIG)
    names = ("HOME", "RAY_USAGE_STATS_ENABLED", "RAY_USAGE_STATS_REPORT_URL", "PYTHONUSERBASE")
    saved = {k: os.environ.get(k) for k in names}
    # the user site-packages (~/.local/...) is found from HOME: keep Ray's processes
    # seeing the one this process sees
    user_base = site.getuserbase()
    os.environ["HOME"] = home
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_USAGE_STATS_REPORT_URL"] = NO_REPORT_URL
    if saved["PYTHONUSERBASE"] is None and user_base:
        os.environ["PYTHONUSERBASE"] = user_base
    try:
        yield home
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(home, ignore_errors=True)
