"""Helpers of the CPU benchmarks: median wall time, this machine's memory bandwidth as numpy sees
it (the anchor the CPU figures are reported against), and the CPU SIMD paths it runs."""
import statistics
import time

import numpy as np

import bitnet_ffi as bn


def time_s(fn, repeats=3):
    """Median seconds of `repeats` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidths():
    """(GB/s of a numpy copy of 1 GiB, counting read + write; GB/s of a numpy sum over 1 GiB)."""
    src = np.ones(1 << 30, np.uint8)
    dst = np.empty_like(src)
    copy_gbps = 2 * src.nbytes / time_s(lambda: np.copyto(dst, src)) / 1e9
    read_gbps = src.nbytes / time_s(lambda: src.view(np.uint64).sum()) / 1e9
    return copy_gbps, read_gbps


def available_isas():
    """The CPU SIMD paths this machine runs, in bn.set_cpu_isa's names; leaves "auto" selected."""
    isas = []
    for isa in ("portable", "avx2", "avx512-vnni"):
        try:
            bn.set_cpu_isa(isa)
            isas.append(isa)
        except bn.UnsupportedError:
            pass
    bn.set_cpu_isa("auto")
    return isas
