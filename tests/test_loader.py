"""The loader, the ABI as the header declares it, and the status -> exception path."""
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import bitnet_ffi
from bitnet_ffi import _ffi, errors
from conftest import builds_the_library

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.cpu


def declared_functions():
    return set(re.findall(r"\bbitnet_status\s+(bitnet_\w+)\s*\(", _ffi._header_declarations()))


def exported_functions(library):
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], check=True,
                         capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith("bitnet_")}


def run_python(code, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("BITNET_")}
    environment.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environment, cwd=str(REPO))


def test_header_and_library_export_the_same_functions():
    library = _ffi.library_candidates()
    loaded = next(p for p in library if p.is_file())
    assert declared_functions(), "no declarations found between the CDEF markers"
    assert exported_functions(loaded) == declared_functions()


@builds_the_library
def test_cpu_only_build_exports_the_same_abi(tmp_path):
    build = subprocess.run(["make", "-s", f"BUILD_DIR={tmp_path}", "BITNET_CPU_ONLY=1"],
                           cwd=REPO, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    assert "CPU-only" in build.stdout
    assert exported_functions(tmp_path / "libbitnet.so") == declared_functions()
    probe = run_python("import bitnet_ffi; from bitnet_ffi import _ffi\n"
                       "c = _ffi.ffi.new('int32_t *'); r = _ffi.ffi.new('const char **')\n"
                       "_ffi.call('device_count', c, r); print(c[0], _ffi.ffi.string(r[0]).decode())\n"
                       "try:\n    bitnet_ffi.DeviceArray((4,), 'float32', 0)\n"
                       "except bitnet_ffi.NoDeviceError as e:\n    print('NoDeviceError', e)\n",
                       BITNET_LIB=str(tmp_path / "libbitnet.so"))
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith("0 this libbitnet was built without CUDA")
    assert "NoDeviceError CUDA device 0 does not exist (0 found: this libbitnet was built without CUDA" \
        in probe.stdout


def test_bad_bitnet_lib_names_the_path_and_make():
    result = run_python("import bitnet_ffi; bitnet_ffi.library_version()",
                        BITNET_LIB="/nonexistent/libbitnet.so")
    assert result.returncode != 0
    assert "LibraryNotFoundError" in result.stderr
    assert "/nonexistent/libbitnet.so (not found)" in result.stderr
    assert "make" in result.stderr


def test_not_a_library_is_reported(tmp_path):
    fake = tmp_path / "libbitnet.so"
    fake.write_text("not an ELF file")
    result = run_python("import bitnet_ffi; bitnet_ffi.library_version()", BITNET_LIB=str(fake))
    assert result.returncode != 0
    assert "LibraryNotFoundError" in result.stderr and str(fake) in result.stderr


def test_missing_library_lists_every_path_tried(tmp_path):
    """An installed package (no Makefile beside it) is told to reinstall; a checkout to run make."""
    package = tmp_path / "bitnet_ffi"
    shutil.copytree(REPO / "bitnet_ffi", package, ignore=shutil.ignore_patterns("*.so"))
    shutil.copy(REPO / "native" / "include" / "bitnet.h", package / "bitnet.h")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("BITNET_")}

    def load_error():
        result = subprocess.run([sys.executable, "-c", "import bitnet_ffi; bitnet_ffi.library_version()"],
                                capture_output=True, text=True, cwd=str(tmp_path), env=environment)
        assert result.returncode != 0
        assert f"{package / 'libbitnet.so'} (not found)" in result.stderr
        assert f"{tmp_path / 'build' / 'libbitnet.so'} (not found)" in result.stderr
        return result.stderr

    installed = load_error()
    assert "reinstall the package from its source" in installed and "Run `make`" not in installed
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "native").mkdir()
    assert f"Run `make` in {tmp_path} to build it" in load_error()


def test_failed_load_is_retried():
    """A bad BITNET_LIB fails every time with the same error; once fixed, the next call works."""
    library = next(p for p in _ffi.library_candidates() if p.is_file())
    result = run_python(
        "import os, bitnet_ffi\n"
        "for _ in range(3):\n"
        "    try:\n        bitnet_ffi.library_version()\n"
        "    except bitnet_ffi.LibraryNotFoundError as e:\n        print('LibraryNotFoundError', e)\n"
        f"os.environ['BITNET_LIB'] = {str(library)!r}\n"
        "print(bitnet_ffi.library_version())\n", BITNET_LIB="/nonexistent/libbitnet.so")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and len(set(lines[:3])) == 1, result.stdout
    assert "/nonexistent/libbitnet.so (not found)" in lines[0]
    assert lines[3] == str(bitnet_ffi.library_version())


def test_bitnet_lib_may_name_a_folder(tmp_path):
    library = next(p for p in _ffi.library_candidates() if p.is_file())
    result = run_python("import bitnet_ffi; print(bitnet_ffi.library_version())",
                        BITNET_LIB=str(library.parent))
    assert result.returncode == 0, result.stderr
    empty = run_python("import bitnet_ffi; bitnet_ffi.library_version()", BITNET_LIB=str(tmp_path))
    assert f"{tmp_path / 'libbitnet.so'} (not found)" in empty.stderr


def test_version_is_the_same_everywhere():
    """The header's BITNET_VERSION_* macros, bitnet_get_version, the package and pyproject.toml."""
    header = (REPO / "native" / "include" / "bitnet.h").read_text()
    macros = tuple(int(re.search(rf"^#define BITNET_VERSION_{part} (\d+)$", header, re.M).group(1))
                   for part in ("MAJOR", "MINOR", "PATCH"))
    pyproject = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert bitnet_ffi.library_version() == macros
    assert bitnet_ffi.__version__ == pyproject.group(1) == ".".join(map(str, macros))


@pytest.mark.parametrize("status,cls", [(1, errors.InvalidArgumentError),
                                        (2, errors.UnsupportedError), (3, errors.NoDeviceError),
                                        (4, errors.OutOfMemoryError), (5, errors.CudaError),
                                        (6, errors.InternalError), (99, errors.BitNetError)])
def test_every_status_maps_to_its_exception(status, cls):
    _ffi.lib().bitnet_malloc(0, -1, _ffi.ffi.new("void **"))  # leaves a known message behind
    with pytest.raises(cls) as info:
        _ffi.check(status)
    assert type(info.value) is cls and info.value.status == status
    assert "nbytes must not be negative, got -1" in str(info.value)
    assert isinstance(info.value, errors.BitNetError)


def test_ok_status_raises_nothing():
    assert _ffi.check(0) is None


def test_invalid_argument_carries_the_library_message():
    with pytest.raises(errors.InvalidArgumentError, match="nbytes must not be negative, got -5"):
        _ffi.call("malloc", 0, -5, _ffi.ffi.new("void **"))


def test_no_device_for_an_absent_device_index():
    info = _ffi.ffi.new("bitnet_device_info *")
    with pytest.raises(errors.NoDeviceError, match="device 4096|without CUDA"):
        _ffi.call("device_get_info", 4096, info)
    with pytest.raises(errors.InvalidArgumentError, match="not a CUDA device index"):
        _ffi.call("device_get_info", -1, info)


def test_last_error_is_per_thread():
    barrier = threading.Barrier(2)
    seen = {}

    def fail_with(nbytes):
        _ffi.lib().bitnet_malloc(0, nbytes, _ffi.ffi.new("void **"))
        barrier.wait()  # both threads have failed before either reads its message
        seen[nbytes] = _ffi.last_error()

    threads = [threading.Thread(target=fail_with, args=(n,)) for n in (-7, -8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "got -7" in seen[-7] and "got -8" in seen[-8]
