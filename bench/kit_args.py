"""A benchmark's command line: --quick, --png, --json, the bench's own options, and for an A/B
bench --ab REV, --ab-place and the hidden flag that makes a run one side of the A/B.
"""

from __future__ import annotations

import argparse
import os
import sys

import kit_ab


def parse_args(doc, quick_help, more=None, ab=None, argv=None):
    """--quick, --png, --json; ``more(parser)`` adds a bench's own options. ``ab``: ``(help,
    child_flag, child)`` adds ``--ab REV`` and the hidden ``child_flag``: a run given ``child_flag
    N,N,...`` is one side of the A/B and runs ``child(N, N, ...)``."""
    argv = sys.argv[1:] if argv is None else argv
    if ab is not None and ab[1] in argv:
        ab[2](*map(int, argv[argv.index(ab[1]) + 1].split(",")))
        sys.exit(0)
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[-1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--png", metavar="PATH", help="also plot the results (needs matplotlib)")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    if ab is not None:
        ap.add_argument("--ab", metavar="REV", help=ab[0])
        ap.add_argument("--ab-place", choices=kit_ab.PLACES, help="both A/B sides pin their driver "
                        "to one CPU and their workers to the others (apart) or to the same one (together)")
        ap.add_argument(ab[1], help=argparse.SUPPRESS)
    if more is not None:
        more(ap)
    args = ap.parse_args(argv)
    if getattr(args, "ab_place", None):
        os.environ[kit_ab.PLACE_ENV] = args.ab_place  # (the A/B's children inherit it)
    return args
