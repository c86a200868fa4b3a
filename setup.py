"""Build of Tidal's native CPU expert kernel (csrc/) as tidal/kernels/_cpu_experts*.so.

Project metadata lives in pyproject.toml; this file only adds the C++ library. It is a plain C ABI
library (no Python.h, no torch) that tidal/kernels/cpu_experts.py loads with ctypes. It is built as a
setuptools Extension so that it lands next to cpu_experts.py, in place for editable installs.

No global -march flag: the AVX2 / AVX-512 / AVX-512-BF16 code paths carry per-function target
attributes and the library picks one at run time, so one build runs on any x86-64 (and on aarch64
with the portable path). The extension is optional: if the compiler fails, the install still
succeeds and Tidal falls back to its torch path (kernel_available() is False).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_SOURCES = [
    "csrc/pool.cpp",
    "csrc/isa.cpp",
    "csrc/kernels_generic.cpp",
    "csrc/kernels_avx2.cpp",
    "csrc/kernels_avx512.cpp",
]
_HEADERS = ["csrc/cpu_experts.h", "csrc/microkernels.h"]


class _BuildExt(build_ext):
    """Compiles .cpp with C++17 flags and links with the C++ driver; no Python libs needed."""

    def build_extensions(self):
        compiler = self.compiler
        if compiler.compiler_type == "unix":
            # Python's CFLAGS carry C-only flags on some distributions; drop them for C++.
            for attr in ("compiler_so", "compiler", "compiler_cxx"):
                cmd = getattr(compiler, attr, None)
                if cmd:
                    setattr(compiler, attr, [a for a in cmd if a not in ("-Wstrict-prototypes",)])
        super().build_extensions()


def _native_extension():
    if sys.platform == "win32" or os.environ.get("TIDAL_NO_NATIVE", "") not in ("", "0"):
        return []
    cflags = ["-std=c++17", "-O3", "-pthread", "-fvisibility=hidden", "-fno-math-errno", "-DNDEBUG"]
    return [
        Extension(
            "tidal.kernels._cpu_experts",
            sources=_SOURCES,
            depends=_HEADERS,
            include_dirs=["csrc"],
            language="c++",
            extra_compile_args=cflags,
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]


setup(ext_modules=_native_extension(), cmdclass={"build_ext": _BuildExt})
