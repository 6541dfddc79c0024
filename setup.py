"""Builds libbitnet.so with make while building the wheel, and ships it and bitnet.h (the loader
reads its declarations) inside the package. The build honours make's knobs from the environment:
BITNET_CPU_ONLY=1 (the CPU-only library even where nvcc exists), CUDA_ARCHS="90" (the GPU
architectures to compile; all default ones take minutes), CC, NVCC, CUDA_HOME. An editable install
(pip install -e) builds nothing: it loads the checkout's build/libbitnet.so, which `make` builds.
Everything else is in pyproject.toml."""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
KNOBS = ("BITNET_CPU_ONLY", "CUDA_ARCHS", "CC", "NVCC", "CUDA_HOME")


class BuildPyWithLibrary(build_py):
    """build_py, then `make` in the source tree (build/, reused when up to date) and a copy of the
    library and the header into the package."""

    def run(self):
        super().run()
        if self.editable_mode:
            print("bitnet-ffi: editable install: libbitnet.so is not built here; run `make`")
            return
        knobs = ", ".join(f"{k}={os.environ[k]}" for k in KNOBS if k in os.environ) or (
            "no knobs set: the CUDA backend for every default architecture where nvcc is found, "
            "else CPU-only")
        print(f"bitnet-ffi: building libbitnet.so with make ({knobs}); BITNET_CPU_ONLY=1 or "
              "CUDA_ARCHS=90 make it faster", flush=True)
        try:
            subprocess.run(["make", "-C", str(ROOT), "BUILD_DIR=build", "all"], check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise SystemExit(f"bitnet-ffi: building libbitnet.so failed ({exc}); it needs make "
                             "and a C compiler with OpenMP (and nvcc for the CUDA backend)")
        package = Path(self.build_lib) / "bitnet_ffi"
        shutil.copy2(ROOT / "build" / "libbitnet.so", package / "libbitnet.so")
        shutil.copy2(ROOT / "native" / "include" / "bitnet.h", package / "bitnet.h")


class NativeDistribution(Distribution):
    """Has native content (the library), so that the wheel is a platform wheel (platlib)."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """The library is no Python extension (cffi's ABI mode): the wheel fits any Python 3 on this
    platform."""

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(distclass=NativeDistribution,
      cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel})
