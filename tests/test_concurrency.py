"""Concurrency: THREADS Python threads call every op at once, each on its own buffers (on the GPU,
each on its own CUDA stream); every result must be bit-identical to a serial run of the same
inputs. And the last-error message is per thread: each thread triggers its own error, all threads
wait at a barrier, then each must read back exactly its own message."""
import threading

import ml_dtypes
import numpy as np
import pytest

import bitnet_ffi as bn
from bitnet_ffi import _ffi
from test_bad_input_matrix import Memory, c_value, valid_call

THREADS = 8
ITERATIONS = 4
BACKENDS = [pytest.param("cpu", marks=pytest.mark.cpu), pytest.param("gpu", marks=pytest.mark.gpu)]


def make_inputs(seed):
    """Small inputs for every op; attention and the layer glue in float16 (both backends run it)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, dtype=np.float32):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    return {
        "w": normal(96, 256), "x": normal(3, 256),
        "w_q": rng.integers(-1, 2, (40, 128), dtype=np.int8), "w_scales": normal(40) ** 2 + 0.1,
        "hidden": normal(4, 200), "norm_w": normal(200), "residual": normal(4, 200),
        "q": normal(2, 3, 4, 64, dtype=np.float16), "k": normal(2, 37, 2, 64, dtype=np.float16),
        "v": normal(2, 37, 2, 64, dtype=np.float16),
        "rq": normal(2, 3, 4, 64, dtype=np.float16), "rk": normal(2, 3, 2, 64, dtype=np.float16),
        "rv": normal(2, 3, 2, 64, dtype=np.float16),
        "k_cache": np.zeros((2, 9, 2, 64), np.float16), "v_cache": np.zeros((2, 9, 2, 64), np.float16),
        "gate_up": normal(5, 96, dtype=np.float16),
        "head_w": normal(50, 64, dtype=ml_dtypes.bfloat16), "head_x": normal(2, 64),
        "logits": normal(3, 500), "table": normal(40, 16),
        "ids": rng.integers(0, 40, 7).astype(np.int32),
        "counter": rng.integers(-1000, 1000, 33).astype(np.int32),
    }


def run_every_op(inputs, put, get, stream=None):
    """Runs every op once on fresh copies of `inputs`; returns every output as numpy."""
    d = {name: put(a) for name, a in inputs.items()}
    out = {}
    tw = bn.quantize_i2s(d["w"], stream=stream)
    out["packed"], out["w_scales"], out["unpacked"] = get(tw.packed), get(tw.scales), get(
        tw.unpack(stream=stream))
    x_q, s = bn.quantize_a8(d["x"], stream=stream)
    out["x_q"], out["x_scales"] = get(x_q), get(s)
    out["gemv_w2a8"] = get(bn.gemv_w2a8(tw, x_q, s, stream=stream))
    out["gemv_w2a8_i32"] = get(bn.gemv_w2a8(tw, x_q, s, out_dtype="int32", stream=stream))
    out["pack"] = get(bn.pack_ternary(d["w_q"], d["w_scales"], stream=stream).packed)
    out["rmsnorm"] = get(bn.rmsnorm(d["hidden"], d["norm_w"], stream=stream))
    y_q, y_s = bn.rmsnorm_quantize(d["hidden"], d["norm_w"], stream=stream)
    out["rms_q"], out["rms_scales"] = get(y_q), get(y_s)
    out["add_rmsnorm"] = get(bn.add_rmsnorm(d["hidden"], d["residual"], d["norm_w"], stream=stream))
    out["residual"] = get(d["residual"])
    out["attention"] = get(bn.attention(d["q"], d["k"], d["v"], seq_lens=[37, 20], stream=stream))
    bn.rope_append_kv(d["rq"], d["rk"], d["rv"], d["k_cache"], d["v_cache"], [0, 5], stream=stream)
    out["rope_q"], out["k_cache"], out["v_cache"] = get(d["rq"]), get(d["k_cache"]), get(d["v_cache"])
    out["relu2"] = get(bn.relu2_gate(d["gate_up"], stream=stream))
    out["gemv_bf16"] = get(bn.gemv_bf16(d["head_w"], d["head_x"], stream=stream))
    out["argmax"] = get(bn.argmax(d["logits"], stream=stream))
    out["embedding"] = get(bn.embedding(d["table"], d["ids"], stream=stream))
    bn.add_int32(d["counter"], 12345, stream=stream)
    out["counter"] = get(d["counter"])
    return out


def backend_io(backend, stream=None):
    """(put, get) for a backend: numpy copies, or torch tensors on cuda:0 read back after `stream`."""
    if backend == "cpu":
        return (lambda a: a.copy()), (lambda a: np.array(a, copy=True))
    import torch

    def put(a):
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.int16).copy()).cuda().view(torch.bfloat16)
        return torch.from_numpy(a.copy()).cuda()

    def get(t):
        stream.synchronize()
        if t.dtype == torch.bfloat16:
            return t.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.cpu().numpy()

    return put, get


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
