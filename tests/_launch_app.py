"""The user's program of test_launch.py, run by ``python -m mpx launch`` on node 0: two
executors one after the other (nnodes, leader address and port from the environment), each
printing where its ranks are; then exits with the status given as argv[1]. With
``--hang`` it prints its pid and waits to be killed after the first call."""

from __future__ import annotations

import os
import sys
import time

import _workers

import mpx


def main() -> int:
    for round_ in (1, 2):
        with mpx.Executor(_workers.Echo, 4, heartbeat_s=1.0, startup_timeout_s=60) as ex:
            where = ex.collective_rpc(_workers.where)
            print(f"ROUND {round_} nnodes={ex.config.nnodes} "
                  f"ranks={[w[:3] for w in where]} pids={' '.join(str(w[4]) for w in where)}",
                  flush=True)
            if "--hang" in sys.argv:
                print(f"HANG {os.getpid()}", flush=True)
                time.sleep(120)
    return int(sys.argv[1])


if __name__ == "__main__":  # the workers are spawned: they import this module
    sys.exit(main())
