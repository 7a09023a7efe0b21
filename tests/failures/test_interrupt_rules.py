"""The locking rules that keep an interrupt (Ctrl-C's KeyboardInterrupt, raised in the main
thread after any call returns) from leaving a lock held, checked on mpx's source (the rules:
mpx/_driver/pump.py's docstring; the storm itself: test_driver_rules.py's Ctrl-C storm).

- No lock is taken with a bare ``lock.acquire()`` (or ``lock_enter(lock)``) statement (the
  ``try`` that would release it starts after a point where an interrupt can land); ``with
  lock:`` enters a C lock with no such point. One exception, by design: a compiled module
  of one source (a ``.py`` with its ``.pxd``: the shared-memory end, the futures core) takes
  its hot locks with the statement directly followed by the ``try`` whose ``finally``
  releases them, because compiled no Python runs between the two (``with`` on a cdef class
  costs ~65 ns a section, measured). Its pure-Python build keeps that instant, as any
  ``acquire()`` in Python does: a Ctrl-C landing exactly there leaves the lock held.
- No ``with`` on a threading.Condition: its ``__enter__`` is Python, and an interrupt at its
  inner call leaves the lock held. The Condition's own lock is entered instead.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "mpx"
FILES = sorted(p for p in SRC.rglob("*.py"))


def _conditions(tree: ast.AST) -> set[str]:
    """The attribute and variable names assigned a threading.Condition(...) in ``tree``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f = node.value.func
            if isinstance(f, ast.Attribute) and f.attr == "Condition" or \
                    isinstance(f, ast.Name) and f.id == "Condition":
                for t in node.targets:
                    if isinstance(t, ast.Attribute):
                        names.add(t.attr)
                    elif isinstance(t, ast.Name):
                        names.add(t.id)
    return names


def _name(expr: ast.AST) -> str | None:
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Name):
        return expr.id
    return None


def _takes_a_lock(call: ast.AST) -> bool:
    """``x.acquire()`` or ``lock_enter(x)``."""
    if not isinstance(call, ast.Call):
        return False
    f = call.func
    return isinstance(f, ast.Attribute) and f.attr == "acquire" or \
        isinstance(f, ast.Name) and f.id == "lock_enter"


def _taken_before_their_try(tree: ast.AST) -> set[int]:
    """The lines of lock takings directly followed by a ``try`` whose ``finally`` gives
    that lock back (``x.release()`` or ``lock_exit(x)``)."""
    lines = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt, after in zip(body, body[1:]):
            if not (isinstance(stmt, ast.Expr) and _takes_a_lock(stmt.value)
                    and isinstance(after, ast.Try) and after.finalbody):
                continue
            call = stmt.value
            lock = ast.dump(call.func.value if isinstance(call.func, ast.Attribute)
                            else call.args[0])
            for fin in after.finalbody:
                c = fin.value if isinstance(fin, ast.Expr) else None
                if isinstance(c, ast.Call) and (
                        isinstance(c.func, ast.Attribute) and c.func.attr == "release" and
                        ast.dump(c.func.value) == lock or
                        isinstance(c.func, ast.Name) and c.func.id == "lock_exit" and
                        ast.dump(c.args[0]) == lock):
                    lines.add(stmt.lineno)
    return lines


def test_the_rule_sees_a_lock_taken_outside_its_try():
    bare = ast.parse("def f(lock):\n    lock.acquire()\n    x = 1\n    try:\n        pass\n"
                     "    finally:\n        lock.release()\n")
    paired = ast.parse("def f(lock):\n    lock_enter(lock)\n    try:\n        pass\n"
                       "    finally:\n        lock_exit(lock)\n")
    other = ast.parse("def f(a, b):\n    a.acquire()\n    try:\n        pass\n"
                      "    finally:\n        b.release()\n")
    assert _taken_before_their_try(bare) == set()
    assert _taken_before_their_try(paired) == {2}
    assert _taken_before_their_try(other) == set()


def test_the_source_is_found():
    assert any(p.name == "pump.py" for p in FILES) and len(FILES) > 20


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_lock_is_taken_where_an_interrupt_can_leave_it_held(path):
    tree = ast.parse(path.read_text(), str(path))
    conditions = _conditions(tree)
    bad = []
    compiled = path.with_suffix(".pxd").exists()
    guarded = _taken_before_their_try(tree) if compiled else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and _takes_a_lock(node.value) and \
                node.lineno not in guarded:
            bad.append(f"line {node.lineno}: a bare lock taking (use `with`)")
        if isinstance(node, ast.With):
            for item in node.items:
                if _name(item.context_expr) in conditions:
                    bad.append(f"line {node.lineno}: `with` on the Condition "
                               f"{_name(item.context_expr)!r} (enter its lock)")
    assert not bad, f"{path.relative_to(SRC)}: " + "; ".join(bad)
