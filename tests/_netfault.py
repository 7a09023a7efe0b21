"""A faulty network link between this host and a network namespace, for tests that need a
real wire that can be cut, lose, delay or corrupt packets (the kernel here has no
``sch_netem``, so the faults are made by a userspace forwarder).

::

    root namespace (leader)                          namespace NS (follower)
    ----------------------                           -----------------------
    sockets on LEADER_IP                             sockets on FOLLOWER_IP
         |                                                    |
    TUN <NS>h  LEADER_IP peer FOLLOWER_IP            TUN <NS>f  FOLLOWER_IP peer LEADER_IP
         |                                                    |
         +---- fd ---->  forwarder process  ---- fd ----------+
                         (this file run as a program)
                         to_follower: <NS>h -> faults -> <NS>f
                         to_leader:   <NS>f -> faults -> <NS>h
                             ^
                             | JSON lines on its stdin/stdout
                         FaultyLink (the test's client)

Every IPv4 packet between the two addresses crosses the forwarder, which copies it from one
TUN device to the other unless a fault says otherwise. The forwarder is a process of its own,
so its copying does not share the test's GIL. It opens the namespace's TUN device after
``setns`` into the namespace and the host's after returning; both devices are
non-persistent, so they vanish when the forwarder exits, however it exits. The forwarder
exits when its stdin closes, so it cannot outlive the test that started it.

Faults are per direction (``"to_follower"``, ``"to_leader"`` or ``"both"``):

- ``partition(True)``: every packet is dropped, silently (no reset, no ICMP): TCP retransmits
  with backoff, exactly as over a cut cable. Packets held by a delay are lost too.
- ``loss(rate)``: each packet dropped with that probability.
- ``delay(seconds)``: each packet held that long before it is passed on (a one-way delay; the
  order of a direction's packets is kept).
- ``corrupt(n)``: the TCP payload of the next ``n`` TCP packets that carry at least
  ``min_payload`` bytes is altered and their checksum recomputed, so TCP accepts the segment
  and the application reads altered bytes.

A control call returns once the forwarder applied it: every packet it reads afterwards gets
the new faults. Usage::

    with faulty_link() as link:
        server = link.ns_popen([sys.executable, "-m", "mpx", "node", ...])
        link.partition(True)
        ...
        print(link.counters())
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import itertools
import json
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

DIRECTIONS = ("to_follower", "to_leader")
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_CLONE_NEWNET = 0x40000000
_BURST = 64  # packets read from one device before the other gets its turn
_COUNTERS = ("forwarded", "dropped", "corrupted", "ignored")


class LinkUnavailable(RuntimeError):
    """This host cannot make the link (not root, no iproute2, no TUN, no namespaces)."""


# --------------------------------------------------------------------------- the forwarder


class _Way:
    """One direction of the link: its faults, its counters and the device its packets leave
    by."""

    def __init__(self, out_fd: int) -> None:
        self.out_fd = out_fd
        self.cut = False
        self.loss = 0.0
        self.delay = 0.0
        self.corrupt = 0
        self.min_payload = 64
        self.last_due = 0.0  # when the last packet held by a delay leaves: keeps the order
        self.held = 0
        self.forwarded = self.dropped = self.corrupted = self.ignored = 0

    def counters(self) -> dict[str, int]:
        return {**{k: getattr(self, k) for k in _COUNTERS}, "held": self.held}


def _tcp_payload(pkt: bytes) -> tuple[int, int, int] | None:
    """(IP header length, payload start, IP total length) of an unfragmented IPv4 TCP
    packet, else None."""
    ihl = (pkt[0] & 0x0F) * 4
    total = int.from_bytes(pkt[2:4], "big")
    if pkt[9] != 6 or int.from_bytes(pkt[6:8], "big") & 0x3FFF or total > len(pkt):
        return None
    return ihl, ihl + (pkt[ihl + 12] >> 4) * 4, total


def _tcp_checksum(pkt: bytearray, ihl: int, total: int) -> int:
    """The TCP checksum of pkt, whose checksum field is zero (RFC 793: the ones'-complement
    sum of the pseudo-header and the segment)."""
    data = bytes(pkt[12:20]) + bytes((0, 6)) + (total - ihl).to_bytes(2, "big") + pkt[ihl:total]
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _corrupted(pkt: bytes, min_payload: int) -> bytes | None:
    """pkt with one payload byte inverted and a TCP checksum that verifies, or None when pkt
    is not a TCP packet with at least min_payload bytes of payload."""
    where = _tcp_payload(pkt)
    if where is None or where[2] - where[1] < min_payload:
        return None
    ihl, start, total = where
    out = bytearray(pkt)
    out[(start + total) // 2] ^= 0xFF
    out[ihl + 16:ihl + 18] = b"\0\0"
    out[ihl + 16:ihl + 18] = _tcp_checksum(out, ihl, total).to_bytes(2, "big")
    return bytes(out)


class _Forwarder:
    """Copies packets between the two TUN devices, applying each direction's faults, and
    answers control requests. Single-threaded: faults change only between packets."""

    def __init__(self, host_fd: int, ns_fd: int, seed: int | None) -> None:
        self.ways = {"to_follower": _Way(ns_fd), "to_leader": _Way(host_fd)}
        self.by_fd = {host_fd: self.ways["to_follower"], ns_fd: self.ways["to_leader"]}
        self.held: list[tuple[float, int, _Way, bytes]] = []  # a heap, by due time
        self.order = itertools.count()
        self.rng = random.Random(seed)

    def admit(self, way: _Way, pkt: bytes) -> None:
        if pkt[0] >> 4 != 4:  # IPv6 is off on both devices; anything else is not ours
            way.ignored += 1
            return
        if way.cut or (way.loss and self.rng.random() < way.loss):
            way.dropped += 1
            return
        if way.corrupt:
            bad = _corrupted(pkt, way.min_payload)
            if bad is not None:
                pkt = bad
                way.corrupt -= 1
                way.corrupted += 1
        if way.delay or way.held:
            due = max(time.monotonic() + way.delay, way.last_due)
            way.last_due = due
            way.held += 1
            heapq.heappush(self.held, (due, next(self.order), way, pkt))
            return
        self.send(way, pkt)

    @staticmethod
    def send(way: _Way, pkt: bytes) -> None:
        try:
            os.write(way.out_fd, pkt)
        except OSError:  # the device is down (a test set it so) or refused the packet
            way.dropped += 1
        else:
            way.forwarded += 1

    def release(self) -> None:
        now = time.monotonic()
        while self.held and self.held[0][0] <= now:
            _, _, way, pkt = heapq.heappop(self.held)
            way.held -= 1
            if way.cut:
                way.dropped += 1
            else:
                self.send(way, pkt)

    def control(self, req: dict) -> dict:
        op = req["op"]
        if op == "counters":
            return {name: way.counters() for name, way in self.ways.items()}
        if op != "set":
            raise ValueError(f"unknown op {op!r}")
        names = DIRECTIONS if req["direction"] == "both" else (req["direction"],)
        for name in names:
            for field, value in req["faults"].items():
                if field not in ("cut", "loss", "delay", "corrupt", "min_payload"):
                    raise ValueError(f"unknown fault {field!r}")
                setattr(self.ways[name], field, value)
        return {}

    def run(self, ctl_in: int, ctl_out: int) -> None:
        """Forward until ctl_in closes or a quit request comes."""
        ep = select.epoll()
        for fd in (*self.by_fd, ctl_in):
            ep.register(fd, select.EPOLLIN)
        pending = b""
        while True:
            timeout = max(0.0, self.held[0][0] - time.monotonic()) if self.held else -1
            for fd, _ in ep.poll(timeout):
                way = self.by_fd.get(fd)
                if way is not None:
                    for _ in range(_BURST):
                        try:
                            pkt = os.read(fd, 65536)
                        except BlockingIOError:
                            break
                        self.admit(way, pkt)
                    continue
                chunk = os.read(ctl_in, 65536)
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    req = json.loads(line)
                    if req["op"] == "quit":
                        return
                    reply: dict[str, object]
                    try:
                        reply = {"ok": self.control(req)}
                    except (KeyError, ValueError) as e:
                        reply = {"error": repr(e)}
                    os.write(ctl_out, json.dumps(reply).encode() + b"\n")
            self.release()


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI))
    with contextlib.suppress(OSError), open(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6",
                                            "w") as f:
        f.write("1")  # no router solicitations or MLD reports crossing the link
    return fd


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _open_tun_in(ns: str, name: str) -> int:
    """A TUN device created inside network namespace ns (this thread returns home after)."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            return _open_tun(name)
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


