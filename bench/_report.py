"""What bench_queue.py and bench_executor.py share: the tracking of their child processes,
statistics, the result rows and the report (header, table, cleanup check, SUMMARY, JSON, PNG).

The scripts run as ``python bench/<script>.py``, which puts this folder on sys.path (also
in their spawn children).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import platform
import sys
import time

import numpy as np

import mpx

CTX = mp.get_context("spawn")
MiB = 1 << 20
BIG = 64 * MiB

# --------------------------------------------------------------------------- children

procs: list = []                 # started by start(), not joined yet
child_pids: set[int] = set()     # every child of this run, for the leak check


def start(target, args):
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    procs.append(p)
    child_pids.add(p.pid)
    return p


def join(p, timeout=30.0, what="child"):
    """Join ``p``; terminate it (saying so, unless ``what`` is None) if it does not exit."""
    p.join(timeout)
    if p.is_alive():
        if what is not None:
            print(f"  warning: {what} {p.pid} did not exit, terminating it", flush=True)
        p.terminate()
        p.join(5)
    if p in procs:
        procs.remove(p)


def cleanup_procs():
    for p in list(procs):
        join(p, 0.1, what=None)


def last_cpu(pid):
    """The CPU ``pid`` last ran on (field 39 of /proc/<pid>/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def leftover_segments():
    """The /dev/shm mpx segments of this process or its children that are still there."""
    mine = child_pids | {os.getpid()}
    out = []
    try:
        for e in os.listdir("/dev/shm"):
            if e.startswith("mpx-"):
                try:
                    pid = int(e.split("-")[1])
                except (IndexError, ValueError):
                    continue
                if pid in mine:
                    out.append(e)
    except OSError:
        pass
    return sorted(out)


# --------------------------------------------------------------------------- numbers

def stats(samples):
    a = np.asarray(samples, dtype=float)
    return {"median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "min": float(a.min()), "n": int(a.size)}


def copy_times(copy, reps):
    """Seconds of ``reps`` calls of ``copy``, after one untimed call."""
    copy()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy()
        ts.append(time.perf_counter() - t0)
    return ts


def gbps(seconds):
    return BIG / seconds / 1e9


def bw_stats(ts):
    """Bandwidth stats from times: median GB/s, and 'p90' = GB/s at the p90 (slow) time."""
    s = stats(ts)
    return {"median": gbps(s["median"]), "p90": gbps(s["p90"]), "best": gbps(s["min"]),
            "n": s["n"], "median_ms": s["median"] * 1e3}


def row(name, unit, mpx_st, base_st, ratio, target, passed, better="lower", note=""):
    return {"name": name, "unit": unit, "mpx": mpx_st, "baseline": base_st, "ratio": ratio,
            "target": target, "passed": passed, "better": better, "note": note}


def pct_row(name, mpx_pct, base_pct, ratio, target, passed, note=""):
    """A row of one CPU percentage each (unit "%")."""
    return row(name, "%", {"median": mpx_pct, "p90": mpx_pct, "n": 1},
               {"median": base_pct, "p90": base_pct, "n": 1}, ratio, target, passed, note=note)


# --------------------------------------------------------------------------- report

def parse_args(doc, quick_help, more=None):
    """The common options (--quick, --png, --json); ``more(parser)`` adds a bench's own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--png", metavar="PATH", help="write a bar chart (needs matplotlib)")
    ap.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    if more is not None:
        more(ap)
    return ap.parse_args()


def print_header(quick, what, ring_key, ring_label, note, **versions):
    """Print the run's environment and return it as a dict (the JSON "header").

    ``versions``: more packages, named after python and before numpy in the first line.
    ``note`` is printed when fewer than 3 CPUs are usable.
    """
    header = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "mpx": mpx.__version__, ring_key: mpx.ring_implementation(),
        "numpy": np.__version__, **versions, "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)), "start_method": "spawn", "quick": quick,
    }
    more = "".join(f"{k} {v}, " for k, v in versions.items())
    print(f"mpx {header['mpx']} {what}  (python {header['python']}, {more}numpy "
          f"{header['numpy']}, {header['platform']})")
    print(f"os.cpu_count()={header['cpu_count']}  len(os.sched_getaffinity(0))="
          f"{header['affinity']}  start method=spawn  {ring_label}={header[ring_key]}"
          f"  mode={'quick' if quick else 'full'}")
    print(f"config: {mpx.Config.from_env().describe()}")
    if header["affinity"] < 3:
        print(f"note: only {header['affinity']} CPUs: {note}")
    print(flush=True)
    return header


def _fmt_val(st, unit):
    if st is None:
        return "-"
    if unit == "%":
        return f"{st['median']:.3f} %"
    if unit == "GB/s":
        return f"{st['median']:.2f} (p90 {st['p90']:.2f})"
    return f"{st['median']:.1f} (p90 {st['p90']:.1f})"


def print_table(rows):
    hdr = ("measurement", "mpx", "baseline", "ratio", "target", "result")
    lines = []
    for r in rows:
        res = "info" if r["passed"] is None else ("PASS" if r["passed"] else "FAIL")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}x"
        lines.append((f"{r['name']} [{r['unit']}]", _fmt_val(r["mpx"], r["unit"]),
                      _fmt_val(r["baseline"], r["unit"]), ratio, r["target"], res))
    w = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(hdr)]
    fmt = "  ".join(f"{{:<{x}}}" for x in w)
    print(fmt.format(*hdr))
    print(fmt.format(*("-" * x for x in w)))
    for line in lines:
        print(fmt.format(*line))
    notes = [f"  * {r['name']}: {r['note']}" for r in rows if r["note"]]
    if notes:
        print("notes:")
        print("\n".join(notes))


def write_png(rows, path, title, pad):
    """Bars of the ratios; the rows with an absolute target (unit "%") go in the title."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; --png {path} skipped")
        return
    rs = [r for r in rows if r["ratio"] is not None and r["unit"] != "%"]
    ratios = [r["ratio"] for r in rs]
    colors = ["tab:gray" if r["passed"] is None else ("tab:green" if r["passed"] else "tab:red")
              for r in rs]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rs) + pad))
    y = np.arange(len(rs))
    ax.barh(y, ratios, color=colors)
    for i, r in enumerate(rs):
        ax.text(ratios[i], i, f" {ratios[i]:.3g}x  (target {r['target']})", va="center",
                fontsize=8)
    ax.set_yticks(y)
    ax.set_yticklabels([r["name"] for r in rs], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("ratio mpx / baseline (green PASS, red FAIL, grey informational)")
    extra = [r for r in rows if r["unit"] == "%"]
    sub = "".join(f"\n{r['name']}: {r['mpx']['median']:.3f}% of a core (target {r['target']}, "
                  f"{'PASS' if r['passed'] else 'FAIL'})" for r in extra)
    ax.set_title(f"{title}{sub}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def finish(args, header, rows, raw, elapsed, *, timed, png_title, png_pad, reap_s=0.0,
           stray=None):
    """Print the table, the cleanup check and the SUMMARY line; write --json and --png.

    ``timed``: what the bandwidth's time is, in the line that explains the values.
    ``reap_s``: a pause before the cleanup check. ``stray``: a callable giving more pids of
    this run's children still alive (shown with the others, sorted; not in the JSON).
    """
    print()
    measure = ("latency in microseconds; bandwidth = 64 MiB / "
               f"{timed} (p90 = bandwidth at the p90 time)" if timed is not None else
               "rates: p90 = the 90th percentile of the rates")
    print(f"values: median (p90) over repetitions; {measure}; ratio = mpx / baseline")
    print()
    print_table(rows)
    print()
    if reap_s:
        time.sleep(reap_s)  # let the last children be reaped
    leftovers = leftover_segments()
    alive = [p.pid for p in mp.active_children()]
    shown = alive if stray is None else sorted(set(alive + stray()))
    judged = [r for r in rows if r["passed"] is not None]
    failed = [r["name"] for r in judged if not r["passed"]]
    print(f"cleanup: child processes alive: {shown or 'none'}; /dev/shm mpx segments left by "
          f"this run: {leftovers or 'none'}")
    print(f"SUMMARY: {len(judged) - len(failed)}/{len(judged)} targets met"
          + (f"; FAIL: {', '.join(failed)}" if failed else "")
          + f"  ({elapsed:.0f} s, {header['affinity']} CPUs)")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "elapsed_s": elapsed, "rows": rows, "raw": raw,
                       "leftover_segments": leftovers, "alive_children": alive}, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        write_png(rows, args.png, png_title, png_pad)


def timed_loop(fn, iters):
    """``iters`` calls of ``fn``; microseconds each, with the GC off."""
    out = [0] * iters
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for i in range(iters):
            t0 = clock()
            fn()
            out[i] = clock() - t0
    finally:
        gc.enable()
    return [x / 1e3 for x in out]


def interleaved(fns, warm, iters, blocks, settle_s):
    """{fn: microseconds per call}: every fn ``warm`` times and for ``settle_s`` first (the
    first round trips after a spawn are slow until the scheduler spreads the processes),
    then ``iters`` timed calls each, in ``blocks`` alternating in order so drift hits all."""
    end = time.perf_counter() + settle_s
    i = 0
    while i < warm or time.perf_counter() < end:
        for fn in fns:
            fn()
        i += 1
    out: dict = {fn: [] for fn in fns}
    per = max(1, iters // blocks)
    for b in range(blocks):
        for fn in (fns if b % 2 == 0 else fns[::-1]):
            out[fn].extend(timed_loop(fn, per))
    return out
