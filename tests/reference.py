"""What the test modules share: the float64 / exact numpy references of the ops, their tolerances,
the input makers and runners that several modules use (the op tests, test_fuzz.py, the
concurrency and resource tests), and the C-ABI call builder of the bad-input matrix. Test modules
import from here and from conftest.py only, never from each other."""
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

import bitnet_ffi
import bitnet_ffi as bn
from bitnet_ffi import _arrays, _ffi


# attention (test_attention.py)
def reference_attention(q, k, v, causal=True, scale=None, seq_lens=None, rows=None):
    """float64 attention; q [B, Sq, Hq, D], k and v [B, C, Hkv, D]; only query rows `rows` (all when
    None) are computed, the others are NaN."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Sq, Hq, D = q.shape
    C, Hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = np.full(q.shape, np.nan)
    rows = np.arange(Sq) if rows is None else np.asarray(rows)
    for b in range(B):
        L = C if seq_lens is None else int(seq_lens[b])
        kb = np.repeat(k[b, :L], Hq // Hkv, axis=1)            # [L, Hq, D]
        vb = np.repeat(v[b, :L], Hq // Hkv, axis=1)
        s = np.einsum("ihd,jhd->hij", q[b, rows], kb) * scale   # [Hq, rows, L]
        if causal:
            s[:, np.arange(L)[None, :] > (L - Sq + rows)[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[b, rows] = np.einsum("hij,jhd->ihd", p, vb)
    return out


# Bound on |out - reference| relative to max |v|: the GPU rounds the probabilities to the input dtype
# before the P.V product and every backend rounds the output; 4 ulps of the dtype cover both.
ATTENTION_TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 1.6e-2}


def make_attention_inputs(rng, dtype, B, Sq, Hq, Hkv, D, C, spread=1.0):
    """Random q, k, v as numpy arrays of `dtype` (normal, q scaled by `spread`)."""
    nd = _arrays.numpy_dtype(dtype)
    q = (rng.standard_normal((B, Sq, Hq, D)) * spread).astype(nd)
    k = rng.standard_normal((B, C, Hkv, D)).astype(nd)
    v = (rng.standard_normal((B, C, Hkv, D)) + 0.5).astype(nd)
    return q, k, v


# gemv_w2a8 (test_gemv_w2a8.py)
def ref_gemv(w_q, w_scales, x_q, x_scales):
    """(exact int64 dot [N, M], float64 y [N, M])."""
    dot = x_q.astype(np.int64) @ w_q.astype(np.int64).T
    return dot, dot * w_scales.astype(np.float64)[None, :] / x_scales.astype(np.float64)[:, None]


def float32_rule(dot, w_scales, x_scales):
    return (dot.astype(np.float32) * w_scales[None, :]) / x_scales[:, None]


def cpu_isas():
    lib, isas = _ffi.lib(), []
    for index, name in enumerate(bn.ternary.CPU_ISAS[1:], start=1):
        if lib.bitnet_cpu_set_isa(index) == 0:
            isas.append(name)
    lib.bitnet_cpu_set_isa(0)
    return isas


# layer_glue (test_layer_glue.py)
def reference_rope(x, positions, theta):
    """Rotate-half RoPE in float64; x [B, S, H, D], token s of sequence b at positions[b] + s."""
    x = np.asarray(x, dtype=np.float64)
    B, S, H, D = x.shape
    half = D // 2
    pos = np.asarray(positions, dtype=np.float64)[:, None] + np.arange(S)[None, :]    # [B, S]
    angle = pos[..., None] * theta ** (-2.0 * np.arange(half) / D)                    # [B, S, half]
    cos, sin = np.cos(angle)[:, :, None, :], np.sin(angle)[:, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def reference_relu2_gate(gate_up):
    gate_up = np.asarray(gate_up, dtype=np.float64)
    F = gate_up.shape[-1] // 2
    return np.maximum(gate_up[..., :F], 0) ** 2 * gate_up[..., F:]


# Rotation and gate run in float32 on float32 inputs, then round once to the dtype: 1 ulp of the
# output dtype (relative to the row's magnitude for RoPE), 2 for float16/bfloat16 with float32
# angle products; float32 results within a few float32 ulps.
ROPE_TOL = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}

GATE_TOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}

GATE_ATOL = {"float32": 1e-38, "float16": 2.0 ** -24, "bfloat16": 1e-38}  # float16 subnormal spacing


# quantize (test_quantize.py)
def ref_scales(w, row_segments=None):
    """Per-row float32 scales: mean |w| of the row's segment in float64, floored at 1e-5."""
    counts = row_segments or [w.shape[0]]
    absw = np.abs(w.astype(np.float64))
    scales, row = [], 0
    for rows in counts:
        scale = np.float32(max(absw[row:row + rows].mean(), 1e-5))
        scales += [scale] * rows
        row += rows
    return np.array(scales, dtype=np.float32)


def ref_codes(w, scales):
    """clamp(rint(w / scale), -1, 1) in float32 (numpy's rint rounds half to even)."""
    q = np.rint(w.astype(np.float32) / scales[:, None].astype(np.float32))
    return np.clip(q, -1, 1).astype(np.int8)