def main(argv: list[str]) -> None:
    """``python _netfault.py NS HOST_DEV NS_DEV SEED``: make the devices, say ``ready`` on
    stdout, forward until stdin closes."""
    ns, host_dev, ns_dev, seed = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the test's Ctrl-C: its client stops us
    ns_fd = _open_tun_in(ns, ns_dev)
    host_fd = _open_tun(host_dev)
    os.write(1, b"ready\n")
    _Forwarder(host_fd, ns_fd, int(seed) if seed != "-" else None).run(0, 1)


# ------------------------------------------------------------------------------ the client


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, timeout=10)
    if r.returncode:
        raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout, r.stderr)


def _direction(direction: str) -> str:
    if direction not in (*DIRECTIONS, "both"):
        raise ValueError(f"direction must be one of {DIRECTIONS} or 'both', not {direction!r}")
    return direction


class FaultyLink:
    """The test's end of one faulty link: the addresses, the namespace and the controls of
    its forwarder. Methods may be called from any thread (one request at a time)."""

    def __init__(self, proc: subprocess.Popen, ns: str, host_dev: str, ns_dev: str,
                 leader_ip: str, follower_ip: str) -> None:
        self.proc = proc
        self.ns = ns  # for ``ip netns exec``
        self.host_dev, self.ns_dev = host_dev, ns_dev
        self.leader_ip, self.follower_ip = leader_ip, follower_ip
        self._lock = threading.Lock()

    def partition(self, on: bool = True, direction: str = "both") -> None:
        """Drop every packet (both ways by default), silently, until partition(False)."""
        self._set(direction, cut=bool(on))

    def loss(self, rate: float, direction: str = "both") -> None:
        """Drop each packet with probability rate (0 turns loss off)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"loss rate must be in [0, 1], not {rate}")
        self._set(direction, loss=float(rate))

    def delay(self, seconds: float, direction: str = "both") -> None:
        """Hold each packet seconds before passing it on, in each named direction (so
        ``delay(d)`` adds 2*d to a round trip); order is kept; 0 turns it off."""
        if seconds < 0:
            raise ValueError(f"delay must be >= 0, not {seconds}")
        self._set(direction, delay=float(seconds))

    def corrupt(self, n: int = 1, direction: str = "both", min_payload: int = 64) -> None:
        """Alter the payload of the next n TCP packets with at least min_payload payload
        bytes, in each named direction, keeping a valid checksum (the receiver reads altered
        bytes). Replaces a count not yet used up."""
        if n < 0 or min_payload < 1:
            raise ValueError("n must be >= 0 and min_payload >= 1")
        self._set(direction, corrupt=int(n), min_payload=int(min_payload))

    def reset(self) -> None:
        """Every fault off, both ways."""
        self._set("both", cut=False, loss=0.0, delay=0.0, corrupt=0)

    def counters(self) -> dict[str, dict[str, int]]:
        """Per direction: packets forwarded, dropped, corrupted, ignored (not IPv4) and held
        (by a delay, now)."""
        return self._ask({"op": "counters"})

    def ns_popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """argv started inside the namespace (``ip netns exec`` execs it: the Popen's pid is
        argv's own process)."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], **kw)

    def _set(self, direction: str, **faults) -> None:
        self._ask({"op": "set", "direction": _direction(direction), "faults": faults})

    def _ask(self, req: dict):
        with self._lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], 10)
            line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(f"the forwarder did not answer {req} (exit code "
                               f"{self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["ok"]

    def close(self) -> None:
        """Stop the forwarder (its devices go with it), end whatever still runs in the
        namespace and delete it. Safe to call twice."""
        proc = self.proc
        if proc.poll() is None:
            with self._lock, contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write(b'{"op": "quit"}\n')
                proc.stdin.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError, ValueError):
                    f.close()
        _delete_ns(self.ns)


