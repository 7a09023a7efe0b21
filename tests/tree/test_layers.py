"""The tree's layers. mpx/__init__.py's docstring lists them, bottom up, with every file and
package of the tree; this test holds that list equal to the tree and every import to it:
``import`` and ``from`` in ``.py`` files, ``cimport``, ``import`` and ``include`` in
``.pyx``, ``.pxd`` and ``.pxi`` files, and ``cython.cimports`` in pure-mode sources. A
module imports only from its own layer and those below. Parsed, never imported."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "mpx"
SOURCES = (".py", ".pyx", ".pxd", ".pxi", ".pyi", ".h")

# Within a layer, siblings that must not know each other (module prefix -> forbidden).
SIBLINGS = {
    # the ring moves bytes: it knows nothing of messages (the codec) or of the shm end
    "mpx._ring": ("mpx.mechanism.codec",),
    "mpx._ring_py": ("mpx.mechanism.codec",),
    # the codec knows nothing of the ring that carries its messages
    "mpx.mechanism.codec": ("mpx._ring", "mpx._ring_py", "mpx.mechanism.segments"),
    # the primitives that reach memory know neither the codec nor the ring that use them
    "mpx.mechanism.buffers": ("mpx.mechanism.codec", "mpx._ring", "mpx._ring_py"),
    "mpx.mechanism.waiting": ("mpx.mechanism.layout", "mpx.mechanism.segments"),
    # the shared-memory end is given its encoder and decoder: it imports no codec or serde
    "mpx.transport.shm_end": ("mpx.protocol", "mpx.mechanism.codec"),
    "mpx.transport.shm_primitives": ("mpx.protocol", "mpx.mechanism.codec"),
    # each kind of process runs its own package: none imports another's
    "mpx._worker": ("mpx._driver", "mpx._node"),
    "mpx._driver": ("mpx._worker",),
    "mpx._node": ("mpx._driver",),
}

# The one import against the layers, and why: _debug reads the compiled ring's build flag
# (MPX_DEBUG) to know whether its counters are on; it calls nothing there.
EXCEPTIONS = {("mpx._debug", "mpx._ring")}


def _layers() -> list[tuple[str, list[str]]]:
    """(layer, entries of mpx/) bottom up, as mpx/__init__.py's docstring lists them."""
    doc = ast.get_docstring(ast.parse((ROOT / "__init__.py").read_text())) or ""
    block = doc.split("Layers, bottom up", 1)[1].split("\n\n", 2)[1]
    layers: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        m = re.match(r"\s{4}(\w+):\s+(.*)$", line)
        if m:
            layers.append((m.group(1), m.group(2).split()))
        else:
            layers[-1][1].extend(line.split())
    return layers


LAYERS = _layers()


def _entry(path: pathlib.Path) -> str:
    """The entry of mpx/ that ``path`` is in: its package (``_driver/``) or its file."""
    rel = path.relative_to(ROOT)
    return rel.parts[0] + "/" if len(rel.parts) > 1 else rel.name


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[-1] == "_ring_layout":  # (included by _ring.pyx)
        parts[-1] = "_ring"
    return ".".join(parts)


_CYTHON_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\b|c?import\s+([\w.]+))")
_PURE_CIMPORT = re.compile(r"cython\.cimports\.([\w.]+)")


def _imports(path: pathlib.Path) -> set[str]:
    """Every mpx module ``path`` names in an import (``from mpx import x`` names
    ``mpx.x``)."""
    out: set[str] = set()
    text = path.read_text()
    if path.suffix in (".py", ".pyi"):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names
                           if _is_module(f"{node.module}.{a.name}"))
    elif path.suffix != ".h":
        for line in text.splitlines():
            m = _CYTHON_IMPORT.match(line)
            if m:
                out.add(m.group(1) or m.group(2))
    out.update(m.group(1) for m in _PURE_CIMPORT.finditer(text))
    return {m for m in out if m == "mpx" or m.startswith("mpx.")}


def _is_module(name: str) -> bool:
    """Whether ``name`` (``from x import y``'s ``x.y``) is a module or package of mpx/
    rather than a name defined in one."""
    path = ROOT.parent.joinpath(*name.split("."))
    return path.is_dir() or any(path.with_suffix(s).exists() for s in SOURCES)


