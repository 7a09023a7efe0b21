"""``python -m mpx launch [--nnodes N] -- PROGRAM ARGS...``: the same line on every node.

Node 0 runs PROGRAM with ``MPX_NNODES``, ``MPX_MASTER_ADDR``, ``MPX_MASTER_PORT`` (and
``MPX_HOST``) set, so that its ``mpx.Executor`` leads the other nodes. Every other node
runs mpx's follower (``python -m mpx node``) in a child process, started again after each
executor the program ends, so a program may make several executors one after another.

Where the node's place comes from, first found wins: the flags; torchrun's variables
(``NODE_RANK``, ``NNODES``, ``MASTER_ADDR``, ``MASTER_PORT``); Slurm's (``SLURM_NODEID``,
``SLURM_NNODES``, and the first host of ``SLURM_JOB_NODELIST`` as the leader's address).
The port is ``--master-port``, else ``MASTER_PORT``, else ``MPX_MASTER_PORT``, else 29555;
the executor's leader listens on it and the launchers talk on the next one (port + 1).

Every node needs the same ``MPX_AUTH_KEY`` in its environment (sbatch and torchrun-style
launchers pass the environment on): it signs the executor's traffic and this command's own.

Exit status: PROGRAM's on every node (128 + N when a signal N ended it). Node 0's launcher
tells the others when PROGRAM exited, also those that check in later, for up to
``startup_timeout_s`` after it (as long as they would wait for node 0); a node that hears
nothing from node 0 for ``heartbeat_s`` (MPX_HEARTBEAT_S) stops its follower and exits with 1.

SIGINT (Ctrl-C), SIGTERM and SIGHUP sent to a launcher go on to its child, which runs in a
session of its own (so that a Ctrl-C on the terminal reaches it once, through the launcher,
as under torchrun) and dies with the launcher; the launcher then exits with 128 + N, and so
does every other node when it was node 0's.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import zmq

from mpx._cli.hostlist import first_host
from mpx._node import control
from mpx._procinfo import describe_exit, set_parent_death_signal
from mpx.config import Config
from mpx.protocol import wire

logger = logging.getLogger("mpx")

# How often a follower node's launcher says hello to node 0's until it answers.
HELLO_EVERY_S = 1.0
# A follower started again right after one ended waits at least this long (a follower that
# fails at once must not spin).
RESPAWN_MIN_S = 1.0
# Node 0's launcher keeps its socket open this long after the program ended, so that its
# JobDone reaches every follower node.
DONE_LINGER_MS = 2000
# Node 0's launcher answers a hello it cannot authenticate with this plain frame, so that
# the other node can say that the keys differ. It tells nothing but that.
BAD_KEY = b"mpx launch: bad key"
# The follower child waits this long for a leader: the program may take hours to make its
# executor; node 0's silence, not this, ends the wait.
LEADER_WAIT_S = 7 * 24 * 3600.0


class LaunchError(Exception):
    """This node's place, key or program cannot be worked out (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Place:
    """Where this node is in the job, and where it learnt it."""

    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    source: str


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer") from None


def find_place(args: argparse.Namespace, env: dict[str, str] | Any) -> Place:
    """This node's rank, the node count and the leader's address and port, from the flags,
    torchrun's variables or Slurm's (see the module docstring)."""
    rank: int | None = args.node_rank
    nnodes: int | None = args.nnodes
    addr: str | None = args.master_addr
    source = "flags"
    if env.get("NODE_RANK") is not None and rank is None:
        rank, source = _int("NODE_RANK", env["NODE_RANK"]), "torchrun variables"
    if env.get("NNODES") and nnodes is None:
        nnodes = _int("NNODES", env["NNODES"])
    addr = addr or env.get("MASTER_ADDR") or None
    if rank is None and env.get("SLURM_NODEID") is not None:
        rank, source = _int("SLURM_NODEID", env["SLURM_NODEID"]), "Slurm variables"
    if nnodes is None and env.get("SLURM_NNODES"):
        nnodes = _int("SLURM_NNODES", env["SLURM_NNODES"])
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if addr is None and nodelist:
        try:
            addr = first_host(nodelist)
        except ValueError as e:
            raise LaunchError(f"SLURM_JOB_NODELIST: {e}") from None
    if nnodes is None:
        nnodes = 1
    if rank is None:
        if nnodes > 1:
            raise LaunchError(f"{nnodes} nodes, but this node's rank is unknown: pass "
                              "--node-rank or set NODE_RANK (torchrun style) or SLURM_NODEID "
                              "(srun sets it)")
        rank = 0
    if nnodes < 1 or not 0 <= rank < nnodes:
        raise LaunchError(f"node rank {rank} is not in [0, {nnodes}) ({source})")
    if addr is None:
        if nnodes > 1:
            raise LaunchError("the leader's address is unknown: pass --master-addr or set "
                              "MASTER_ADDR, or run under Slurm (SLURM_JOB_NODELIST)")
        addr = "127.0.0.1"
    port = args.master_port
    for name in ("MASTER_PORT", "MPX_MASTER_PORT"):
        if port is None and env.get(name):
            port = _int(name, env[name])
    if port is None:
        port = Config().master_port
    if not 1 <= port < 65535:
        raise LaunchError(f"the leader's port {port} is not in [1, 65535) (this command also "
                          "uses the next one)")
    return Place(rank, nnodes, addr, port, source)


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise LaunchError(f"cannot resolve the leader's address {host!r}: {e}") from None


