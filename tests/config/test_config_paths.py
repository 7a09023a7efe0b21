"""Every path and address a Config holds: a bad value is refused by Config naming the field
(and its variable), whether it comes as an argument or from the environment; what can be
bound is bound before any worker starts, and a bind that fails says which field to change.
(The stats socket's own path rules, what may be at it: test_stats_socket.py.)"""

from __future__ import annotations

import socket

import _path_workers
import pytest

import mpx

LONG = "/tmp/" + "s" * 120 + ".sock"

BAD = [
    ("stats_socket", LONG, "at most 107"),
    ("stats_socket", "/nonexistent-dir-of-mpx/stats.sock", "not an existing directory"),
    ("stats_socket", "/tmp/a\0b.sock", "NUL byte"),
    ("shm_dir", "/dev/\0shm", "NUL byte"),
    ("dump_dir", "/tmp/\0dumps", "NUL byte"),
    ("host", "256.1.1.1", "not a valid IP address"),
    ("host", "10.0.0.1 172.17.0.1", "several words"),
    ("host", "", "is empty"),
    ("host", "::1::2", "not a valid IP address"),
    ("host", "bad_name!", "neither an IP address nor a valid host name"),
    ("host", "127.0.0.1\0", "NUL byte"),
    ("master_addr", "300.0.0.1", "not a valid IP address"),
    ("master_addr", "-leader", "neither an IP address nor a valid host name"),
    ("ray_address", "auto\0", "NUL byte"),
]


@pytest.mark.parametrize("field,value,why", BAD, ids=[f"{f}-{i}" for i, (f, _, _) in
                                                    enumerate(BAD)])
def test_config_refuses_a_bad_path_or_address_naming_the_field(field, value, why):
    with pytest.raises(ValueError) as ei:
        mpx.Config(**{field: value})
    text = str(ei.value)
    assert f"mpx.Config.{field}" in text and f"MPX_{field.upper()}" in text and why in text


@pytest.mark.parametrize("field,value,why", [b for b in BAD if "\0" not in b[1]])
def test_the_environment_is_refused_the_same_way(field, value, why):
    with pytest.raises(ValueError, match=f"mpx.Config.{field} .*{why}"):
        mpx.Config.from_env(environ={f"MPX_{field.upper()}": value})


@pytest.mark.parametrize("value", ["127.0.0.1", "::1", "[::1]", "localhost",
                                   "node-7.cluster.example", "10.0.0.1"])
def test_good_addresses_pass(value):
    assert mpx.Config(host=value, master_addr=value).host == value


def test_the_key_is_not_shown_when_refused():
    with pytest.raises(ValueError) as ei:
        mpx.Config(auth_key="secret\0key")
    assert "secret" not in str(ei.value) and "NUL byte" in str(ei.value)


def _no_worker_started(marks) -> bool:
    return list(marks.iterdir()) == []


@pytest.mark.parametrize("field,value,why", [BAD[0], BAD[1], BAD[5]])
def test_an_executor_with_a_bad_value_starts_no_worker(executor, tmp_path, field, value, why):
    marks = tmp_path / "marks"
    marks.mkdir()
    with pytest.raises(ValueError, match=why):
        executor(_path_workers.Marks, n=2, worker_kwargs={"marks": str(marks)},
                 **{field: value})
    assert _no_worker_started(marks)


def test_a_host_that_is_not_this_nodes_fails_at_bind_before_any_worker(executor, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    with pytest.raises(OSError) as ei:  # (192.0.2.0/24: TEST-NET-1, nobody's address)
        executor(_path_workers.Marks, n=2, worker_kwargs={"marks": str(marks)},
                 transport="zmq", host="192.0.2.1")
    text = str(ei.value)
    assert "192.0.2.1" in text and "Config.host" in text and "MPX_HOST" in text
    assert "address of this node" in text
    assert _no_worker_started(marks)


def test_a_leader_port_in_use_fails_at_bind_before_any_worker(executor, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as ei:
            executor(_path_workers.Marks, n=2, worker_kwargs={"marks": str(marks)},
                     nnodes=2, master_port=port, allow_insecure=True, startup_timeout_s=5)
    text = str(ei.value)
    assert f"127.0.0.1:{port}" in text and "MPX_MASTER_PORT" in text
    assert "another process" in text
    assert _no_worker_started(marks)

