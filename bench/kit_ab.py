"""The paired A/B against another git revision: one child process a side (this tree, and git
revision REV checked out and built in a temporary worktree), both alive, taking turns in short
blocks. This VM's speed drifts by a third within seconds, so children run one after the other
compare the drift, not the code.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time

import kit_cpus
import kit_procs
import kit_stats
import kit_timing

import mpx

# After its block a side sleeps this long, so that its workers park (they yield for yield_us,
# 1 ms) before the other side's block.
AB_REST_S = 0.005

# With MPX_AB_PLACE in the environment (--ab-place), each side places its processes the same
# way: "apart", its driver on the first CPU and its workers on the others; "together", all on
# the first CPU. Left to the scheduler, a side's driver and worker share one CPU in some
# blocks and not in others (on 2 cores 35-45 us a plain-Python no-op against 20-25), and the
# blocks' ratios are that lottery's.
PLACE_ENV = "MPX_AB_PLACE"
PLACES = ("apart", "together")


def serve_ab(call, block, warm, idle_s=0.0, pids=()):
    """One side, in its child: once ``call`` is warm, print this mpx's path as JSON, then for each
    "go" line on stdin the us of ``block`` calls (after ``idle_s`` asleep). ``pids``: the
    workers', placed as MPX_AB_PLACE says (PLACES; unset: by the scheduler)."""
    if os.environ.get(PLACE_ENV) in PLACES:
        kit_cpus.place(pids, os.environ[PLACE_ENV])
    kit_timing.settle([call], kit_timing.SETTLE_S, min_rounds=warm)
    print(json.dumps({"mpx": mpx.__file__}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        time.sleep(idle_s)
        us = kit_timing.timed_us(call, block)
        time.sleep(AB_REST_S)
        print(json.dumps({"us": us}), flush=True)


class _Side:
    def __init__(self, tree, args, cwd, timeout):
        self.tree, self.timeout = tree, timeout
        self.proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=cwd,
                                     env=dict(os.environ, PYTHONPATH=tree))

    def answer(self):
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not (line := self.proc.stdout.readline() if ready else ""):
            raise RuntimeError(f"the A/B child of {self.tree} died or hung (exit {self.proc.poll()})")
        return json.loads(line)

    def ask(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.answer()["us"]

    def close(self):
        try:
            self.proc.stdin.close()  # end of input: the child shuts its executor down
            self.proc.wait(self.timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def ab_paired(rev, script, child_flag, child_args, blocks, timeout=120):
    """(stats of this tree's us, of REV's, the blocks' paired ratios): ``script child_flag
    child_args`` run with this tree's mpx and with REV's (this tree's bench/ on both sides), taking
    turns block by block, the first one alternating (both placed as PLACE_ENV says)."""
    root = kit_procs.ROOT
    out, git = {"new": [], "old": []}, ["git", "-C", root]
    with tempfile.TemporaryDirectory(prefix="mpx-ab-") as tmp:
        old, sides = os.path.join(tmp, "tree"), {}
        subprocess.run([*git, "worktree", "add", "--detach", old, rev], check=True, capture_output=True)
        try:
            subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=old,
                           check=True, capture_output=True)
            for name, tree in (("new", root), ("old", old)):
                sides[name] = _Side(tree, [os.path.abspath(script), child_flag, child_args], tmp, timeout)
                if not sides[name].answer()["mpx"].startswith(tree):
                    raise RuntimeError(f"the {name} side did not import {tree}'s mpx")
            for b in range(blocks):
                for name in (("new", "old") if b % 2 == 0 else ("old", "new")):
                    out[name].append(sides[name].ask())
        finally:
            for side in sides.values():
                side.close()
            subprocess.run([*git, "worktree", "remove", "--force", old], capture_output=True)
    return (kit_stats.stats([us for b in out["new"] for us in b]),
            kit_stats.stats([us for b in out["old"] for us in b]),
            kit_stats.paired(out["new"], out["old"]))
