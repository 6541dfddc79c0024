"""A short script exits cleanly after an op that started OpenMP threads.

The workers may still be running when the interpreter shuts down; if libbitnet were unloaded then,
libgomp would go with it and a worker would crash in unmapped code (exit code 139). The library is
loaded with RTLD_NODELETE and linked with -z nodelete, so it stays for the life of the process.
OMP_WAIT_POLICY=ACTIVE keeps the workers spinning until exit (libgomp spins only while there are no
more threads than cores), which made every such run crash before; the default policy crashed in a
few percent of runs. Each script also checks that the op started worker threads, so that a pass
means something."""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bitnet_ffi import _ffi

pytestmark = pytest.mark.cpu

THREADS = max(2, min(8, len(os.sched_getaffinity(0))))
# [256, 4096] float32 is well above the work at which the CPU ops start OpenMP threads.
THREADS_BEFORE = """
import os
threads_before = len(os.listdir("/proc/self/task"))
"""
THREADS_STARTED = f"""
started = len(os.listdir("/proc/self/task")) - threads_before
assert started == {THREADS - 1}, f"the op started {{started}} threads, not {THREADS - 1}"
"""
CFFI_SCRIPT = """
import numpy as np, bitnet_ffi as bn
bn.library_version()
""" + THREADS_BEFORE + """
bn.quantize_a8(np.ones((256, 4096), np.float32))
""" + THREADS_STARTED
# Another loader that unloads the library explicitly: dlclose must not unload it.
CTYPES_SCRIPT = """
import ctypes, _ctypes, sys
import numpy as np
library = ctypes.CDLL(sys.argv[1])
x = np.ones((256, 4096), np.float32)
x_q, scales = np.empty(x.shape, np.int8), np.empty(256, np.float32)
""" + THREADS_BEFORE + """
status = library.bitnet_quantize_a8(
    ctypes.c_int32(-1), ctypes.c_void_p(x.ctypes.data), ctypes.c_int32(0), ctypes.c_int64(256),
    ctypes.c_int64(4096), ctypes.c_void_p(x_q.ctypes.data), ctypes.c_void_p(scales.ctypes.data),
    ctypes.c_void_p(None))
assert status == 0 and (x_q == 127).all(), status
""" + THREADS_STARTED + """
_ctypes.dlclose(library._handle)
"""


def run_many(script, runs, wait_policy, *args):
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("BITNET_", "OMP_"))}
    environment.update(OMP_NUM_THREADS=str(THREADS))
    if wait_policy:
        environment["OMP_WAIT_POLICY"] = wait_policy
    if "BITNET_LIB" in os.environ:  # the sanitizer run's library
        environment["BITNET_LIB"] = os.environ["BITNET_LIB"]

    def one(_):
        done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                              text=True, env=environment, timeout=60)
        return done.returncode, done.stderr[-2000:]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(runs)))
    failed = [(code, err) for code, err in results if code != 0]
    assert not failed, f"{len(failed)} of {runs} runs failed; first: exit code {failed[0][0]}, " \
                       f"stderr:\n{failed[0][1]}"


@pytest.mark.parametrize("wait_policy", ["ACTIVE", None])
def test_script_exits_cleanly_after_an_openmp_op(wait_policy):
    run_many(CFFI_SCRIPT, 12, wait_policy)


def test_dlclose_by_another_loader_leaves_the_library_loaded():
    library = next(p for p in _ffi.library_candidates() if p.is_file())
    run_many(CTYPES_SCRIPT, 8, "ACTIVE", str(Path(library).resolve()))
