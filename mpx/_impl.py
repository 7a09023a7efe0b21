"""Chooses the implementation of the mechanism modules: compiled (``mpx._ring``,
``mpx._buffers``, ``mpx._future_core``) or their pure-Python twins (``mpx._ring_py``,
``mpx._buffers_py``, ``mpx._future_core_py``)."""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

_warned = False


def _pure_requested() -> bool:
    return os.environ.get("MPX_PURE_PYTHON", "").strip().lower() in {"1", "true", "yes", "on"}


def _choose(name: str) -> ModuleType:
    """``mpx.<name>`` unless ``MPX_PURE_PYTHON=1`` or it is missing (then one warning that
    says how to build it), else ``mpx.<name>_py``."""
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
    return importlib.import_module(f"mpx.{name}_py")


def ring_module() -> ModuleType:
    """The ring module to use now (``RingWriter``, ``RingReader``)."""
    return _choose("_ring")


def buffers_module() -> ModuleType:
    """The buffers module to use now (``Assembler``), of the same implementation as the
    ring."""
    return _choose("_buffers")


def future_core_module() -> ModuleType:
    """The module of RPCFuture's core (``FutureCore``), of the same implementation as the
    ring."""
    return _choose("_future_core")


def ring_implementation() -> str:
    """``"cython"`` or ``"python"``: the ring implementation new queues will use."""
    return ring_module().IMPLEMENTATION