MODULES = sorted(p for p in ROOT.rglob("*") if p.suffix in SOURCES and p.is_file())


def _layer_of(module: str) -> int | None:
    """The index of ``module``'s layer, or None for the package itself (``mpx``)."""
    if module == "mpx":
        return None
    top = module.split(".")[1]
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if e.rstrip("/") == top or e.split(".")[0] == top:
                return i
    raise AssertionError(f"{module} is in no layer of mpx/__init__.py's list")


def test_the_layer_list_is_the_tree():
    listed = [e for _, entries in LAYERS for e in entries]
    assert len(listed) == len(set(listed)), "an entry is listed twice"
    tree = {_entry(p) for p in MODULES if p.name != "__init__.py" or p.parent != ROOT}
    assert set(listed) == tree, (f"listed, not in the tree: {sorted(set(listed) - tree)}; "
                                 f"in the tree, not listed: {sorted(tree - set(listed))}")


def test_the_tree_is_found():
    names = {_module_name(p) for p in MODULES}
    assert {"mpx._driver.executor", "mpx._driver.future_core", "mpx._worker.main",
            "mpx._node.leader", "mpx._cli.main", "mpx.queue", "mpx.protocol.wire",
            "mpx._ring", "mpx.mechanism.codec"} <= names
    assert [name for name, _ in LAYERS][:3] == ["base", "mechanism", "protocol"]


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "__init__.py" or p.parent != ROOT],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_respect_the_layers(path):
    name = _module_name(path)
    mine = _layer_of(name)
    assert mine is not None
    wrong = []
    for m in sorted(_imports(path)):
        theirs = _layer_of(m)
        if theirs is None or any(name == a and (m == b or m.startswith(b + "."))
                                 for a, b in EXCEPTIONS):
            continue
        if theirs > mine:
            wrong.append(f"{m} ({LAYERS[theirs][0]}, above {LAYERS[mine][0]})")
        for prefix, bad in SIBLINGS.items():
            if name == prefix or name.startswith(prefix + "."):
                wrong += [m for b in bad if m == b or m.startswith(b + ".")]
    assert not wrong, f"{name} imports {wrong}, which its layer must not"


def test_the_rule_reads_cython_sources():
    # (the reader sees cimports and pure-mode cimports, which a .py parser would not)
    sample = ROOT.parent / "tests" / "_layer_sample.pyx"
    try:
        sample.write_text("from mpx.mechanism.codec cimport owned_buffer\ncimport mpx._ring\n"
                          "x = 'cython.cimports.mpx.queue'\n")
        assert _imports(sample) == {"mpx.mechanism.codec", "mpx._ring", "mpx.queue"}
    finally:
        sample.unlink()


def test_the_codec_imports_no_mpx_module_but_its_cython_shim_and_primitives():
    # (buffers: imported where the codec runs plain, cimported from its .pxd where compiled)
    assert _imports(ROOT / "mechanism" / "codec.py") <= {
        "mpx.mechanism", "mpx.mechanism._cython_shim", "mpx.mechanism.buffers"}
    assert _imports(ROOT / "mechanism" / "buffers.py") == set()
    assert _imports(ROOT / "mechanism" / "buffers.pxd") == set()


# the driver's futures core (mpx/_driver/__init__.py lists it): one source each, compiled
# where built, told what it must know of the rest of mpx (CoreSettings)
FUTURES_CORE = ("primitives", "locks", "meter", "core_settings", "ledger", "waiters",
                "future_core")


@pytest.mark.parametrize("module", FUTURES_CORE)
def test_the_futures_core_imports_no_mpx_module_but_its_own_the_adapter_and_the_shim(module):
    # (its .pxd and pure-mode cimports too)
    allowed = {"mpx", "mpx._interp", "mpx._driver", "mpx.mechanism",
               "mpx.mechanism._cython_shim"} | {f"mpx._driver.{m}" for m in FUTURES_CORE}
    for suffix in (".py", ".pxd"):
        wrong = _imports(ROOT / "_driver" / (module + suffix)) - allowed
        assert not wrong, f"mpx/_driver/{module}{suffix} imports {sorted(wrong)}"


def test_only_the_public_names_are_exported():
    import mpx
    assert all(not n.startswith("_") or n == "__version__" for n in mpx.__all__)
    for n in mpx.__all__:
        assert hasattr(mpx, n), n
