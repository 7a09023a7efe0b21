"""``python -m mpx <command>``: doctor, cleanup, info, demo, node, bench."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
from importlib import metadata

from mpx._units import human_size


def _cmd_cleanup(args: argparse.Namespace) -> int:
    from mpx import shm, watchdog
    from mpx.config import Config

    removed = shm.reap_stale()
    for name in removed:
        print(f"removed {name}")
    if not removed:
        print("no stale mpx segments")
    dumps = watchdog.reap_empty_dumps(watchdog.dump_dir(Config.from_env().dump_dir))
    for path in dumps:
        print(f"removed {path}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from mpx import doctor

    return doctor.main(import_torch=not args.no_torch)




def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cmd_info(args: argparse.Namespace) -> int:
    import mpx
    from mpx import shm

    rows: list[tuple[str, str]] = []
    rows.append(("mpx", f"{mpx.__version__} ({os.path.dirname(mpx.__file__)})"))
    rows.append(("ring implementation", mpx.ring_implementation()))
    rows.append(("python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("platform", platform.platform()))

    shm_dir = "/dev/shm"
    try:
        st = os.statvfs(shm_dir)
        rows.append((f"{shm_dir} size", human_size(st.f_blocks * st.f_frsize)))
        free = shm.free_bytes(shm_dir)
        rows.append((f"{shm_dir} free", f"{human_size(free)} ({free} bytes)"))
    except OSError as e:
        rows.append((shm_dir, f"unavailable: {e}"))

    try:
        import zmq
        rows.append(("pyzmq", zmq.__version__))
        rows.append(("libzmq", zmq.zmq_version()))
    except ImportError as e:
        rows.append(("pyzmq", f"not importable: {e}"))

    # find_spec only: importing torch costs seconds and is not needed to answer.
    if importlib.util.find_spec("torch") is not None:
        rows.append(("torch", f"importable ({_dist_version('torch') or 'version unknown'})"))
    else:
        rows.append(("torch", "not installed"))
    numpy_version = _dist_version("numpy") if importlib.util.find_spec("numpy") else None
    rows.append(("numpy", numpy_version or "not installed"))

    cpus = os.cpu_count()
    try:
        usable = len(os.sched_getaffinity(0))
        rows.append(("CPUs", f"{usable} usable of {cpus}"))
    except AttributeError:
        rows.append(("CPUs", str(cpus)))

    stale = shm.stale_segments()
    rows.append(("stale mpx segments", ", ".join(stale) if stale else "none"))
    from mpx import _debug
    rows.append(("debug counters", ", ".join(f"{k}={v}" for k, v in _debug.counts().items())
                 if _debug.ENABLED else "off (build with MPX_DEBUG=1, or set it for the pure ring)"))

    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key + ':':<{width + 1}} {value}")
    if stale:
        print("(remove them with `python -m mpx cleanup`)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.queue:
        from mpx import _demo
        return _demo.run()
    from mpx import _demo_mlp
    return _demo_mlp.run()


def _env_int(*names: str) -> int | None:
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return None


def _cmd_node(args: argparse.Namespace) -> int:
    """A follower node; flags, else torchrun's or Slurm's variables."""
    import mpx
    from mpx import node

    addr = args.master_addr or os.environ.get("MASTER_ADDR")
    port = args.master_port or _env_int("MASTER_PORT")
    rank = args.node_rank if args.node_rank is not None else _env_int("NODE_RANK", "SLURM_NODEID")
    nnodes = args.nnodes or _env_int("NNODES", "SLURM_NNODES")
    missing = [n for n, v in (("--master-addr", addr), ("--master-port", port),
                              ("--node-rank", rank), ("--nnodes", nnodes)) if v is None]
    if missing:
        print(f"mpx node: missing {', '.join(missing)} (or MASTER_ADDR, MASTER_PORT, NODE_RANK "
              "/ SLURM_NODEID, NNODES / SLURM_NNODES)", file=sys.stderr)
        return 2
    assert addr is not None and port is not None and rank is not None and nnodes is not None
    config = mpx.Config.from_env(host=args.host)
    return node.run_follower(addr, port, rank, nnodes, config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpx",
        description="mpx: collective RPC to worker processes over shared memory.")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.required = True
    sub.add_parser("cleanup", help="remove /dev/shm segments and empty stack-dump files "
                   "left by dead mpx processes").set_defaults(func=_cmd_cleanup)
    doctor = sub.add_parser("doctor", help="check that an executor can start here (exit 1 "
                            "if not): ring, /dev/shm, start method, pyzmq, torch, stale segments")
    doctor.add_argument("--no-torch", action="store_true",
                        help="do not import torch (faster; CUDA is then not checked)")
    doctor.set_defaults(func=_cmd_doctor)
    sub.add_parser("info", help="print versions, the ring implementation, /dev/shm space "
                   "and stale segments").set_defaults(func=_cmd_info)
    demo = sub.add_parser("demo", help="serve a tensor-parallel torch MLP on 2 workers "
                          "(a few seconds)")
    demo.add_argument("--queue", action="store_true",
                      help="instead, demo the MessageQueue alone (no torch needed)")
    demo.set_defaults(func=_cmd_demo)
    nodep = sub.add_parser("node", help="run a follower node of a multi-node executor")
    nodep.add_argument("--master-addr", help="the leader's address (MASTER_ADDR)")
    nodep.add_argument("--master-port", type=int, help="the leader's port (MASTER_PORT)")
    nodep.add_argument("--node-rank", type=int, help="this node's rank, 1.. (NODE_RANK)")
    nodep.add_argument("--nnodes", type=int, help="number of nodes (NNODES)")
    nodep.add_argument("--host", help="the address the leader reaches this node at (MPX_HOST)")
    nodep.set_defaults(func=_cmd_node)
    bench = sub.add_parser("bench", help="compare mpx.Executor with Pipe, Queue, zmq and "
                           "ProcessPoolExecutor (~4 min; --quick under 1 min)")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument("--png", metavar="PATH", help="also plot the results (needs matplotlib)")
    bench.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    bench.set_defaults(func=lambda args: importlib.import_module("mpx._bench").run(args))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
