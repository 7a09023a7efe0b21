"""The driver's lock ranks (mpx/_driver/lockorder.py): the checked lock refuses an acquire
out of order and records it, allows the right order, a re-entrant lock's own re-entry and
a Condition's wait; every lock the driver makes has a rank of the table."""

from __future__ import annotations

import ast
import pathlib
import threading

import pytest

from mpx._driver import lockorder
from mpx._driver.lockorder import CheckedLock, LockOrderError

DRIVER = pathlib.Path(lockorder.__file__).parent


@pytest.fixture(autouse=True)
def _no_leftover_violations():
    before = list(lockorder.violations)
    yield
    del lockorder.violations[len(before):]


def test_the_right_order_passes_and_the_wrong_one_is_refused_and_recorded():
    outer = CheckedLock("outer", lockorder.MEMBERSHIP)
    inner = CheckedLock("inner", lockorder.ORDER)
    with outer, inner:
        pass
    n = len(lockorder.violations)
    with inner:
        with pytest.raises(LockOrderError, match="outer .* taken while holding inner"):
            outer.acquire()
        assert not outer.locked()  # (refused before it was taken)
    assert len(lockorder.violations) == n + 1
    with outer:  # both usable afterwards: nothing was left held
        pass


def test_the_same_rank_twice_is_refused():
    a, b = CheckedLock("a", lockorder.LEAF), CheckedLock("b", lockorder.LEAF)
    with a:
        with pytest.raises(LockOrderError):
            b.acquire()


def test_a_try_acquire_is_never_refused():
    outer = CheckedLock("outer", lockorder.REGROUP)
    inner = CheckedLock("inner", lockorder.TURN)
    with inner:
        assert outer.acquire(blocking=False)  # (cannot wait: cannot deadlock)
        outer.release()


def test_a_reentrant_lock_may_be_taken_again_by_its_holder():
    members = CheckedLock("members", lockorder.MEMBERSHIP, reentrant=True)
    order = CheckedLock("order", lockorder.ORDER)
    with members, order, members:  # (a snapshot inside a swap, say)
        pass


def test_a_condition_over_a_checked_lock_waits_and_wakes():
    lk = CheckedLock("turn", lockorder.TURN)
    cv = threading.Condition(lk)
    woke = []

    def waiter():
        with lk:
            woke.append(cv.wait(5))

    t = threading.Thread(target=waiter)
    t.start()
    while not lk.acquire(blocking=False) or not t.is_alive():
        pass
    cv.notify_all()
    lk.release()
    t.join(5)
    assert woke == [True]


def test_the_checks_are_off_unless_asked_for():
    if lockorder.CHECK:
        pytest.skip("this run checks lock order (MPX_CHECK_LOCKS)")
    assert type(lockorder.lock("x", 1)) is type(threading.Lock())


def _lock_ranks(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, rank expression) of each lockorder.lock/rlock call in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "lockorder" \
                and node.func.attr in ("lock", "rlock"):
            out.append((node.lineno, ast.unparse(node.args[1])))
    return out


def test_every_driver_lock_has_a_rank_of_the_table():
    ranks = {name for name in vars(lockorder) if name.isupper() and
             isinstance(getattr(lockorder, name), int) and name != "CHECK"}
    found = [(p.name, line, rank) for p in sorted(DRIVER.glob("*.py"))
             for line, rank in _lock_ranks(p)]
    assert len(found) >= 8, found
    for name, line, rank in found:
        assert rank.startswith("lockorder.") and rank.split(".")[1] in ranks, (name, line, rank)
    plain = [(p.name, n.lineno) for p in sorted(DRIVER.glob("*.py")) if p.name not in
             ("lockorder.py", "futures.py", "future_core.py")
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and
             n.func.attr in ("Lock", "RLock") and isinstance(n.func.value, ast.Name) and
             n.func.value.id == "threading"]
    assert not plain, f"driver locks made without a rank: {plain}"
