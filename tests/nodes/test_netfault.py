"""The faulty link of tests/_netfault.py, over real sockets: a TCP echo server in the
namespace and its client here. Then a 2-node mpx group across the link. Needs root,
iproute2 and /dev/net/tun (skipped otherwise)."""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time

import _workers
import pytest
from _netfault import faulty_link
from _nodes import group_across

ECHO = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen()
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := c.recv(65536):
    c.sendall(data)
"""


@pytest.fixture
def link():
    with faulty_link(seed=1) as made:
        yield made


@contextlib.contextmanager
def echo(link):
    """A TCP connection from here to an echo server in the link's namespace."""
    server = link.ns_popen([sys.executable, "-c", ECHO, link.follower_ip],
                           stdout=subprocess.PIPE)
    try:
        port = int(server.stdout.readline())
        with socket.create_connection((link.follower_ip, port), timeout=10) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            yield conn
        assert server.wait(5) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()


def recv_exactly(conn, n):
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        assert chunk, "the connection closed"
        out += chunk
    return bytes(out)


def round_trips(conn, n=10):
    """The median of n round trips of one byte."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.sendall(b"x")
        assert recv_exactly(conn, 1) == b"x"
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def test_bytes_cross_both_ways_with_little_overhead(link):
    data = os.urandom(300_000)
    with echo(link) as conn:
        conn.sendall(data)
        assert recv_exactly(conn, len(data)) == data
        assert round_trips(conn, 50) < 0.001
    counts = link.counters()
    assert counts["to_follower"]["forwarded"] > 200 and counts["to_leader"]["forwarded"] > 200
    assert all(c["dropped"] == c["corrupted"] == 0 for c in counts.values())


def test_partition_holds_bytes_until_it_heals_on_the_same_connection(link):
    with echo(link) as conn:
        assert round_trips(conn, 3) < 0.01
        link.partition(True)
        conn.sendall(b"p" * 1000)
        conn.settimeout(0.5)
        with pytest.raises(socket.timeout):
            conn.recv(1)
        link.partition(False)
        healed = time.monotonic()
        conn.settimeout(10)
        assert recv_exactly(conn, 1000) == b"p" * 1000  # no reset: TCP retransmitted
        backoff = time.monotonic() - healed
        # measured: sent at 0, a tail loss probe at ~0.21 s, retransmissions at ~0.42 s and
        # ~0.85 s: delivered ~0.35 s after the heal
        assert backoff < 3.0, backoff
        print(f"delivered {backoff * 1000:.0f} ms after a 0.5 s partition healed")
    assert link.counters()["to_follower"]["dropped"] >= 2  # the send and a retransmission


def test_one_way_partition(link):
    with echo(link) as conn:
        link.partition(True, direction="to_leader")
        conn.sendall(b"q" * 100)
        conn.settimeout(0.3)
        with pytest.raises(socket.timeout):
            conn.recv(1)
        counts = link.counters()
        assert counts["to_follower"]["forwarded"] > 0 and counts["to_leader"]["dropped"] > 0
        link.partition(False, direction="to_leader")
        conn.settimeout(10)
        assert recv_exactly(conn, 100) == b"q" * 100


def test_corrupt_delivers_altered_bytes_on_a_live_connection(link):
    sent = bytes(range(256)) * 4
    with echo(link) as conn:
        link.corrupt(1, direction="to_follower")
        conn.sendall(sent)
        got = recv_exactly(conn, len(sent))
        # TCP took the segment (a bad checksum would have been dropped and resent intact)
        assert got != sent
        assert sum(a != b for a, b in zip(got, sent)) == 1
        conn.sendall(sent)
        assert recv_exactly(conn, len(sent)) == sent  # used up; the connection is fine
    counts = link.counters()
    assert counts["to_follower"]["corrupted"] == 1 and counts["to_leader"]["corrupted"] == 0


def test_corrupt_skips_packets_without_enough_payload(link):
    with echo(link) as conn:
        link.corrupt(1, direction="to_leader", min_payload=64)
        conn.sendall(b"s" * 63)
        assert recv_exactly(conn, 63) == b"s" * 63
        conn.sendall(b"l" * 64)
        assert recv_exactly(conn, 64) != b"l" * 64


def test_delay_adds_to_the_round_trip(link):
    with echo(link) as conn:
        base = round_trips(conn, 10)
        link.delay(0.025)  # each way
        both = round_trips(conn, 5) - base
        link.delay(0.05, direction="to_follower")
        link.delay(0.0, direction="to_leader")
        one = round_trips(conn, 5) - base
        link.delay(0.0)
        after = round_trips(conn, 5)
    assert 0.045 < both < 0.1, both
    assert 0.045 < one < 0.1, one
    assert after < base + 0.005


def test_loss_drops_packets_and_tcp_recovers(link):
    data = os.urandom(100_000)
    with echo(link) as conn:
        link.loss(0.1)
        conn.sendall(data)
        assert recv_exactly(conn, len(data)) == data
    counts = link.counters()
    assert counts["to_follower"]["dropped"] + counts["to_leader"]["dropped"] > 0


def test_exit_leaves_no_namespace_device_or_process():
    with faulty_link() as made:
        forwarder = made.proc
        stray = made.ns_popen(["sleep", "60"])  # left running on purpose: close kills it
        ns, dev = made.ns, made.host_dev
        assert ns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                    text=True).stdout
    stray.wait(5)
    assert forwarder.returncode == 0
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                    text=True).stdout
    assert subprocess.run(["ip", "link", "show", dev], capture_output=True).returncode != 0


def test_a_two_node_group_across_a_delayed_link(link):
    link.delay(0.005)
    with group_across(link) as (ex, follower):
        where = ex.collective_rpc(_workers.where)
        assert [w[:3] for w in where] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
        t0 = time.monotonic()
        assert ex.collective_rpc("mul", args=(3,)) == [3, 6, 9, 12]
        assert time.monotonic() - t0 >= 0.01  # the remote ranks' replies crossed the delay
        futs = [ex.collective_rpc("ident", args=(i,), non_block=True) for i in range(10)]
        assert [f.result(timeout=10) for f in futs] == [[i] * 4 for i in range(10)]
        blob = os.urandom(200_000)
        assert ex.collective_rpc("ident", args=(blob,)) == [blob] * 4
        ex.shutdown()
        assert follower.wait(10) == 0
