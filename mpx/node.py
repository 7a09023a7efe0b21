"""Multi-node groups: the leader's control socket and the follower node process.

The leader (the driver's executor) binds a ROUTER on ``master_addr:master_port``. Each
follower (``python -m mpx node``) connects, introduces itself, receives the worker class,
kwargs, config and the broadcast queue's handle, starts its local workers (which read calls
over ZeroMQ and answer over their own ZeroMQ queues), and reports their handles. Both sides
then exchange heartbeats; a follower reports its workers' deaths, and exits with its
workers when the leader goes away. Every control message is an HMAC-sealed pickle, and a
follower joins only by signing a fresh nonce from the leader, so a replayed hello is useless.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import queue
import secrets
import threading
import time
from typing import Any

import cloudpickle
import zmq

from mpx import _debug, watchdog, wire
from mpx.auth import seal, unseal
from mpx.config import Config
from mpx.errors import (
    Cancelled,
    MessageAbortedError,
    NodeLostError,
    PeerDiedError,
    QueueClosedError,
    WorkerDiedError,
    WorkerStartupError,
)
from mpx.launch import LocalWorkers, describe_exit, describe_stall
from mpx.queue import MessageQueue
from mpx.wire import WorkerContext

logger = logging.getLogger("mpx")

_TAG = b"MPXC"
_POLL_MS = 100


def _pack(key: bytes, msg: Any) -> bytes:
    return seal(key, _TAG, [cloudpickle.dumps(msg)])


def _unpack(key: bytes, frame: Any) -> Any:
    """The node-control message (a :mod:`mpx.wire` dataclass) in ``frame``, or None when
    the frame is not authentic."""
    body = unseal(key, frame)
    if body is None or bytes(body[:4]) != _TAG:
        return None
    return pickle.loads(body[4:])


def _socket(kind: int) -> zmq.Socket:
    sock: zmq.Socket = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class Leader:
    """The driver's side of a multi-node group (used by mpx.Executor when nnodes > 1)."""

    def __init__(self, config: Config, world_size: int) -> None:
        self.config = config
        self.key = config.auth_key.encode()
        self.local = world_size // config.nnodes
        self.sock = _socket(zmq.ROUTER)
        self.sock.bind(f"tcp://{config.master_addr}:{config.master_port}")
        self.nodes: dict[int, bytes] = {}       # node rank -> routing id
        self.last_seen: dict[int, float] = {}
        self.pids: dict[int, int] = {}          # global rank -> pid
        self.handles: dict[int, Any] = {}       # global rank -> response-queue handle
        self._spec: wire.NodeSpec | None = None
        self._challenges: dict[bytes, tuple[int, bytes]] = {}  # routing id -> (node, nonce)
        self._beat_at = 0.0
        self.lost: set[int] = set()
        # Executor.dump_stacks: a request for the watch thread to send, and the answers
        self._dumps = threading.Condition()
        self._dump_token = 0
        self._dump_asks: list[wire.DumpStacks] = []
        self._dump_answers: dict[int, dict[int, str]] = {}

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.local, (node + 1) * self.local))

    def _recv(self, timeout_ms: int) -> tuple[int | None, Any]:
        """(node, message) of the next authenticated message from a joined node. A hello
        gets a fresh nonce to sign back ("join"): a replayed hello or join joins nothing."""
        if not self.sock.poll(timeout_ms):
            return None, None
        frames = self.sock.recv_multipart()
        msg = _unpack(self.key, frames[-1]) if len(frames) == 2 else None
        if msg is None:
            logger.warning("mpx: leader dropped an unauthenticated control message")
            return None, None
        ident = frames[0]
        if isinstance(msg, wire.Hello):
            nonce = secrets.token_bytes(16)
            self._challenges[ident] = (msg.node_rank, nonce)
            self.sock.send_multipart([ident, _pack(self.key, wire.Challenge(nonce))])
            return None, None
        if isinstance(msg, wire.Join):
            if self._challenges.pop(ident, None) != (msg.node_rank, msg.nonce):
                logger.warning("mpx: leader dropped a join that answers no challenge")
                return None, None
            self.nodes[msg.node_rank] = ident
        node = next((n for n, i in self.nodes.items() if i == ident), None)
        if node is not None:
            self.last_seen[node] = time.monotonic()
        return node, msg

    def send(self, node: int, msg: Any) -> None:
        self.sock.send_multipart([self.nodes[node], _pack(self.key, msg)])

    def admit(self, spec: wire.NodeSpec, deadline: float) -> None:
        """Wait for every follower to say hello and send it ``spec`` (its workers then start
        while the leader's own finish theirs: torch.distributed needs all of them at once).
        ``spec.node_rank`` is filled in per node, and the key is taken out of its config."""
        self._spec = spec
        self._wait(deadline, lambda: len(self.nodes) == self.config.nnodes - 1)

    def collect(self, deadline: float) -> dict[int, Any]:
        """The response-queue handles of every follower worker, once all are ready."""
        self._wait(deadline, lambda: len(self.handles) == self.local * (self.config.nnodes - 1))
        return self.handles

    def _wait(self, deadline: float, done: Any) -> None:
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, self.config.nnodes)) - set(self.nodes))
                if missing:
                    raise WorkerStartupError(
                        f"follower nodes {missing} did not join within "
                        f"{self.config.startup_timeout_s} s",
                        [r for n in missing for r in self.node_ranks(n)])
                late = [r for r in range(self.local, self.local * self.config.nnodes)
                        if r not in self.handles]
                raise WorkerStartupError(f"follower workers {late} did not become ready "
                                         f"within {self.config.startup_timeout_s} s", late)
            node, msg = self._recv(min(_POLL_MS, int(left * 1000) + 1))
            if msg is None or node is None:
                continue
            if isinstance(msg, wire.Join):
                assert self._spec is not None
                # the key never travels: each follower has its own copy
                self.send(node, dataclasses.replace(
                    self._spec, node_rank=node,
                    config=dataclasses.replace(self._spec.config, auth_key="")))
            elif isinstance(msg, wire.WorkerReady):
                self.handles[msg.rank] = msg.handle
                self.pids[msg.rank] = msg.pid
            elif isinstance(msg, wire.NodeStartupFailed):
                raise WorkerStartupError(f"on node {node}: {msg.message}", msg.ranks,
                                         msg.traceback)

    def poll(self) -> WorkerDiedError | NodeLostError | None:
        """One step of the leader's watch: heartbeats out, a failure if one was reported."""
        now = time.monotonic()
        if now >= self._beat_at:
            self._beat_at = now + self.config.heartbeat_s / 3
            for n in self.nodes:
                self.send(n, wire.Beat())
        with self._dumps:
            asks, self._dump_asks = self._dump_asks, []
        for ask in asks:
            for n in self.nodes:
                self.send(n, ask)
        node, msg = self._recv(_POLL_MS)
        if isinstance(msg, wire.Stacks) and node is not None:
            with self._dumps:
                if msg.token == self._dump_token:
                    self._dump_answers[node] = msg.stacks
                    self._dumps.notify_all()
        if isinstance(msg, wire.WorkerDead):
            return WorkerDiedError(f"worker rank {msg.rank} (pid {msg.pid}) on node {node} died: "
                                   f"{describe_exit(msg.exitcode)}", rank=msg.rank, pid=msg.pid,
                                   exitcode=msg.exitcode)
        for n, seen in list(self.last_seen.items()):
            if n not in self.lost and time.monotonic() - seen > self.config.heartbeat_s:
                self.lost.add(n)
                return NodeLostError(f"node {n} (ranks {self.node_ranks(n)}) sent nothing for "
                                     f"{self.config.heartbeat_s} s: it died or its link was cut",
                                     n, self.node_ranks(n))
        return None

    def stacks(self, timeout: float) -> dict[int, str]:
        """Every follower worker's stacks by rank (see Executor.dump_stacks); ranks of a
        node that does not answer within ``timeout`` get a line saying so."""
        deadline = time.monotonic() + timeout
        with self._dumps:
            self._dump_token += 1
            self._dump_answers = {}
            self._dump_asks.append(wire.DumpStacks(self._dump_token, timeout))
            nodes = list(self.nodes)
            self._dumps.wait_for(lambda: len(self._dump_answers) == len(nodes),
                                 max(0.0, deadline - time.monotonic()))
            answers = dict(self._dump_answers)
        out: dict[int, str] = {}
        for n in nodes:
            out.update(answers.get(n) or {r: f"<no stacks from rank {r}: node {n} did not "
                                           f"answer within {timeout} s>"
                                           for r in self.node_ranks(n)})
        return out

    def stop(self) -> None:
        for node in self.nodes:
            try:
                self.send(node, wire.StopNode())
            except zmq.ZMQError:
                pass
        self.sock.close(linger=100)


