"""``python -m mpx <command>``: doctor, cleanup, demo, node, launch, bench."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys


def _cmd_cleanup(args: argparse.Namespace) -> int:
    from mpx import dumps
    from mpx.config import Config
    from mpx.mechanism import segments

    removed = segments.reap_stale()
    for name in removed:
        print(f"removed {name}")
    if not removed:
        print("no stale mpx segments")
    removed_dumps = dumps.reap_empty_dumps(dumps.dump_dir(Config.from_env().dump_dir))
    for path in removed_dumps:
        print(f"removed {path}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from mpx._cli import doctor

    return doctor.main(import_torch=not args.no_torch)




def _cmd_demo(args: argparse.Namespace) -> int:
    if args.queue:
        from mpx._cli import demo
        return demo.run()
    from mpx._cli import demo_mlp
    return demo_mlp.run(args.steps)


def _env_int(*names: str) -> int | None:
    for name in names:
        if os.environ.get(name):
            try:
                return int(os.environ[name])
            except ValueError:
                raise ValueError(f"{name}={os.environ[name]!r} is not an integer") from None
    return None


def _seconds(raw: str) -> float:
    """A duration flag: a finite number of seconds above 0."""
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a finite number of seconds above 0")
    return value


def _cmd_node(args: argparse.Namespace) -> int:
    """A follower node; flags, else torchrun's or Slurm's variables."""
    import mpx
    from mpx._node import follower

    try:
        addr = args.master_addr or os.environ.get("MASTER_ADDR")
        port = args.master_port or _env_int("MASTER_PORT")
        rank = args.node_rank if args.node_rank is not None else _env_int("NODE_RANK",
                                                                           "SLURM_NODEID")
        nnodes = args.nnodes or _env_int("NNODES", "SLURM_NNODES")
        config = mpx.Config.from_env(host=args.host)
    except ValueError as e:  # a bad variable
        print(f"mpx node: {e}", file=sys.stderr)
        return 2
    missing = [n for n, v in (("--master-addr", addr), ("--master-port", port),
                              ("--node-rank", rank), ("--nnodes", nnodes)) if v is None]
    if missing:
        print(f"mpx node: missing {', '.join(missing)} (or MASTER_ADDR, MASTER_PORT, NODE_RANK "
              "/ SLURM_NODEID, NNODES / SLURM_NNODES)", file=sys.stderr)
        return 2
    assert addr is not None and port is not None and rank is not None and nnodes is not None
    # SIGTERM (mpx launch, a scheduler) stops this node's workers on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return follower.run_follower(addr, port, rank, nnodes, config,
                                 leader_wait_s=args.leader_wait_s)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpx",
        description="mpx: collective RPC to worker processes over shared memory.")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.required = True
    sub.add_parser("cleanup", help="remove /dev/shm segments and empty stack-dump files "
                   "left by dead mpx processes").set_defaults(func=_cmd_cleanup)
    doctor = sub.add_parser("doctor", help="print what mpx finds on this machine (versions, "
                            "ring, /dev/shm, CPUs) and check that an executor can start here "
                            "(exit 1 if not)")
    doctor.add_argument("--no-torch", action="store_true",
                        help="do not import torch (faster; CUDA is then not checked)")
    doctor.set_defaults(func=_cmd_doctor)
    demo = sub.add_parser("demo", help="serve a tensor-parallel torch MLP on 2 workers "
                          "(a few seconds)")
    demo.add_argument("--queue", action="store_true",
                      help="instead, demo the MessageQueue alone (no torch needed)")
    demo.add_argument("--steps", type=int, default=300,
                      help="model steps of the MLP demo (and as many no-op calls)")
    demo.set_defaults(func=_cmd_demo)
    nodep = sub.add_parser("node", help="run a follower node of a multi-node executor")
    nodep.add_argument("--master-addr", help="the leader's address (MASTER_ADDR)")
    nodep.add_argument("--master-port", type=int, help="the leader's port (MASTER_PORT)")
    nodep.add_argument("--node-rank", type=int, help="this node's rank, 1.. (NODE_RANK)")
    nodep.add_argument("--nnodes", type=int, help="number of nodes (NNODES)")
    nodep.add_argument("--host", help="the address the leader reaches this node at (MPX_HOST)")
    nodep.add_argument("--leader-wait-s", type=_seconds, help="how long to wait for the leader "
                       "(default: startup_timeout_s)")
    nodep.set_defaults(func=_cmd_node)
    launchp = sub.add_parser(
        "launch", help="the same line on every node: run PROGRAM on node 0 and mpx's "
        "follower on the others (reads torchrun's or Slurm's variables; see "
        "docs/launchers-ray-slurm.md)")
    launchp.add_argument("--nnodes", type=int, help="number of nodes (NNODES, SLURM_NNODES)")
    launchp.add_argument("--node-rank", type=int,
                         help="this node's rank (NODE_RANK, SLURM_NODEID)")
    launchp.add_argument("--master-addr", help="node 0's address (MASTER_ADDR, else the first "
                         "host of SLURM_JOB_NODELIST)")
    launchp.add_argument("--master-port", type=int, help="the executor's port on node 0 "
                         "(MASTER_PORT, MPX_MASTER_PORT; the launchers also use the next one)")
    launchp.add_argument("program", nargs=argparse.REMAINDER,
                         help="-- then the program and its arguments, run on node 0")
    launchp.set_defaults(func=lambda args: importlib.import_module("mpx._cli.launch").run(args))
    top = sub.add_parser("top", help="a live view of a running executor: per rank its pid, "
                         "state, replies, reply latency and CPU (the executor needs "
                         "Config.stats_socket, MPX_STATS_SOCKET)")
    top.add_argument("socket", help="the executor's Config.stats_socket path")
    top.add_argument("--once", action="store_true", help="print one table and exit")
    top.add_argument("--interval", type=_seconds, default=1.0,
                     help="seconds between refreshes (default 1)")
    top.set_defaults(func=lambda args: importlib.import_module("mpx._cli.top").run(args))
    bench = sub.add_parser("bench", help="compare mpx.Executor with Pipe, Queue, zmq and "
                           "ProcessPoolExecutor (~4 min; --quick under 1 min; runs "
                           "bench/bench_compare.py of a source checkout)")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument("--png", metavar="PATH", help="also plot the results (needs matplotlib)")
    bench.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    bench.set_defaults(func=lambda args: importlib.import_module("mpx._cli.bench").run(args))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
