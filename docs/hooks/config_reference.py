"""MkDocs hook: generate the configuration reference from ``mpx.Config`` at build time.

``docs/configuration.md`` holds the marker ``<!-- mpx:config-reference -->``; this hook
replaces it with one table row per field of ``mpx.Config``, in declaration order: the
field, its ``MPX_*`` environment variable, its type, its default and its doc string
(``dataclasses.Field.metadata["doc"]``, written next to the field in the source). Nothing
is copied by hand, so the page cannot drift from the code: a field added, renamed or
re-documented shows up in the next build, and a field without a doc string, or a missing
marker, fails the build.

The hook imports ``mpx`` from the checkout this file sits in (it puts the repository root
first on ``sys.path``), so the reference describes the source being documented rather than
whatever copy of mpx happens to be installed. Importing ``mpx`` needs its runtime
dependencies (cloudpickle, pyzmq, posix-ipc), which the ``docs`` extra brings in.
"""

from __future__ import annotations

import dataclasses
import html
import os
import sys
from typing import Any

MARKER = "<!-- mpx:config-reference -->"
PAGE = "configuration.md"

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config_class() -> type:
    if sys.path[:1] != [_ROOT]:
        sys.path.insert(0, _ROOT)
    import mpx

    where = os.path.dirname(os.path.abspath(mpx.__file__))
    if os.path.dirname(where) != _ROOT:
        raise RuntimeError(f"the config reference would document mpx from {where}, not the "
                           f"checkout at {_ROOT}")
    return mpx.Config


def env_var(field_name: str) -> str:
    """The environment variable of a field, as ``Config.from_env`` reads it."""
    return "MPX_" + field_name.upper()


def _default(value: Any) -> str:
    if isinstance(value, bool):
        return f"`{value}` (`{int(value)}`)"
    if value == "":
        return "empty"
    return f"`{value}`"


def _limits(config_cls: type) -> dict[str, tuple]:
    # the module's table of numeric ranges, where it has one (checked in __post_init__)
    module = sys.modules[config_cls.__module__]
    limits = getattr(module, "_LIMITS", {})
    return limits if isinstance(limits, dict) else {}


def _cell(text: str) -> str:
    # doc strings are plain text: "<tmp>" must not turn into an HTML tag
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")


def render_table() -> str:
    config_cls = _config_class()
    limits = _limits(config_cls)
    rows = ["| Field | Environment variable | Type | Default | Meaning | Range |",
            "|---|---|---|---|---|---|"]
    for f in dataclasses.fields(config_cls):
        doc = f.metadata.get("doc")
        if not doc:
            raise RuntimeError(f"mpx.Config.{f.name} has no doc string (metadata['doc']); "
                               "the configuration reference needs one for every field")
        bounds = limits.get(f.name)
        span = f"{bounds[0]} to {bounds[1]}" if bounds else ""
        rows.append(f"| `{f.name}` | `{env_var(f.name)}` | `{type(f.default).__name__}` | "
                    f"{_default(f.default)} | {_cell(doc)} | {span} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise RuntimeError(f"docs/{PAGE} lost its marker {MARKER}")
    return markdown.replace(MARKER, render_table())
