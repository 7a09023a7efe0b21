"""What the environment asks of this test run, read in one place: the ring implementations
to test (``MPX_TEST_IMPL=cython|python``, default both; only python in a run started with
``MPX_PURE_PYTHON=1``, whose process loads the pure build of every module the compiled ring
would need) and the multiprocessing start method
of every process the tests start (``MPX_TEST_START_METHOD``, default spawn)."""

import os

_PURE = os.environ.get("MPX_PURE_PYTHON", "").strip().lower() in {"1", "true", "yes", "on"}
IMPLS = [i for i in ("cython", "python")
         if os.environ.get("MPX_TEST_IMPL", "python" if _PURE else i) == i]
START_METHOD = os.environ.get("MPX_TEST_START_METHOD", "spawn")
# the tests' root folder (tests/): where the support modules (_workers.py, _procs.py, ...)
# are, which processes a test starts put on their path
TESTS = os.path.dirname(os.path.abspath(__file__))