def ref_pack(w_q):
    """Weight 16g+4i+b of a row -> byte 4g+b, bits 2i..2i+1, as code w+1."""
    M, K = w_q.shape
    codes = (w_q.astype(np.int16) + 1).astype(np.uint8).reshape(M, K // 16, 4, 4)  # [m, g, i, b]
    return (codes << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(
        axis=2, dtype=np.uint8).reshape(M, K // 4)


def ref_quantize_a8(x):
    x = x.astype(np.float32)
    s = (np.float32(127) / np.maximum(np.abs(x).max(axis=-1), np.float32(1e-5))).astype(np.float32)
    q = np.clip(np.rint(x * s[..., None]), -128, 127).astype(np.int8)
    return q, s


# rmsnorm (test_rmsnorm.py)
RMSNORM_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}


UINT = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}


def reference_rmsnorm(x, weight, eps, residual=None):
    """float64 RMSNorm: (y [T, H] float64, the new residual as it must be stored, or None)."""
    new_residual = None
    if residual is not None:
        # One float32 add rounded once to the dtype is the correctly rounded sum (float32 carries
        # more than 2p + 2 bits for p = 8, 11), so the stored residual is exact: compared bit for bit.
        new_residual = (residual.astype(np.float32) + x.astype(np.float32)).astype(x.dtype)
        x = new_residual
    v = x.astype(np.float64)
    y = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * weight.astype(np.float64)
    return y, new_residual


def reference_allreduce_rms(xs, rows, n, norm_cols, eps):
    """bitnet_peer_allreduce_rms's arithmetic in numpy float32, before the rounding to y's dtype:
    the ranks' x = [rows * n partial sums | rows sums of squares] summed in rank order, then each
    row times 1 / sqrt(its sum of squares / norm_cols + eps)."""
    total = np.zeros(rows * n + rows, np.float32)
    for x in xs:
        total += x
    factor = np.float32(1) / np.sqrt(total[rows * n:] / np.float32(norm_cols) + np.float32(eps))
    return total[:rows * n].reshape(rows, n) * factor[:, None]


def reference_rmsnorm_quantize(y):
    """quantize_a8 applied to the float64 norm: (codes, float32 scales, mask of near-ties)."""
    scales = (127.0 / np.maximum(np.abs(y).max(axis=-1), 1e-5)).astype(np.float32)
    scaled = y * scales.astype(np.float64)[..., None]
    codes = np.clip(np.rint(scaled), -128, 127).astype(np.int8)
    near_tie = np.abs(scaled - np.floor(scaled) - 0.5) < TIE_BAND
    return codes, scales, near_tie


# |y - ref| <= RTOL * |ref| + ATOL. float32: a sum of squares adds at most H/16 terms per partial
# sum on the CPU (<= 512 here) and fewer on the GPU, so it is off by < 512 * 2^-24 = 3e-5
# relatively, halved by the square root, plus three roundings. The 16-bit dtypes add the final
# rounding to the dtype (2^-11, 2^-8). ATOL: half the dtype's smallest subnormal step.
RMSNORM_RTOL = {"float32": 2e-5, "float16": 2.0**-11 + 2e-5, "bfloat16": 2.0**-8 + 2e-5}

RMSNORM_ATOL = {"float32": 2.0**-150, "float16": 2.0**-25, "bfloat16": 2.0**-134}


# y * scale = 127 * v * w / max|v * w| exactly (the RMS factor cancels); float32 evaluation leaves
# about 7 roundings, <= 127 * 7 * 2^-24 = 5.3e-5 absolute. A code may differ from the reference by
# one only where the reference y * scale lies within TIE_BAND of a k + 0.5 boundary.
TIE_BAND = 2e-4


# The scales carry the RMS factor's error: the float32 bound.
SCALE_RTOL = RMSNORM_RTOL["float32"]


def make_rmsnorm_inputs(rng, T, H, dtype, magnitude=1.0):
    """x, weight, residual of `dtype`: normal values, each row scaled by 10^U(-1, 1) * magnitude,
    weights around 1 (none zero)."""
    row_scale = 10.0 ** rng.uniform(-1, 1, size=(T, 1)) * magnitude
    x = (rng.standard_normal((T, H)) * row_scale).astype(RMSNORM_DTYPES[dtype])
    residual = (rng.standard_normal((T, H)) * row_scale).astype(RMSNORM_DTYPES[dtype])
    weight = (rng.choice([-1, 1], H) * rng.uniform(0.25, 2.0, H)).astype(RMSNORM_DTYPES[dtype])
    return x, weight, residual


def poisoned(shape, dtype):
    if dtype == "int8":
        return np.full(shape, 0x7F, np.int8)
    return np.full(shape, np.nan, RMSNORM_DTYPES[dtype])


def run_rmsnorm(variant, x, weight, eps, residual, put, get):
    """Runs one variant with poisoned outputs passed in; returns host copies of what it wrote."""
    dtype = x.dtype.name
    xd, wd = put(x), put(weight)
    res = put(residual.copy()) if "add" in variant else None
    y = put(poisoned(x.shape, dtype)) if variant != "quant" else None
    q = put(poisoned(x.shape, "int8")) if "quant" in variant else None
    s = put(poisoned(x.shape[:-1], "float32")) if "quant" in variant else None
    if variant == "norm":
        assert bitnet_ffi.rmsnorm(xd, wd, eps, out=y) is y
    elif variant == "add":
        assert bitnet_ffi.add_rmsnorm(xd, res, wd, eps, out=y) is y
    else:
        got = bitnet_ffi.rmsnorm_quantize(xd, wd, eps, residual=res, out=(q, s), y_out=y)
        assert got[0] is q and got[1] is s
    written = {"y": y, "residual": res, "y_q": q, "scales": s}
    return {name: get(a) for name, a in written.items() if a is not None}


def assert_close(got, ref, dtype, what="y"):
    got64 = got.astype(np.float64)
    err = np.abs(got64 - ref)
    bound = RMSNORM_RTOL[dtype] * np.abs(ref) + RMSNORM_ATOL[dtype]
    bad = ~(err <= bound)  # NaN (an unwritten element) counts as bad
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, np.inf, err / bound)), err.shape)
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements out of bounds, e.g. at "
                             f"{i}: got {got64[i]!r}, reference {ref[i]!r}")


