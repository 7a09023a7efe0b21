"""What the environment asks of this test run, read in one place: the ring implementations
to test (``MPX_TEST_IMPL=cython|python``, default both) and the multiprocessing start method
of every process the tests start (``MPX_TEST_START_METHOD``, default spawn)."""

import os

IMPLS = [i for i in ("cython", "python") if os.environ.get("MPX_TEST_IMPL", i) == i]
START_METHOD = os.environ.get("MPX_TEST_START_METHOD", "spawn")
