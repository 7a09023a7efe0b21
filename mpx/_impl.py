"""Chooses the implementation of the mechanism modules: compiled (``mpx._ring``,
``mpx._codec``, ``mpx._future_core``) or pure Python. The ring and the futures' core have
pure-Python twins (``mpx._ring_py``, ``mpx._future_core_py``); the codec is one source,
``mpx/_codec.py``, compiled by Cython's pure-Python mode, whose pure version is that file
run as plain Python (``mpx._codec_py``, see ``_plain``)."""

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

# the modules written once, in Cython's pure-Python mode: their pure version is their source
_ONE_SOURCE = frozenset({"_codec"})


def _pure_requested() -> bool:
    return os.environ.get("MPX_PURE_PYTHON", "").strip().lower() in {"1", "true", "yes", "on"}


def _choose(name: str) -> ModuleType:
    """``mpx.<name>`` unless ``MPX_PURE_PYTHON=1`` or it is missing (then one warning that
    says how to build it), else its pure-Python version: ``mpx.<name>_py``."""
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
    if name in _ONE_SOURCE:
        return _plain(name)
    return importlib.import_module(f"mpx.{name}_py")


def _plain(name: str) -> ModuleType:
    """``mpx/<name>.py`` run as plain Python, as the module ``mpx.<name>_py`` (made once,
    then kept in sys.modules), even where its compiled extension sits beside it: an import
    of ``mpx.<name>`` finds the extension first. (Where the extension is not built, that
    import runs the same file as plain Python too.)"""
    alias = f"mpx.{name}_py"
    with _loading:
        module = sys.modules.get(alias)
        if module is None:
            path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
            spec = importlib.util.spec_from_file_location(alias, path)
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
    return _choose("_codec")


def future_core_module() -> ModuleType:
    """The module of RPCFuture's core (``FutureCore``), of the same implementation as the
    ring."""
    return _choose("_future_core")


def ring_implementation() -> str:
    """``"cython"`` or ``"python"``: the ring implementation new queues will use."""
    return ring_module().IMPLEMENTATION
