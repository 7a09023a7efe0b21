"""One way to compile: every module that Cython compiles from a ``.py`` (a ``.pxd`` beside
it; mpx/_impl.py's one-source modules) is one source for both builds. ``cython.compiled``
appears in it only to choose its primitives once, where they are imported (a top-level
``if cython.compiled:`` of imports alone: the ``.pxd``'s C or the ``.py``'s plain
versions), and in its ``IMPLEMENTATION``; never in its logic. The ring, the one deliberate
twin, is ``_ring.pyx`` and ``_ring_py.py``. Parsed, never imported."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "mpx"
ONE_SOURCE = sorted(p for p in ROOT.rglob("*.py") if p.with_suffix(".pxd").exists()
                    and p.with_suffix(".pxd").read_text().strip())


def _is_compiled(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "compiled" and \
        isinstance(node.value, ast.Name) and node.value.id == "cython"


def _uses_outside_the_import_choice(tree: ast.Module) -> list[int]:
    """The lines where ``cython.compiled`` is read other than as allowed."""
    allowed: set[int] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.If) and _is_compiled(stmt.test) and all(
                isinstance(s, (ast.Import, ast.ImportFrom)) for s in stmt.body + stmt.orelse):
            allowed.add(id(stmt.test))
        if isinstance(stmt, ast.Assign) and [getattr(t, "id", None) for t in stmt.targets] == \
                ["IMPLEMENTATION"] and isinstance(stmt.value, ast.IfExp) and \
                _is_compiled(stmt.value.test):
            allowed.add(id(stmt.value.test))
    return sorted(n.lineno for n in ast.walk(tree) if _is_compiled(n) and id(n) not in allowed)


def test_the_one_source_modules_are_found():
    names = {str(p.relative_to(ROOT)) for p in ONE_SOURCE}
    assert {"mechanism/codec.py", "mechanism/waiting.py", "transport/shm_end.py",
            "_driver/future_core.py", "_driver/ledger.py", "_driver/locks.py"} <= names


@pytest.mark.parametrize("path", ONE_SOURCE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_build_branch_in_a_module_s_logic(path):
    lines = _uses_outside_the_import_choice(ast.parse(path.read_text()))
    assert not lines, f"{path.relative_to(ROOT)}: cython.compiled read in its logic at {lines}"


def test_the_check_sees_a_branch_in_logic():
    source = ("import cython\nif cython.compiled:\n    from x import a\nelse:\n    from y import a\n"
              "IMPLEMENTATION = 'cython' if cython.compiled else 'python'\n"
              "def f():\n    if cython.compiled:\n        return 1\n    return 2\n")
    assert _uses_outside_the_import_choice(ast.parse(source)) == [8]


def test_the_ring_is_the_one_twin():
    # (a pure twin is a module named after a compiled one with _py: only the ring's)
    twins = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*_py.py"))
    assert twins == ["_ring_py.py"]
