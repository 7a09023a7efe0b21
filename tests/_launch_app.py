"""The user's program of test_launch.py, run by ``python -m mpx launch`` on node 0: two
executors one after the other (nnodes, leader address and port from the environment), each
printing where its ranks are; then exits with the status given as argv[1].

- ``--hang``: print "HANG <pid>" after the first call and wait to be killed;
- ``--call-hang``: print "HANG <pid>", then make a call that never returns; when it fails,
  print "ERROR <type> node=<node> ranks=<ranks>" and exit with argv[1];
- ``--no-executor``: print "DONE" and exit at once (``--sleep S``: after S seconds).

A Ctrl-C ends it quietly ("INTERRUPTED"), by SIGINT."""

from __future__ import annotations

import os
import signal
import sys
import time

import _workers
from _env import START_METHOD

import mpx


def main() -> int:
    if "--no-executor" in sys.argv:
        if "--sleep" in sys.argv:
            time.sleep(float(sys.argv[sys.argv.index("--sleep") + 1]))
        print("DONE", flush=True)
        return int(sys.argv[1])
    for round_ in (1, 2):
        with mpx.Executor(_workers.Echo, 4, startup_timeout_s=60,
                          start_method=START_METHOD) as ex:  # heartbeat_s: MPX_HEARTBEAT_S
            where = ex.collective_rpc(_workers.where)
            print(f"ROUND {round_} nnodes={ex.config.nnodes} "
                  f"ranks={[w[:3] for w in where]} pids={' '.join(str(w[4]) for w in where)}",
                  flush=True)
            if "--hang" in sys.argv:
                print(f"HANG {os.getpid()}", flush=True)
                time.sleep(120)
            if "--call-hang" in sys.argv:
                print(f"HANG {os.getpid()}", flush=True)
                try:
                    ex.collective_rpc("sleep", args=(120,))
                except mpx.MpxError as e:
                    print(f"ERROR {type(e).__name__} node={getattr(e, 'node_rank', None)} "
                          f"ranks={getattr(e, 'ranks', None)}", flush=True)
                    return int(sys.argv[1])
    return int(sys.argv[1])


if __name__ == "__main__":  # the workers are spawned: they import this module
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