def _delete_ns(ns: str) -> None:
    """Kill what the tests left running in ns (started by this test, in this namespace),
    then delete it."""
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10)
    for pid in r.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


_links = itertools.count()


def _free_subnet() -> int:
    """k of a 10.231.k.0/24 that no address in this namespace uses (test_netns.py uses 77)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                         timeout=10).stdout
    used = {int(w.split(".")[2]) for w in out.split() if w.startswith("10.231.")}
    start = os.getpid() % 150
    for i in range(150):
        k = 100 + (start + i) % 150
        if k not in used:
            return k
    raise LinkUnavailable("no free 10.231.k.0/24 subnet (k in 100..249)")


def _check_host() -> None:
    if os.geteuid() != 0:
        raise LinkUnavailable("a faulty link needs root")
    if shutil.which("ip") is None:
        raise LinkUnavailable("a faulty link needs iproute2 (ip)")
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        raise LinkUnavailable("a faulty link needs /dev/net/tun")


@contextlib.contextmanager
def faulty_link(seed: int | None = None, mtu: int = 1500) -> Iterator[FaultyLink]:
    """A namespace joined to this one through a forwarder (the module docstring's picture).
    Yields a FaultyLink with no faults on; on exit the forwarder is stopped and reaped, the
    devices and the namespace are gone and nothing runs in it. Raises LinkUnavailable (or,
    under pytest, skips the test) where the host cannot make one. seed makes loss
    reproducible."""
    try:
        _check_host()
        ns = f"mpxf{os.getpid() % 100000}x{next(_links)}"
        try:
            _ip("netns", "add", ns)
        except subprocess.CalledProcessError as e:
            raise LinkUnavailable(f"cannot create a network namespace here: "
                                  f"{e.stderr.decode().strip()}") from None
    except LinkUnavailable as e:
        if "pytest" in sys.modules:
            import pytest
            pytest.skip(str(e))
        raise
    host_dev, ns_dev = f"{ns}h", f"{ns}f"
    try:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), ns, host_dev,
                                 ns_dev, "-" if seed is None else str(seed)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    except BaseException:
        _delete_ns(ns)
        raise
    link = FaultyLink(proc, ns, host_dev, ns_dev, "", "")
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        if not ready or proc.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the forwarder did not start (exit code {proc.poll()})")
        _ip("link", "set", "lo", "up", ns=ns)
        for attempt in range(5):  # another test run may take the same subnet meanwhile
            k = _free_subnet()
            leader, follower = f"10.231.{k}.1", f"10.231.{k}.2"
            try:
                _ip("addr", "add", leader, "peer", follower, "dev", host_dev)
                break
            except subprocess.CalledProcessError:
                if attempt == 4:
                    raise
        _ip("link", "set", host_dev, "mtu", str(mtu), "up")
        _ip("addr", "add", follower, "peer", leader, "dev", ns_dev, ns=ns)
        _ip("link", "set", ns_dev, "mtu", str(mtu), "up", ns=ns)
        link.leader_ip, link.follower_ip = leader, follower
        yield link
    finally:
        link.close()


if __name__ == "__main__":
    main(sys.argv[1:])
