"""``mpx.Config``: every tunable in one frozen dataclass.

Each field's default comes from an ``MPX_<FIELD>`` environment variable when it is set,
else from the value written here; explicit arguments win over both.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

from mpx import _addresses

logger = logging.getLogger("mpx")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _env_field(default: Any, doc: str, repr: bool = True) -> Any:
    return dataclasses.field(default=default, repr=repr, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of queues and executors.

    Build one with ``Config.from_env(**overrides)``; ``Config()`` ignores the environment.
    """

    # 1 MiB slots stream large messages at memory speed (per-slot sync costs <0.1% of the
    # copy); 16 of them let 16 small messages be in flight before the writer must wait.
    max_chunk_bytes: int = _env_field(1 << 20, "bytes of payload per ring slot")
    max_chunks: int = _env_field(16, "slots per ring")
    # A waiter polls with sched_yield, then parks on a futex (a ZeroMQ reader: blocks in
    # libzmq's receive; mpx/mechanism/waiting.py, docs/tuning.md). sched_yield returns at once
    # when nothing else wants the core, so polling with it is as fast as a pause spin on an
    # idle machine (4 us round trip here), and it hands the core over when processes
    # outnumber cores: a 50 us pause spin made round trips 110 us with one busy process on
    # 2 cores, the yield loop 8 us. A reply within yield_us costs no futex wake (~46 us on
    # a VM); an idle waiter costs nothing after it.
    spin_us: int = _env_field(0, "pause-instruction spin before yielding, microseconds")
    yield_us: int = _env_field(1000, "sched_yield polling before parking, microseconds")
    # How often a parked waiter wakes to check that its peer is still alive.
    liveness_poll_ms: int = _env_field(100, "peer liveness check period while parked, ms")
    shm_dir: str = _env_field("/dev/shm", "where POSIX shared memory lives (size checks)")
    # Executor. spawn is the default: a forked child of a process that already initialised
    # CUDA cannot use CUDA, and fork copies whatever threads and locks the driver holds.
    start_method: str = _env_field("spawn", "fork, spawn or forkserver")
    startup_timeout_s: float = _env_field(120.0, "deadline for every worker to become ready")
    shutdown_grace_s: float = _env_field(5.0, "wait for workers to exit before SIGTERM")
    terminate_grace_s: float = _env_field(2.0, "wait after SIGTERM before SIGKILL")
    worker_threads: int = _env_field(0, "OMP/torch threads per worker; 0: cores / local workers")
    # A group with a dead worker cannot serve calls, and its survivors may hold GPU memory or
    # wait forever in a collective with the dead rank: stop them as shutdown() does. Off
    # keeps them running (dump_stacks() still works) until shutdown().
    stop_on_failure: bool = _env_field(True, "stop the surviving workers when one dies")
    # A rank whose process dies is started again in place, in a new process (its calls in
    # flight fail with WorkerDiedError; the executor goes on), this many times over the
    # executor's life; the death after that fails the executor as with 0. A rank on a
    # follower node is started again by its follower (docs/restart.md).
    max_restarts: int = _env_field(0, "times each rank may be restarted in place after its "
                                   "process dies; 0: a death fails the executor")
    # A call that makes no progress (mpx.watchdog.feed) for this long is a stall: its
    # worker dumps every thread's stack and reports it. 0 turns the watchdog off.
    watchdog_timeout_s: float = _env_field(300.0, "seconds without progress before a call "
                                           "counts as stalled; 0: no watchdog")
    dump_dir: str = _env_field("", "where workers write stack dumps; '': <tmp>/mpx-dumps-<uid>")
    async_output: bool = _env_field(False, "send replies from a background thread so the "
                                    "next call starts at once")
    # `python -m mpx top PATH` reads the executor's stats() there (JSON over a Unix socket
    # that only this user can open); '' opens none.
    stats_socket: str = _env_field("", "Unix socket path where the executor serves its stats "
                                   "for `python -m mpx top`; '': none")
    # OpenTelemetry (opentelemetry-api installed): a CLIENT span per collective_rpc, its
    # context sent with the call, a SERVER span per call in each worker. Off: no span, no cost.
    tracing: bool = _env_field(False, "trace each collective_rpc with OpenTelemetry, into "
                               "the workers")
    # Transports. auto: shared memory inside a node, ZeroMQ across; zmq: ZeroMQ for every
    # rank (containers whose /dev/shm is tiny or not shared); shm: one node only.
    transport: str = _env_field("auto", "auto, zmq or shm")
    auth_key: str = _env_field("", "HMAC key for remote traffic; the same on every node",
                               repr=False)  # a logged or printed Config must not show it
    allow_insecure: bool = _env_field(False, "accept remote traffic without a key")
    host: str = _env_field("127.0.0.1", "address this node's sockets bind to and peers reach")
    # Liveness between nodes rides its own channel (UDP probes every heartbeat_s / 4,
    # mpx/_node/liveness.py), not the data's TCP connections, whose retransmissions back
    # off (0.2, 0.4, 0.8 s...) and would make a short cut look long. A queue's TCP link that
    # breaks is reconnected and what the reader missed is resent (mpx/transport/zmq_link.py).
    heartbeat_s: float = _env_field(3.0, "how often remote peers prove they are alive "
                                    "(probes every heartbeat_s / 4)")
    link_grace_s: float = _env_field(0.0, "a remote peer silent, or whose link stays broken, "
                                     "this long is lost; 0: 2 x heartbeat_s")
    curve: bool = _env_field(False, "encrypt remote queue traffic with CURVE (libzmq with curve)")
    # relay: a follower node takes each call once off the network and relays it to its
    # workers through its own ring (one network copy and one HMAC check per node, not per
    # remote rank), streaming each chunk on as it arrives. auto relays where a follower has
    # 2 or more ranks: on one 2-core machine (bench/bench_remote.py, 2 nodes x 2 ranks)
    # relay answered a no-op in 170-180 us against 201-234 us direct and moved 64 MiB to
    # the 2 remote ranks in 77-90 ms against 100 ms; with 1 rank per node it is only an
    # extra hop (158 us against 118 us).
    relay: str = _env_field("auto", "auto, on or off: relay calls on follower nodes")
    # Multi-node: the leader binds master_addr:master_port; followers connect to it.
    nnodes: int = _env_field(1, "nodes in the group (the leader is node 0)")
    master_addr: str = _env_field("127.0.0.1", "the leader's address")
    master_port: int = _env_field(29555, "the leader's control port")
    # Who starts the follower nodes. local: the user, with `python -m mpx node` on each
    # other node (or `python -m mpx launch` under Slurm/torchrun-style variables); ray: a
    # Ray placement group, one bundle per node, and one small follower actor per other
    # node (see docs/launchers-ray-slurm.md). Ray only places processes: calls still go
    # over shared memory and ZeroMQ.
    launcher: str = _env_field("local", "local or ray: who starts the follower nodes")
    ray_address: str = _env_field("auto", "launcher='ray': the cluster to connect to when "
                                  "ray is not initialised yet (ray.init(address=...))")
    ray_cpus_per_worker: float = _env_field(1.0, "launcher='ray': CPUs each worker's bundle "
                                            "share reserves")
    ray_gpus_per_worker: float = _env_field(0.0, "launcher='ray': GPUs each worker's bundle "
                                            "share reserves")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value: Any = getattr(self, f.name)
            kind = type(f.default)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                object.__setattr__(self, f.name, value)
            if f.name == "relay":
                continue  # a bool or a word, read below
            if not isinstance(value, kind) or kind is int and isinstance(value, bool):
                raise _invalid(f.name, value, f"must be a {kind.__name__}")
            if isinstance(value, float) and not math.isfinite(value):
                raise _invalid(f.name, value, "must be a finite number")
            limits = _LIMITS.get(f.name)
            if limits is not None and not limits[0] <= value <= limits[1]:
                raise _invalid(f.name, value, f"must be in [{limits[0]}, {limits[1]}]"
                               + (f" ({limits[2]})" if len(limits) > 2 else ""))
        if 0 < self.watchdog_timeout_s < WATCHDOG_MIN_S:
            raise _invalid("watchdog_timeout_s", self.watchdog_timeout_s,
                           f"must be 0 (off) or at least {WATCHDOG_MIN_S} s")
        if self.max_chunk_bytes % 64:
            raise _invalid("max_chunk_bytes", self.max_chunk_bytes, "must be a multiple of 64")
        for name, choices in (("start_method", ("fork", "spawn", "forkserver")),
                              ("transport", ("auto", "zmq", "shm")),
                              ("launcher", ("local", "ray"))):
            if getattr(self, name) not in choices:
                raise _invalid(name, getattr(self, name), f"must be one of {', '.join(choices)}")
        relay = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off",
                 "no": "off"}.get(str(self.relay).strip().lower(), str(self.relay).strip().lower())
        if relay not in ("auto", "on", "off"):
            raise _invalid("relay", self.relay, "must be auto, on or off")
        object.__setattr__(self, "relay", relay)
        self._check_addresses()
        if self.launcher == "ray" and not self.ray_cpus_per_worker and not self.ray_gpus_per_worker:
            raise _invalid("ray_cpus_per_worker", self.ray_cpus_per_worker,
                           "and ray_gpus_per_worker cannot both be 0 (a Ray bundle must hold "
                           "something)")

    def _check_addresses(self) -> None:
        """Refuse a path or address that cannot serve, naming the field (mpx/_addresses.py)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str) and (why := _addresses.nul_byte(value)):
                raise _invalid(f.name, "<hidden>" if f.name == "auth_key" else value, why)
        # (shm_dir and dump_dir are checked where they are used, before any worker starts:
        # mpx/_driver/preflight.py)
        checks = (("stats_socket", lambda v: _addresses.unix_socket_path(v) if v else None),
                  ("host", _addresses.host),
                  ("master_addr", _addresses.host))
        for name, check in checks:
            why = check(getattr(self, name))
            if why:
                raise _invalid(name, getattr(self, name), why)

    @property
    def link_grace(self) -> float:
        """The effective ``link_grace_s``: the field, or twice ``heartbeat_s`` when it is 0."""
        return self.link_grace_s or 2 * self.heartbeat_s

    def relays(self, local_world_size: int) -> bool:
        """Whether follower nodes with ``local_world_size`` ranks relay calls."""
        return self.relay == "on" or self.relay == "auto" and local_world_size > 1

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Config:
        """Defaults, then ``MPX_*`` variables, then ``overrides`` (``None`` means unset)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get("MPX_" + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f, raw)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown mpx.Config field(s): {', '.join(sorted(unknown))}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def describe(self) -> str:
        """One line with every field, for the startup log (the key is not shown)."""
        def shown(name: str) -> str:
            value = getattr(self, name)
            return "<set>" if name == "auth_key" and value else repr(value)
        return ", ".join(f"{f.name}={shown(f.name)}" for f in dataclasses.fields(self))