def check_quantized(q, s, y_ref):
    """Scales within SCALE_RTOL; codes exact except near-ties, which may be off by one. Returns the
    number of near-tie codes that differ."""
    codes, scales, near_tie = reference_rmsnorm_quantize(y_ref)
    assert np.all(np.abs(s.astype(np.float64) - scales) <= SCALE_RTOL * scales), "scales"
    diff = q.astype(np.int32) - codes
    assert np.all(np.abs(diff) <= 1), f"codes off by more than one: {np.argwhere(np.abs(diff) > 1)[:5]}"
    off = diff != 0
    assert not np.any(off & ~near_tie), f"codes differ away from ties at {np.argwhere(off & ~near_tie)[:5]}"
    return int(off.sum())


def check_rmsnorm(variant, got, x, weight, eps, residual):
    """Checks every output of `variant` against the reference; returns the reference norm."""
    y_ref, res_ref = reference_rmsnorm(x, weight, eps, residual if "add" in variant else None)
    if res_ref is not None:
        u = UINT[x.dtype.name]
        assert np.array_equal(got["residual"].view(u), res_ref.view(u)), "residual not exact"
    if "y" in got:
        assert_close(got["y"], y_ref, x.dtype.name)
    if "y_q" in got:
        off = check_quantized(got["y_q"], got["scales"], y_ref)
        print(f"{variant}: {off} near-tie codes differ by one")
    return y_ref


def relu2_values(gate_up):
    """v as bitnet_relu2_gate stores it: max(gate, 0)^2 * up in float32, rounded to the dtype (numpy
    float32 arithmetic is IEEE, and its casts round to nearest even: exact)."""
    g, u = np.split(gate_up.astype(np.float32), 2, axis=-1)
    relu = np.where(g < 0, np.float32(0), g)
    with np.errstate(over="ignore"):
        return (relu * relu * u).astype(gate_up.dtype)


