"""Both builds of a one-source module in one test process, to compare them: ``plain(name)``
is module ``name``'s .py run as plain Python, loaded beside its compiled extension under the
name ``name + "__plain"`` (a test's name: mpx itself loads one build per process, see
mpx/_impl.py)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType


def plain(name: str) -> ModuleType:
    """``name``'s source run uncompiled, loaded once."""
    alias = name + "__plain"
    if alias not in sys.modules:
        package, _, leaf = name.rpartition(".")
        folder = importlib.import_module(package).__path__[0]
        spec = importlib.util.spec_from_file_location(alias, f"{folder}/{leaf}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[alias] = module
        spec.loader.exec_module(module)
    return sys.modules[alias]
