"""Timing helpers of the CPU benchmarks: median wall time, and this machine's memory bandwidth as
numpy sees it (the anchor the CPU figures are reported against)."""
import statistics
import time

import numpy as np


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
