"""A benchmark's PNG plots (matplotlib, imported on demand: the mpx[bench] extra): any figure,
and the bar chart of a report's mpx / baseline ratios.
"""

from __future__ import annotations


def write_png(path, draw, **subplots):
    """``draw(fig, axes)`` fills ``matplotlib.pyplot.subplots(**subplots)``, saved to ``path``;
    without matplotlib, say so and skip."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed (pip install 'mpx[bench]'); {path} skipped")
        return
    fig, axes = plt.subplots(**subplots)
    draw(fig, axes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def ratio_bars(path, rows, title):
    """The ``rows`` (kit_report.row) that have a ratio as horizontal bars on a log scale, green
    where they met their target, red where they did not, grey where informational."""
    def draw(fig, ax):
        ratios = [r["ratio"] for r in rows]
        ax.barh(range(len(rows)), ratios, color=["tab:gray" if r["passed"] is None else "tab:green"
                                                 if r["passed"] else "tab:red" for r in rows])
        for i, r in enumerate(rows):
            ax.text(ratios[i], i, f" {ratios[i]:.3g}x ({r['target']})", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("mpx / baseline (green PASS, red FAIL, grey informational)")
        ax.set_title(title, fontsize=9)
    write_png(path, draw, figsize=(9, 0.45 * len(rows) + 1.5))
