"""Chooses the ring implementation: the compiled ``mpx._ring`` or ``mpx._ring_py``."""

from __future__ import annotations

import os
import warnings
from types import ModuleType

_warned = False


def _pure_requested() -> bool:
    return os.environ.get("MPX_PURE_PYTHON", "").strip().lower() in {"1", "true", "yes", "on"}


def ring_module() -> ModuleType:
    """The ring module to use now: pure Python if ``MPX_PURE_PYTHON=1`` or the extension is
    missing (with one warning that says how to build it), else the Cython one."""
    global _warned
    if not _pure_requested():
        try:
            from mpx import _ring
            return _ring
        except ImportError as e:
            if not _warned:
                _warned = True
                warnings.warn(
                    f"mpx: the compiled ring (mpx._ring) is not available ({e}); using the "
                    "pure-Python ring, which is several times slower. Build it with "
                    "`pip install .` or `python setup.py build_ext --inplace` (needs Cython "
                    "and a C compiler), or set MPX_PURE_PYTHON=1 to silence this warning.",
                    RuntimeWarning, stacklevel=3)
    from mpx import _ring_py
    return _ring_py


def ring_implementation() -> str:
    """``"cython"`` or ``"python"``: the ring implementation new queues will use."""
    return ring_module().IMPLEMENTATION
