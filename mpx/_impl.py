"""Chooses the implementation of the mechanism modules: compiled or pure Python. The ring
(``mpx._ring``) has a pure-Python twin, ``mpx._ring_py``; serde's codec (``mpx._codec``)
and the driver's futures core (``mpx._driver.future_core``) are one source each, in
Cython's pure-Python mode: compiled where they were built, and that same file run as plain
Python where they were not or under ``MPX_PURE_PYTHON=1`` (``_plain``)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import warnings
from types import ModuleType

_warned = False
_loading = threading.Lock()


def _pure_requested() -> bool:
    return os.environ.get("MPX_PURE_PYTHON", "").strip().lower() in {"1", "true", "yes", "on"}


def _choose(name: str, one_source: bool = False) -> ModuleType:
    """``mpx.<name>`` unless ``MPX_PURE_PYTHON=1`` or it is missing (then one warning that
    says how to build it), else its pure version: ``mpx.<name>_py``, or for a module of one
    source its .py run as plain Python."""
    global _warned
    if not _pure_requested():
        try:
            return importlib.import_module(f"mpx.{name}")
        except ImportError as e:
            if not _warned:
                _warned = True
                warnings.warn(
                    f"mpx: the compiled ring (mpx.{name}) is not available ({e}); using the "
                    "pure-Python ring and futures, which are several times slower. Build "
                    "them with `pip install .` or `python setup.py build_ext --inplace` (needs "
                    "Cython and a C compiler), or set MPX_PURE_PYTHON=1 to silence this "
                    "warning.", RuntimeWarning, stacklevel=4)
    if one_source:
        return _plain(f"mpx.{name}")
    return importlib.import_module(f"mpx.{name}_py")


def _plain(name: str) -> ModuleType:
    """Module ``name`` (a .py file that Cython compiles in pure-Python mode) run from its
    source, uncompiled, as module ``<name>_plain``, loaded once. A plain import would load
    the compiled extension where one sits beside the .py."""
    alias = f"{name}_plain"
    module = sys.modules.get(alias)
    if module is not None:
        return module
    with _loading:
        module = sys.modules.get(alias)
        if module is None:
            package, _, leaf = name.rpartition(".")
            folder = os.path.dirname(importlib.import_module(package).__file__ or "")
            spec = importlib.util.spec_from_file_location(alias, os.path.join(folder, f"{leaf}.py"))
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[alias] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[alias]
                raise
    return module


def ring_module() -> ModuleType:
    """The ring module to use now (``RingWriter``, ``RingReader``)."""
    return _choose("_ring")


def codec_module() -> ModuleType:
    """serde's codec to use now (``Encoder``, ``Decoder``, ``Assembler``, the small codec),
    of the same implementation as the ring."""
    return _choose("_codec", one_source=True)


def future_core_module() -> ModuleType:
    """The driver's futures core, mpx/_driver/future_core.py (``Call``, ``FutureCore``):
    compiled where it was built, else plain Python (without a compiler the ring's warning
    says so); under MPX_PURE_PYTHON=1 its source, uncompiled, although the extension is
    there."""
    if _pure_requested():
        return _plain("mpx._driver.future_core")
    return importlib.import_module("mpx._driver.future_core")


def ring_implementation() -> str:
    """``"cython"`` or ``"python"``: the ring implementation new queues will use."""
    return ring_module().IMPLEMENTATION
