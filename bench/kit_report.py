"""A benchmark's report: progress lines, the header (versions, cores, ring, mode), tables, the
result rows, the cleanup check (children alive, /dev/shm segments left), the SUMMARY line, and
the --json and --png outputs.
"""

from __future__ import annotations

import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import sys
import time

import kit_plot
import kit_procs

import mpx

_T0 = time.perf_counter()  # the run's start (this module is imported as it begins)


def progress(msg):
    """One progress line on stderr, with the seconds since the run began."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def print_header(quick, what, note, min_cpus=3, **versions):
    """Print the run's environment (versions, core count, ring, mode); return it as a dict."""
    cpus = len(os.sched_getaffinity(0))
    header = {"python": platform.python_version(), "platform": platform.platform(), "mpx": mpx.__version__,
              "ring": mpx.ring_implementation(), "numpy": version("numpy"), **versions,
              "cpu_count": os.cpu_count(), "affinity": cpus, "quick": quick, "loadavg": os.getloadavg()}
    more = "".join(f"{k} {v}, " for k, v in versions.items())
    print(f"mpx {header['mpx']} {what}  (python {header['python']}, {more}numpy {header['numpy']}, "
          f"{header['platform']})")
    print(f"os.cpu_count()={os.cpu_count()}  usable CPUs={cpus}  ring={header['ring']}  "
          f"mode={'quick' if quick else 'full'}  load average {header['loadavg'][0]:.2f}")
    print(f"config: {mpx.Config.from_env().describe()}")
    if cpus < min_cpus:
        print(f"note: only {cpus} CPUs: {note}")
    print(flush=True)
    return header


def print_table(hdr, lines, indent=""):
    """``lines`` (tuples of strings) under ``hdr`` in left-aligned columns."""
    w = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(hdr)]
    fmt = indent + "  ".join(f"{{:<{x}}}" for x in w)
    for line in (hdr, ["-" * x for x in w], *lines):
        print(fmt.format(*line))


def row(name, unit, m, b=None, target="info", ok=None, note=""):
    """A result: mpx's stats ``m`` against the baseline's ``b`` (the ratio of the medians, m / b);
    ``ok`` None: informational."""
    return {"name": name, "unit": unit, "mpx": m, "baseline": b, "target": target, "passed": ok,
            "ratio": m["median"] / b["median"] if b and b["median"] else None, "note": note}


def _fmt(st, unit):
    if st is None:
        return "-"
    if unit == "%":
        return f"{st['median']:.3f} %"
    d = 2 if unit == "GB/s" else 3 if unit == "s" else 1
    return f"{st['median']:.{d}f} (p90 {st['p90']:.{d}f})"


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    print(f"wrote {path}")


def print_cleanup(pids=()):
    """Say which of the run's children are alive and which /dev/shm segments mpx made in their name
    (``mpx-<creator pid>-<random>``) or in this process's are left."""
    pids = set(pids) | kit_procs.child_pids | {p.pid for p in mp.active_children()}
    mine = {str(p) for p in pids | {os.getpid()}}
    left = kit_procs.alive(pids - {os.getpid()})
    try:
        segments = sorted(e for e in os.listdir("/dev/shm")
                          if e.startswith("mpx-") and e.split("-")[1] in mine)
    except OSError:
        segments = []
    print(f"cleanup: child processes alive: {left or 'none'}; /dev/shm mpx segments left by this run: "
          f"{segments or 'none'}")
    return left, segments


def finish(args, header, rows, raw, title, reap_s=0.2):
    """Print the rows, the cleanup check and the SUMMARY line; write --json and --png."""
    print("\nvalues: median (p90) over repetitions; ratio = mpx / baseline\n")
    print_table(("measurement", "mpx", "baseline", "ratio", "target", "result"), [
        (f"{r['name']} [{r['unit']}]", _fmt(r["mpx"], r["unit"]), _fmt(r["baseline"], r["unit"]),
         "-" if r["ratio"] is None else f"{r['ratio']:.3f}x", r["target"],
         "info" if r["passed"] is None else "PASS" if r["passed"] else "FAIL") for r in rows])
    if notes := [f"  * {r['name'].strip()}: {r['note']}" for r in rows if r["note"]]:
        print("notes:\n" + "\n".join(notes))
    print()
    time.sleep(reap_s)  # let the last children be reaped
    left, segments = print_cleanup()
    judged = [r for r in rows if r["passed"] is not None]
    failed = [r["name"].strip() for r in judged if not r["passed"]]
    elapsed = time.perf_counter() - _T0
    print(f"SUMMARY: {len(judged) - len(failed)}/{len(judged)} targets met"
          + (f"; FAIL: {', '.join(failed)}" if failed else "")
          + f"  ({elapsed:.0f} s, {header['affinity']} CPUs)")
    if args.json:
        write_json(args.json, {"header": header, "elapsed_s": elapsed, "rows": rows, "raw": raw,
                               "leftover_segments": segments, "alive_children": left})
    if args.png and (shown := [r for r in rows if r["ratio"] is not None]):
        kit_plot.ratio_bars(args.png, shown, f"{title} ({header['affinity']} CPUs)")
