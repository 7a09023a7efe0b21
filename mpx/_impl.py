"""The one loader of mpx's two builds: compiled, or pure Python.

- The ring is the one deliberate twin: ``mpx._ring`` (compiled from ``_ring.pyx``) and
  ``mpx._ring_py``, behind one contract. ``ring_module()`` picks one for each new queue.
- Every other compiled module is one source, a ``.py`` in Cython's pure-Python mode (its C
  types in the ``.pxd`` beside it): compiled where it was built, that same file run as plain
  Python where it was not. Under ``MPX_PURE_PYTHON=1``, set when the process imports mpx,
  ``_SourceFinder`` imports each of them from its ``.py`` under its own name, although its
  extension sits beside it; the choice holds for the life of the process.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

_warned = False


def pure_requested() -> bool:
    """Whether ``MPX_PURE_PYTHON`` asks for the pure-Python build now."""
    return os.environ.get("MPX_PURE_PYTHON", "").strip().lower() in {"1", "true", "yes", "on"}


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds an ``mpx`` module that has both a ``.py`` and a compiled extension beside it,
    and gives its ``.py``: the pure build, under the module's own name."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if path is None or not fullname.startswith("mpx."):
            return None
        leaf = fullname.rpartition(".")[2]
        for folder in path:
            source = os.path.join(folder, leaf + ".py")
            if os.path.isfile(source) and any(
                    os.path.isfile(os.path.join(folder, leaf + suffix))
                    for suffix in importlib.machinery.EXTENSION_SUFFIXES):
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def install() -> None:
    """Install the pure build's finder where ``MPX_PURE_PYTHON=1``. Run when this module is
    imported, which mpx/__init__.py does before any other mpx module."""
    if pure_requested() and not any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceFinder())


def ring_module() -> ModuleType:
    """The ring to use for a new queue (``RingWriter``, ``RingReader``): ``mpx._ring``,
    unless ``MPX_PURE_PYTHON=1`` or it was not built (then one warning that says how to
    build it), else its twin ``mpx._ring_py``."""
    global _warned
    if not pure_requested():
        try:
            return importlib.import_module("mpx._ring")
        except ImportError as e:
            if not _warned:
                _warned = True
                warnings.warn(
                    f"mpx: the compiled ring (mpx._ring) is not available ({e}); using the "
                    "pure-Python build, which is several times slower. Build it with "
                    "`pip install .` or `python setup.py build_ext --inplace` (needs Cython "
                    "and a C compiler), or set MPX_PURE_PYTHON=1 to silence this warning.",
                    RuntimeWarning, stacklevel=3)
    return importlib.import_module("mpx._ring_py")


def ring_implementation() -> str:
    """``"cython"`` or ``"python"``: the ring implementation new queues will use."""
    return ring_module().IMPLEMENTATION


install()
