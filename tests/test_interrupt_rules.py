"""The locking rules that keep an interrupt (Ctrl-C's KeyboardInterrupt, raised in the main
thread after any call returns) from leaving a lock held, checked on mpx's source (the rules:
mpx/_driver/pump.py's docstring; the storm itself: test_driver_rules.py's Ctrl-C storm).

- No lock is taken with a bare ``lock.acquire()`` statement (the ``try`` that would release
  it starts after a point where an interrupt can land); ``with lock:`` enters a C lock with
  no such point.
- No ``with`` on a threading.Condition: its ``__enter__`` is Python, and an interrupt at its
  inner call leaves the lock held. The Condition's own lock is entered instead.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "mpx"
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


def test_the_source_is_found():
    assert any(p.name == "pump.py" for p in FILES) and len(FILES) > 20


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_lock_is_taken_where_an_interrupt_can_leave_it_held(path):
    tree = ast.parse(path.read_text(), str(path))
    conditions = _conditions(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            if isinstance(f, ast.Attribute) and f.attr == "acquire":
                bad.append(f"line {node.lineno}: a bare .acquire() (use `with`)")
        if isinstance(node, ast.With):
            for item in node.items:
                if _name(item.context_expr) in conditions:
                    bad.append(f"line {node.lineno}: `with` on the Condition "
                               f"{_name(item.context_expr)!r} (enter its lock)")
    assert not bad, f"{path.relative_to(SRC)}: " + "; ".join(bad)
