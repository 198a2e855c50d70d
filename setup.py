"""Builds the C++ CPU kernels (`csrc/`) into `grpo_fast._C` with plain pybind11.

No torch headers: tensors cross the boundary as raw pointers and sizes, so the build takes
seconds, needs no torch in the build environment, and is not tied to the installed torch's ABI.
The Triton sources in `kernels/` install as `grpo_fast.kernels`.
"""

import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

ext = Pybind11Extension(
    "grpo_fast._C",
    sorted(glob.glob("csrc/*.cpp")),
    cxx_std=17,
    # Portable baseline (x86-64); the hot loops are multiversioned at run time (see csrc/).
    extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=fast"],
    extra_link_args=["-fopenmp"],
)

setup(
    packages=find_packages(include=["grpo_fast", "grpo_fast.*"]) + ["grpo_fast.kernels"],
    package_dir={"grpo_fast.kernels": "kernels"},
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext},
)
