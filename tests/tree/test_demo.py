"""``python -m mpx demo``, as a newcomer runs it: the MLP's outputs checked, and each step's
split into delivery, compute and return, judged against no-op calls carrying the same
tensors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def test_the_demo_checks_its_outputs_and_splits_each_step():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-m", "mpx", "demo", "--steps", "20"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outputs match the single-process MLP" in out.stdout, out.stdout
    split = re.search(r"median of 20: (\d+) us = delivery to rank 0 (\d+) us \+ compute and "
                      r"all-reduce (\d+) us \+ return (\d+) us", out.stdout)
    assert split, out.stdout
    total, deliver, compute, back = map(int, split.groups())
    assert compute > 0 and total >= compute, out.stdout
    assert deliver >= 0 and back >= 0, out.stdout  # (one clock: a negative leg is a bug)
    judged = re.search(r"RPC overhead \(delivery \+ return\) (\d+) us .*: ([\d.]+)x the round "
                       r"trip of a no-op carrying the same tensors \((\d+) us\)", out.stdout)
    assert judged and int(judged.group(3)) > 0, out.stdout
    assert out.stdout.rstrip().endswith("demo OK"), out.stdout
