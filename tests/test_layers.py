"""The tree's layers: each module imports only what its place allows (see mpx/__init__.py
and each internal package's docstring). Parsed, not imported: no process starts."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "mpx"

# module prefix -> mpx modules it must never import
FORBIDDEN = {
    "mpx._worker": ("mpx._driver", "mpx._node", "mpx._cli"),
    "mpx._driver": ("mpx._worker", "mpx._cli"),
    "mpx._node": ("mpx._driver", "mpx._cli"),
    "mpx.queue": ("mpx._driver", "mpx._worker", "mpx._node", "mpx._cli"),
    "mpx.transport": ("mpx.queue", "mpx._driver", "mpx._worker", "mpx._node", "mpx._cli"),
    "mpx.serde": ("mpx.transport", "mpx.queue", "mpx._driver", "mpx._worker", "mpx._node"),
    "mpx.segments": ("mpx.serde", "mpx.transport", "mpx.queue", "mpx._driver", "mpx._worker"),
    # serde's mechanism (compiled): it knows nothing above it, not even serde
    "mpx._codec": ("mpx.serde", "mpx.sharing", "mpx.wire", "mpx.errors", "mpx.segments",
                   "mpx.transport", "mpx.queue", "mpx._driver", "mpx._worker", "mpx._node",
                   "mpx._cli"),
    # the wait policy's choices in Python: the pure ring and the ZeroMQ reader use them
    "mpx.waiting": ("mpx.layout", "mpx.serde", "mpx.transport", "mpx.queue", "mpx._driver",
                    "mpx._worker", "mpx._node", "mpx._cli"),
    "mpx.wire": ("mpx.queue", "mpx._driver", "mpx._worker", "mpx._node", "mpx._cli"),
    "mpx.dumps": ("mpx.queue", "mpx._driver", "mpx._worker", "mpx._node", "mpx._cli"),
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every mpx module named by an import in ``path`` (``from mpx import x`` names
    ``mpx.x``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in out if m == "mpx" or m.startswith("mpx.")}


MODULES = sorted(ROOT.rglob("*.py"))


def test_the_tree_is_found():
    names = {_module_name(p) for p in MODULES}
    assert {"mpx._driver.executor", "mpx._driver.future_core", "mpx._worker.main",
            "mpx._node.leader", "mpx._cli.main", "mpx.queue", "mpx.wire"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_respect_the_layers(path):
    name = _module_name(path)
    rules = [bad for prefix, bad in FORBIDDEN.items()
             if name == prefix or name.startswith(prefix + ".")]
    wrong = sorted(m for m in _imports(path) for bad in rules for b in bad
                   if m == b or m.startswith(b + "."))
    assert not wrong, f"{name} imports {wrong}, which its layer must not"


def test_the_codec_imports_no_mpx_module_but_its_cython_shim():
    assert _imports(ROOT / "_codec.py") <= {"mpx", "mpx._cython_shim"}


def test_the_futures_core_imports_no_mpx_module_but_its_cython_shim():
    # (compiled, or run as plain Python, it is told what it must know of the wire and of
    # the driver's event loops)
    assert _imports(ROOT / "_driver" / "future_core.py") <= {"mpx", "mpx._cython_shim"}


def test_only_the_public_names_are_exported():
    import mpx
    assert all(not n.startswith("_") or n == "__version__" for n in mpx.__all__)
    for n in mpx.__all__:
        assert hasattr(mpx, n), n
