"""Builds mpx/_ring.pyx. Set MPX_DEBUG=1 at build time for a build with C assertions."""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("MPX_DEBUG") == "1"
extra = ["-O0", "-g"] if debug else ["-O3"]
macros = [] if debug else [("NDEBUG", "1")]

ext = Extension(
    "mpx._ring",
    ["mpx/_ring.pyx"],
    include_dirs=["mpx"],
    extra_compile_args=extra,
    define_macros=macros,
)

setup(ext_modules=cythonize([ext], compiler_directives={"language_level": "3"},
                            compile_time_env={"MPX_DEBUG": debug}))
