"""What an executor checks before it starts any worker, so that a setup that cannot work
fails at once with an error naming the cause. ``python -m mpx doctor`` runs the same checks.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import warnings

from mpx import dumps
from mpx._units import human_size
from mpx.config import Config
from mpx.errors import WorkerStartupError
from mpx.mechanism import layout, segments

logger = logging.getLogger("mpx")

# Local workers per core past which startup warns: each worker is a whole Python process.
WORKERS_PER_CORE_WARNING = 4




def _processes_left() -> int | None:
    """How many more processes this user may start now (RLIMIT_NPROC, and the kernel's
    threads-max and pid_max, less what runs), or None where that cannot be read."""
    limits = []
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    for knob in ("/proc/sys/kernel/threads-max", "/proc/sys/kernel/pid_max"):
        try:
            with open(knob) as f:
                limits.append(int(f.read()))
        except (OSError, ValueError):
            pass
    if not limits:
        return None
    try:
        running = sum(1 for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return None
    return max(0, min(limits) - running)


def check_size(world_size: int, n_local: int, n_new: int) -> None:
    """ValueError, naming the limit, when a group of ``world_size`` ranks (``n_local`` of
    them on this node, ``n_new`` of those still to start) cannot be held: more local ranks
    than a ring has readers, or more new processes than the host lets this user start.
    Made before anything is allocated: the per-rank bookkeeping grows with the size."""
    if n_local > layout.MAX_READERS:
        raise ValueError(f"world_size {world_size} is over the limit of {layout.MAX_READERS} "
                         f"local ranks per executor (a ring's reader limit, "
                         f"mpx.mechanism.layout.MAX_READERS): {n_local} ranks would run on this node")
    left = _processes_left()
    if left is not None and n_new > left:
        raise ValueError(f"world_size {world_size} is over this host's process limit: it "
                         f"needs {n_new} new worker processes and only {left} more may start "
                         f"(RLIMIT_NPROC, kernel.threads-max, kernel.pid_max)")


def ring_bytes(cfg: Config, n_local: int) -> int:
    """Shared memory an executor with ``n_local`` workers on this node needs: the broadcast
    ring and one response ring per worker."""
    return (layout.segment_size(cfg.max_chunk_bytes, cfg.max_chunks, n_local)
            + n_local * layout.segment_size(cfg.max_chunk_bytes, cfg.max_chunks, 1))


def check_shared_memory(cfg: Config, n_local: int) -> None:
    """ShmError naming the bytes needed and free when ``Config.shm_dir`` cannot hold every
    ring of a ``transport='shm'`` executor (``auto`` falls back to ZeroMQ instead)."""
    if cfg.transport != "shm":
        return
    segments.require_free(ring_bytes(cfg, n_local), cfg.shm_dir,
                     f"an executor with {n_local} local worker(s), {n_local + 1} rings,")


def check_dump_dir(cfg: Config) -> str:
    """The directory workers write stack dumps to, created if needed; WorkerStartupError
    naming it when it cannot be written."""
    where = dumps.dump_dir(cfg.dump_dir)
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
    except OSError as e:
        raise WorkerStartupError(f"cannot use Config.dump_dir (MPX_DUMP_DIR) {where!r} for "
                                 f"stack dumps: {e}") from e
    if not os.access(where, os.W_OK | os.X_OK):
        raise WorkerStartupError(f"cannot write stack dumps to Config.dump_dir (MPX_DUMP_DIR) "
                                 f"{where!r}: permission denied")
    return where


def check_process() -> None:
    """WorkerStartupError in a daemonic multiprocessing child, which may not start
    processes of its own."""
    if multiprocessing.current_process().daemon:
        raise WorkerStartupError(
            "an mpx.Executor cannot start in a daemonic multiprocessing process (daemonic "
            "processes may not have children): create the executor in the main process, or "
            "start this process with daemon=False")


def warn_crowding(cfg: Config, n_local: int) -> None:
    """Warn when the local workers far outnumber the cores, saying what each one costs."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    if n_local > WORKERS_PER_CORE_WARNING * cores:
        rings = 2 * layout.segment_size(cfg.max_chunk_bytes, cfg.max_chunks, 1)
        warnings.warn(
            f"mpx: {n_local} workers on {cores} core(s): each is a Python process (tens of "
            f"MiB of memory, more with torch, and a second or more to start) with "
            f"{human_size(rings)} of rings; startup and every call will be slow",
            RuntimeWarning, stacklevel=4)


def check(cfg: Config, n_local: int) -> None:
    """Every check above, before a single worker is started."""
    check_process()
    check_shared_memory(cfg, n_local)
    check_dump_dir(cfg)
    warn_crowding(cfg, n_local)
