"""``python -m mpx top SOCKET``: a live table of a running executor, read from its stats
socket (``Config.stats_socket``), refreshed every second in the terminal; ``--once`` prints
one table (CPU over half a second) for scripts.

Each read of the socket has one deadline for connecting and the whole answer
(``stats_server.FETCH_S``) and a size cap (``stats_server.MAX_ANSWER``): a server that
drips, never ends its line or sends without end makes ``top`` exit with status 1 and say
so, never hang or grow."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from mpx._driver.stats_server import fetch

_CLEAR = "\x1b[H\x1b[2J"


def _us(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _cpu(now: float | None, before: float | None, dt: float) -> str:
    if now is None or before is None or dt <= 0:
        return "-"
    return f"{100 * (now - before) / dt:.1f}%"


def table(snap: dict[str, Any], prev: dict[str, Any] | None) -> str:
    """The table of ``snap``, with CPU use since ``prev`` (a snapshot before it)."""
    dt = snap["time"] - prev["time"] if prev else 0.0
    before = {r["rank"]: r["cpu_s"] for r in prev["ranks"]} if prev else {}
    ok = sum(o["ok"] for o in snap["calls"].values())
    failed = sum(o["error"] + o["timeout"] for o in snap["calls"].values())
    skew = snap["skew"]
    lines = [
        f"mpx executor (driver pid {snap['driver']['pid']}, CPU "
        f"{_cpu(snap['driver']['cpu_s'], prev['driver']['cpu_s'] if prev else None, dt)})"
        f"   calls ok {ok}, failed {failed}   in flight {snap['in_flight']}, queued "
        f"{snap['queued']}   skew p50 {_us(skew['p50_s'])} p99 {_us(skew['p99_s'])}",
        f"{'rank':>4}  {'pid':>8}  {'state':<5}  {'replies':>9}  {'p50':>10}  {'p99':>10}  "
        f"{'max':>10}  {'CPU':>7}",
    ]
    for r in snap["ranks"]:
        lat = r["latency"]
        lines.append(
            f"{r['rank']:>4}  {r['pid'] if r['pid'] is not None else '-':>8}  "
            f"{'up' if r['alive'] else 'dead':<5}  {r['replies']:>9}  {_us(lat['p50_s']):>10}  "
            f"{_us(lat['p99_s']):>10}  {_us(lat['max_s']):>10}  "
            f"{_cpu(r['cpu_s'], before.get(r['rank']), dt):>7}")
    if snap["calls"]:
        lines.append("")
        lines.append(f"{'method':<32} {'ok':>9} {'error':>7} {'timeout':>7}")
        for name, o in sorted(snap["calls"].items()):
            lines.append(f"{name[:32]:<32} {o['ok']:>9} {o['error']:>7} {o['timeout']:>7}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The ``top`` command."""
    try:
        prev = fetch(args.socket)
        if args.once:
            time.sleep(0.5)
            print(table(fetch(args.socket), prev))
            return 0
        while True:
            time.sleep(args.interval)
            snap = fetch(args.socket)
            sys.stdout.write(_CLEAR + table(snap, prev) + "\n")
            sys.stdout.flush()
            prev = snap
    except RuntimeError as e:  # (the executor answered, with its snapshot's failure)
        print(f"mpx top: {args.socket!r}: {e}", file=sys.stderr)
        return 1
    except (KeyError, TypeError) as e:
        print(f"mpx top: {args.socket!r} answered JSON that is not an mpx stats snapshot "
              f"({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"mpx top: cannot read the stats socket {args.socket!r}: {e} (is the executor "
              "running with Config.stats_socket set to it?)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
