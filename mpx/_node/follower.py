"""A follower node (``python -m mpx node``; runs in its own process on every node but the
driver's).

It joins the leader (:mod:`mpx._node.leader`), receives the group's spec, starts its local
workers (which read calls over ZeroMQ, or through a :class:`~mpx._node.relay.Relay`, and
answer over their own ZeroMQ queues), reports their handles, then probes the leader
(:mod:`mpx._node.liveness`) and reports worker deaths until the leader stops it or is silent
for ``Config.link_grace``; its workers end with it. Its control connection keeps one routing
id, so that when the link breaks and libzmq reconnects, the leader knows it again.

It says on stderr, once, that it joined and which ranks it runs. A leader that cannot
authenticate its hello answers ``control.BAD_KEY``; that hint is not authenticated, so
the follower goes on trying until its wait ends, and then says that the keys did not
match rather than that no leader answered.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from mpx import _debug, dumps
from mpx._node import control
from mpx._node.liveness import FOLLOWER, Probes
from mpx._node.local_workers import LocalWorkers
from mpx._node.relay import Relay, relay_reader
from mpx._procinfo import describe_stall
from mpx.config import Config
from mpx.errors import WorkerStartupError
from mpx.protocol import wire
from mpx.protocol.wire import WorkerContext

logger = logging.getLogger("mpx")


# A follower says hello again this often until the leader answers: a hello that reached a
# leader which closed before answering (the previous executor of a `mpx launch` job) is lost.
HELLO_EVERY_S = 1.0


def run_follower(master_addr: str, master_port: int, node_rank: int, nnodes: int,
                 config: Config, *, node_id: str = "",
                 leader_wait_s: float | None = None) -> int:
    """Run follower node ``node_rank`` until the leader stops it or goes away.

    ``node_id`` is handed to the workers as ``WorkerContext.node_id`` (the Ray launcher
    passes Ray's node id); ``leader_wait_s`` bounds the wait for a leader (default
    ``config.startup_timeout_s``). Returns 0 when the leader stopped it, 1 when the leader
    went silent, this node's workers could not start or the leader counts another number
    of nodes; SystemExit without a key or without a leader in time."""
    if not config.auth_key and not config.allow_insecure:
        raise SystemExit("mpx node: set MPX_AUTH_KEY to the leader's key (or "
                         "MPX_ALLOW_INSECURE=1)")
    key = config.auth_key.encode()
    sock = control.control_socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"\x01" + secrets.token_bytes(15))
    sock.connect(f"tcp://{master_addr}:{master_port}")
    wait_s = config.startup_timeout_s if leader_wait_s is None else leader_wait_s
    deadline = time.monotonic() + wait_s
    at = f"{master_addr}:{master_port}"
    spec = None
    nonce = b""
    hello_at = 0.0
    bad_key = False  # the leader answered with a frame this node's key does not verify
    try:
        while spec is None:
            now = time.monotonic()
            if now > deadline:
                raise SystemExit(_no_leader(node_rank, nnodes, master_addr, master_port, wait_s,
                                            bad_key))
            if now >= hello_at:
                hello_at = now + HELLO_EVERY_S
                sock.send(control.pack(key, wire.Hello(node_rank, os.getpid())))
            if sock.poll(control.POLL_MS):
                msg = control.unpack(key, sock.recv())
                if msg is None and not bad_key:
                    bad_key = True
                    print(f"mpx node {node_rank}: the leader at {at} could not authenticate "
                          "this node's hello: its MPX_AUTH_KEY does not match this node's; "
                          "still trying", file=sys.stderr, flush=True)
                if isinstance(msg, wire.Challenge):
                    nonce = msg.nonce
                    sock.send(control.pack(key, wire.Join(node_rank, nonce)))
                elif isinstance(msg, wire.NodeSpec):
                    spec = msg
    except BaseException:
        sock.close(linger=0)
        raise
    if spec.config.nnodes != nnodes:  # its ranks are not the ones this node would start
        failed = _count_mismatch(node_rank, nnodes, spec)
        logger.error("mpx node %d: %s", node_rank, failed.message)
        sock.send(control.pack(key, failed))
        sock.close(linger=1000)
        return 1
    # the leader's settings, with this node's own address and key
    cfg = dataclasses.replace(spec.config, host=config.host, auth_key=config.auth_key)
    local = spec.world_size // nnodes
    print(f"mpx node {node_rank}: joined the leader at {at} with "
          f"{_ranks_text(node_rank * local, local)} of {spec.world_size}", file=sys.stderr,
          flush=True)
    ctxs = [WorkerContext(rank=node_rank * local + i, local_rank=i, world_size=spec.world_size,
                          local_world_size=local, node_rank=node_rank,
                          distributed_init_method=spec.distributed_init_method, config=cfg,
                          node_id=node_id)
            for i in range(local)]
    relay = Relay(spec.handle, relay_reader(local, node_rank), local, cfg) \
        if cfg.relays(local) else None
    handle = relay.handle if relay is not None else spec.handle
    workers = LocalWorkers(cfg, ctxs, handle, spec.worker_cls, spec.worker_kwargs,
                           remote_driver=True, local_queue=relay is not None)
    try:
        try:
            handles = workers.handshake(time.monotonic() + cfg.startup_timeout_s)
        except WorkerStartupError as e:
            sock.send(control.pack(key, wire.NodeStartupFailed(str(e), e.ranks, e.remote_traceback)))
            return 1
        if relay is not None:
            relay.start()
        for rank, pid in zip(workers.ranks, workers.pids):
            sock.send(control.pack(key, wire.WorkerReady(rank, handles[rank], pid)))
        probes = Probes(key, FOLLOWER, config.host, 0, cfg.heartbeat_s)

        def restart(rank: int, answers: queue.SimpleQueue) -> None:
            _restart_in_background(workers, ctxs[rank - node_rank * local], spec.handle, cfg,
                                   answers)

        try:
            probes.expect(node_rank, nonce, (master_addr, master_port))
            def heard_again() -> None:  # (the leader was silent: see liveness)
                if relay is not None:
                    relay.reconnect()
                workers.kick_links()  # (those that read the driver directly)

            return _serve_follower(sock, probes, node_rank, key, workers, cfg, heard_again,
                                   restart)
        finally:
            probes.close()
    finally:
        if relay is not None:
            relay.stop()
        workers.stop()
        if relay is not None:
            relay.close()
        sock.close(linger=100)


def _no_leader(node_rank: int, nnodes: int, master_addr: str, master_port: int, wait_s: float,
               bad_key: bool) -> str:
    """Why node ``node_rank`` found no leader within ``wait_s``, and what to do."""
    at = f"{master_addr}:{master_port}"
    if bad_key:
        return (f"mpx node {node_rank}: the leader at {at} could not authenticate this "
                f"node's hello within {wait_s:g} s: this node's MPX_AUTH_KEY did not match "
                "the leader's; give every node the same MPX_AUTH_KEY")
    return (f"mpx node {node_rank}: no leader at {at} within {wait_s:g} s: start the driver "
            f"(its mpx.Executor with nnodes={nnodes}, master_port={master_port}) "
            "first or wait longer (--leader-wait-s), and check that this node reaches that "
            "address")


def _ranks_text(first: int, count: int) -> str:
    return f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"


def _count_mismatch(node_rank: int, nnodes: int, spec: wire.NodeSpec) -> wire.NodeStartupFailed:
    local = spec.world_size // spec.config.nnodes
    return wire.NodeStartupFailed(
        f"node {node_rank} was started with nnodes={nnodes}, node 0 (the leader) with "
        f"nnodes={spec.config.nnodes}: give every node the same node count (--nnodes, NNODES "
        "or SLURM_NNODES); this node started no workers",
        list(range(node_rank * local, (node_rank + 1) * local)), "")


def _dump_in_background(workers: LocalWorkers, cfg: Config, token: int, timeout: float,
                        answers: queue.SimpleQueue) -> None:
    """Take this node's workers' stacks in a thread (the control loop keeps beating) and
    leave the answer in ``answers`` for the loop to send."""
    where = dumps.dump_dir(cfg.dump_dir)
    targets = {rank: (p.pid, dumps.dump_path(where, rank, p.pid))
               for rank, p in zip(workers.ranks, workers.procs)}

    def run() -> None:
        answers.put(wire.Stacks(token, dumps.dump_all(targets, timeout, describe_stall)))

    threading.Thread(target=_debug.counted_thread(run), name="mpx-dump", daemon=True).start()


def _restart_in_background(workers: LocalWorkers, ctx: WorkerContext, handle: Any, cfg: Config,
                           answers: queue.SimpleQueue) -> None:
    """Start ``ctx.rank`` again in a thread (the control loop keeps probing), reading the
    driver's broadcast of ``handle`` directly (a relay's ring cannot take a new reader: its
    name was unlinked once its first readers attached), and leave WorkerReady or
    RestartFailed in ``answers`` for the loop to send."""

    def run() -> None:
        try:
            i = workers.add(ctx, handle, direct=True)
            handles = workers.handshake(time.monotonic() + cfg.startup_timeout_s, [i])
            answers.put(wire.WorkerReady(ctx.rank, handles[ctx.rank], workers.procs[i].pid))
        except WorkerStartupError as e:
            answers.put(wire.RestartFailed(ctx.rank, str(e), e.remote_traceback, e.exitcode))

    threading.Thread(target=_debug.counted_thread(run), name="mpx-restart", daemon=True).start()


def _serve_follower(sock: zmq.Socket, probes: Probes, node_rank: int, key: bytes,
                    workers: LocalWorkers, cfg: Config, heard_again: Callable[[], None] | None,
                    restart: Callable[[int, queue.SimpleQueue], None]) -> int:
    # The leader says Beat once its own startup is done (its workers may take longer to
    # spawn than ours): until that word, only startup_timeout_s bounds its silence; from
    # then on, link_grace_s does.
    started = time.monotonic()
    serving = False
    last_seen = 0.0
    grace = cfg.link_grace
    reported: set[int] = set()
    answers: queue.SimpleQueue = queue.SimpleQueue()  # to "dump", from their threads
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(probes.fileno(), zmq.POLLIN)
    while True:
        probes.tick()
        ready = dict(poller.poll(min(control.POLL_MS, int(probes.wait_s() * 1000) + 1)))
        if probes.fileno() in ready and probes.take() and heard_again is not None:
            heard_again()  # (the leader was silent: its calls' link is worth taking up now)
        if sock in ready:
            msg = control.unpack(key, sock.recv())
            # (a late answer to a repeated hello is no sign of life of the leader's watch)
            if msg is not None and not isinstance(msg, (wire.Challenge, wire.NodeSpec)):
                last_seen = time.monotonic()
                serving = serving or isinstance(msg, wire.Beat)
                if isinstance(msg, wire.StopNode):
                    return 0
                if isinstance(msg, wire.DumpStacks):
                    _dump_in_background(workers, cfg, msg.token, msg.timeout, answers)
                if isinstance(msg, wire.RestartRank) and msg.rank in workers.ranks:
                    restart(msg.rank, answers)
        while not answers.empty():
            answer = answers.get()
            if isinstance(answer, wire.WorkerReady):  # (started again: its death is news)
                reported.discard(answer.rank)
            sock.send(control.pack(key, answer))
        now = time.monotonic()
        if serving:
            if now - max(last_seen, probes.heard.get(node_rank, 0.0)) > grace:
                why = f"the leader sent nothing for {grace:g} s (link_grace_s)"
                logger.error("mpx node: %s; stopping", why)
                sock.send(control.pack(key, wire.NodeLeaving(why)))
                return 1
        elif now - started > cfg.startup_timeout_s:
            logger.error("mpx node: the leader did not finish its startup within %.1f s "
                         "(startup_timeout_s); stopping", cfg.startup_timeout_s)
            return 1
        for rank, p in zip(workers.ranks, workers.procs):
            if rank not in reported and p.exitcode is not None:
                reported.add(rank)
                sock.send(control.pack(key, wire.WorkerDead(rank, p.pid, p.exitcode)))
