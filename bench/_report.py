"""What the bench/ scripts share beyond mpx._cli.benchkit (the machinery they share with
``python -m mpx bench``): their result rows, the table and ratio chart of those rows, the
SUMMARY line, bandwidth statistics and their option parser.

The scripts run as ``python bench/<script>.py``, which puts this folder on sys.path (also
in their spawn children).
"""

from __future__ import annotations

import argparse
import sys
import time

from mpx._cli.benchkit import (
    add_arguments,
    child_pids,
    print_cleanup,
    print_table,
    settle,
    stats,
    time_calls,
    write_json,
    write_png,
)

MiB = 1 << 20
BIG = 64 * MiB


def last_cpu(pid):
    """The CPU ``pid`` last ran on (field 39 of /proc/<pid>/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


# --------------------------------------------------------------------------- numbers

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


def timed_us(fn, iters, warm=0):
    """``time_calls`` in microseconds."""
    return [t * 1e6 for t in time_calls(fn, iters, warm)]


def interleaved(fns, warm, iters, blocks, settle_s):
    """{fn: microseconds per call}: every fn ``warm`` times and for ``settle_s`` first (the
    first round trips after a spawn are slow until the scheduler spreads the processes),
    then ``iters`` timed calls each, in ``blocks`` alternating in order so drift hits all."""
    settle(fns, settle_s, min_rounds=warm)
    out: dict = {fn: [] for fn in fns}
    per = max(1, iters // blocks)
    for b in range(blocks):
        for fn in (fns if b % 2 == 0 else fns[::-1]):
            out[fn].extend(timed_us(fn, per))
    return out


# --------------------------------------------------------------------------- report

def parse_args(doc, quick_help, more=None, ab=None):
    """The common options (--quick, --png, --json); ``more(parser)`` adds a bench's own.

    ``ab``: ``(help, child_flag, child)`` adds ``--ab REV`` (A/B against a git revision) and
    the hidden ``child_flag``: a run given ``child_flag N,N,...`` is one side of the A/B, so
    it runs ``child(N, N, ...)`` and exits.
    """
    if ab is not None:
        ab_help, child_flag, child = ab
        if child_flag in sys.argv:
            child(*map(int, sys.argv[sys.argv.index(child_flag) + 1].split(",")))
            sys.exit(0)
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_arguments(ap, quick_help)
    if ab is not None:
        ap.add_argument("--ab", metavar="REV", help=ab_help)
        ap.add_argument(child_flag, help=argparse.SUPPRESS)
    if more is not None:
        more(ap)
    return ap.parse_args()


def _fmt_val(st, unit):
    if st is None:
        return "-"
    if unit == "%":
        return f"{st['median']:.3f} %"
    if unit == "GB/s":
        return f"{st['median']:.2f} (p90 {st['p90']:.2f})"
    return f"{st['median']:.1f} (p90 {st['p90']:.1f})"


def print_table_rows(rows):
    hdr = ("measurement", "mpx", "baseline", "ratio", "target", "result")
    lines = []
    for r in rows:
        res = "info" if r["passed"] is None else ("PASS" if r["passed"] else "FAIL")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}x"
        lines.append((f"{r['name']} [{r['unit']}]", _fmt_val(r["mpx"], r["unit"]),
                      _fmt_val(r["baseline"], r["unit"]), ratio, r["target"], res))
    print_table(hdr, lines)
    notes = [f"  * {r['name']}: {r['note']}" for r in rows if r["note"]]
    if notes:
        print("notes:")
        print("\n".join(notes))


def _draw_ratios(rows, title):
    """Bars of the ratios; the rows with an absolute target (unit "%") go in the title."""
    rs = [r for r in rows if r["ratio"] is not None and r["unit"] != "%"]

    def draw(fig, ax):
        ratios = [r["ratio"] for r in rs]
        colors = ["tab:gray" if r["passed"] is None else
                  ("tab:green" if r["passed"] else "tab:red") for r in rs]
        y = range(len(rs))
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
        sub = "".join(f"\n{r['name']}: {r['mpx']['median']:.3f}% of a core (target "
                      f"{r['target']}, {'PASS' if r['passed'] else 'FAIL'})" for r in extra)
        ax.set_title(f"{title}{sub}", fontsize=9)
    return draw, len(rs)


def finish(args, header, rows, raw, elapsed, *, timed, png_title, png_pad, reap_s=0.0):
    """Print the table, the cleanup check and the SUMMARY line; write --json and --png.

    ``timed``: what the bandwidth's time is, in the line that explains the values.
    ``reap_s``: a pause before the cleanup check.
    """
    print()
    measure = ("latency in microseconds; bandwidth = 64 MiB / "
               f"{timed} (p90 = bandwidth at the p90 time)" if timed is not None else
               "rates: p90 = the 90th percentile of the rates")
    print(f"values: median (p90) over repetitions; {measure}; ratio = mpx / baseline")
    print()
    print_table_rows(rows)
    print()
    if reap_s:
        time.sleep(reap_s)  # let the last children be reaped
    alive, leftovers = print_cleanup(child_pids)
    judged = [r for r in rows if r["passed"] is not None]
    failed = [r["name"] for r in judged if not r["passed"]]
    print(f"SUMMARY: {len(judged) - len(failed)}/{len(judged)} targets met"
          + (f"; FAIL: {', '.join(failed)}" if failed else "")
          + f"  ({elapsed:.0f} s, {header['affinity']} CPUs)")

    if args.json:
        write_json(args.json, {"header": header, "elapsed_s": elapsed, "rows": rows,
                               "raw": raw, "leftover_segments": leftovers,
                               "alive_children": alive})
    if args.png:
        draw, n = _draw_ratios(rows, png_title)
        write_png(args.png, draw, figsize=(9, 0.45 * n + png_pad))
