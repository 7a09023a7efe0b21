"""mpx.Config, in process: defaults, MPX_* variables, explicit arguments, and a clear error
naming the field and its variable for every bad value."""

from __future__ import annotations

import dataclasses
import math

import pytest

import mpx
from mpx.config import WATCHDOG_MIN_S


def test_defaults_then_environment_then_arguments():
    env = {"MPX_MAX_CHUNKS": "8", "MPX_ASYNC_OUTPUT": "yes", "MPX_SHUTDOWN_GRACE_S": "1.5",
           "MPX_TRANSPORT": "zmq", "MPX_MASTER_PORT": "0x7000"}
    cfg = mpx.Config.from_env(env, max_chunks=4, heartbeat_s=None)
    assert cfg.max_chunks == 4  # the argument wins; None means unset
    assert cfg.async_output is True and cfg.shutdown_grace_s == 1.5
    assert cfg.transport == "zmq" and cfg.master_port == 0x7000
    assert cfg.heartbeat_s == mpx.Config().heartbeat_s
    assert mpx.Config.from_env({}) == mpx.Config()


def test_an_int_for_a_float_field_is_taken():
    cfg = mpx.Config(shutdown_grace_s=2)
    assert cfg.shutdown_grace_s == 2.0 and isinstance(cfg.shutdown_grace_s, float)


@pytest.mark.parametrize("field,value,says", [
    ("startup_timeout_s", math.nan, "finite"),
    ("shutdown_grace_s", math.inf, "finite"),
    ("terminate_grace_s", -1.0, "must be in"),
    ("watchdog_timeout_s", math.inf, "finite"),
    ("watchdog_timeout_s", 1e-6, "at least"),
    ("nnodes", 0, "must be in"),
    ("spin_us", 99999999999, "burns a core"),
    ("yield_us", -1, "must be in"),
    ("max_chunk_bytes", 100, "multiple of 64"),
    ("max_chunks", 0, "must be in"),
    ("heartbeat_s", 0.0, "must be in"),
    ("master_port", 70000, "must be in"),
    ("max_chunks", "4", "must be a int"),
    ("async_output", "no", "must be a bool"),
    ("start_method", "thread", "one of fork, spawn, forkserver"),
    ("transport", "tcp", "one of auto, zmq, shm"),
    ("relay", "sometimes", "auto, on or off"),
])
def test_bad_values_name_the_field_and_variable(field, value, says):
    with pytest.raises(ValueError) as ei:
        mpx.Config(**{field: value})
    text = str(ei.value)
    assert f"mpx.Config.{field}" in text and f"MPX_{field.upper()}" in text and says in text


@pytest.mark.parametrize("var,raw", [("MPX_STARTUP_TIMEOUT_S", "nan"),
                                     ("MPX_SHUTDOWN_GRACE_S", "inf"),
                                     ("MPX_WATCHDOG_TIMEOUT_S", "inf"),
                                     ("MPX_NNODES", "0"),
                                     ("MPX_SPIN_US", "99999999999"),
                                     ("MPX_MAX_CHUNKS", "many")])
def test_bad_environment_values_fail_at_once_naming_the_variable(var, raw):
    with pytest.raises(ValueError, match=var):
        mpx.Config.from_env({var: raw})


def test_the_watchdog_floor_and_off():
    assert mpx.Config(watchdog_timeout_s=0).watchdog_timeout_s == 0
    assert mpx.Config(watchdog_timeout_s=WATCHDOG_MIN_S).watchdog_timeout_s == WATCHDOG_MIN_S


def test_unknown_fields_are_refused():
    with pytest.raises(TypeError, match="nope"):
        mpx.Config.from_env({}, nope=1)


def test_an_executor_with_a_bad_override_starts_no_worker():
    with pytest.raises(ValueError, match="MPX_SHUTDOWN_GRACE_S"):
        mpx.Executor(object, 1, shutdown_grace_s=math.inf)


def test_describe_hides_the_key():
    cfg = dataclasses.replace(mpx.Config(), auth_key="secret")
    assert "secret" not in cfg.describe() and "auth_key=<set>" in cfg.describe()


def test_repr_hides_the_key():
    cfg = dataclasses.replace(mpx.Config(), auth_key="secret")
    assert "secret" not in repr(cfg) and "secret" not in str(cfg)