def _route_to(ip: str) -> str:
    """This host's address on the route to ``ip`` (what node 0 reaches this node at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))  # UDP: no packet is sent
        return str(s.getsockname()[0])


def _has_children(pid: int) -> bool:
    """Whether ``pid`` has child processes (True when Linux cannot say)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return bool(f.read().strip())
    except OSError:
        return True


def _exit_status(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def _die_with_parent() -> None:  # runs in the child between fork and exec
    set_parent_death_signal(signal.SIGTERM)


def _start(cmd: list[str], **kw: Any) -> subprocess.Popen:
    """``cmd`` in a session of its own (a terminal's Ctrl-C reaches it through _Forward
    only), ended by SIGTERM when this launcher dies."""
    return subprocess.Popen(cmd, preexec_fn=_die_with_parent, start_new_session=True, **kw)


class _Forward:
    """Pass SIGINT, SIGTERM and SIGHUP (Ctrl-C, Slurm's scancel, a closed terminal) on to
    the child, as ``as_signal`` when given; ``got`` is the last one."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, as_signal: int | None = None) -> None:
        self.child: subprocess.Popen | None = None
        self.got: int | None = None
        self.as_signal = as_signal
        self.saved = {s: signal.signal(s, self._on) for s in self.SIGNALS}

    def _on(self, signum: int, frame: Any) -> None:
        self.got = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(self.as_signal or signum)

    def restore(self) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)


def _key(cfg: Config) -> bytes:
    if not cfg.auth_key and not cfg.allow_insecure:
        raise LaunchError(
            "a multi-node launch needs MPX_AUTH_KEY, the same secret on every node, in the "
            "job's environment (sbatch and torchrun-style launchers pass it on), e.g. "
            "export MPX_AUTH_KEY=$(python3 -c 'import secrets; print(secrets.token_hex(32))') "
            "before sbatch; or MPX_ALLOW_INSECURE=1 on a trusted network")
    return cfg.auth_key.encode()


class _Roll:
    """Node 0's side of the launchers' channel: the other nodes' launchers that checked in,
    each answered with a beat while the program runs and with its exit status after."""

    def __init__(self, sock: zmq.Socket, key: bytes, nnodes: int) -> None:
        self.sock, self.key, self.nnodes = sock, key, nnodes
        self.nodes: dict[bytes, tuple[int, bytes]] = {}  # routing id -> (node rank, nonce)
        self.warned: set[bytes] = set()  # routing ids already warned about
        self.code: int | None = None  # the program's exit status, once it ended

    def all_told(self) -> bool:
        return {r for r, _ in self.nodes.values()} >= set(range(1, self.nnodes))

    def _answer(self, ident: bytes, nonce: bytes) -> None:
        msg = wire.LaunchBeat(nonce) if self.code is None else wire.JobDone(self.code, nonce)
        self.sock.send_multipart([ident, control.pack(self.key, msg)])

    def send_all(self) -> None:
        for ident, (_, nonce) in self.nodes.items():
            self._answer(ident, nonce)

    def serve(self) -> None:
        """Answer the next message, if one comes within control.POLL_MS."""
        if not self.sock.poll(control.POLL_MS):
            return
        frames = self.sock.recv_multipart(copy=False)
        ident = frames[0].bytes
        msg = control.unpack(self.key, frames[-1].bytes) if len(frames) == 2 else None
        if msg is None:
            if ident not in self.warned:
                self.warned.add(ident)
                print(f"mpx launch: node 0: a hello from {_peer(frames[-1])} failed "
                      "authentication: is MPX_AUTH_KEY the same on every node?", file=sys.stderr)
            self.sock.send_multipart([ident, BAD_KEY])
            return
        if not isinstance(msg, wire.LaunchHello):
            return
        if ident not in self.nodes:
            logger.info("mpx launch: node %d is here", msg.node_rank)
            if not 0 < msg.node_rank < self.nnodes and ident not in self.warned:
                self.warned.add(ident)
                print(f"mpx launch: node 0: node {msg.node_rank} checked in, but node 0 was "
                      f"launched with nnodes={self.nnodes}: is the node count the same on every "
                      "node?", file=sys.stderr)
        self.nodes[ident] = (msg.node_rank, msg.nonce)
        self._answer(ident, msg.nonce)


def _peer(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return "a node"


def run_leader_node(place: Place, ip: str, cmd: list[str], cfg: Config) -> int:
    """Node 0: run ``cmd`` with the executor's settings in its environment, beat to the
    other nodes' launchers, and tell them its exit status (those that check in late too,
    for up to ``startup_timeout_s``)."""
    key = _key(cfg) if place.nnodes > 1 else b""
    env = dict(os.environ, MPX_NNODES=str(place.nnodes), MPX_MASTER_ADDR=ip,
               MPX_MASTER_PORT=str(place.master_port))
    env.setdefault("MPX_HOST", ip)
    roll = None
    if place.nnodes > 1:
        sock = control.control_socket(zmq.ROUTER)
        try:
            sock.bind(f"tcp://{ip}:{place.master_port + 1}")
        except zmq.ZMQError as e:
            sock.close(0)
            raise LaunchError(f"cannot listen on {ip}:{place.master_port + 1} (MASTER_PORT + 1, "
                              f"for the other nodes' launchers): {e}") from None
        roll = _Roll(sock, key, place.nnodes)
    forward = _Forward()
    try:
        try:
            child = forward.child = _start(cmd, env=env)
        except OSError as e:
            raise LaunchError(f"cannot run {cmd[0]!r}: {e}") from None
        beat_at = 0.0
        while child.poll() is None:
            if roll is None:
                try:
                    child.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
                continue
            now = time.monotonic()
            if now >= beat_at:
                beat_at = now + cfg.heartbeat_s / 3
                roll.send_all()
            roll.serve()
        code = _exit_status(child.returncode) if forward.got is None else 128 + forward.got
        if roll is not None:
            roll.code = code
            roll.send_all()
            # the nodes that have not checked in yet (a program may end at once) would wait
            # this long for node 0; a signal to this launcher ends the job now
            deadline = time.monotonic() + cfg.startup_timeout_s
            while not roll.all_told() and forward.got is None and time.monotonic() < deadline:
                roll.serve()
        return code
    finally:
        forward.restore()
        if roll is not None:
            roll.sock.close(linger=DONE_LINGER_MS)


class _FollowerChild:
    """``python -m mpx node`` for this node, started again after each executor."""

    def __init__(self, place: Place, ip: str, host: str) -> None:
        self.node_rank = place.node_rank
        self.cmd = [sys.executable, "-m", "mpx", "node", "--master-addr", ip,
                    "--master-port", str(place.master_port), "--node-rank", str(place.node_rank),
                    "--nnodes", str(place.nnodes), "--host", host,
                    "--leader-wait-s", str(LEADER_WAIT_S)]
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def keep_running(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            return
        if p is not None:
            self.proc = None
            if p.returncode < 0:
                # (node 0's executor, if this one served it, refuses the next one and counts
                # this node lost; a later executor takes it)
                print(f"mpx launch: node {self.node_rank}: the follower (pid {p.pid}) was "
                      f"{describe_exit(p.returncode)}; starting another", file=sys.stderr)
            else:
                logger.info("mpx launch: follower exited with %s", p.returncode)
        if time.monotonic() - self.started < RESPAWN_MIN_S:
            return
        self.started = time.monotonic()
        # the key reaches it through the environment, never the command line
        self.proc = _start(self.cmd)

    def stop(self, grace: float) -> None:
        """A follower serving an executor (it has worker processes) gets ``grace`` to
        finish, as node 0's executor stopped it or went away; one still waiting for a
        leader is told at once. SIGTERM (it stops its workers), then SIGKILL."""
        p = self.proc
        if p is None:
            return
        first = grace if _has_children(p.pid) else 0.0
        for sig, wait_s in ((None, first), (signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            if p.poll() is not None:
                return
            if sig is not None:
                p.send_signal(sig)
            try:
                p.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass


def run_follower_node(place: Place, ip: str, cfg: Config) -> int:
    """Any node but 0: keep a follower running until node 0's launcher says the program
    ended (then exit with its status) or goes silent (exit 1)."""
    key = _key(cfg)
    host = cfg.host if os.environ.get("MPX_HOST") else _route_to(ip)
    nonce = secrets.token_bytes(16)
    sock = control.control_socket(zmq.DEALER)
    sock.connect(f"tcp://{ip}:{place.master_port + 1}")
    follower = _FollowerChild(place, ip, host)
    forward = _Forward(as_signal=signal.SIGTERM)  # the follower stops its workers on SIGTERM
    grace = cfg.shutdown_grace_s + cfg.terminate_grace_s
    try:
        deadline = time.monotonic() + cfg.startup_timeout_s
        hello_at = 0.0
        last_seen: float | None = None
        bad_key = False  # node 0 answered that this node's hello failed authentication
        while True:
            now = time.monotonic()
            if forward.got is not None:
                return 128 + forward.got
            if last_seen is None:
                if now > deadline:
                    at = f"{ip}:{place.master_port + 1}"
                    within = f"within {cfg.startup_timeout_s:g} s (startup_timeout_s)"
                    why = (f"node 0's launcher at {at} could not authenticate this node's hello "
                           f"{within}: MPX_AUTH_KEY differs between the nodes" if bad_key else
                           f"no mpx launch on node 0 at {at} {within}")
                    print(f"mpx launch: node {place.node_rank}: {why}", file=sys.stderr)
                    return 1
                if now >= hello_at:
                    hello_at = now + HELLO_EVERY_S
                    sock.send(control.pack(key, wire.LaunchHello(place.node_rank, nonce)))
            elif now - last_seen > cfg.heartbeat_s:
                print(f"mpx launch: node {place.node_rank}: node 0 ({ip}) sent nothing for "
                      f"{cfg.heartbeat_s:g} s (heartbeat_s); stopping", file=sys.stderr)
                return 1
            else:
                follower.keep_running()
                forward.child = follower.proc
            if sock.poll(control.POLL_MS):
                frame = sock.recv()
                if frame == BAD_KEY and not bad_key:
                    bad_key = True  # (unauthenticated: a hint for the message, no more)
                    print(f"mpx launch: node {place.node_rank}: node 0's launcher could not "
                          "authenticate this node's hello: MPX_AUTH_KEY may differ between "
                          "the nodes; still trying", file=sys.stderr)
                msg = control.unpack(key, frame)
                if isinstance(msg, (wire.LaunchBeat, wire.JobDone)) and msg.nonce == nonce:
                    last_seen = time.monotonic()
                    if isinstance(msg, wire.JobDone):
                        return msg.exit_code
    finally:
        try:
            follower.stop(grace)
        finally:
            forward.restore()
            sock.close(linger=0)


def run(args: argparse.Namespace) -> int:
    """``python -m mpx launch``; returns the exit status."""
    cmd = list(args.program)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        if not cmd:
            raise LaunchError("no program given: python -m mpx launch [options] -- python app.py")
        place = find_place(args, os.environ)
        try:
            cfg = Config.from_env()
        except ValueError as e:  # a bad MPX_* value
            raise LaunchError(str(e)) from None
        ip = _resolve(place.master_addr)
        if place.node_rank == 0:
            return run_leader_node(place, ip, cmd, cfg)
        return run_follower_node(place, ip, cfg)
    except LaunchError as e:
        print(f"mpx launch: {e}", file=sys.stderr)
        return 2
