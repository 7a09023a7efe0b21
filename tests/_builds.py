"""Both builds of a one-source module in one test process, to compare them: ``plain(name)``
is module ``name``'s .py run as plain Python, loaded beside its compiled extension under the
name ``name + "__plain"`` (a test's name: mpx itself loads one build per process, see
mpx/_impl.py). The one-source modules it imports (a compiled module beside its .py, such as
the futures core's others) are their plain builds too, loaded the same way."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from types import ModuleType

import pytest

from mpx._driver import futures as F
from mpx.errors import NotOwnerError
from mpx.protocol import wire


def _source(name: str) -> str | None:
    """The .py of ``name`` if it is a one-source module (a compiled extension beside it)."""
    package, _, leaf = name.rpartition(".")
    try:
        folder = importlib.import_module(package).__path__[0]
    except (ImportError, AttributeError):
        return None
    source = os.path.join(folder, leaf + ".py")
    if os.path.isfile(source) and any(os.path.isfile(os.path.join(folder, leaf + suffix))
                                      for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        return source
    return None


def _one_source_imports(source: str) -> list[str]:
    """The one-source mpx modules that ``source`` imports (``from mpx.x import y``)."""
    tree = ast.parse(open(source).read())
    names = {node.module for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
             and node.module.startswith("mpx.")}
    return sorted(n for n in names if _source(n) is not None)


def plain(name: str) -> ModuleType:
    """``name``'s source run uncompiled, loaded once."""
    alias = name + "__plain"
    if alias not in sys.modules:
        package, _, leaf = name.rpartition(".")
        folder = importlib.import_module(package).__path__[0]
        source = f"{folder}/{leaf}.py"
        # (its one-source imports are their plain builds while it runs its imports)
        deps = {dep: plain(dep) for dep in _one_source_imports(source)}
        saved = {dep: sys.modules.get(dep) for dep in deps}
        spec = importlib.util.spec_from_file_location(alias, source)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[alias] = module
        sys.modules.update(deps)
        try:
            spec.loader.exec_module(module)
        finally:
            for dep, was in saved.items():
                if was is None:
                    sys.modules.pop(dep, None)
                else:
                    sys.modules[dep] = was
    return sys.modules[alias]


# the futures core's modules, in the order they import each other
CORE_MODULES = ("locks", "meter", "core_settings", "ledger", "waiters", "future_core")


def load_core(impl: str) -> types.SimpleNamespace:
    """The core of ``impl``, its modules' names in one namespace: "cython", the compiled
    extensions (skipped where they were not built), or "python", their sources run as
    plain Python (as MPX_PURE_PYTHON=1 loads them). ``settings``: a CoreSettings of that
    build, as the call registry makes one."""
    if impl == "cython":
        modules = [importlib.import_module(f"mpx._driver.{m}") for m in CORE_MODULES]
        if any(m.IMPLEMENTATION != "cython" for m in modules):
            pytest.skip("extensions not built")
    else:
        modules = [plain(f"mpx._driver.{m}") for m in CORE_MODULES]
    assert {m.IMPLEMENTATION for m in modules} == {impl}
    core = types.SimpleNamespace(modules=modules)
    for m in modules:
        vars(core).update((k, v) for k, v in vars(m).items() if not k.startswith("__"))
    core.settings = core.CoreSettings(wire.OK, wire.ERR, NotOwnerError.of, F.loop_delivery)
    return core
