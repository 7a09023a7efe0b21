"""Builds mpx/_ring.pyx and, in Cython's pure-Python mode (the .py, with the C types of its
.pxd, runs as plain Python where it is not compiled), the wait policy and the codec
(mpx/mechanism/waiting.py, codec.py), the shared-memory end (mpx/transport/shm_end.py) and
the driver's futures core (mpx/_driver/: locks, meter, core_settings, ledger, waiters,
future_core).

Without a C compiler or the Python headers the build warns and installs mpx without the
extensions: it then runs as pure Python (the ring's twin, every other module's .py; slower).
Set MPX_REQUIRE_EXTENSION=1 to make that a build error instead, and MPX_DEBUG=1 for an
unoptimised build with C assertions and the debug counters of mpx._debug (live segments,
rings and threads) switched on.
"""

import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

debug = os.environ.get("MPX_DEBUG") == "1"
required = os.environ.get("MPX_REQUIRE_EXTENSION") == "1"


class OptionalBuildExt(build_ext):
    """Treat a failed compile as 'no extension' unless MPX_REQUIRE_EXTENSION=1: all of them,
    since the compiled modules cimport each other (a compiled ring beside a plain waiting
    module would not import). After one fails, the others are not built, and those built
    already are removed, so mpx runs as one build: pure Python."""

    def run(self):
        self._failed = False
        try:
            super().run()
        except Exception as e:  # distutils raises several unrelated types here
            self._skip(e)
        if self._failed:
            self._remove_built()

    def build_extension(self, ext):
        if self._failed:
            return
        try:
            super().build_extension(ext)
        except Exception as e:
            self._skip(e)

    def _skip(self, e):
        if required:
            raise e
        self._failed = True
        sys.stderr.write(
            f"WARNING: mpx could not build its compiled modules ({e}); installing without "
            "them. mpx will run as pure Python, several times slower. Install a C compiler "
            "and the Python headers (e.g. apt-get install gcc python3-dev) and reinstall.\n")

    def _remove_built(self):
        for ext in self.extensions:
            relative = self.get_ext_filename(ext.name)
            for path in (os.path.join(self.build_lib, relative), relative):
                if os.path.exists(path):
                    os.remove(path)


def _extension(name: str, source: str) -> Extension:
    return Extension(
        name,
        [source],
        include_dirs=["mpx"],
        extra_compile_args=["-O0", "-g"] if debug else ["-O3"],
        # MPX_DEBUG: mpx._ring.DEBUG, which turns on mpx._debug's live-resource counters
        define_macros=[("MPX_DEBUG", "1")] if debug else [("NDEBUG", "1")],
    )


# Modules that cimport each other (the ring and waiting, the futures core's) are all built, or
# (without a compiler) none is used: each .py then runs as plain Python. mpx/mechanism/buffers.pxd
# is no module: its cdef inline functions compile into the codec and the ring, which cimport them.
extensions = [_extension("mpx.mechanism.codec", "mpx/mechanism/codec.py"),
              _extension("mpx._ring", "mpx/_ring.pyx"),
              _extension("mpx._driver.locks", "mpx/_driver/locks.py"),
              _extension("mpx._driver.meter", "mpx/_driver/meter.py"),
              _extension("mpx._driver.core_settings", "mpx/_driver/core_settings.py"),
              _extension("mpx._driver.ledger", "mpx/_driver/ledger.py"),
              _extension("mpx._driver.waiters", "mpx/_driver/waiters.py"),
              _extension("mpx._driver.future_core", "mpx/_driver/future_core.py"),
              _extension("mpx.mechanism.waiting", "mpx/mechanism/waiting.py"),
              _extension("mpx.transport.shm_end", "mpx/transport/shm_end.py")]

setup(
    ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}),
    cmdclass={"build_ext": OptionalBuildExt},
)