# Each number's range: wider values are typos or units mixed up, and some do harm (a spin
# of hours keeps idle workers at 100% CPU; an infinite grace makes shutdown wait forever).
_LIMITS: dict[str, tuple] = {
    "max_chunk_bytes": (64, 1 << 40),
    "max_chunks": (1, 1 << 20),
    "spin_us": (0, 10_000, "a pause spin longer than 10 ms burns a core for nothing"),
    "yield_us": (0, 1_000_000),
    "liveness_poll_ms": (1, 60_000),
    "startup_timeout_s": (0.001, 86_400.0),
    "shutdown_grace_s": (0.0, 3_600.0),
    "terminate_grace_s": (0.0, 3_600.0),
    "worker_threads": (0, 4096),
    "max_restarts": (0, 1_000_000),
    "watchdog_timeout_s": (0.0, 86_400.0),
    "heartbeat_s": (0.01, 3_600.0),
    "link_grace_s": (0.0, 86_400.0),
    "nnodes": (1, 65_536),
    "master_port": (1, 65_535),
    "ray_cpus_per_worker": (0.0, 1024.0),
    "ray_gpus_per_worker": (0.0, 64.0),
}
# The watchdog's dead man's switch is faulthandler's C thread, which reads the other
# threads' frames without the GIL: safe while they are stuck (a real stall), not while
# Python runs. With a timeout of microseconds it fired during ordinary calls and crashed
# workers with SIGSEGV (3 runs of 3 at 1e-6 s, none at 1e-3 s once the switch was set from
# now); a floor far above any call's jitter keeps it to real stalls.
WATCHDOG_MIN_S = 0.1


def _invalid(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"mpx.Config.{name} (environment variable MPX_{name.upper()}) {why}, "
                      f"got {value!r}")


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = type(f.default)
    name = "MPX_" + f.name.upper()
    try:
        if kind is bool:
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw, 0)
        if kind is float:
            return float(raw)
        return raw
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {kind.__name__}") from None
