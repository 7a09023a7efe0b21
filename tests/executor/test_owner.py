"""An executor and its futures serve only the process that created them: in a forked child
every public entry point raises NotOwnerError at once (none waits for replies the child
never reads), and the parent goes on unharmed.

The lists of entry points are read from the classes, so a public method added later is
checked too; each one's arguments are in ``EXECUTOR_USES`` / ``FUTURE_USES``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import os
import signal

import _workers
import pytest

import mpx

pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning")

# (name: how the child uses it) for every public attribute of Executor
EXECUTOR_USES = {
    "collective_rpc": lambda e: e.collective_rpc("ident", args=(1,)),
    "check_health": lambda e: e.check_health(timeout=1),
    "check_health_async": lambda e: asyncio.run(e.check_health_async(timeout=1)),
    "shutdown_async": lambda e: asyncio.run(e.shutdown_async()),
    "failure_future": lambda e: e.failure_future(),
    "wait_for_failure": lambda e: asyncio.run(asyncio.wait_for(e.wait_for_failure(), 1)),
    "dump_stacks": lambda e: e.dump_stacks(timeout=1),
    "pending_calls": lambda e: e.pending_calls(),
    "stats": lambda e: e.stats(),
    "register_restart_callback": lambda e: e.register_restart_callback(print),
    "register_failure_callback": lambda e: e.register_failure_callback(print),
    "resize": lambda e: e.resize(3, timeout=1),
    "distributed_init_method": lambda e: e.distributed_init_method,
    "world_size": lambda e: e.world_size,
    "is_failed": lambda e: e.is_failed,
    "worker_pids": lambda e: e.worker_pids,
    "shutdown": lambda e: e.shutdown(),
    "__enter__": lambda e: e.__enter__(),
}


async def _await(fut):
    return await asyncio.wait_for(fut, 1)


# (name: how the child uses it) for every public method of RPCFuture, and the ways
# concurrent.futures and asyncio reach one
FUTURE_USES = {
    "result": lambda f: f.result(timeout=1),
    "exception": lambda f: f.exception(timeout=1),
    "done": lambda f: f.done(),
    "running": lambda f: f.running(),
    "cancel": lambda f: f.cancel(),
    "cancelled": lambda f: f.cancelled(),
    "add_done_callback": lambda f: f.add_done_callback(print),
    "remove_done_callback": lambda f: f.remove_done_callback(print),
    "set_result": lambda f: f.set_result(1),
    "set_exception": lambda f: f.set_exception(ValueError()),
    "set_running_or_notify_cancel": lambda f: f.set_running_or_notify_cancel(),
    "__await__": lambda f: asyncio.run(_await(f)),
    "concurrent.futures.wait": lambda f: concurrent.futures.wait([f], timeout=1),
    "concurrent.futures.as_completed": lambda f: list(
        concurrent.futures.as_completed([f], timeout=1)),
}


def _public(cls) -> set[str]:
    return {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}


def test_the_lists_name_every_public_entry_point():
    assert _public(mpx.Executor) - {"config"} <= set(EXECUTOR_USES)
    assert _public(mpx.RPCFuture) <= set(FUTURE_USES)


def _in_child(e, futures: dict) -> dict:
    """Fork; in the child, use every entry point and report what each raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(30)  # a use that waits forever kills the child: the parent sees no report
        out = {}
        for name, use in EXECUTOR_USES.items():
            out["executor." + name] = _outcome(use, e)
        for state, fut in futures.items():
            for name, use in FUTURE_USES.items():
                out[f"{state} future.{name}"] = _outcome(use, fut)
        out["repr"] = repr(next(iter(futures.values())))
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert data, f"the child reported nothing (wait status {status}): a use hung or crashed"
    return json.loads(data)


def _outcome(use, arg) -> str:
    try:
        use(arg)
    except mpx.NotOwnerError as exc:
        return "NotOwnerError" if "forked child" in str(exc) else f"unclear: {exc}"
    except BaseException as exc:  # noqa: BLE001 (reported to the parent)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_every_entry_point_raises_not_owner_in_a_forked_child(executor):
    e = executor()
    done = e.collective_rpc("ident", args=(1,), non_block=True)
    assert done.result(timeout=10) == [1, 1]
    pending = e.collective_rpc("sleep", args=(3,), non_block=True)
    out = _in_child(e, {"pending": pending, "done": done})
    assert out.pop("repr").startswith("<RPCFuture at")
    wrong = {k: v for k, v in out.items() if v != "NotOwnerError"}
    assert not wrong
    # the parent's executor and futures are untouched
    assert pending.result(timeout=10) == [0, 1]
    assert e.collective_rpc("ident", args=(2,)) == [2, 2]
    assert e.world_size == 2 and not e.is_failed


def test_a_child_builds_an_executor_of_its_own(executor):
    """Owner checks judge the object, not the process: a forked child's own executor (and
    its futures) serve it."""
    e = executor()
    assert e.collective_rpc("ident", args=(1,)) == [1, 1]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)
        code = 1
        try:
            with mpx.Executor(_workers.Echo, 1, start_method="spawn") as own:
                fut = own.collective_rpc("ident", args=(7,), non_block=True)
                code = 0 if fut.result(timeout=30) == [7] and fut.done() else 2
        except BaseException:  # noqa: BLE001
            code = 3
        os.write(w, bytes([code]))
        os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"\x00"