def poisoned_outputs(gate_up, with_y, put):
    """Poisoned y_q [..., F], scales [...] and, with_y, y [..., F] of gate_up's dtype."""
    shape = gate_up.shape[:-1] + (gate_up.shape[-1] // 2,)
    return (put(poisoned(shape, "int8")), put(poisoned(shape[:-1], "float32")),
            put(poisoned(shape, gate_up.dtype.name)) if with_y else None)


def host_outputs(q, s, y, get):
    return {name: get(a) for name, a in {"y": y, "y_q": q, "scales": s}.items() if a is not None}


def run_gated(gate_up, weight, eps, with_y, put, get):
    """relu2_rmsnorm_quantize with poisoned outputs (y_out too when with_y); host copies of them."""
    q, s, y = poisoned_outputs(gate_up, with_y, put)
    got = bitnet_ffi.relu2_rmsnorm_quantize(put(gate_up), put(weight), eps, out=(q, s), y_out=y)
    assert got[0] is q and got[1] is s
    return host_outputs(q, s, y, get)


def run_two_ops(gate_up, weight, eps, with_y, put, get, gate_on_cpu=False):
    """relu2_gate then rmsnorm_quantize, both where `put` puts arrays; with gate_on_cpu the gate
    runs on the CPU and its output is uploaded (the GPU relu2_gate has no float32)."""
    v = put(bitnet_ffi.relu2_gate(gate_up)) if gate_on_cpu else bitnet_ffi.relu2_gate(put(gate_up))
    q, s, y = poisoned_outputs(gate_up, with_y, put)
    bitnet_ffi.rmsnorm_quantize(v, put(weight), eps, out=(q, s), y_out=y)
    return host_outputs(q, s, y, get)


def assert_rmsnorm_bit_identical(got, want):
    assert set(got) == set(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), f"{name} differs from the two ops"


def check_gated(got, gate_up, weight, eps):
    """y and the codes against the float64 norm of v = relu2_gate(gate_up) as stored; returns
    the reference y."""
    assert "y_q" in got
    return check_rmsnorm("relu2_quant", got, relu2_values(gate_up), weight, eps, None)


# bad_input_matrix (test_bad_input_matrix.py)
NULL, MISALIGNED, HOST, PAST_LAST_DEVICE = "NULL", "MISALIGNED", "HOST", "PAST_LAST_DEVICE"
ffi = _ffi.ffi


SLACK = 64  # spare bytes after every buffer, so that a misaligned pointer stays inside it


class Memory:
    """Allocates the arrays of a call on the CPU (numpy) or on CUDA device 0 (torch), each
    64-byte aligned with SLACK spare bytes, and reads them back as bytes."""

    def __init__(self, gpu):
        self.gpu = gpu
        self.device = 0 if gpu else -1
        self.keep = []  # host copies passed as HOST mutations stay alive until the call returns

    def put(self, host):
        host = np.ascontiguousarray(host)
        raw = np.zeros(host.nbytes + 2 * SLACK, np.uint8)
        start = -raw.ctypes.data % SLACK
        buffer = raw[start:start + host.nbytes + SLACK]
        buffer[:host.nbytes] = host.view(np.uint8).reshape(-1)
        if not self.gpu:
            return buffer
        import torch
        return torch.from_numpy(buffer).cuda()

    def ptr(self, array):
        return array.data_ptr() if self.gpu else array.ctypes.data

    def host_copy_ptr(self, array):
        host = Memory(False).put(self.read(array))
        self.keep.append(host)
        return host.ctypes.data

    def read(self, array):
        if self.gpu:
            import torch
            torch.cuda.synchronize()
            return array.cpu().numpy().copy()
        return array.copy()


def poison(shape, dtype):
    """0x7f bytes: a NaN in every float dtype, 127 in int8, a large int32."""
    return np.full(int(np.prod(shape)) * _arrays.ITEMSIZE[dtype], 0x7F, np.uint8)


def values(rng, shape, dtype):
    data = rng.standard_normal(shape).astype(np.float32)
    return data.astype(_arrays.numpy_dtype(dtype)).view(np.uint8).reshape(-1)


@dataclass
class Out:
    """A scalar output parameter (int32_t *, void **, ...), pre-filled with a sentinel."""
    ctype: str


@dataclass
class Struct:
    """A struct argument: passed by pointer when ctype is given (a struct pointer type), else a
    struct member of its parent, by value. Its fields hold values as a Call's args do (arrays,
    numbers, Structs); a mutation names a field by its path, "config.H", "weights.qkv.w_packed"."""
    ctype: object
    fields: dict


@dataclass
class Call:
    """One valid call: the C arguments by name in order, and which of them are written."""
    entry: str
    args: dict
    outputs: tuple


def lookup(args, path):
    """The value at a dotted path of a Call's args ("h", "weights.qkv.w_packed")."""
    head, _, rest = path.partition(".")
    value = args[head]
    return lookup(value.fields, rest) if rest else value


def with_changes(args, changes):
    """A copy of a Call's args with each change (by dotted path) applied; Structs on a changed path
    are copied, so the valid call's own stay as they were."""
    args = dict(args)
    for path, value in changes.items():
        head, _, rest = path.partition(".")
        if rest and isinstance(args.get(head), Struct):
            value = Struct(args[head].ctype, with_changes(args[head].fields, {rest: value}))
        args[head] = value
    return args


def float_dtype(mem):
    """The float dtype of the attention and glue calls: float32 runs on the CPU only."""
    return "float16" if mem.gpu else "float32"


def valid_call(entry, mem, rng):
    """The valid call of `entry` on `mem` (CPU or CUDA device 0)."""
    d, put = mem.device, mem.put
    fd = float_dtype(mem)
    code = _arrays.DTYPE_CODES[fd]
    if entry == "quantize_i2s":
        return Call(entry, dict(device=d, w=put(values(rng, (3, 128), "float32")), w_dtype=0, M=3,
                                K=128, row_segments=NULL, n_segments=0,
                                w_packed=put(poison((3, 32), "uint8")),
                                w_scales=put(poison((3,), "float32")), stream=NULL),
                    ("w_packed", "w_scales"))
    if entry == "pack_ternary":
        w_q = rng.integers(-1, 2, (3, 128), dtype=np.int8)
        return Call(entry, dict(device=d, w_q=put(w_q), M=3, K=128,
                                w_packed=put(poison((3, 32), "uint8")), stream=NULL), ("w_packed",))
    if entry == "unpack_ternary":
        return Call(entry, dict(device=d, w_packed=put(rng.integers(0, 255, 96, dtype=np.uint8)),
                                M=3, K=128, w_q=put(poison((3, 128), "int8")), stream=NULL),
                    ("w_q",))
    if entry == "quantize_a8":
        return Call(entry, dict(device=d, x=put(values(rng, (2, 128), "float32")), x_dtype=0, N=2,
                                K=128, x_q=put(poison((2, 128), "int8")),
                                x_scales=put(poison((2,), "float32")), stream=NULL),
                    ("x_q", "x_scales"))
    if entry == "gemv_w2a8":
        return Call(entry, dict(device=d, w_packed=put(rng.integers(0, 255, 96, dtype=np.uint8)),
                                w_scales=put(np.ones(3, np.float32)), M=3, K=128,
                                x_q=put(rng.integers(-128, 128, 256, dtype=np.int8)),
                                x_scales=put(np.full(2, 50.0, np.float32)), N=2,
                                y=put(poison((2, 3), "float32")), y_dtype=0, stream=NULL), ("y",))
    if entry == "gemv_w2a8_block_scaled":
        return Call(entry, dict(device=d, w_packed=put(rng.integers(0, 255, 192, dtype=np.uint8)),
                                w_scales=put(np.ones(3, np.float32)),
                                block_scales=put(np.full((3, 1), 0.5, np.float32)), M=3, K=256,
                                x_q=put(rng.integers(-128, 128, 512, dtype=np.int8)),
                                x_scales=put(np.full(2, 50.0, np.float32)), N=2,
                                y=put(poison((2, 3), "float32")), y_dtype=0, stream=NULL), ("y",))
    if entry == "rmsnorm":
        return Call(entry, dict(device=d, dtype=0, T=2, H=8, x=put(values(rng, (2, 8), "float32")),
                                residual=put(values(rng, (2, 8), "float32")),
                                weight=put(values(rng, (8,), "float32")), eps=1e-5,
                                y=put(poison((2, 8), "float32")), y_q=put(poison((2, 8), "int8")),
                                y_scales=put(poison((2,), "float32")), stream=NULL),
                    ("residual", "y", "y_q", "y_scales"))
    if entry == "relu2_rmsnorm":  # float32 runs on the GPU too
        return Call(entry, dict(device=d, dtype=0, T=2, F=8,
                                gate_up=put(values(rng, (2, 16), "float32")),
                                weight=put(values(rng, (8,), "float32")), eps=1e-5,
                                y=put(poison((2, 8), "float32")), y_q=put(poison((2, 8), "int8")),
                                y_scales=put(poison((2,), "float32")), stream=NULL),
                    ("y", "y_q", "y_scales"))
    if entry == "glu_rmsnorm":  # weight NULL (no norm) is valid: GLU_NORM_MUTATIONS give one
        return Call(entry, dict(device=d, dtype=0, T=2, F=8, activation=1,
                                gate_up=put(values(rng, (2, 16), "float32")),
                                weight=put(values(rng, (8,), "float32")), eps=1e-5,
                                y=put(poison((2, 8), "float32")), y_q=put(poison((2, 8), "int8")),
                                y_scales=put(poison((2,), "float32")), stream=NULL),
                    ("y", "y_q", "y_scales"))
    if entry == "rmsnorm_partial":
        return Call(entry, dict(device=d, dtype=0, T=2, H=8, x=put(values(rng, (2, 8), "float32")),
                                weight=put(values(rng, (8,), "float32")),
                                y_q=put(poison((2, 8), "int8")), y_scales=put(poison((2,), "float32")),
                                sumsq=put(poison((2,), "float32")), stream=NULL),
                    ("y_q", "y_scales", "sumsq"))
    if entry == "glu_rmsnorm_partial":
        return Call(entry, dict(device=d, dtype=0, T=2, F=8, activation=0,
                                gate_up=put(values(rng, (2, 16), "float32")),
                                weight=put(values(rng, (8,), "float32")),
                                y_q=put(poison((2, 8), "int8")), y_scales=put(poison((2,), "float32")),
                                sumsq=put(poison((2,), "float32")), stream=NULL),
                    ("y_q", "y_scales", "sumsq"))
    if entry == "attention":
        q, kv = (1, 2, 4, 64), (1, 5, 2, 64)
        return Call(entry, dict(device=d, dtype=code, B=1, Sq=2, Hq=4, Hkv=2, D=64,
                                q=put(values(rng, q, fd)), k=put(values(rng, kv, fd)),
                                v=put(values(rng, kv, fd)), C=5,
                                seq_lens=put(np.array([4], np.int32)), causal=1, scale=0.0,
                                out=put(poison(q, fd)), workspace=put(poison((1 << 16,), "uint8")),
                                workspace_bytes=1 << 16, stream=NULL), ("out",))
    if entry == "attention_workspace_size":
        return Call(entry, dict(device=d, B=1, Sq=2, Hq=4, Hkv=2, D=64, C=5,
                                bytes=Out("int64_t *")), ("bytes",))
    if entry == "rope_append_kv":
        qkv, q, cache = (2, 3, 8, 8), (2, 3, 4, 8), (2, 6, 2, 8)
        return Call(entry, dict(device=d, dtype=code, B=2, S=3, Hq=4, Hkv=2, D=8,
                                qkv=put(values(rng, qkv, fd)), q=put(poison(q, fd)),
                                k_cache=put(poison(cache, fd)), v_cache=put(poison(cache, fd)), C=6,
                                positions=put(np.array([0, 3], np.int32)), theta=10000.0,
                                stream=NULL), ("q", "k_cache", "v_cache"))
    if entry == "attention_rope_append_kv":
        qkv, q, cache = (2, 1, 8, 64), (2, 1, 4, 64), (2, 5, 2, 64)
        return Call(entry, dict(device=d, dtype=code, B=2, Hq=4, Hkv=2, D=64,
                                qkv=put(values(rng, qkv, fd)), k_cache=put(values(rng, cache, fd)),
                                v_cache=put(values(rng, cache, fd)), C=5,
                                positions=put(np.array([0, 4], np.int32)), theta=10000.0, scale=0.0,
                                out=put(poison(q, fd)), workspace=put(poison((1 << 16,), "uint8")),
                                workspace_bytes=1 << 16, stream=NULL),
                    ("k_cache", "v_cache", "out"))
    if entry == "gemv_w2a8_rope_append_kv":  # Hq = 2, Hkv = 1, D = 8: 32 rows of K = 128
        return Call(entry, dict(device=d, dtype=code,
                                w_packed=put(rng.integers(0, 255, 32 * 32, dtype=np.uint8)),
                                w_scales=put(np.ones(32, np.float32)), K=128,
                                x_q=put(rng.integers(-128, 128, 128, dtype=np.int8)),
                                x_scale=put(np.full(1, 50.0, np.float32)), Hq=2, Hkv=1, D=8,
                                q=put(poison((2, 8), fd)), k_cache=put(poison((3, 1, 8), fd)),
                                v_cache=put(poison((3, 1, 8), fd)), C=3,
                                position=put(np.array([1], np.int32)), theta=10000.0,
                                stream=NULL), ("q", "k_cache", "v_cache"))
    if entry == "gemv_w2a8_add_norm_stats":  # M = 32 rows: on a GPU a grid of 8 blocks
        return Call(entry, dict(device=d, dtype=code,
                                w_packed=put(rng.integers(0, 255, 32 * 32, dtype=np.uint8)),
                                w_scales=put(np.ones(32, np.float32)), M=32, K=128,
                                x_q=put(rng.integers(-128, 128, 128, dtype=np.int8)),
                                x_scale=put(np.full(1, 50.0, np.float32)),
                                h=put(values(rng, (32,), fd)), norm_weight=put(values(rng, (32,), fd)),
                                stats=put(poison((16, 2), "float32")), slots=16, stream=NULL),
                    ("h", "stats"))
    if entry in ("rmsnorm_gemv_w2a8", "rmsnorm_gemv_w2a8_rope_append_kv"):
        stats = np.zeros((4, 2), np.float32)
        stats[0] = (128.0, 2.5)  # a sum of squares and max |h w| the values could have
        normed = dict(device=d, dtype=code, h=put(values(rng, (128,), fd)),
                      norm_weight=put(values(rng, (128,), fd)), stats=put(stats), slots=4, eps=1e-5,
                      w_packed=put(rng.integers(0, 255, 32 * 32, dtype=np.uint8)),
                      w_scales=put(np.ones(32, np.float32)))
        if entry == "rmsnorm_gemv_w2a8":
            return Call(entry, dict(**normed, M=32, K=128, y=put(poison((32,), "float32")),
                                    y_dtype=0, stream=NULL), ("y",))
        return Call(entry, dict(**normed, K=128, Hq=2, Hkv=1, D=8, q=put(poison((2, 8), fd)),
                                k_cache=put(poison((3, 1, 8), fd)),
                                v_cache=put(poison((3, 1, 8), fd)), C=3,
                                position=put(np.array([1], np.int32)), theta=10000.0,
                                stream=NULL), ("q", "k_cache", "v_cache"))
    if entry == "relu2_gate":
        return Call(entry, dict(device=d, dtype=code, T=3, F=5, gate_up=put(values(rng, (3, 10), fd)),
                                out=put(poison((3, 5), fd)), stream=NULL), ("out",))
    if entry == "glu_gate":
        return Call(entry, dict(device=d, dtype=code, T=3, F=5, activation=1,
                                gate_up=put(values(rng, (3, 10), fd)), out=put(poison((3, 5), fd)),
                                stream=NULL), ("out",))
    if entry == "gemv_bf16":
        return Call(entry, dict(device=d, w=put(values(rng, (3, 16), "bfloat16")), M=3, K=16,
                                x=put(values(rng, (2, 16), "float32")), x_dtype=0, N=2,
                                y=put(poison((2, 3), "float32")), y_dtype=0, stream=NULL), ("y",))
    if entry == "argmax":
        return Call(entry, dict(device=d, x=put(values(rng, (2, 7), "float32")), N=2, M=7,
                                index=put(poison((2,), "int32")), stream=NULL), ("index",))
    if entry == "sample":
        return Call(entry, dict(device=d, logits=put(values(rng, (2, 7), "float32")), N=2, V=7,
                                seed=5, counters=put(np.array([3, 9], np.int32)), temperature=1.0,
                                top_k=3, top_p=0.9, index=put(poison((2,), "int32")), stream=NULL),
                    ("index",))
    if entry == "embedding":
        return Call(entry, dict(device=d, dtype=0, table=put(values(rng, (5, 8), "float32")), V=5,
                                H=8, ids=put(np.array([4, 0, 2], np.int32)), N=3,
                                out=put(poison((3, 8), "float32")), stream=NULL), ("out",))
    if entry == "add_int32":
        return Call(entry, dict(device=d, x=put(np.arange(5, dtype=np.int32)), n=5, delta=3,
                                stream=NULL), ("x",))
    if entry in ("decode_layer", "decode_layer_workspace_size"):
        return decode_layer_call(entry, mem, rng, code, fd)
    raise KeyError(entry)


def decode_layer_call(entry, mem, rng, code, fd):
    """The valid call of bitnet_decode_layer (or its workspace size): H = I = Hq D = 128, SiLU, a
    4-row cache at position 0 (only the row the call writes is read)."""
    config = Struct("bitnet_decode_layer_config *", dict(
        H=128, I=128, Hq=2, Hkv=1, D=64, activation=1, eps=1e-5, attn_sub_eps=1e-5,
        ffn_sub_eps=1e-5, theta=10000.0, attention_scale=0.0))
    if entry == "decode_layer_workspace_size":
        return Call(entry, dict(device=mem.device, dtype=code, config=config,
                                bytes=Out("int64_t *")), ("bytes",))
    _ffi.lib()  # declares the struct types
    nbytes, sizes = ffi.new("int64_t *"), []
    for device in {mem.device, -1}:  # room for both: the device=-1 mutation must fail elsewhere
        _ffi.call("decode_layer_workspace_size", device, code, ffi.new(config.ctype, config.fields),
                  nbytes)
        sizes.append(nbytes[0])
    put = mem.put

    def ternary(rows, cols):
        return Struct(None, dict(w_packed=put(rng.integers(0, 255, rows * cols // 4, dtype=np.uint8)),
                                 w_scales=put(np.full(rows, 0.05, np.float32))))

    weights = Struct("bitnet_decode_layer_weights *", dict(
        qkv=ternary(256, 128), o=ternary(128, 128), gate_up=ternary(256, 128),
        down=ternary(128, 128), **{name: put(values(rng, (128,), fd)) for name in (
            "attn_norm", "attn_sub_norm", "ffn_norm", "ffn_sub_norm")}))
    cache = (4, 1, 64)
    return Call(entry, dict(device=mem.device, dtype=code, config=config, weights=weights,
                            h=put(values(rng, (128,), fd)), k_cache=put(poison(cache, fd)),
                            v_cache=put(poison(cache, fd)), C=4,
                            position=put(np.array([0], np.int32)),
                            workspace=put(poison((max(sizes),), "uint8")),
                            workspace_bytes=max(sizes), stream=NULL),
                ("h", "k_cache", "v_cache", "workspace"))


def c_value(mem, call, name, value):
    """The cffi argument for `value` of argument `name` of `call` (a dotted path for a field of a
    Struct)."""
    if isinstance(value, Struct):
        fields = {field: c_value(mem, call, f"{name}.{field}", v) for field, v in value.fields.items()}
        return fields if value.ctype is None else ffi.new(value.ctype, fields)
    if isinstance(value, str):
        if value == NULL:
            return ffi.NULL
        if value == MISALIGNED:
            return ffi.cast("void *", mem.ptr(lookup(call.args, name)) + 1)
        if value == HOST:
            return ffi.cast("void *", mem.host_copy_ptr(lookup(call.args, name)))
        if value == PAST_LAST_DEVICE:
            count = ffi.new("int32_t *")
            _ffi.call("device_count", count, ffi.NULL)
            return count[0]
        if value.startswith("ALIAS:"):
            return ffi.cast("void *", mem.ptr(lookup(call.args, value[6:])))
        raise ValueError(value)
    if isinstance(value, Out):
        return ffi.new(value.ctype, 0x5EED)
    if isinstance(value, list):
        return ffi.new("int64_t[]", value)
    if isinstance(value, np.ndarray) or hasattr(value, "data_ptr"):
        return ffi.cast("void *", mem.ptr(value))
    return value


# concurrency (test_concurrency.py)
def make_every_op_inputs(seed):
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
        "rqkv": normal(2, 3, 8, 64, dtype=np.float16),
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
    rope_q = bn.rope_append_kv(d["rqkv"], d["k_cache"], d["v_cache"], [0, 5], stream=stream)
    out["rope_q"], out["k_cache"], out["v_cache"] = get(rope_q), get(d["k_cache"]), get(d["v_cache"])
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


# attention (test_attention.py), also used by its rejection tests in the matrix
def attention_poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype=_arrays.numpy_dtype(dtype))


def torch_inputs(rng, dtype, B, Sq, Hq, Hkv, D, C, spread=1.0):
    import torch
    q, k, v = (torch.from_numpy(x.astype(np.float32)).to(getattr(torch, dtype)).cuda()
               for x in make_attention_inputs(rng, "float32", B, Sq, Hq, Hkv, D, C, spread))
    return q, k, v


# gemv_w2a8 (test_gemv_w2a8.py), also used by its rejection tests in the matrix
def make_problem(rng, M, K, N):
    w_q = rng.integers(-1, 2, (M, K), dtype=np.int8)
    w_scales = rng.uniform(0.01, 2.0, M).astype(np.float32)
    x_q = rng.integers(-128, 128, (N, K), dtype=np.int8)
    x_q[0, :64] = -128                      # activation extremes
    x_q[-1, 64:128] = 127
    x_scales = rng.uniform(1.0, 300.0, N).astype(np.float32)
    return w_q, w_scales, x_q, x_scales


def torch_problem(torch, rng, M, K, N):
    w_q, w_scales, x_q, x_scales = make_problem(rng, M, K, N)
    tw_cpu = bn.pack_ternary(w_q, w_scales)
    tw = bn.TernaryWeights(torch.from_numpy(tw_cpu.packed).cuda(), torch.from_numpy(w_scales).cuda())
    return tw, tw_cpu, torch.from_numpy(x_q).cuda(), torch.from_numpy(x_scales).cuda(), x_q, x_scales


# head (test_head.py), also used by its rejection tests in the matrix
BF16 = np.dtype(ml_dtypes.bfloat16)


def random_bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(BF16)


# layer_glue (test_layer_glue.py), also used by its rejection tests in the matrix
def cast(x, dtype):
    return x.astype(_arrays.numpy_dtype(dtype))


def rope_case(rng, dtype, B, S, Hq, Hkv, D, C):
    """q, k, v, their fused [B, S, Hq + 2 Hkv, D] qkv, and NaN caches [B, C, Hkv, D]."""
    q = cast(rng.standard_normal((B, S, Hq, D)), dtype)
    k = cast(rng.standard_normal((B, S, Hkv, D)), dtype)
    v = cast(rng.standard_normal((B, S, Hkv, D)), dtype)
    k_cache = np.full((B, C, Hkv, D), np.nan, dtype=q.dtype)
    v_cache = np.full((B, C, Hkv, D), np.nan, dtype=q.dtype)
    return q, k, v, np.concatenate([q, k, v], axis=2), k_cache, v_cache


def to_torch(x):
    import torch
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(x).cuda()


# rmsnorm (test_rmsnorm.py), also used by its rejection tests in the matrix
def raw_call(device=-1, dtype=0, T=4, H=8, x=None, residual=None, weight=None, eps=1e-5, y=None,
             y_q=None, y_scales=None):
    """bitnet_rmsnorm with raw pointers (cffi pointers or None for NULL); returns the status."""
    def cast(p, ctype="void *"):
        return _ffi.ffi.NULL if p is None else _ffi.ffi.cast(ctype, p)
    return _ffi.lib().bitnet_rmsnorm(device, dtype, T, H, cast(x), cast(residual), cast(weight), eps,
                                     cast(y), cast(y_q, "int8_t *"), cast(y_scales, "float *"),
                                     _ffi.ffi.NULL)


class Buffers:
    """Host arrays for T=4, H=8 float32 with poisoned outputs, and their pointers."""

    def __init__(self, rng):
        self.x, self.weight, self.residual = make_rmsnorm_inputs(rng, 4, 8, "float32")
        self.residual_before = self.residual.copy()
        self.y, self.y_q, self.s = poisoned((4, 8), "float32"), poisoned((4, 8), "int8"), poisoned(4, "float32")

    def ptr(self, name, offset=0):
        a = getattr(self, name)
        return _ffi.ffi.cast("char *", a.ctypes.data) + offset

    def args(self, **changes):
        base = {"x": self.ptr("x"), "weight": self.ptr("weight"), "y": self.ptr("y"),
                "residual": self.ptr("residual"), "y_q": self.ptr("y_q"), "y_scales": self.ptr("s")}
        base.update(changes)
        return base

    def assert_untouched(self):
        assert np.isnan(self.y).all() and (self.y_q == 0x7F).all() and np.isnan(self.s).all()
        np.testing.assert_array_equal(self.residual, self.residual_before)


def torch_put(a):
    import torch
    if a.dtype == RMSNORM_DTYPES["bfloat16"]:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def status_and_message(status):
    return int(status), _ffi.last_error()


def c_quantize_i2s(w, M, K, segments, n_segments, packed, scales, dtype=0, device=-1):
    return status_and_message(_ffi.lib().bitnet_quantize_i2s(
        device, w, dtype, M, K, segments, n_segments, packed, scales, _ffi.ffi.NULL))


def reference_sentencepiece_encode(text, metadata):
    """llama.cpp's 'llama' (sentencepiece BPE) tokenization, written from its algorithm: the text
    splits at control and user-defined tokens (leftmost, then longest); each other fragment gets a
    space prefixed, spaces become U+2581, and, starting from its characters, the adjacent pair
    whose concatenation is the token of highest score merges (the leftmost of equals) until no
    pair is a token; a remaining piece that is no token becomes its UTF-8 bytes' <0xXX> tokens."""
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = [t for t, kind in zip(tokens, metadata["tokenizer.ggml.token_type"]) if kind in (3, 4)]
    ids, rest = [], text
    while rest:
        found = [(rest.find(s), -len(s), s) for s in specials if s in rest]
        at, _, special = min(found) if found else (len(rest), 0, None)
        if at:
            symbols = list(("\u2581" + rest[:at]).replace(" ", "\u2581"))
            while True:
                pairs = [(scores[vocab[a + b]], -j) for j, (a, b) in
                         enumerate(zip(symbols, symbols[1:])) if a + b in vocab]
                if not pairs:
                    break
                j = -max(pairs)[1]
                symbols[j:j + 2] = [symbols[j] + symbols[j + 1]]
            for piece in symbols:
                ids += [vocab[piece]] if piece in vocab else \
                    [vocab[f"<0x{b:02X}>"] for b in piece.encode()]
        if special is None:
            break
        ids.append(vocab[special])
        rest = rest[at + len(special):]
    return ids


# decode_layer (test_decode_layer.py), also used by its rejection tests in the matrix
def decode_config(H, I, Hq, Hkv, D, activation="relu2", sub_norms=True):
    """A one-layer Config of these sizes (no checks: any shape the op takes)."""
    from bitnet_ffi.config import Config
    return Config(hidden=H, intermediate=I, layers=1, heads=Hq, kv_heads=Hkv, head_dim=D,
                  activation=activation, sub_norms=sub_norms)


def decode_layer_case(rng, config, dtype, C, p):
    """(layer, h, k_cache, v_cache) on the CPU: a bitnet_ffi.model.Layer as random_weights makes one
    (random floats quantized by quantize_i2s, one scale per part of the fused QKV and gate|up
    projections; norm weights around 1; sub-norms only where config.sub_norms), h [H] about as large
    as the projections' outputs, caches [C, Hkv, D] whose rows before p hold random keys and values
    and the rest NaN (row p is written by the step; a later row must be neither read nor written)."""
    from bitnet_ffi.model import Layer
    nd = _arrays.numpy_dtype(dtype)
    H, I, Q, KV = config.hidden, config.intermediate, config.q_dim, config.kv_dim

    def ternary(rows, cols, segments=None):  # scaled so that outputs are about as large as h
        w = rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
        return bn.quantize_i2s(w, row_segments=segments)

    def norm(width):
        return (1.0 + 0.1 * rng.standard_normal(width)).astype(nd)

    subs = config.sub_norms
    layer = Layer(qkv=ternary(Q + 2 * KV, H, [Q, KV, KV]), o=ternary(H, Q),
                  gate_up=ternary(2 * I, H, [I, I]), down=ternary(H, I), attn_norm=norm(H),
                  ffn_norm=norm(H), attn_sub_norm=norm(Q) if subs else None,
                  ffn_sub_norm=norm(I) if subs else None)
    h = (rng.standard_normal(H) * 10.0 ** rng.uniform(-0.5, 0.5)).astype(nd)
    shape = (C, config.kv_heads, config.head_dim)
    k_cache, v_cache = np.full(shape, np.nan, nd), np.full(shape, np.nan, nd)
    k_cache[:p] = rng.standard_normal((p,) + shape[1:])
    v_cache[:p] = rng.standard_normal((p,) + shape[1:]) + 0.5
    return layer, h, k_cache, v_cache
