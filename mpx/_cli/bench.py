"""``python -m mpx bench [--quick] [--png PATH] [--json PATH]``: mpx.Executor next to
multiprocessing.Pipe, multiprocessing.Queue, pyzmq and ProcessPoolExecutor.

The benchmark itself, and the kit every benchmark shares, live in the source checkout's
bench/ folder beside the package (bench/bench_compare.py, bench/kit_*.py): this command runs
it from there, and says what to do when mpx was installed without one (from a wheel).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mpx


def bench_dir() -> Path:
    """Where a source checkout keeps its benchmarks: bench/ beside the mpx package."""
    return Path(mpx.__file__).resolve().parent.parent / "bench"


def run(args: argparse.Namespace) -> int:
    where = bench_dir()
    if not (where / "bench_compare.py").is_file():
        print(f"python -m mpx bench: no benchmarks at {where} (mpx is installed without its "
              "source checkout): clone the mpx repository, pip install -e . in it, and run "
              "python -m mpx bench (or python bench/bench_compare.py) there", file=sys.stderr)
        return 2
    sys.path.insert(0, str(where))  # (spawn children inherit it)
    import bench_compare

    return int(bench_compare.run(args))
