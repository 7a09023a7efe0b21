"""The command line, ``python -m mpx <command>`` (internal).

- ``main``: the argument parser and the commands (cleanup, doctor, demo, node, launch,
  top, bench);
- ``top``: ``python -m mpx top``, the live view of an executor's stats socket;
- ``launch``, ``hostlist``: ``python -m mpx launch``, one line for every node of a Slurm or
  torchrun-style job (and Slurm's host lists);
- ``doctor``: what mpx finds on this machine, and whether an executor can start here;
- ``demo``, ``demo_mlp``: the demos (the MessageQueue alone; a tensor-parallel MLP);
- ``bench``: ``python -m mpx bench``, mpx against Pipe, Queue, zmq and ProcessPoolExecutor:
  it runs bench/bench_compare.py of the source checkout beside the package (the benchmarks
  and their kit, bench/kit_*.py, are not shipped in the package).

Runs in the user's shell process; it may import anything in mpx, and nothing imports it.
"""