def run_follower(master_addr: str, master_port: int, node_rank: int, nnodes: int,
                 config: Config) -> int:
    """Run follower node ``node_rank`` until the leader stops it or goes away."""
    if not config.auth_key and not config.allow_insecure:
        raise SystemExit("mpx node: set MPX_AUTH_KEY to the leader's key (or "
                         "MPX_ALLOW_INSECURE=1)")
    key = config.auth_key.encode()
    sock = _socket(zmq.DEALER)
    sock.connect(f"tcp://{master_addr}:{master_port}")
    sock.send(_pack(key, wire.Hello(node_rank, os.getpid())))
    deadline = time.monotonic() + config.startup_timeout_s
    spec = None
    while spec is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"mpx node {node_rank}: no leader at {master_addr}:{master_port}")
        if sock.poll(_POLL_MS):
            msg = _unpack(key, sock.recv())
            if isinstance(msg, wire.Challenge):
                sock.send(_pack(key, wire.Join(node_rank, msg.nonce)))
            elif isinstance(msg, wire.NodeSpec):
                spec = msg
    # the leader's settings, with this node's own address and key
    cfg = dataclasses.replace(spec.config, host=config.host, auth_key=config.auth_key)
    local = spec.world_size // nnodes
    ctxs = [WorkerContext(rank=node_rank * local + i, local_rank=i, world_size=spec.world_size,
                          local_world_size=local, node_rank=node_rank,
                          distributed_init_method=spec.distributed_init_method, config=cfg)
            for i in range(local)]
    relay = _Relay(spec.handle, local + node_rank - 1, local, cfg) \
        if cfg.relays(local) else None
    handle = relay.handle if relay is not None else spec.handle
    workers = LocalWorkers(cfg, ctxs, handle, spec.worker_cls, spec.worker_kwargs,
                           remote_driver=True, local_queue=relay is not None)
    try:
        try:
            handles = workers.handshake(time.monotonic() + cfg.startup_timeout_s)
        except WorkerStartupError as e:
            sock.send(_pack(key, wire.NodeStartupFailed(str(e), e.ranks, e.remote_traceback)))
            return 1
        if relay is not None:
            relay.start()
        for rank, pid in zip(workers.ranks, workers.pids):
            sock.send(_pack(key, wire.WorkerReady(rank, handles[rank], pid)))
        return _serve_follower(sock, key, workers, cfg)
    finally:
        if relay is not None:
            relay.stop()
        workers.stop()
        if relay is not None:
            relay.close()
        sock.close(linger=100)


