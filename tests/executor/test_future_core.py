"""RPCFuture's core (mpx/_driver/: locks, meter, core_settings, ledger, waiters,
future_core), compiled and run as plain Python from the same sources, each under
RPCFuture's own methods, in one process: the completing thread, waiters, callbacks and the
asyncio hand-off. The executor's tests run the same paths across processes with whichever
core this run imports."""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import os
import pathlib
import subprocess
import sys
import threading
import time
import types

import _builds
import _env
import pytest
from _env import IMPLS

from mpx._driver import futures as F
from mpx.errors import NotOwnerError
from mpx.protocol import wire


@pytest.fixture(params=IMPLS)
def core(request):
    """The compiled core module, or the same source run as plain Python."""
    return _builds.load_core(request.param)


class Source:
    """A stand-in for the call table: ``wait`` completes the call from another thread."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, call, timeout=None):
        self.waits += 1
        fut = call["future"]
        t = threading.Thread(target=fut.set_result, args=(call["value"],))
        t.start()
        t.join()

    def read_ready(self):
        return 0

    def lease_to_loop(self):
        pass

    def wake_background(self):
        pass


@pytest.fixture
def make(core):
    """``make(value)``: a future of that core whose call, once waited for, gives ``value``."""
    methods = {k: v for k, v in F.RPCFuture.__dict__.items()
               if k in ("_condition", "result", "exception", "set_result", "set_exception")}
    cls = type("RPCFuture", (core.FutureCore, concurrent.futures.Future), methods)
    source = Source()

    def factory(value=None):
        call = {"value": value}
        call["future"] = fut = cls(source, call, core.settings)
        return fut

    factory.source = source
    factory.core = core
    return factory


def test_a_running_future_cannot_be_cancelled_and_completes_once(make):
    f = make()
    assert f.running() and not f.done() and not f.cancelled()
    assert f.cancel() is False
    f.set_result(3)
    assert f.done() and not f.running() and f.result() == 3 and f.exception() is None
    with pytest.raises(concurrent.futures.InvalidStateError):
        f.set_result(4)
    e = make()
    e.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        e.result()
    assert isinstance(e.exception(), KeyError)


def test_callbacks_run_in_the_completing_thread_or_at_once(make):
    f = make()
    seen = []
    f.add_done_callback(lambda fut: seen.append((fut.result(), threading.get_ident())))
    f.add_done_callback(lambda fut: 1 / 0)  # logged, not raised, the others still run
    f.add_done_callback(lambda fut: seen.append("third"))
    t = threading.Thread(target=f.set_result, args=(5,))
    t.start()
    t.join()
    assert seen == [(5, t.ident), "third"]
    f.add_done_callback(lambda fut: seen.append("late"))
    assert seen[-1] == "late"


def test_result_waits_through_the_source_and_wait_as_completed_work(make):
    f = make(7)
    assert f.result(timeout=5) == 7 and make.source.waits == 1
    fs = [make(i) for i in range(5)]
    threading.Timer(0.05, lambda: [g.set_result(i) for i, g in enumerate(fs)]).start()
    done, not_done = concurrent.futures.wait(fs, timeout=5)
    assert len(done) == 5 and not not_done
    gs = [make() for _ in range(3)]
    threading.Timer(0.05, lambda: [g.set_exception(ValueError(i)) for i, g in enumerate(gs)]).start()
    assert len(list(concurrent.futures.as_completed(gs, timeout=5))) == 3


def test_a_thread_sleeping_on_the_condition_is_woken(make):
    f = make()
    got = []
    t = threading.Thread(target=lambda: got.append(
        concurrent.futures.Future.result(f, timeout=5)))
    t.start()
    time.sleep(0.05)  # asleep on the Condition built on the future's lock
    f.set_result("woken")
    t.join(5)
    assert got == ["woken"]


def test_a_future_lock_behaves_as_a_threading_lock(make):
    # (compiled, a CLock taken in C; plain, a threading.Lock: the Condition and
    # concurrent.futures' waits use acquire, release and locked)
    lock = make()._lock
    assert lock.acquire() is True and lock.locked()
    assert lock.acquire(False) is False and lock.acquire(True, 0.02) is False
    other = []
    t = threading.Thread(target=lambda: other.append(lock.acquire(timeout=5)))
    t.start()
    time.sleep(0.05)
    lock.release()  # (the waiting thread takes it)
    t.join(5)
    assert other == [True] and lock.locked()
    lock.release()  # (released by another thread than the one that took it)
    assert not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()
    with pytest.raises(ValueError):
        lock.acquire(False, 1)
    with pytest.raises(ValueError):
        lock.acquire(True, -2)
    with lock:
        assert lock.locked()
    assert not lock.locked()
    if make.core.IMPLEMENTATION == "cython":
        assert isinstance(lock, make.core.CLock)


def test_awaited_from_the_loop_and_from_other_threads(make):
    async def main():
        loop = asyncio.get_running_loop()
        delivery = F.loop_delivery(loop)
        inline = [make() for _ in range(100)]
        for i, f in enumerate(inline):
            loop.call_later(0.001, f.set_result, i)  # completed in the loop's own thread
        across = [make() for _ in range(100)]
        for i, f in enumerate(across):
            threading.Timer(0.001, f.set_result, args=(i,)).start()  # from other threads
        got = await asyncio.gather(*inline, *across)
        assert got == list(range(100)) * 2
        assert not delivery.awaiting  # every awaited future was handed over
        twice = make()
        loop.call_later(0.01, twice.set_result, "x")
        assert await asyncio.gather(twice, twice) == ["x", "x"]  # a second awaiter
        done = make()
        done.set_exception(KeyError("k"))
        with pytest.raises(KeyError):
            await done
        return delivery

    delivery = asyncio.run(main())
    assert not delivery.awaiting


def test_a_wait_for_timeout_leaves_the_future_to_finish(make):
    async def main():
        loop = asyncio.get_running_loop()
        f = make()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(f, 0.05)
        assert not f.done() and f.cancel() is False
        loop.call_soon(f.set_result, "late")  # the reply comes after all: dropped, counted
        await asyncio.sleep(0.01)
        assert f.result() == "late"
        assert not F.loop_delivery(loop).awaiting

    asyncio.run(main())


def test_awaiting_outside_a_running_loop_is_refused(make):
    with pytest.raises(RuntimeError, match="running event loop"):
        make().__await__()


def test_complete_each_sets_the_settled_futures_in_order(make):
    import collections
    order = []
    calls = collections.deque()
    for i in range(4):
        fut = make()
        fut.add_done_callback(lambda f, i=i: order.append(i))
        calls.append(types.SimpleNamespace(future=fut, value=i, error=None))
    calls[1].future.set_result("by hand")  # already set: left as it is
    order.clear()
    calls.append(types.SimpleNamespace(future=make(), value=None, error=KeyError("k")))
    done = [c.future for c in calls]
    make.core.complete_each(calls)
    assert not calls and order == [0, 2, 3]
    assert [f.result() for f in done[:4]] == [0, "by hand", 2, 3]
    assert isinstance(done[4].exception(), KeyError)


def test_call_gathers_replies_in_rank_order(core):
    before = time.monotonic()
    call = core.Call(7, "step", 3, None, None, None, core.settings)
    assert before <= call.started <= time.monotonic()  # time.monotonic's clock
    assert (call.seq, call.method, call.n_ranks, call.done) == (7, "step", 3, False)
    assert call.first_missing() == 0 and call.missing() == [0, 1, 2]
    assert call.add(1, True, "b") == core.MORE
    assert call.first_missing() == 0 and call.missing() == [0, 2]
    assert call.add(0, True, "a") == core.MORE
    assert call.first_missing() == 2
    assert call.add(2, True, None) == core.ALL_OK
    assert call.ok_value() == ["a", "b", None]
    with pytest.raises(AssertionError, match="call 7 has every reply"):
        call.first_missing()


def test_call_of_one_reply_rank_and_errors(core):
    call = core.Call(0, "step", 2, 1, None, 5.0, core.settings)
    assert call.deadline == 5.0
    call.add(0, True, None)
    assert call.add(1, True, "mine") == core.ALL_OK
    assert call.ok_value() == "mine"
    failed = core.Call(1, "step", 2, None, None, None, core.settings)
    assert failed.add(0, False, ("ValueError", "bad", "tb")) == core.MORE
    assert failed.add(1, True, 1) == core.ANSWERED
    assert failed.errors == {0: ("ValueError", "bad", "tb")} and failed.results == {1: 1}
    aggregated = core.Call(2, "step", 1, None, sum, None, core.settings)
    assert aggregated.add(0, True, [1]) == core.ANSWERED  # the table runs the aggregator


def test_call_take_records_its_own_next_replies_and_leaves_the_rest(core):
    call = core.Call(5, "step", 3, None, None, None, core.settings)
    next_reply = [5, 5, 4]
    assert call.take(0, (5, wire.OK, "a"), next_reply) == core.MORE
    assert call.take(1, (5, wire.ERR, ("E", "m", "")), next_reply) == core.MORE
    assert next_reply == [6, 6, 4] and call.missing() == [2] and call.first_missing() == 2
    # left to the table, nothing recorded: an older call's reply (call 4 timed out), a stall
    # report, what is no reply, and this call's reply after a gap (next_reply[2] is 4)
    for reply in [(4, wire.OK, "old"), (5, wire.STALL, {}), "junk", [5, wire.OK, "c"],
                  (5, wire.OK), (6, wire.OK, "next"), (5, wire.OK, "c")]:
        assert call.take(2, reply, next_reply) == core.LEAVE
    assert next_reply == [6, 6, 4] and call.missing() == [2]
    assert call.errors == {1: ("E", "m", "")} and call.results == {0: "a"}
    next_reply[2] = 5  # (the table recorded call 4's)
    assert call.take(2, (5, wire.OK, "c"), next_reply) == core.ANSWERED
    assert next_reply == [6, 6, 6] and call.results == {0: "a", 2: "c"}
    ok = core.Call(6, "step", 2, 1, None, None, core.settings)
    assert ok.take(0, (6, wire.OK, None), next_reply) == core.MORE
    assert ok.take(1, (6, wire.OK, "mine"), next_reply) == core.ALL_OK
    assert ok.ok_value() == "mine" and next_reply == [7, 7, 6]
    assert len({core.MORE, core.ALL_OK, core.ANSWERED, core.LEAVE}) == 4


def test_a_call_records_the_statuses_its_settings_name_whatever_was_imported(core):
    # (no module holds the statuses: each call is given them, and records only those)
    ok, err = object(), object()
    settings = core.CoreSettings(ok, err, NotOwnerError.of, F.loop_delivery)
    call, next_reply = core.Call(0, "m", 2, None, None, None, settings), [0, 0]
    assert call.take(0, (0, wire.OK, "wire's"), next_reply) == core.LEAVE
    assert call.take(0, (0, ok, "a"), next_reply) == core.MORE
    assert call.take(1, (0, err, ("E", "m", "")), next_reply) == core.ANSWERED
    assert call.results == {0: "a"} and call.errors == {1: ("E", "m", "")}
    assert core.in_turn((1, wire.ERR, None), 0, next_reply, settings) is None
    answered = []
    assert core.record_each([(1, ok, "b")], 0, 0, next_reply, {}, answered, settings) == 1
    assert next_reply == [2, 1] and not answered  # (call 1 is not pending: dropped)


def test_a_future_raises_its_settings_not_owner_error_in_a_forked_child(make):
    # (the error is the settings' own, whoever imported what)
    class Stranger(Exception):
        pass

    settings = make.core.CoreSettings(wire.OK, wire.ERR, lambda *a: Stranger(*a), F.loop_delivery)
    fut = type(make())(make.source, {}, settings)
    pid = os.fork()
    if pid == 0:  # (the child: exits with what it saw)
        try:
            fut.done()
        except Stranger as e:
            os._exit(0 if e.args[1:] == (os.getppid(), os.getpid()) else 2)
        except BaseException:
            os._exit(3)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not fut.done()


def test_the_core_chooses_its_build_only_where_it_imports():
    # (no `if cython.compiled:` in any module's logic: a module-level `if` of imports alone
    # picks the C or the Python primitives and the others' types, and IMPLEMENTATION names
    # the build; the rest is one source)
    folder = pathlib.Path(F.__file__).parent
    for name in _builds.CORE_MODULES + ("primitives",):
        tree = ast.parse((folder / f"{name}.py").read_text())
        allowed = set()
        for node in tree.body:
            if isinstance(node, ast.If) and all(isinstance(n, (ast.Import, ast.ImportFrom))
                                                for n in node.body + node.orelse):
                allowed.add(id(node.test))
            elif isinstance(node, ast.Assign) and \
                    [t.id for t in node.targets if isinstance(t, ast.Name)] == ["IMPLEMENTATION"]:
                allowed.update(id(n) for n in ast.walk(node.value))
        found = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "compiled"
                 and isinstance(n.value, ast.Name) and n.value.id == "cython"]
        assert all(id(n) in allowed for n in found), \
            (name, [n.lineno for n in found if id(n) not in allowed])


def test_the_states_are_concurrent_futures_own():
    # (concurrent.futures' Future compares _state with these: wait, as_completed, repr)
    from concurrent.futures import _base
    for impl in IMPLS:
        core = _builds.load_core(impl)
        assert (core.RUNNING, core.FINISHED) == (_base.RUNNING, _base.FINISHED)


def test_the_plain_core_runs_from_its_source_without_cython(tmp_path):
    # MPX_PURE_PYTHON=1 with the extension built beside the .py, and Cython not importable
    # (a build dependency only): the .py itself runs, and a call goes through it
    code = (
        "import sys\n"
        "sys.modules['cython'] = None  # (import cython fails)\n"
        "import mpx, mpx._impl\n"
        "import importlib\n"
        f"for name in {_builds.CORE_MODULES!r}:\n"
        "    core = importlib.import_module('mpx._driver.' + name)\n"
        "    assert core.IMPLEMENTATION == 'python' and core.__file__.endswith(name + '.py')\n"
        "from _workers import Echo\n"
        "ex = mpx.Executor(Echo, world_size=2, start_method='spawn')\n"
        "try:\n"
        "    assert ex.collective_rpc('ident', args=(1,)) == [1, 1]\n"
        "    assert ex.collective_rpc('ident', args=(2,), non_block=True).result(30) == [2, 2]\n"
        "finally:\n"
        "    ex.shutdown()\n"
        "print('ok', 'cython' in sys.modules and sys.modules['cython'] is None)\n")
    tests = _env.TESTS
    root = os.path.dirname(tests)
    env = dict(os.environ, MPX_PURE_PYTHON="1",
               PYTHONPATH=os.pathsep.join([root, tests, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "True"]


def test_call_outcome(core):
    call = core.Call(0, "step", 1, None, None, None, core.settings)
    call.value, call.done = 42, True
    assert call.outcome() == 42
    call.error = KeyError("gone")
    with pytest.raises(KeyError, match="gone"):
        call.outcome()


def test_record_each_records_a_batch_and_stops_at_what_is_not_a_call_reply(core):
    calls = {s: core.Call(s, "step", 2, None, None, None, core.settings) for s in (3, 4, 5)}
    calls[3].add(0, True, "a3")
    calls[4].add(0, False, ("E", "m", ""))
    pending, next_reply, answered = dict(calls), [6, 2], []
    replies = [(2, wire.OK, "late"), (3, wire.OK, "b3"), (4, wire.OK, "b4"),
               (5, wire.STALL, {}), (5, wire.OK, "b5"), (7, wire.OK, "after a gap")]
    # call 2 timed out (not pending): its reply is dropped; calls 3 and 4 are answered
    assert core.record_each(replies, 0, 1, next_reply, pending, answered, core.settings) == 3
    assert answered == [calls[3], calls[4]] and next_reply == [6, 5]
    assert calls[3].results == {0: "a3", 1: "b3"} and calls[4].errors == {0: ("E", "m", "")}
    # the stall report is the table's; then call 5's reply; then a gap (6 is owed): the table's
    assert core.record_each(replies, 4, 1, next_reply, pending, answered, core.settings) == 5
    assert next_reply == [6, 6] and calls[5].results == {1: "b5"}  # rank 0 still missing
    assert answered == [calls[3], calls[4]]


def test_in_turn_is_the_one_test_and_advance_of_every_recorded_reply(core):
    next_reply = [4, 9]
    assert core.in_turn((4, wire.OK, "r"), 0, next_reply, core.settings) == 4 and next_reply == [5, 9]
    for out_of_turn in [(6, wire.OK, "r"), (4, wire.OK, "r"), (5, wire.STALL, {}),
                        (5, "no such status", None), ["not", "a", "tuple"], (5, wire.OK)]:
        assert core.in_turn(out_of_turn, 0, next_reply, core.settings) is None, out_of_turn
        assert next_reply == [5, 9]  # nothing changed
    call = core.Call(5, "m", 2, None, None, None, core.settings)
    assert call.take(0, (5, wire.ERR, ("E", "m", "")), next_reply) == core.MORE
    assert next_reply == [6, 9]
    assert call.take(1, (5, wire.OK, "x"), next_reply) == core.LEAVE  # (rank 1 owes 9)
    assert next_reply == [6, 9] and call.missing() == [1]


def test_settle_ok_settles_in_order_and_stops_where_the_table_must_finish(core):
    import collections
    done_already = core.Call(1, "step", 1, None, None, None, core.settings)
    done_already.done = True  # (a timeout settled it first)
    ok = core.Call(2, "step", 1, 0, None, 9.0, core.settings)
    ok.future = "a future"
    failed = core.Call(3, "step", 1, None, None, None, core.settings)
    later = core.Call(4, "step", 1, None, None, None, core.settings)
    ok.add(0, True, "r")
    failed.add(0, False, ("E", "m", ""))
    later.add(0, True, "s")
    calls = [done_already, ok, failed, later]
    pending, completed = {c.seq: c for c in calls[1:]}, collections.deque()
    assert core.settle_ok(calls, 0, pending, completed) == (2, 1, 1)
    assert ok.done and ok.value == "r" and list(completed) == [ok] and 2 not in pending
    assert not failed.done and 3 in pending  # the table's _finish settles it
    assert core.settle_ok(calls, 3, pending, completed) == (4, 0, 0)
    assert later.done and later.value == ["s"] and pending == {3: failed}
    assert list(completed) == [ok]  # no future: nothing to complete


def test_a_task_awaiting_a_future_is_cancelled_at_once_and_the_late_reply_dropped(make):
    async def main():
        loop = asyncio.get_running_loop()
        f = make()
        caught = []

        async def awaiting():
            try:
                await f
            except asyncio.CancelledError as e:
                caught.append(e.args)
                raise

        task = asyncio.ensure_future(awaiting())
        await asyncio.sleep(0)  # the task waits on the future
        task.cancel("stop")
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)  # (not the call's end: it never comes)
        assert caught == [("stop",)] and not f.done()
        f.set_result("late")  # in the loop's thread: dropped, the count handed over
        await asyncio.sleep(0)
        assert F.loop_delivery(loop).awaiting == {}
        assert f.result() == "late"

    asyncio.run(main())


def test_tasks_resume_in_their_own_context_in_the_order_their_futures_completed(make):
    import contextvars
    var = contextvars.ContextVar("var")

    async def main():
        loop = asyncio.get_running_loop()
        fs = [make() for _ in range(10)]
        order = []

        async def awaiting(i):
            var.set(i)
            got = await fs[i]
            order.append((got, var.get()))

        tasks = [asyncio.ensure_future(awaiting(i)) for i in range(10)]
        await asyncio.sleep(0)
        loop.call_soon(lambda: [fs[i].set_result(i) for i in (3, 1, 4, 0, 2, 9, 5, 8, 7, 6)])
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == [(i, i) for i in (3, 1, 4, 0, 2, 9, 5, 8, 7, 6)]


def test_a_waiter_reports_a_failing_callback_and_runs_the_others(core):
    async def main():
        loop = asyncio.get_running_loop()
        reported, ran = [], []
        loop.set_exception_handler(lambda lp, context: reported.append(context["exception"]))
        waiter = core.Waiter(loop, core.LoopWakeups())
        assert asyncio.isfuture(waiter) and waiter.get_loop() is loop and not waiter.done()
        with pytest.raises(asyncio.InvalidStateError):
            waiter.result()
        waiter.add_done_callback(lambda w: 1 / 0)
        waiter.add_done_callback(lambda w: ran.append(w.result()))
        waiter.add_done_callback(print)
        assert waiter.remove_done_callback(print) == 1
        waiter.set_result(7)
        with pytest.raises(asyncio.InvalidStateError):
            waiter.set_result(8)
        assert not waiter.cancel()
        await asyncio.sleep(0)
        assert ran == [7] and len(reported) == 1 and isinstance(reported[0], ZeroDivisionError)
        waiter.add_done_callback(lambda w: ran.append("late"))  # done: runs soon
        await asyncio.sleep(0)
        assert ran == [7, "late"]
        cancelled = core.Waiter(loop, core.LoopWakeups())
        assert cancelled.cancel("why") and cancelled.cancelled()
        with pytest.raises(asyncio.CancelledError, match="why"):
            cancelled.result()

    asyncio.run(main())


def test_loops_in_two_threads_each_get_their_own_futures(make):
    results, errors = {}, []

    def run(name):
        async def main():
            loop = asyncio.get_running_loop()
            fs = [make() for _ in range(20)]
            for i, f in enumerate(fs):
                if i % 2:
                    loop.call_soon(f.set_result, (name, i))  # in this loop's thread
                else:
                    threading.Timer(0.001, f.set_result, args=((name, i),)).start()
            return await asyncio.gather(*fs)

        try:
            results[name] = asyncio.run(asyncio.wait_for(main(), 10))
        except BaseException as e:  # (reported by the assertion below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and {n: [i for _, i in r] for n, r in results.items()} == \
        {"a": list(range(20)), "b": list(range(20))}
    assert all(n == name for name, r in results.items() for n, _ in r)


def test_the_baton_is_held_by_one_thread_and_never_taken_twice(core):
    baton = core.Baton()
    assert not baton.locked() and not baton.held() and baton.holder is None
    assert baton.take()
    assert baton.locked() and baton.held() and baton.holder == threading.get_ident()
    assert not baton.take() and not baton.take(0.05)  # (this thread holds it)
    seen = []

    def other():
        seen.append((baton.take(), baton.take(0.05), baton.held(), baton.let_go()))
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [(False, False, False, False)]  # (held elsewhere: not its to let go)
    assert baton.let_go() and not baton.let_go()
    assert not baton.locked() and baton.holder is None


def test_a_timed_take_waits_for_the_holder_and_an_interrupt_ends_it(core):
    import signal
    baton = core.Baton()
    taken, leave = threading.Event(), threading.Event()

    def hold():
        baton.take()
        taken.set()
        leave.wait(10)
        baton.let_go()
    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(10)
    try:
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            baton.take(10)
        assert time.monotonic() - t0 < 5 and not baton.held()
        assert not baton.take(0.05)  # (still held there)
        threading.Timer(0.1, leave.set).start()
        assert baton.take(10) and baton.held()  # (waits for the holder to let go)
        assert baton.let_go()
    finally:
        leave.set()
        holder.join(10)


def test_the_ledger_keeps_pending_and_its_counters_in_step(core):
    ledger = core.Ledger()
    plain = core.Call(0, "a", 1, None, None, None, core.settings)
    timed = core.Call(1, "b", 1, None, None, time.monotonic() + 60, core.settings)
    held = core.Call(2, "c", 1, None, None, None, core.settings)
    held.future = object()
    for call in (plain, timed, held):
        assert ledger.register(call)
    assert list(ledger.pending) == [0, 1, 2]
    assert (ledger.with_deadline, ledger.outstanding) == (1, 1)
    assert ledger.settle(timed, "v", None) and not ledger.settle(timed, "w", None)
    assert timed.done and timed.value == "v" and ledger.with_deadline == 0
    assert list(ledger.completed) == []  # (no future: nothing to set)
    err = KeyError("x")
    assert ledger.settle(held, None, err) and held.error is err and ledger.outstanding == 0
    assert list(ledger.completed) == [held]
    ledger.forget(plain)
    assert plain.done and plain.value is None and not ledger.pending
    ledger.open = False  # (the table stopped: no call registers)
    late = core.Call(3, "d", 1, None, None, None, core.settings)
    assert not ledger.register(late) and not ledger.pending


def test_the_ledger_settles_a_batch_until_a_call_needs_the_table(core):
    ledger = core.Ledger()
    calls = [core.Call(i, "m", 1, None, None, time.monotonic() + 60, core.settings)
             for i in range(4)]
    calls[1].future = object()
    for c in calls:
        ledger.register(c)
        assert c.add(0, True, c.seq * 10) == core.ALL_OK
    calls[3].add(0, False, ("E", "boom", ""))  # (an error reply: the table's to settle)
    assert ledger.settle_ok(calls, 0) == 3
    assert [c.done for c in calls] == [True, True, True, False]
    assert [c.value for c in calls[:3]] == [[0], [10], [20]]
    assert list(ledger.pending) == [3] and list(ledger.completed) == [calls[1]]
    assert (ledger.with_deadline, ledger.outstanding) == (1, 0)


def test_the_compiled_table_lock_is_entered_with_with_and_an_interrupt_ends_its_wait():
    import signal
    if "cython" not in IMPLS:
        pytest.skip("extension not built")
    core = _builds.load_core("cython")
    lock = core.Ledger().lock
    assert isinstance(lock, core.CLock)
    with lock:
        pass
    taken, leave = threading.Event(), threading.Event()

    def hold():
        with lock:
            taken.set()
            leave.wait(10)
    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(10)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            with lock:
                pytest.fail("entered a lock another thread holds")
        assert time.monotonic() - t0 < 5
        threading.Timer(0.1, leave.set).start()
        with lock:  # (waits for the holder)
            assert not holder.is_alive() or leave.is_set()
    finally:
        leave.set()
        holder.join(10)
    with pytest.raises(TypeError, match="compiled"):
        _builds.load_core("python").CLock()
