"""What mpx/mechanism/codec.py and mpx/_driver/future_core.py need of Cython's ``cython`` module to
run as plain Python where Cython is not installed (it is a build dependency, not a runtime
one): ``compiled`` is False, and every other use of ``cython`` in them is inside an
``if cython.compiled:`` branch, which plain Python never runs."""

compiled = False
