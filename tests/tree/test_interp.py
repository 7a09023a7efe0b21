"""The interpreter adapter (mpx/_interp.py): every private part of CPython's standard library
it names still exists and behaves as mpx assumes, on the running Python and on each Python
3.10 to 3.13 that pyenv has (tests/_interp_check.py, run there as a script that loads the
adapter by its path); the names mpx must define itself are defined, in both builds of the
futures core; and no other module spells what the adapter names."""

from __future__ import annotations

import glob
import os
import pathlib
import subprocess

import _builds
import _interp_check
import pytest
from _env import IMPLS

from mpx import _interp

ROOT = pathlib.Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "mpx" / "_interp.py"


@pytest.mark.parametrize("check", _interp_check.CHECKS, ids=lambda c: c.__name__)
def test_each_named_internal_behaves_as_assumed_here(check):
    check(_interp)


def _pythons() -> dict[str, str]:
    """One interpreter of each minor version 3.10 to 3.13 that pyenv has, by version."""
    found = {}
    for folder in sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[0-3].*"))):
        python = os.path.join(folder, "bin", "python")
        if os.access(python, os.X_OK):
            found[".".join(os.path.basename(folder).split(".")[:2])] = python
    return found


@pytest.mark.parametrize("version", ["3.10", "3.11", "3.12", "3.13"])
def test_each_named_internal_behaves_as_assumed_on_every_python(version):
    python = _pythons().get(version)
    if python is None:
        pytest.skip(f"pyenv has no Python {version}")
    out = subprocess.run([python, "-I", str(ROOT / "tests" / "_interp_check.py"), str(ADAPTER)],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "ok" and out.stdout.split()[1].startswith(version + ".")


@pytest.mark.parametrize("impl", IMPLS)
def test_the_names_mpx_must_define_are_defined_in_both_builds(impl):
    from mpx._driver.futures import RPCFuture
    core = _builds.load_core(impl)
    # (asyncio looks for the flag on the class; concurrent.futures reads these on a future)
    assert hasattr(core.Waiter, _interp.ASYNCIO_BLOCKING)
    assert {"_state", "_waiters"} <= set(dir(core.FutureCore))
    assert set(_interp.FUTURE_FIELDS) <= set(dir(RPCFuture))
    assert core.RUNNING is _interp.RUNNING and core.FINISHED is _interp.FINISHED
    lock = core.Ledger().lock  # (a CLock compiled, a threading.Lock plain)
    assert all(hasattr(lock, name) for name in _interp.CONDITION_LOCK_NEEDS)


def test_no_other_module_names_what_the_adapter_names():
    # (a slot or field must be spelled where it is defined: the Waiter's flag)
    spelled = {"concurrent.futures._base": set(), "concurrent.futures import _base": set(),
               _interp.ASYNCIO_BLOCKING: {"_driver/waiters.py", "_driver/waiters.pxd"},
               '"asyncio."': set()}
    for path in (ROOT / "mpx").rglob("*"):
        if path.suffix not in (".py", ".pyx", ".pxd") or path == ADAPTER:
            continue
        text, rel = path.read_text(), str(path.relative_to(ROOT / "mpx"))
        for name, allowed in spelled.items():
            assert name not in text or rel in allowed, f"mpx/{rel} spells {name}"
