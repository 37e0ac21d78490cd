"""Builds the Cython extensions: the hot path (tree builder, accept walk) and the CPU backend's kernels
(runtime/cpu_linear.h, runtime/cpu_attention.h; with OpenMP where the compiler has it). Everything else is pure
Python."""
import os
import sys
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

COMMON = dict(include_dirs=[np.get_include(), "runtime"], extra_compile_args=["-O3"],
              define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])
extensions = [Extension(f"runtime.{name}", [f"runtime/{name}.pyx"], **COMMON)
              for name in ("tree", "accept", "cpu_kernels")]


def _compiler_has_openmp(compiler) -> bool:
    """Compile and link a one-line OpenMP program with the compiler setuptools will use."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp_probe.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=["-fopenmp"])
            compiler.link_executable(objs, "omp_probe", output_dir=tmp, extra_postargs=["-fopenmp"])
        except Exception:
            return False
    return True


class BuildExt(build_ext):
    """cpu_kernels gets -fopenmp when the compiler takes it; without it its kernels run on one thread (said here)."""

    def build_extensions(self):
        if self.compiler.compiler_type == "unix" and _compiler_has_openmp(self.compiler):
            for ext in self.extensions:
                if ext.name == "runtime.cpu_kernels":
                    ext.extra_compile_args = ext.extra_compile_args + ["-fopenmp"]
                    ext.extra_link_args = ext.extra_link_args + ["-fopenmp"]
        else:
            print("ddtree setup: no OpenMP in this compiler; the CPU backend's kernels will use one thread",
                  file=sys.stderr)
        super().build_extensions()


setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    ),
    cmdclass={"build_ext": BuildExt},
)
