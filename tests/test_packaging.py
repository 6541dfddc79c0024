"""Packaging: a wheel built from a clean copy of the checkout (through its sdist, as `python -m
build` does) installs into a fresh virtual environment and runs ops from another folder; `make
install` gives a C program the library, its SONAME links and the header."""
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

import bitnet_ffi as bn
from conftest import builds_the_library

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.cpu, builds_the_library]


def clean_environment(**extra):
    """This environment without the library's knobs, Python's paths, and an outer make's state
    (under `make test`, MAKELEVEL would stop the build's make from running jobs in parallel)."""
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("BITNET_", "PYTHON")) and
                   k not in ("CUDA_ARCHS", "MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    environment.update(extra)
    return environment


def clean_copy(destination):
    """The checkout's files as git sees them (tracked, and new ones not ignored): no build/, .venv."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout, no clean copy to build from: {exc}")
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (REPO / name).is_file():  # a tracked file deleted in the working tree is left out
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, destination / name)


@pytest.mark.slow
def test_wheel_from_a_clean_checkout_runs_ops_in_a_fresh_venv(tmp_path, rng):
    source, dist, elsewhere = tmp_path / "source", tmp_path / "dist", tmp_path / "elsewhere"
    source.mkdir()
    elsewhere.mkdir()
    clean_copy(source)
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist),
                            str(source)], capture_output=True, text=True, timeout=900,
                           env=clean_environment(BITNET_CPU_ONLY="1"))
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "bitnet-ffi: building libbitnet.so with make (BITNET_CPU_ONLY=1)" in built.stdout
    assert "built the CPU-only library" in built.stdout

    version = bn.__version__
    with tarfile.open(dist / f"bitnet_ffi-{version}.tar.gz") as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for needed in ("Makefile", "setup.py", "pyproject.toml", "native/bitnet.map",
                   "native/include/bitnet.h", "native/src/quantize.c", "native/src/cpu/quantize.c",
                   "native/src/cuda/quantize.cu", "bitnet_ffi/_ffi.py"):
        assert needed in names, f"the sdist lacks {needed}"
    assert not [name for name in names if name.endswith((".so", ".o"))]

    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    wheel = dist / f"bitnet_ffi-{version}-py3-none-{platform}.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"bitnet_ffi-{version}.dist-info/METADATA").decode()
    assert {"bitnet_ffi/libbitnet.so", "bitnet_ffi/bitnet.h", "bitnet_ffi/_ffi.py"} <= names
    for dependency in ("cffi", "numpy", "ml_dtypes"):
        assert f"Requires-Dist: {dependency}" in metadata

    # A fresh venv with the wheel alone; its dependencies (numpy, cffi, ml_dtypes) are taken from
    # this environment through a path file, which adds the folder but runs none of its own path
    # files (the editable install of the checkout among them), so that no network is needed.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                                "-q", "--no-deps", "--no-index", str(wheel)],
                               capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path("
                                "'purelib'))"], capture_output=True, text=True,
                               check=True).stdout.strip())
    import cffi
    import ml_dtypes
    dependency_folders = {str(Path(m.__file__).resolve().parents[1]) for m in (np, cffi, ml_dtypes)}
    (site / "dependencies_from_the_test.pth").write_text("\n".join(sorted(dependency_folders)))

    x = rng.standard_normal((3, 256)).astype(np.float32)
    w = rng.standard_normal((5, 256)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "w.npy", w)
    script = ("import sys, numpy as np, bitnet_ffi as bn\n"
              "from bitnet_ffi import _ffi\n"
              "x, w = np.load(sys.argv[1] + '/x.npy'), np.load(sys.argv[1] + '/w.npy')\n"
              "x_q, s = bn.quantize_a8(x)\n"
              "np.save(sys.argv[1] + '/y.npy', bn.gemv_w2a8(bn.quantize_i2s(w), x_q, s))\n"
              "print(bn.__file__); print(_ffi.loaded_path)\n")
    ran = subprocess.run([str(python), "-c", script, str(tmp_path)], capture_output=True,
                         text=True, cwd=elsewhere, env=clean_environment(), timeout=120)
    assert ran.returncode == 0, ran.stderr
    package_file, library = ran.stdout.split()
    assert Path(package_file).parent == site / "bitnet_ffi"
    assert Path(library) == site / "bitnet_ffi" / "libbitnet.so"
    x_q, s = bn.quantize_a8(x)  # the checkout's library: the same CPU code, bit for bit
    assert np.array_equal(np.load(tmp_path / "y.npy"), bn.gemv_w2a8(bn.quantize_i2s(w), x_q, s))

    cli = subprocess.run([str(venv / "bin" / "bitnet-ffi"), "--version"], capture_output=True,
                         text=True, cwd=elsewhere, env=clean_environment())
    assert cli.returncode == 0, cli.stderr
    assert f"bitnet-ffi {version}, libbitnet {version} ({site / 'bitnet_ffi'}" in cli.stdout
    help_text = subprocess.run([str(venv / "bin" / "bitnet-ffi"), "--help"], capture_output=True,
                               text=True, cwd=elsewhere, env=clean_environment()).stdout
    assert help_text.startswith("usage: bitnet-ffi ")


C_PROGRAM = r"""
#include <bitnet.h>
#include <stdio.h>

int main(void) {
    int32_t major, minor, patch;
    if (bitnet_get_version(&major, &minor, &patch) != BITNET_OK) return 1;
    if (major != BITNET_VERSION_MAJOR || minor != BITNET_VERSION_MINOR ||
        patch != BITNET_VERSION_PATCH) return 2;
    float x[128], scale;
    int8_t x_q[128];
    for (int i = 0; i < 128; i++) x[i] = (float)(i - 64);
    if (bitnet_quantize_a8(BITNET_DEVICE_CPU, x, BITNET_DTYPE_F32, 1, 128, x_q, &scale, NULL))
        return 3;
    printf("%d.%d.%d %d %d %g\n", major, minor, patch, x_q[0], x_q[127], scale);
    return 0;
}
"""


def test_make_install_serves_a_c_program(tmp_path):
    prefix, build = tmp_path / "prefix", tmp_path / "build"
    done = subprocess.run(["make", "-s", "install", f"PREFIX={prefix}", f"BUILD_DIR={build}",
                           "BITNET_CPU_ONLY=1"], cwd=REPO, capture_output=True, text=True,
                          env=clean_environment())
    assert done.returncode == 0, done.stderr
    version = bn.__version__
    soname = "libbitnet.so." + ".".join(version.split(".")[:2])
    lib = prefix / "lib"
    assert (lib / f"libbitnet.so.{version}").is_file()
    assert os.readlink(lib / soname) == f"libbitnet.so.{version}"
    assert os.readlink(lib / "libbitnet.so") == soname
    assert (prefix / "include" / "bitnet.h").read_text() == \
        (REPO / "native" / "include" / "bitnet.h").read_text()

    (tmp_path / "program.c").write_text(C_PROGRAM)
    compiled = subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", str(tmp_path / "program.c"),
                               f"-I{prefix / 'include'}", f"-L{lib}", "-lbitnet", "-o",
                               str(tmp_path / "program")], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    needed = subprocess.run(["readelf", "-d", str(tmp_path / "program")], capture_output=True,
                            text=True, check=True).stdout
    assert f"Shared library: [{soname}]" in needed
    ran = subprocess.run([str(tmp_path / "program")], capture_output=True, text=True,
                         env=clean_environment(LD_LIBRARY_PATH=str(lib)))
    assert ran.returncode == 0, ran.stderr
    # x_q = rint(x * 127 / 64): -127 for -64, 125 (125.02 rounded) for 63.
    assert ran.stdout.split() == [version, "-127", "125", "1.98438"]
