"""No module of mpx waits with select() or an API bound by its FD_SETSIZE (1024): a process
holding more descriptors than that (test_many_fds.py) fails in it ("filedescriptor out of
range in select()"). Wait on one descriptor with ``select.poll()``, a socket timeout or
``zmq.Poller``."""

from __future__ import annotations

import pathlib
import re

import pytest

import mpx

ROOT = pathlib.Path(mpx.__file__).parent
SUFFIXES = {".py", ".pyx", ".pxd", ".pxi", ".h"}
# Python: select.select, zmq.select, the select-based selector, a bare `select` imported
# from either; C (and Cython's C declarations): select(), fd_set and its macros
FORBIDDEN = [
    re.compile(r"\bselect\.select\b"),
    re.compile(r"\bzmq\.select\b"),
    re.compile(r"\bSelectSelector\b"),
    re.compile(r"\bfrom\s+(select|zmq)\s+import\b[^#\n]*\bselect\b"),
    re.compile(r"\bFD_(SET|ZERO|ISSET|CLR)\b|\bfd_set\b"),
]
C_FORBIDDEN = [re.compile(r"(?<![.\w])p?select\s*\(")]


def offending_lines(text: str, suffix: str) -> list[tuple[int, str]]:
    """(line number, line) of each line of a file of ``suffix`` that waits with select."""
    patterns = FORBIDDEN + (C_FORBIDDEN if suffix in {".h", ".pyx", ".pxd", ".pxi"} else [])
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
            if any(p.search(line) for p in patterns)]


def _sources() -> list[pathlib.Path]:
    return sorted(p for p in ROOT.rglob("*") if p.suffix in SUFFIXES and p.is_file())


def test_the_scan_covers_the_package():
    names = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert {"_ring.pyx", "_ring.pxd", "_ring_sync.h", "_ring_py.py", "transport/zmq_reader.py",
            "transport/shm.py", "_driver/stats_server.py", "_cli/top.py"} <= names


def test_no_module_of_mpx_waits_with_select():
    found = {p.relative_to(ROOT).as_posix(): lines for p in _sources()
             if (lines := offending_lines(p.read_text(errors="replace"), p.suffix))}
    assert found == {}, f"select() (limited to descriptors below 1024) in mpx: {found}"


@pytest.mark.parametrize("line, suffix", [
    ("    r, _, _ = select.select([fd], [], [], 0)", ".py"),
    ("ready = zmq.select([a, b], [], [], 1.0)", ".py"),
    ("sel = selectors.SelectSelector()", ".py"),
    ("from select import select", ".py"),
    ("from zmq import Poller, select  # (both)", ".py"),
    ("    FD_SET(fd, &set);", ".h"),
    ("    fd_set readable;", ".h"),
    ("    return select(fd + 1, &r, NULL, NULL, &tv) > 0;", ".h"),
    ("    int select(int nfds, void *r, void *w, void *e, void *t)", ".pxd"),
    ("    n = pselect(fd + 1, &r, NULL, NULL, &ts, NULL);", ".pyx"),
])
def test_the_scan_catches_each_form(line, suffix):
    assert offending_lines(f"x = 1\n{line}\n", suffix) == [(2, line.strip())]


@pytest.mark.parametrize("line, suffix", [
    ("p = select.poll()", ".py"),
    ("poller = zmq.Poller()", ".py"),
    ("import select", ".py"),
    ("sock.poll(timeout_ms, zmq.POLLIN)", ".py"),
    ("    return poll(&p, 1, 0) > 0;", ".h"),
    ("bundle_label_selector=[", ".py"),
    ("waits in ``accept`` with a timeout (not select())", ".py"),
])
def test_the_scan_passes_what_is_not_select(line, suffix):
    assert offending_lines(line, suffix) == []
