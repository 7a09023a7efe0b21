"""What mpx's one-source compiled modules (mechanism/codec.py and waiting.py,
transport/shm_end.py, the driver's futures core) need of Cython's ``cython`` module to run as
plain Python where Cython is not installed (it is a build dependency, not a runtime one):
``compiled`` is False. Each of them uses ``cython.compiled`` only to choose, once at import,
between the C primitives of a ``.pxd`` (cimported) and their plain versions, and for its
``IMPLEMENTATION``."""

compiled = False
