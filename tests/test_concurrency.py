"""Concurrency: THREADS Python threads call every op at once, each on its own buffers (on the GPU,
each on its own CUDA stream); every result must be bit-identical to a serial run of the same
inputs. And the last-error message is per thread: each thread triggers its own error, all threads
wait at a barrier, then each must read back exactly its own message."""
import threading

import numpy as np
import pytest

from bitnet_ffi import _ffi

from reference import (Memory, backend_io, c_value, make_every_op_inputs as make_inputs, run_every_op,
                       valid_call)

THREADS = 8
ITERATIONS = 4
BACKENDS = [pytest.param("cpu", marks=pytest.mark.cpu), pytest.param("gpu", marks=pytest.mark.gpu)]


def run_on(backend, inputs, stream):
    if backend == "cpu":
        return run_every_op(inputs, *backend_io("cpu"))
    import torch
    with torch.cuda.stream(stream):  # torch's own allocations and copies go to this stream too
        return run_every_op(inputs, *backend_io("gpu", stream), stream=stream)


def assert_same(got, want, where):
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), f"{where}: {name} differs from serial"


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_calling_every_op_match_serial_runs(backend, capsys):
    streams = [None] * THREADS
    if backend == "gpu":
        import torch
        streams = [torch.cuda.Stream() for _ in range(THREADS)]
    inputs = [make_inputs(1000 + t) for t in range(THREADS)]
    serial = [run_on(backend, inputs[t], streams[t]) for t in range(THREADS)]
    barrier = threading.Barrier(THREADS)
    failures, calls = [], [0] * THREADS

    def worker(t):
        try:
            barrier.wait()
            for i in range(ITERATIONS):
                assert_same(run_on(backend, inputs[t], streams[t]), serial[t],
                            f"thread {t}, iteration {i}")
                calls[t] += len(serial[t])
        except Exception as exc:  # reported by the main thread
            failures.append(f"thread {t}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, "\n".join(failures)
    with capsys.disabled():
        print(f"\n[concurrency] {backend}: {THREADS} threads x {ITERATIONS} rounds of every op, "
              f"{sum(calls)} outputs identical to serial runs")


# Each thread's own error: (entry point, argument changes, a number only its message has).
ERRORS = [("rmsnorm", {"T": -1001}, "-1001"), ("quantize_a8", {"N": -1002}, "-1002"),
          ("attention", {"causal": 1003}, "1003"), ("add_int32", {"n": -1004}, "-1004"),
          ("argmax", {"M": -1005}, "-1005"), ("gemv_bf16", {"K": 1006}, "1006"),
          ("relu2_gate", {"T": -1007}, "-1007"), ("embedding", {"V": -1008}, "-1008")]
ROUNDS = 50


@pytest.mark.parametrize("backend", BACKENDS)
def test_last_error_is_per_thread(backend):
    assert len(ERRORS) == THREADS
    mem = Memory(backend == "gpu")
    prepared = []
    for entry, changes, fragment in ERRORS:
        call = valid_call(entry, mem, np.random.default_rng(0))
        args = {**call.args, **changes}
        prepared.append((call.entry, [c_value(mem, call, n, v) for n, v in args.items()], fragment))
    barrier = threading.Barrier(THREADS)
    seen = [[] for _ in range(THREADS)]

    def worker(t):
        entry, args, _ = prepared[t]
        function = getattr(_ffi.lib(), "bitnet_" + entry)
        for _ in range(ROUNDS):
            status = function(*args)
            barrier.wait()  # every thread has failed before any reads its message
            seen[t].append((int(status), _ffi.last_error()))
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for t, (entry, _, fragment) in enumerate(prepared):
        others = [f for i, (_, _, f) in enumerate(prepared) if i != t]
        for status, message in seen[t]:
            assert status != 0 and fragment in message, (entry, status, message)
            assert not any(f in message for f in others), (entry, message)
        assert len(seen[t]) == ROUNDS
