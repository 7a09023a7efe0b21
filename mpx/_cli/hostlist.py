"""Slurm host lists (``SLURM_JOB_NODELIST``), expanded as ``scontrol show hostnames`` does.

``"node[01-03,7],gpu5"`` -> ``["node01", "node02", "node03", "node7", "gpu5"]``. A range
keeps the width of its lower bound (``[08-10]``: ``08 09 10``); several bracket groups in
one name multiply out, leftmost slowest (``r[1-2]n[1-2]``: ``r1n1 r1n2 r2n1 r2n2``).
"""

from __future__ import annotations

# A host list is written by Slurm; a range this long is a typo, not a cluster.
MAX_HOSTS = 1_000_000


def _split_top(spec: str) -> list[str]:
    """``spec`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {spec!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {spec!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"host list {spec!r}: '[' without ']'")
    parts.append(spec[start:])
    return parts


def _range(spec: str, body: str) -> list[str]:
    """The suffixes of one bracket group's body, e.g. ``"01-03,7"``."""
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or sep and not hi.isdigit():
            raise ValueError(f"host list {spec!r}: {item!r} is not a number or a range a-b")
        if not sep:
            out.append(lo)
            continue
        first, last = int(lo), int(hi)
        if last < first:
            raise ValueError(f"host list {spec!r}: range {item!r} runs backwards")
        if last - first >= MAX_HOSTS:
            raise ValueError(f"host list {spec!r}: range {item!r} has over {MAX_HOSTS} hosts")
        out.extend(str(n).zfill(len(lo)) for n in range(first, last + 1))
    return out


def _expand_name(spec: str, name: str) -> list[str]:
    if "[" not in name:
        return [name]
    open_at = name.index("[")
    close_at = name.index("]", open_at)
    heads = [name[:open_at] + s for s in _range(spec, name[open_at + 1:close_at])]
    tails = _expand_name(spec, name[close_at + 1:])
    return [h + t for h in heads for t in tails]


def expand_hostlist(spec: str) -> list[str]:
    """Every host named by the Slurm host list ``spec``, in order (duplicates kept, as
    scontrol does). ValueError naming the list when it is malformed."""
    spec = spec.strip()
    if not spec:
        raise ValueError("host list is empty")
    hosts: list[str] = []
    for name in _split_top(spec):
        if not name:
            raise ValueError(f"host list {spec!r}: empty host name")
        hosts.extend(_expand_name(spec, name))
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"host list {spec!r} names over {MAX_HOSTS} hosts")
    return hosts


def first_host(spec: str) -> str:
    """The first host of the Slurm host list ``spec`` (Slurm's node 0)."""
    return expand_hostlist(spec)[0]