class _Relay:
    """Takes each call once off the network and rebroadcasts it, as it is (no unpickling),
    through a shared-memory ring to this node's workers, chunk by chunk as it arrives."""

    def __init__(self, handle: Any, reader_rank: int, local: int, cfg: Config) -> None:
        self.up = MessageQueue.create_from_handle(handle, reader_rank, config=cfg)
        self.down = MessageQueue(local, local, config=dataclasses.replace(cfg, transport="shm"))
        self.handle = self.down.export_handle()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_debug.counted_thread(self._run),
                                        name="mpx-relay", daemon=True)

    def start(self) -> None:
        self.down.wait_until_ready(timeout=30)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:  # each chunk goes on as soon as it has arrived and been checked
                kind, total, pieces = self.up.dequeue_stream(cancel=self._stop)
                try:
                    self.down.enqueue_stream(kind, total, pieces)
                except MessageAbortedError:
                    pass  # the driver gave up on it part way; the workers never see it
        except (Cancelled, PeerDiedError, QueueClosedError):
            pass
        finally:
            self.down.close()  # the workers read what was relayed, then stop

    def stop(self) -> None:
        self._stop.set()
        self.down.shutdown()
        if self._thread.is_alive():
            self._thread.join(5)

    def close(self) -> None:
        self.up.close()
        self.down.close()


def _dump_in_background(workers: LocalWorkers, cfg: Config, token: int, timeout: float,
                        answers: queue.SimpleQueue) -> None:
    """Take this node's workers' stacks in a thread (the control loop keeps beating) and
    leave the answer in ``answers`` for the loop to send."""
    where = watchdog.dump_dir(cfg.dump_dir)
    targets = {rank: (p.pid, watchdog.dump_path(where, rank, p.pid))
               for rank, p in zip(workers.ranks, workers.procs)}

    def run() -> None:
        answers.put(wire.Stacks(token, watchdog.dump_all(targets, timeout, describe_stall)))

    threading.Thread(target=_debug.counted_thread(run), name="mpx-dump", daemon=True).start()


def _serve_follower(sock: zmq.Socket, key: bytes, workers: LocalWorkers, cfg: Config) -> int:
    last_seen = time.monotonic()
    beat_at = 0.0
    reported: set[int] = set()
    dumps: queue.SimpleQueue = queue.SimpleQueue()  # answers to "dump", from their threads
    while True:
        now = time.monotonic()
        if now >= beat_at:
            beat_at = now + cfg.heartbeat_s / 3
            sock.send(_pack(key, wire.Beat()))
        if sock.poll(_POLL_MS):
            msg = _unpack(key, sock.recv())
            if msg is not None:
                last_seen = time.monotonic()
                if isinstance(msg, wire.StopNode):
                    return 0
                if isinstance(msg, wire.DumpStacks):
                    _dump_in_background(workers, cfg, msg.token, msg.timeout, dumps)
        while not dumps.empty():
            sock.send(_pack(key, dumps.get()))
        if time.monotonic() - last_seen > cfg.heartbeat_s:
            logger.error("mpx node: the leader sent nothing for %.1f s; stopping", cfg.heartbeat_s)
            return 1
        for rank, p in zip(workers.ranks, workers.procs):
            if rank not in reported and p.exitcode is not None:
                reported.add(rank)
                sock.send(_pack(key, wire.WorkerDead(rank, p.pid, p.exitcode)))
