"""``python -m mpx doctor``: what mpx finds on this machine, can an executor start here, and
how will it run?

First the facts (versions, the ring implementation, /dev/shm, CPUs, debug counters), then
the checks.

Each check is a line ``[ OK ]``, ``[WARN]`` or ``[FAIL] name: detail``. FAIL means an
executor with the effective configuration (``mpx.Config.from_env()``) would not start;
WARN means it would, but slower or with something to clean up.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import multiprocessing
import os
from importlib import metadata
from typing import Any

from mpx._units import human_size

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclasses.dataclass
class Check:
    """One line of the report."""

    status: str
    name: str
    detail: str


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _core_implementation(modules: tuple[Any, ...]) -> str:
    """The futures core's build ("cython" or "python"), or each module's where they
    differ (a partial build)."""
    builds = {m.__name__.rpartition(".")[2]: m.IMPLEMENTATION for m in modules}
    if len(set(builds.values())) == 1:
        return next(iter(builds.values()))
    return ", ".join(f"{name} {build}" for name, build in builds.items())


def machine_facts() -> list[tuple[str, str]]:
    """What mpx finds here, as (name, value) rows: versions, the ring, /dev/shm, CPUs."""
    import platform
    import sys

    import mpx
    from mpx import _debug
    from mpx._driver import core_settings, future_core, ledger, locks, meter, waiters
    from mpx.mechanism import segments

    rows = [("mpx", f"{mpx.__version__} ({os.path.dirname(mpx.__file__)})"),
            ("ring implementation", mpx.ring_implementation()),
            ("futures core", _core_implementation(
                (locks, meter, ledger, waiters, future_core, core_settings))),
            ("python", f"{platform.python_version()} ({sys.executable})"),
            ("platform", platform.platform())]
    try:
        st = os.statvfs("/dev/shm")
        free = segments.free_bytes()
        rows += [("/dev/shm size", human_size(st.f_blocks * st.f_frsize)),
                 ("/dev/shm free", f"{human_size(free)} ({free} bytes)")]
    except OSError as e:
        rows.append(("/dev/shm", f"unavailable: {e}"))
    try:
        import zmq
        rows += [("pyzmq", zmq.__version__), ("libzmq", zmq.zmq_version())]
    except ImportError as e:
        rows.append(("pyzmq", f"not importable: {e}"))
    for dist in ("torch", "numpy"):  # find_spec only: importing torch costs seconds
        found = importlib.util.find_spec(dist) is not None
        rows.append((dist, (_version(dist) or "version unknown") if found else "not installed"))
    rows.append(("CPUs", f"{len(os.sched_getaffinity(0))} usable of {os.cpu_count()}"))
    rows.append(("debug counters", ", ".join(f"{k}={v}" for k, v in _debug.counts().items())
                 if _debug.ENABLED else "off (build with MPX_DEBUG=1, or set it for the pure ring)"))
    return rows


def check_config() -> tuple[list[Check], object | None]:
    """The effective Config, or FAIL when an MPX_* variable is invalid."""
    from mpx.config import Config
    try:
        cfg = Config.from_env()
    except (ValueError, TypeError) as e:
        return [Check(FAIL, "config", f"MPX_* environment is invalid: {e}")], None
    return [Check(OK, "config", f"transport={cfg.transport}, start_method={cfg.start_method}, "
                                f"ring {cfg.max_chunks} x {human_size(cfg.max_chunk_bytes)}")], cfg


def check_ring() -> list[Check]:
    from mpx import _debug
    from mpx._impl import pure_requested
    from mpx._impl import ring_implementation as impl
    name = impl()
    out = []
    if name == "cython":
        out.append(Check(OK, "ring implementation", "cython (compiled mpx._ring)"))
    elif pure_requested():
        out.append(Check(OK, "ring implementation", "python (MPX_PURE_PYTHON=1)"))
    else:
        out.append(Check(WARN, "ring implementation",
                         "python: the compiled mpx._ring is missing, calls are several times "
                         "slower; reinstall with a C compiler and the Python headers"))
    if _debug.ENABLED:
        counts = ", ".join(f"{k}={v}" for k, v in _debug.counts().items())
        out.append(Check(OK, "debug counters", f"on ({counts})"))
    return out


def check_shm(cfg) -> list[Check]:
    """/dev/shm (and Config.shm_dir, where free space is checked): present, big enough for
    the rings of a 1-worker executor, and usable (a one-page segment is created and
    removed)."""
    from mpx._driver.preflight import ring_bytes
    from mpx.errors import ShmError
    from mpx.mechanism import segments
    out = []
    # what Executor(W, 1) needs (the checks of its start); each further worker adds more
    need = ring_bytes(cfg, 1)
    more = ring_bytes(cfg, 2) - need
    # too little shared memory stops a 'shm' executor; 'auto' falls back to ZeroMQ
    short = FAIL if cfg.transport == "shm" else WARN
    fallback = "" if cfg.transport == "shm" else " (transport 'auto' will use ZeroMQ instead)"
    if cfg.transport == "zmq":
        return [Check(OK, "shared memory", "not used (transport 'zmq')")]
    dirs = [segments.SHM_ROOT] + ([cfg.shm_dir] if cfg.shm_dir != segments.SHM_ROOT else [])
    for d in dirs:
        try:
            st = os.statvfs(d)
        except OSError as e:
            out.append(Check(short, d, f"unusable: {e}{fallback}"))
            continue
        size, free = st.f_blocks * st.f_frsize, segments.free_bytes(d)
        text = (f"size {human_size(size)}, free {human_size(free)}; an executor of 1 worker "
                f"needs {human_size(need)}, each further worker {human_size(more)}")
        out.append(Check(OK, d, text) if free >= need else
                   Check(short, d, f"{text}: too small{fallback}; enlarge it (docker "
                                   "--shm-size) or lower MPX_MAX_CHUNKS / MPX_MAX_CHUNK_BYTES"))
    if all(c.status == OK for c in out):
        try:
            name, mm = segments.create(4096, cfg.shm_dir)
        except (ShmError, OSError) as e:
            out.append(Check(short, "shared-memory segment", f"cannot create one: {e}{fallback}"))
        else:
            segments.close(mm)
            segments.unlink(name)
            out.append(Check(OK, "shared-memory segment", "created and removed a test segment"))
    return out


def check_executor_start(cfg) -> list[Check]:
    """The checks an executor makes before it starts a worker (mpx._driver.preflight)."""
    from mpx._driver import preflight
    from mpx.errors import MpxError
    out = []
    for what, run in (("process", preflight.check_process),
                      ("dump directory", lambda: preflight.check_dump_dir(cfg)),
                      ("executor shared memory", lambda: preflight.check_shared_memory(cfg, 1))):
        try:
            got = run()
        except MpxError as e:
            out.append(Check(FAIL, what, str(e)))
        else:
            out.append(Check(OK, what, got if isinstance(got, str) else "an executor may start"))
    return out


def check_start_method(cfg) -> list[Check]:
    methods = multiprocessing.get_all_start_methods()
    if cfg.start_method not in methods:
        return [Check(FAIL, "start method", f"{cfg.start_method!r} is not available here "
                                            f"(available: {', '.join(methods)})")]
    return [Check(OK, "start method", f"{cfg.start_method} (available: {', '.join(methods)})")]


def check_zmq(cfg) -> list[Check]:
    try:
        import zmq
    except ImportError as e:
        return [Check(FAIL, "pyzmq", f"not importable: {e}")]
    out = [Check(OK, "pyzmq", f"{zmq.__version__} (libzmq {zmq.zmq_version()})")]
    curve = bool(zmq.has("curve"))
    if curve:
        out.append(Check(OK, "CURVE encryption", "supported by libzmq"))
    elif cfg.curve:
        out.append(Check(FAIL, "CURVE encryption", "MPX_CURVE is on but this libzmq has no "
                                                   "CURVE support"))
    else:
        out.append(Check(WARN, "CURVE encryption", "not supported by this libzmq (only "
                                                   "needed with MPX_CURVE=1)"))
    return out


def check_torch(import_torch: bool = True) -> list[Check]:
    if importlib.util.find_spec("torch") is None:
        return [Check(OK, "torch", "not installed (optional)")]
    if not import_torch:
        return [Check(OK, "torch", f"installed ({_version('torch') or 'version unknown'})")]
    try:
        import torch
    except Exception as e:  # a broken install raises anything
        return [Check(WARN, "torch", f"installed but import fails: {e}")]
    cuda = torch.version.cuda
    if cuda is None:
        gpu = "CPU-only build"
    elif torch.cuda.is_available():
        gpu = f"CUDA {cuda}, {torch.cuda.device_count()} GPU(s)"
    else:
        gpu = f"CUDA {cuda} build, no GPU visible"
    return [Check(OK, "torch", f"{torch.__version__}; {gpu}")]


def check_stale() -> list[Check]:
    from mpx.mechanism import segments
    stale = segments.stale_segments()
    if not stale:
        return [Check(OK, "stale mpx segments", "none")]
    return [Check(WARN, "stale mpx segments",
                  f"{len(stale)} left by dead processes: {', '.join(stale)} "
                  "(remove them with `python -m mpx cleanup`)")]


def run_checks(import_torch: bool = True) -> list[Check]:
    """Every check, in report order."""
    checks, cfg = check_config()
    checks += check_ring()
    if cfg is not None:
        checks += (check_shm(cfg) + check_executor_start(cfg) + check_start_method(cfg)
                   + check_zmq(cfg))
    checks += check_torch(import_torch) + check_stale()
    return checks


def main(import_torch: bool = True) -> int:
    """Print the report; 1 if any check failed, else 0."""
    rows = machine_facts()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name + ':':<{width + 1}} {value}")
    print()
    checks = run_checks(import_torch)
    for c in checks:
        print(f"[{c.status:^4}] {c.name}: {c.detail}")
    failed = [c.name for c in checks if c.status == FAIL]
    warned = [c.name for c in checks if c.status == WARN]
    if failed:
        print(f"FAIL: an executor cannot start here ({', '.join(failed)})")
        return 1
    print(f"OK: an executor can start here{' (with warnings)' if warned else ''}")
    return 0
