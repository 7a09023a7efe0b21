"""Statistics of the samples a benchmark takes: median, p90 and min, GB/s, and paired ratios.
"""

from __future__ import annotations

import statistics

MiB = 1 << 20
BIG = 64 * MiB  # the large payload of the bandwidth measurements


def stats(samples):
    """{"median", "p90" (linear interpolation), "min", "n"}."""
    xs = sorted(samples)
    p90 = statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]
    return {"median": statistics.median(xs), "p90": p90, "min": xs[0], "n": len(xs)}


def gbps(ts, nbytes=BIG):
    """GB/s stats from seconds per ``nbytes``: 'p90' is the GB/s at the p90 (slow) time."""
    s = stats(ts)
    return {"median": nbytes / s["median"] / 1e9, "p90": nbytes / s["p90"] / 1e9, "n": s["n"],
            "median_ms": s["median"] * 1e3}


def paired(xs, ys):
    """Sorted ratios of paired samples (or of blocks, lists, by their medians)."""
    def med(v):
        return statistics.median(v) if isinstance(v, list) else v
    return sorted(med(x) / med(y) for x, y in zip(xs, ys))


def quartiles(pairs):
    return f"{pairs[len(pairs) // 4]:.3f}-{pairs[3 * len(pairs) // 4]:.3f}x"
