"""The bad-input matrix of issue 7: every public entry point of bitnet.h, called with one valid set
of arguments mutated one argument at a time, must return the documented status with a message
naming the problem, and leave every output untouched (outputs are poisoned and compared byte for
byte before and after).

One table, MUTATIONS, drives raw cffi calls of the ops on the CPU (tier 1) and on CUDA device 0
with torch tensors (tier 3); RUNTIME_CASES covers the entry points without op arrays (memory,
streams, events, graphs, version, CPU path); python_cases() is the table of the Python API.
Mutation classes: NULL, misaligned (+1 byte), host instead of device memory (GPU), zero, negative
and overflowing sizes (count * element size > 2^63), dtype and enum values outside the enum or
unsupported, mismatched shapes, NaN / infinite scalars (eps, scale, theta), device indices that are
negative or past the last device, a CPU op given device memory, and out-of-range index contents
(ids, positions, seq_lens)."""
import dataclasses
import inspect
import math
import re
from dataclasses import dataclass, field

import numpy as np
import pytest

import bitnet_ffi
import bitnet_ffi as bn
from bitnet_ffi import _arrays, _ffi
from bitnet_ffi.errors import ArgumentTypeError, InvalidArgumentError, NoDeviceError, UnsupportedError
from bitnet_ffi.model import Layer

from reference import (BF16, Buffers, HOST, Memory, MISALIGNED, NULL, Out, PAST_LAST_DEVICE,
                       attention_poisoned, c_value, cast, ffi, make_attention_inputs as make_qkv,
                       make_problem, make_rmsnorm_inputs as make_inputs, poisoned, random_bf16, raw_call,
                       rope_case, to_torch, torch_inputs, torch_problem, torch_put, valid_call,
                       c_quantize_i2s, status_and_message, with_changes, decode_config,
                       decode_layer_case)

OK, INVALID, UNSUPPORTED, NO_DEVICE = 0, 1, 2, 3
BIG = 1 << 62


def has_cuda_build():
    flag = ffi.new("int32_t *")
    _ffi.call("has_cuda", flag)
    return bool(flag[0])


CUDA_BUILD = has_cuda_build()


def by_build(cuda, cpu_only):
    """The expected (status, fragment) where it depends on whether the library has CUDA."""
    return cuda if CUDA_BUILD else cpu_only


WITHOUT_CUDA = (NO_DEVICE, "without CUDA")


# ---------------------------------------------------------------- memory the calls run on


# ---------------------------------------------------------------- one valid call per entry point


OP_ENTRIES = ("quantize_i2s", "pack_ternary", "unpack_ternary", "quantize_a8", "gemv_w2a8",
              "gemv_w2a8_block_scaled",
              "rmsnorm", "relu2_rmsnorm", "attention", "attention_workspace_size", "rope_append_kv",
              "attention_rope_append_kv", "gemv_w2a8_rope_append_kv", "gemv_w2a8_add_norm_stats", "rmsnorm_gemv_w2a8",
              "rmsnorm_gemv_w2a8_rope_append_kv", "relu2_gate", "glu_gate", "glu_rmsnorm", "sample", "gemv_bf16", "argmax", "embedding", "add_int32",
              "rmsnorm_partial", "glu_rmsnorm_partial", "decode_layer",
              "decode_layer_workspace_size")


# ---------------------------------------------------------------- the mutation table


@dataclass
class Mutation:
    arg: str
    value: object
    status: int
    fragment: str
    where: str = "both"  # "both", "cpu" (content checks the host makes) or "gpu"
    also: dict = field(default_factory=dict)  # a second argument changed with this one


def nulls(*names):
    return [Mutation(n, NULL, INVALID, "is NULL") for n in names]


def misaligned(*names):
    return [Mutation(n, MISALIGNED, INVALID, "is not aligned") for n in names]


def host_pointers(*names):
    return [Mutation(n, HOST, INVALID, "is host memory", "gpu") for n in names]


def bad_devices(pointers=True):
    """Devices that do not exist; with `pointers`, also the CPU asked to run on device memory."""
    return [Mutation("device", -2, INVALID, "neither the CPU"),
            Mutation("device", 4096, NO_DEVICE, "does not exist"),
            Mutation("device", PAST_LAST_DEVICE, NO_DEVICE, "does not exist", "gpu")] + (
        [Mutation("device", -1, INVALID, "but the op runs on the CPU", "gpu")] if pointers else [])


def non_positive(fragment, *names):
    return [Mutation(n, v, INVALID, fragment) for n in names for v in (0, -1)]


def overlaps(*cases):
    """(arg, other, names): arg given other's pointer, so that an output overlaps another array;
    the message names the two in the order of the C call's arrays. arg is never larger than other,
    so that it overlaps nothing else, whatever the allocator's layout (ASan's differs)."""
    return [Mutation(arg, f"ALIAS:{other}", INVALID, f"{first} and {second} overlap")
            for arg, other, (first, second) in cases]


def pointers(*names, aligned=()):
    """NULL and host-memory mutations of every pointer, misaligned ones of those in `aligned`."""
    return nulls(*names) + misaligned(*aligned) + host_pointers(*names)


def attention_mutations():
    """The dtype and size checks both attention entry points share (the valid calls: Hq = 4,
    Hkv = 2, D = 64)."""
    return [
        Mutation("dtype", 4, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("dtype", 0, UNSUPPORTED, "float32 runs on the CPU only", "gpu"),
        Mutation("Hkv", 3, INVALID, "not a multiple of Hkv"),
        Mutation("D", 96, UNSUPPORTED, "head_dim D = 96 is not supported"),
        Mutation("D", 8192, INVALID, "too large"),
        Mutation("B", BIG, INVALID, "overflows"),
    ]


def decode_config_mutations():
    """The config checks both decode_layer entry points share (the valid config: H = I = 128,
    Hq = 2, Hkv = 1, D = 64)."""
    return [
        Mutation("config", NULL, INVALID, "config is NULL"),
        Mutation("dtype", 3, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("dtype", 0, UNSUPPORTED, "float32 runs on the CPU only", "gpu"),
        Mutation("config.D", 96, UNSUPPORTED, "head_dim D = 96 is not supported"),
        Mutation("config.Hkv", 3, INVALID, "Hq (2) is not a multiple of Hkv (3)"),
        Mutation("config.H", 200, UNSUPPORTED, "config H = 200 is not a multiple of 128"),
        Mutation("config.I", 65536 + 128, UNSUPPORTED, "config I = 65664 is over the largest"),
        Mutation("config.Hq", 1026, UNSUPPORTED, "config Hq * D = 65664 is over the largest"),
        Mutation("config.Hq", 1 << 60, UNSUPPORTED, "over the largest supported width"),
        Mutation("config.activation", 2, INVALID, "is not BITNET_ACTIVATION_RELU2"),
        Mutation("config.activation", -1, INVALID, "is not BITNET_ACTIVATION_RELU2"),
        Mutation("config.eps", 0.0, INVALID, "config eps must be finite and > 0"),
        Mutation("config.eps", math.nan, INVALID, "config eps must be finite"),
        Mutation("config.attn_sub_eps", -1e-6, INVALID, "config attn_sub_eps must be finite and > 0"),
        Mutation("config.ffn_sub_eps", math.inf, INVALID, "config ffn_sub_eps must be finite"),
        Mutation("config.theta", 1.0, INVALID, "config theta must be finite and > 1"),
        Mutation("config.theta", math.nan, INVALID, "config theta must be finite"),
        Mutation("config.attention_scale", -0.5, INVALID, "attention_scale must be finite and >= 0"),
        Mutation("config.attention_scale", math.inf, INVALID, "attention_scale must be finite"),
    ] + [Mutation(f"config.{name}", value, INVALID, "H, I, Hq, Hkv and D must be positive")
         for name in ("H", "I", "Hq", "Hkv", "D") for value in (0, -1)]


DECODE_WEIGHTS = tuple(f"weights.{name}.{part}" for name in ("qkv", "o", "gate_up", "down")
                       for part in ("w_packed", "w_scales")) + ("weights.attn_norm",
                                                                "weights.ffn_norm")
DECODE_SUB_NORMS = ("weights.attn_sub_norm", "weights.ffn_sub_norm")  # may be NULL

TERNARY = "must be at least 1"
MUTATIONS = {
    "quantize_i2s": bad_devices() + non_positive(TERNARY, "M", "K") + [
        Mutation("w_dtype", 3, UNSUPPORTED, "int8 is not supported"),
        Mutation("w_dtype", 99, INVALID, "is not a bitnet_dtype"),
        Mutation("w_dtype", -1, INVALID, "is not a bitnet_dtype"),
        Mutation("K", 100, UNSUPPORTED, "not a multiple of 128"),
        Mutation("K", 1 << 23, UNSUPPORTED, "over the largest supported K"),
        Mutation("M", BIG, INVALID, "overflow a 64-bit byte count"),
        Mutation("M", 1 << 54, INVALID, "overflow a 64-bit byte count"),  # M*K fits, *4 does not
        Mutation("n_segments", 2, INVALID, "n_segments must be 0 or 1"),
        Mutation("row_segments", [1, 1], INVALID, "sum to"),  # n_segments 2 (COMPANIONS)
    ] + pointers("w", "w_packed", "w_scales", aligned=("w", "w_packed", "w_scales"))
      + overlaps(("w_packed", "w", ("w", "w_packed")), ("w_scales", "w_packed", ("w_packed", "w_scales"))),
    "pack_ternary": bad_devices() + non_positive(TERNARY, "M", "K") + [
        Mutation("K", 200, UNSUPPORTED, "not a multiple of 128"),
        Mutation("M", BIG, INVALID, "overflow a 64-bit byte count"),
        Mutation("w_q", np.full((3, 128), 2, np.int8), INVALID, "is not -1, 0 or 1"),
        Mutation("w_q", np.full((3, 128), -128, np.int8), INVALID, "is not -1, 0 or 1"),
    ] + pointers("w_q", "w_packed", aligned=("w_q", "w_packed"))
      + overlaps(("w_packed", "w_q", ("w_q", "w_packed"))),
    "unpack_ternary": bad_devices() + non_positive(TERNARY, "M", "K") + [
        Mutation("K", 64, UNSUPPORTED, "not a multiple of 128"),
        Mutation("M", BIG, INVALID, "overflow a 64-bit byte count"),
    ] + pointers("w_packed", "w_q", aligned=("w_packed", "w_q"))
      + overlaps(("w_packed", "w_q", ("w_packed", "w_q"))),
    "quantize_a8": bad_devices() + non_positive("N must be at least 1", "N")
      + non_positive(TERNARY, "K") + [
        Mutation("x_dtype", 4, UNSUPPORTED, "int32 is not supported"),
        Mutation("x_dtype", 77, INVALID, "is not a bitnet_dtype"),
        Mutation("K", 1 << 23, UNSUPPORTED, "over the largest supported K"),
        Mutation("N", 1 << 54, INVALID, "overflow a 64-bit byte count"),
    ] + pointers("x", "x_q", "x_scales", aligned=("x", "x_q", "x_scales"))
      + overlaps(("x_q", "x", ("x", "x_q")), ("x_scales", "x_q", ("x_q", "x_scales"))),
    "gemv_w2a8": bad_devices() + non_positive(TERNARY, "M", "K") + [
        Mutation("N", 0, INVALID, "N must be at least 1"),
        Mutation("N", -5, INVALID, "N must be at least 1"),
        Mutation("y_dtype", 3, UNSUPPORTED, "int8 is not supported"),
        Mutation("y_dtype", 50, INVALID, "is not a bitnet_dtype"),
        Mutation("K", 130, UNSUPPORTED, "not a multiple of 128"),
        Mutation("N", 1 << 57, INVALID, "overflow a 64-bit byte count"),  # N * K
        Mutation("M", 1 << 61, INVALID, "overflow a 64-bit byte count"),  # M * K
    ] + pointers("w_packed", "w_scales", "x_q", "x_scales", "y",
                 aligned=("w_packed", "w_scales", "x_q", "x_scales", "y"))
      + overlaps(("y", "x_q", ("x_q", "y")), ("w_scales", "y", ("w_scales", "y"))),
    "gemv_w2a8_block_scaled": bad_devices() + non_positive(TERNARY, "M", "K") + [
        Mutation("N", 0, INVALID, "N must be at least 1"),
        Mutation("y_dtype", 4, UNSUPPORTED, "int32 is not supported"),
        Mutation("y_dtype", 50, INVALID, "is not a bitnet_dtype"),
        Mutation("K", 130, UNSUPPORTED, "not a multiple of 128"),
        Mutation("K", 384, UNSUPPORTED, "not a multiple of the scale block"),
        Mutation("N", 1 << 57, INVALID, "overflow a 64-bit byte count"),  # N * K
        Mutation("M", 1 << 61, INVALID, "overflow a 64-bit byte count"),  # M * K
    ] + pointers("w_packed", "w_scales", "block_scales", "x_q", "x_scales", "y",
                 aligned=("w_packed", "w_scales", "block_scales", "x_q", "x_scales", "y"))
      + overlaps(("y", "x_q", ("x_q", "y")), ("block_scales", "y", ("block_scales", "y"))),
    "rmsnorm": bad_devices() + non_positive("must be >= 1", "T", "H") + [
        Mutation("dtype", 3, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("dtype", 42, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("T", BIG, INVALID, "overflows"),
        Mutation("T", 1 << 59, INVALID, "overflow a 64-bit byte count"),  # T*H fits, *4 does not
        Mutation("eps", math.nan, INVALID, "eps must be finite"),
        Mutation("eps", math.inf, INVALID, "eps must be finite"),
        Mutation("eps", -1e-6, INVALID, "eps must be finite and >= 0"),
        Mutation("y_scales", NULL, INVALID, "go together"),
        Mutation("y_q", NULL, INVALID, "go together"),
        Mutation("y", "ALIAS:residual", INVALID, "overlap"),
        Mutation("y_q", "ALIAS:x", INVALID, "overlap"),
        Mutation("residual", "ALIAS:weight", INVALID, "overlap"),
    ] + nulls("x", "weight") + misaligned("x", "weight", "residual", "y", "y_scales")
      + host_pointers("x", "weight", "residual", "y", "y_q", "y_scales"),
    "relu2_rmsnorm": bad_devices() + non_positive("must be >= 1", "T", "F") + [
        Mutation("dtype", 3, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("dtype", 42, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("F", 1 << 62, INVALID, "T*2F overflows"),  # 2F itself overflows
        Mutation("T", BIG, INVALID, "T*2F overflows"),
        Mutation("T", 1 << 58, INVALID, "overflow a 64-bit byte count"),  # T*2F fits, *4 does not
        Mutation("eps", math.nan, INVALID, "eps must be finite"),
        Mutation("eps", math.inf, INVALID, "eps must be finite"),
        Mutation("eps", -1e-6, INVALID, "eps must be finite and >= 0"),
        Mutation("y_q", NULL, INVALID, "both NULL", also={"y": NULL, "y_scales": NULL}),
        Mutation("y_scales", NULL, INVALID, "go together"),
        Mutation("y_q", NULL, INVALID, "go together"),
        Mutation("y", "ALIAS:gate_up", INVALID, "gate_up and y overlap"),
        Mutation("y_q", "ALIAS:gate_up", INVALID, "gate_up and y_q overlap"),
        Mutation("y", "ALIAS:weight", INVALID, "weight and y overlap"),
        Mutation("y_scales", "ALIAS:y_q", INVALID, "y_q and y_scales overlap"),
        Mutation("y_scales", "ALIAS:y", INVALID, "y and y_scales overlap"),
    ] + nulls("gate_up", "weight") + misaligned("gate_up", "weight", "y", "y_scales")
      + host_pointers("gate_up", "weight", "y", "y_q", "y_scales"),
    "rmsnorm_partial": bad_devices() + non_positive("must be >= 1", "T", "H") + [
        Mutation("dtype", 3, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("T", BIG, INVALID, "overflows"),
        Mutation("T", 1 << 59, INVALID, "overflow a 64-bit byte count"),
        Mutation("y_q", "ALIAS:x", INVALID, "overlap"),
        Mutation("sumsq", "ALIAS:y_scales", INVALID, "y_scales and sumsq overlap"),
    ] + pointers("x", "weight", "y_q", "y_scales", "sumsq",
                 aligned=("x", "weight", "y_scales", "sumsq")),
    "glu_rmsnorm_partial": bad_devices() + non_positive("must be >= 1", "T", "F") + [
        Mutation("dtype", 3, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("activation", 2, INVALID, "is not BITNET_ACTIVATION_RELU2"),
        Mutation("activation", -1, INVALID, "is not BITNET_ACTIVATION_RELU2"),
        Mutation("F", 1 << 62, INVALID, "T*2F overflows"),
        Mutation("y_q", "ALIAS:gate_up", INVALID, "gate_up and y_q overlap"),
        Mutation("sumsq", "ALIAS:weight", INVALID, "weight and sumsq overlap"),
    ] + pointers("gate_up", "weight", "y_q", "y_scales", "sumsq",
                 aligned=("gate_up", "weight", "y_scales", "sumsq")),
    "attention": bad_devices() + non_positive("must be positive", "B", "Sq", "Hq", "Hkv", "D", "C")
    + attention_mutations() + [
        Mutation("causal", 2, INVALID, "causal must be 0 or 1"),
        Mutation("scale", math.nan, INVALID, "scale must be finite"),
        Mutation("scale", -math.inf, INVALID, "scale must be finite"),
        Mutation("workspace_bytes", -1, INVALID, "workspace_bytes is negative"),
        Mutation("seq_lens", np.array([1], np.int32), INVALID, "is outside", "cpu"),  # < Sq
        Mutation("seq_lens", np.array([6], np.int32), INVALID, "is outside", "cpu"),  # > C
    ] + pointers("q", "k", "v", "out", aligned=("q", "k", "v", "out", "seq_lens"))
      + host_pointers("seq_lens")
      + overlaps(("out", "q", ("q", "out")), ("out", "v", ("v", "out")),
                 ("seq_lens", "out", ("seq_lens", "out"))),
    "attention_workspace_size": bad_devices(pointers=False)
    + non_positive("must be positive", "B", "Sq", "Hq", "Hkv", "D", "C") + [
        Mutation("Hq", 3, INVALID, "not a multiple of Hkv"),
        Mutation("B", BIG, INVALID, "overflows"),
    ] + nulls("bytes"),
    "attention_rope_append_kv": bad_devices()
    + non_positive("must be positive", "B", "Hq", "Hkv", "D", "C") + attention_mutations() + [
        Mutation("Hq", 130, UNSUPPORTED, "65 query heads per KV head; a GPU takes at most 64",
                 "gpu"),
        Mutation("theta", math.nan, INVALID, "theta must be finite"),
        Mutation("theta", 1.0, INVALID, "theta must be finite and > 1"),
        Mutation("scale", math.nan, INVALID, "scale must be finite"),
        Mutation("scale", -math.inf, INVALID, "scale must be finite"),
        Mutation("workspace_bytes", -1, INVALID, "workspace_bytes is negative"),
        Mutation("positions", np.array([0, 5], np.int32), INVALID, "outside the cache", "cpu"),
        Mutation("positions", np.array([-1, 0], np.int32), INVALID, "outside the cache", "cpu"),
    ] + pointers("qkv", "k_cache", "v_cache", "positions", "out",
                 aligned=("qkv", "k_cache", "v_cache", "positions", "out"))
      + overlaps(("out", "qkv", ("qkv", "out")), ("v_cache", "k_cache", ("k_cache", "v_cache")),
                 ("positions", "out", ("positions", "out"))),
    "gemv_w2a8_rope_append_kv": bad_devices()
    + non_positive("must be positive", "Hq", "Hkv", "D", "C") + non_positive(TERNARY, "K") + [
        Mutation("dtype", 5, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("dtype", 0, UNSUPPORTED, "float32 runs on the CPU only", "gpu"),
        Mutation("D", 6, INVALID, "must be a multiple of 4"),
        Mutation("D", 2048, INVALID, "at most 1024"),
        Mutation("K", 100, UNSUPPORTED, "not a multiple of 128"),
        Mutation("Hq", BIG, INVALID, "too large"),
        Mutation("C", BIG, INVALID, "too large"),
        Mutation("theta", math.nan, INVALID, "theta must be finite"),
        Mutation("theta", 1.0, INVALID, "theta must be finite and > 1"),
        Mutation("position", np.array([3], np.int32), INVALID, "outside the cache", "cpu"),
        Mutation("position", np.array([-1], np.int32), INVALID, "outside the cache", "cpu"),
    ] + pointers("w_packed", "w_scales", "x_q", "x_scale", "q", "k_cache", "v_cache", "position",
                 aligned=("w_packed", "w_scales", "x_q", "x_scale", "q", "k_cache", "v_cache",
                          "position"))
      + overlaps(("q", "x_q", ("x_q", "q")), ("v_cache", "k_cache", ("k_cache", "v_cache")),
                 ("position", "q", ("q", "position"))),
    "gemv_w2a8_add_norm_stats": bad_devices() + non_positive(TERNARY, "M", "K") + [
        Mutation("dtype", 5, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("dtype", 0, UNSUPPORTED, "float32 runs on the CPU only", "gpu"),
        Mutation("K", 130, UNSUPPORTED, "not a multiple of 128"),
        Mutation("M", 1 << 61, INVALID, "overflow a 64-bit byte count"),
        Mutation("slots", 0, INVALID, "slots must be positive"),
        Mutation("slots", -1, INVALID, "slots must be positive"),
        Mutation("slots", BIG, INVALID, "overflow a 64-bit byte count"),
        Mutation("slots", 1, INVALID, "stats has 1 slots, the launch needs 8", "gpu"),
    ] + pointers("w_packed", "w_scales", "x_q", "x_scale", "h", "norm_weight", "stats",
                 aligned=("w_packed", "w_scales", "x_q", "x_scale", "h", "norm_weight", "stats"))
      + overlaps(("x_scale", "h", ("x_scale", "h")), ("norm_weight", "h", ("h", "norm_weight"))),
    "rmsnorm_gemv_w2a8": bad_devices() + non_positive(TERNARY, "M", "K") + [
        Mutation("dtype", 5, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("dtype", 0, UNSUPPORTED, "float32 runs on the CPU only", "gpu"),
        Mutation("K", 130, UNSUPPORTED, "not a multiple of 128"),
        Mutation("K", 16384, UNSUPPORTED, "over the CUDA kernel's limit for a normed input", "gpu"),
        Mutation("eps", 0.0, INVALID, "eps must be finite and > 0"),
        Mutation("eps", math.nan, INVALID, "eps must be finite"),
        Mutation("slots", 0, INVALID, "slots must be positive"),
        Mutation("slots", 600, UNSUPPORTED, "600 stats slots are over the CUDA kernel's limit", "gpu"),
        Mutation("y_dtype", 3, UNSUPPORTED, "int8 is not supported"),
        Mutation("y_dtype", 50, INVALID, "is not a bitnet_dtype"),
    ] + pointers("h", "norm_weight", "stats", "w_packed", "w_scales", "y",
                 aligned=("h", "norm_weight", "stats", "w_packed", "w_scales", "y"))
      + overlaps(("h", "y", ("h", "y")), ("norm_weight", "y", ("norm_weight", "y"))),
    "rmsnorm_gemv_w2a8_rope_append_kv": bad_devices()
    + non_positive("must be positive", "Hq", "Hkv", "D", "C") + non_positive(TERNARY, "K") + [
        Mutation("dtype", 5, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("dtype", 0, UNSUPPORTED, "float32 runs on the CPU only", "gpu"),
        Mutation("D", 6, INVALID, "must be a multiple of 4"),
        Mutation("eps", -1.0, INVALID, "eps must be finite and > 0"),
        Mutation("slots", 0, INVALID, "slots must be positive"),
        Mutation("theta", math.nan, INVALID, "theta must be finite"),
        Mutation("position", np.array([3], np.int32), INVALID, "outside the cache", "cpu"),
    ] + pointers("h", "norm_weight", "stats", "w_packed", "w_scales", "q", "k_cache", "v_cache",
                 "position", aligned=("h", "norm_weight", "stats", "w_packed", "w_scales", "q",
                                      "k_cache", "v_cache", "position"))
      + overlaps(("q", "h", ("h", "q")), ("v_cache", "k_cache", ("k_cache", "v_cache"))),
    "rope_append_kv": bad_devices()
    + non_positive("must be positive", "B", "S", "Hq", "Hkv", "D", "C") + [
        Mutation("dtype", 5, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("dtype", 0, UNSUPPORTED, "float32 runs on the CPU only", "gpu"),
        Mutation("D", 7, INVALID, "must be even"),
        Mutation("D", 2048, INVALID, "at most 1024"),
        Mutation("B", BIG, INVALID, "overflows"),
        Mutation("C", 2, INVALID, "do not fit a cache"),  # S = 3 > C
        Mutation("theta", math.nan, INVALID, "theta must be finite"),
        Mutation("theta", math.inf, INVALID, "theta must be finite"),
        Mutation("theta", 1.0, INVALID, "theta must be finite and > 1"),
        Mutation("theta", -5.0, INVALID, "theta must be finite and > 1"),
        Mutation("positions", np.array([0, 4], np.int32), INVALID, "do not fit a cache", "cpu"),
        Mutation("positions", np.array([-1, 0], np.int32), INVALID, "do not fit a cache", "cpu"),
    ] + pointers("qkv", "q", "k_cache", "v_cache", "positions",
                 aligned=("qkv", "q", "k_cache", "v_cache", "positions"))
      + overlaps(("q", "qkv", ("qkv", "q")), ("k_cache", "qkv", ("qkv", "k_cache")),
                 ("v_cache", "k_cache", ("k_cache", "v_cache")), ("positions", "q", ("q", "positions"))),
    "relu2_gate": bad_devices() + non_positive("must be positive", "T", "F") + [
        Mutation("dtype", 3, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("dtype", 0, UNSUPPORTED, "float32 runs on the CPU only", "gpu"),
        Mutation("F", 1 << 40, INVALID, "overflows"),
        Mutation("T", BIG, INVALID, "overflows"),
    ] + pointers("gate_up", "out", aligned=("gate_up", "out"))
      + overlaps(("out", "gate_up", ("gate_up", "out"))),
    "glu_gate": bad_devices() + non_positive("must be positive", "T", "F") + [
        Mutation("dtype", 3, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("dtype", 0, UNSUPPORTED, "float32 runs on the CPU only", "gpu"),
        Mutation("activation", 2, INVALID, "is not BITNET_ACTIVATION_RELU2"),
        Mutation("activation", -1, INVALID, "is not BITNET_ACTIVATION_RELU2"),
        Mutation("F", 1 << 40, INVALID, "overflows"),
        Mutation("T", BIG, INVALID, "overflows"),
    ] + pointers("gate_up", "out", aligned=("gate_up", "out"))
      + overlaps(("out", "gate_up", ("gate_up", "out"))),
    "glu_rmsnorm": bad_devices() + non_positive("must be >= 1", "T", "F") + [
        Mutation("dtype", 3, INVALID, "is not float32, float16 or bfloat16"),
        Mutation("activation", 2, INVALID, "is not BITNET_ACTIVATION_RELU2"),
        Mutation("activation", 99, INVALID, "is not BITNET_ACTIVATION_RELU2"),
        Mutation("F", 1 << 62, INVALID, "T*2F overflows"),
        Mutation("T", 1 << 58, INVALID, "overflow a 64-bit byte count"),
        Mutation("eps", math.nan, INVALID, "eps must be finite"),
        Mutation("eps", -1e-6, INVALID, "eps must be finite and >= 0"),
        Mutation("y_q", NULL, INVALID, "both NULL", also={"y": NULL, "y_scales": NULL}),
        Mutation("y_q", NULL, INVALID, "both NULL", also={"y": NULL, "y_scales": NULL, "weight": NULL}),
        Mutation("y_scales", NULL, INVALID, "go together"),
        Mutation("y_scales", NULL, INVALID, "go together", also={"weight": NULL}),
        Mutation("weight", NULL, INVALID, "ask for y_q too", also={"y_q": NULL, "y_scales": NULL}),
        Mutation("y", "ALIAS:gate_up", INVALID, "gate_up and y overlap"),
        Mutation("y_q", "ALIAS:gate_up", INVALID, "gate_up and y_q overlap", also={"weight": NULL}),
        Mutation("y", "ALIAS:weight", INVALID, "weight and y overlap"),
    ] + nulls("gate_up") + misaligned("gate_up", "weight", "y", "y_scales")
      + host_pointers("gate_up", "weight", "y", "y_q", "y_scales"),
    "gemv_bf16": bad_devices() + non_positive("size must be positive", "M", "N", "K") + [
        Mutation("x_dtype", 1, INVALID, "x dtype must be float32 or bfloat16"),
        Mutation("x_dtype", 9, INVALID, "x dtype must be float32 or bfloat16"),
        Mutation("y_dtype", 4, INVALID, "y dtype must be float32 or bfloat16"),
        Mutation("K", 12, INVALID, "multiple of 8"),
        Mutation("M", 1 << 60, INVALID, "overflow a 64-bit byte count"),
        Mutation("N", 1 << 60, INVALID, "overflow a 64-bit byte count"),
        Mutation("K", BIG, INVALID, "overflow a 64-bit byte count"),  # K * 2 itself overflows
    ] + pointers("w", "x", "y", aligned=("w", "x", "y")) + overlaps(("y", "x", ("x", "y"))),
    "argmax": bad_devices() + non_positive("size must be positive", "N", "M") + [
        Mutation("M", 1 << 31, INVALID, "does not fit the int32 index"),
        Mutation("N", BIG, INVALID, "overflow a 64-bit byte count"),
        Mutation("N", 1 << 40, INVALID, "overflow a 64-bit byte count"),  # N * M * 4, M = 2^31-1
    ] + pointers("x", "index", aligned=("x", "index")) + overlaps(("index", "x", ("x", "index"))),
    "sample": bad_devices() + non_positive("size must be positive", "N", "V") + [
        Mutation("V", 1 << 31, INVALID, "does not fit the int32 index"),
        Mutation("N", BIG, INVALID, "overflow a 64-bit byte count"),
        Mutation("temperature", -0.5, INVALID, "temperature must be finite and >= 0"),
        Mutation("temperature", math.nan, INVALID, "temperature must be finite"),
        Mutation("temperature", math.inf, INVALID, "temperature must be finite"),
        Mutation("top_k", -1, INVALID, "top_k must be in [0, 1024]"),
        Mutation("top_k", 1025, INVALID, "top_k must be in [0, 1024]"),
        Mutation("top_p", 0.0, INVALID, "top_p must be in (0, 1]"),
        Mutation("top_p", 1.5, INVALID, "top_p must be in (0, 1]"),
        Mutation("top_p", math.nan, INVALID, "top_p must be in (0, 1]"),
    ] + pointers("logits", "counters", "index", aligned=("logits", "counters", "index"))
      + overlaps(("index", "logits", ("logits", "index")), ("index", "counters", ("counters", "index"))),
    "embedding": bad_devices() + non_positive("size must be positive", "V", "H", "N") + [
        Mutation("dtype", 4, INVALID, "dtype must be float32, float16 or bfloat16"),
        Mutation("V", 1 << 31, INVALID, "does not fit the int32 ids"),
        Mutation("N", BIG, INVALID, "overflow a 64-bit byte count"),
        Mutation("H", 1 << 40, INVALID, "overflow a 64-bit byte count"),  # V * H * 4, V = 2^30
        Mutation("H", BIG, INVALID, "overflow a 64-bit byte count"),  # H * 4 wraps to 0
        Mutation("H", BIG + 1, INVALID, "overflow a 64-bit byte count"),  # H * 4 wraps to 4
        Mutation("ids", np.array([4, 5, 0], np.int32), INVALID, "is outside [0, 5)", "cpu"),
        Mutation("ids", np.array([-1, 0, 0], np.int32), INVALID, "is outside [0, 5)", "cpu"),
    ] + pointers("table", "ids", "out", aligned=("table", "ids", "out"))
      + overlaps(("out", "table", ("table", "out")), ("ids", "out", ("ids", "out"))),
    "add_int32": bad_devices() + non_positive("size must be positive", "n") + [
        Mutation("n", BIG, INVALID, "overflow a 64-bit byte count"),
    ] + pointers("x", aligned=("x",)),
    "decode_layer": bad_devices() + decode_config_mutations() + [
        Mutation("weights", NULL, INVALID, "weights is NULL"),
        Mutation("C", 0, INVALID, "C = 0 must be in [1, 2^31 - 1]"),
        Mutation("C", -1, INVALID, "C = -1 must be in [1, 2^31 - 1]"),
        Mutation("C", 1 << 31, INVALID, "must be in [1, 2^31 - 1]"),
        Mutation("workspace_bytes", -1, INVALID, "workspace_bytes is negative"),
        Mutation("workspace_bytes", 64, INVALID, "workspace of 64 bytes is too small"),
        Mutation("position", np.array([4], np.int32), INVALID, "position = 4 is outside [0, C = 4)",
                 "cpu"),
        Mutation("position", np.array([-1], np.int32), INVALID, "position = -1 is outside", "cpu"),
    ] + pointers("h", "k_cache", "v_cache", "position", "workspace", *DECODE_WEIGHTS,
                 aligned=("h", "k_cache", "v_cache", "position", "workspace", *DECODE_WEIGHTS,
                          *DECODE_SUB_NORMS))
      + host_pointers(*DECODE_SUB_NORMS)
      + overlaps(("h", "workspace", ("h", "workspace")), ("v_cache", "k_cache", ("k_cache", "v_cache")),
                 ("weights.attn_norm", "h", ("weights.attn_norm", "h")),
                 ("position", "workspace", ("position", "workspace")),
                 ("weights.down.w_scales", "k_cache", ("weights.down.w_scales", "k_cache"))),
    "decode_layer_workspace_size": bad_devices(pointers=False) + decode_config_mutations()
    + nulls("bytes"),
}
# Mutations that change two arguments that only make sense together (the table stays one argument
# per row: the second is applied by COMPANIONS).
COMPANIONS = {("quantize_i2s", "row_segments"): {"n_segments": 2},
              ("argmax", "N"): {"M": (1 << 31) - 1},
              ("sample", "N"): {"V": (1 << 31) - 1},
              ("embedding", "H"): {"V": 1 << 30}}


def mutation_cases(where):
    cases = []
    for entry, mutations in MUTATIONS.items():
        for m in mutations:
            if m.where in ("both", where):
                label = m.value if isinstance(m.value, (int, float, str)) else "array"
                label = "".join([f"{m.arg}={label}"] + [f"+{k}={v}" for k, v in m.also.items()])
                cases.append(pytest.param(entry, m, id=f"{entry}-{label}"))
    return cases


def run_call(mem, call, changes):
    """Calls the entry point with `changes` applied; returns (status, message, outputs before,
    outputs after) where outputs are bytes."""
    changes = {name: mem.put(v) if isinstance(v, np.ndarray) else v for name, v in changes.items()}
    args = with_changes(call.args, changes)
    converted = {name: c_value(mem, call, name, value) for name, value in args.items()}

    def snapshot():
        result = {}
        for name in call.outputs:
            if isinstance(call.args[name], Out):
                pointer = converted[name]
                result[name] = bytes(ffi.buffer(pointer)) if pointer != ffi.NULL else b""
            else:
                result[name] = mem.read(call.args[name]).tobytes()
        return result

    before = snapshot()
    status = getattr(_ffi.lib(), "bitnet_" + call.entry)(*converted.values())
    message = _ffi.last_error()
    return int(status), message, before, snapshot()


def check_mutation(mem, entry, mutation, rng):
    call = valid_call(entry, mem, rng)
    changes = {mutation.arg: mutation.value, **COMPANIONS.get((entry, mutation.arg), {}),
               **mutation.also}
    status, message, before, after = run_call(mem, call, changes)
    assert (status, mutation.fragment in message) == (mutation.status, True), \
        f"bitnet_{entry} with {mutation.arg}={mutation.value!r}: status {status}, {message!r}"
    for name in call.outputs:
        assert after[name] == before[name], f"{name} was written by a rejected call"


# ---------------------------------------------------------------- tier 1: C ABI on the CPU


@pytest.mark.cpu
@pytest.mark.parametrize("entry", OP_ENTRIES)
def test_the_valid_call_succeeds_on_the_cpu(entry, rng):
    """Each row of the table differs from a call that works in exactly one argument."""
    mem = Memory(False)
    call = valid_call(entry, mem, rng)
    status, message, before, after = run_call(mem, call, {})
    assert status == OK, message
    assert any(after[n] != before[n] for n in call.outputs), "the valid call wrote nothing"


@pytest.mark.cpu
@pytest.mark.parametrize("entry,mutation", mutation_cases("cpu"))
def test_cpu_op_mutation(entry, mutation, rng):
    check_mutation(Memory(False), entry, mutation, rng)


# The runtime entry points (no op arrays): (entry, args, expected (status, fragment)). String
# arguments: "out:<ctype>" a fresh output, "host" a host buffer, "fake" a non-NULL pointer that the
# argument checks must reject before it reaches CUDA.
RUNTIME_CASES = [
    ("get_last_error", ["NULL"], (INVALID, "message is NULL")),
    ("get_version", ["NULL", "out:int32_t *", "out:int32_t *"], (INVALID, "NULL output pointer")),
    ("get_version", ["out:int32_t *", "NULL", "out:int32_t *"], (INVALID, "NULL output pointer")),
    ("get_version", ["out:int32_t *", "out:int32_t *", "NULL"], (INVALID, "NULL output pointer")),
    ("has_cuda", ["NULL"], (INVALID, "has_cuda is NULL")),
    ("device_count", ["NULL", "NULL"], (INVALID, "count is NULL")),
    ("device_get_info", [0, "NULL"], (INVALID, "info is NULL")),
    ("device_get_info", [-1, "out:bitnet_device_info *"], (INVALID, "not a CUDA device index")),
    ("device_get_info", [4096, "out:bitnet_device_info *"], (NO_DEVICE, "does not exist")),
    ("pointer_device", ["NULL", "out:int32_t *"], (INVALID, "ptr is NULL")),
    ("pointer_device", ["host", "NULL"], (INVALID, "device is NULL")),
    ("malloc", [0, 16, "NULL"], (INVALID, "ptr is NULL")),
    ("malloc", [0, -1, "out:void **"], (INVALID, "nbytes must not be negative")),
    ("malloc", [-1, 16, "out:void **"], (INVALID, "not a CUDA device index")),
    ("malloc", [4096, 16, "out:void **"], (NO_DEVICE, "does not exist")),
    ("free", [-1, "fake"], (INVALID, "not a CUDA device index")),
    ("free", [4096, "fake"], (NO_DEVICE, "does not exist")),
    ("memcpy", ["host", "host", -1, 0, "NULL"], (INVALID, "nbytes must not be negative")),
    ("memcpy", ["host", "host", 8, 7, "NULL"], (INVALID, "kind 7 is not a bitnet_copy_kind")),
    # cffi passes the enum as unsigned: 2^32 - 1 arrives as the int -1.
    ("memcpy", ["host", "host", 8, 0xFFFFFFFF, "NULL"], (INVALID, "kind -1 is not a bitnet_copy_kind")),
    ("memcpy", ["NULL", "host", 8, 1, "NULL"], by_build((INVALID, "dst is NULL"), WITHOUT_CUDA)),
    ("memcpy", ["host", "NULL", 8, 0, "NULL"], by_build((INVALID, "src is NULL"), WITHOUT_CUDA)),
    ("memcpy", ["host", "host", 8, 0, "NULL"],
     by_build((INVALID, "does not match the copy kind"), WITHOUT_CUDA)),
    ("memset", ["host", 256, 8, "NULL"], (INVALID, "byte_value 256 is not in 0..255")),
    ("memset", ["host", -1, 8, "NULL"], (INVALID, "byte_value -1 is not in 0..255")),
    ("memset", ["host", 0, -8, "NULL"], (INVALID, "nbytes must not be negative")),
    ("memset", ["NULL", 0, 8, "NULL"], by_build((INVALID, "ptr is NULL"), WITHOUT_CUDA)),
    ("memset", ["host", 0, 8, "NULL"], by_build((INVALID, "is host memory"), WITHOUT_CUDA)),
    ("device_synchronize", [-1], (INVALID, "not a CUDA device index")),
    ("device_synchronize", [4096], (NO_DEVICE, "does not exist")),
    ("cpu_set_isa", [-1], (INVALID, "is not 0 (auto)")),
    ("cpu_set_isa", [4], (INVALID, "is not 0 (auto)")),
    ("cpu_get_isa", ["NULL"], (INVALID, "isa is NULL")),
    ("stream_create", [0, "NULL"], (INVALID, "stream is NULL")),
    ("stream_create", [-1, "out:void **"], (INVALID, "not a CUDA device index")),
    ("stream_create", [4096, "out:void **"], (NO_DEVICE, "does not exist")),
    ("stream_destroy", [0, "NULL"], (INVALID, "the default stream cannot be destroyed")),
    ("stream_destroy", [4096, "fake"], (NO_DEVICE, "does not exist")),
    ("stream_destroy", [-1, "fake"], (INVALID, "not a CUDA device index")),
    ("event_create", [0, "NULL"], (INVALID, "event is NULL")),
    ("event_create", [-1, "out:void **"], (INVALID, "not a CUDA device index")),
    ("event_create", [4096, "out:void **"], (NO_DEVICE, "does not exist")),
    ("event_destroy", [0, "NULL"], (INVALID, "event is NULL")),
    ("event_destroy", [4096, "fake"], (NO_DEVICE, "does not exist")),
    ("event_destroy", [-1, "fake"], (INVALID, "not a CUDA device index")),
    ("event_record", ["NULL", "NULL"], (INVALID, "event is NULL")),
    ("event_elapsed_ms", ["NULL", "fake", "out:float *"], (INVALID, "NULL start")),
    ("event_elapsed_ms", ["fake", "NULL", "out:float *"], (INVALID, "NULL end")),
    ("event_elapsed_ms", ["fake", "fake", "NULL"], (INVALID, "NULL ms")),
    ("graph_capture_begin", ["NULL"], (INVALID, "legacy default stream cannot be captured")),
    ("graph_capture_end", ["NULL", "out:void **"], (INVALID, "stream is NULL")),
    ("graph_capture_end", ["fake", "NULL"], (INVALID, "graph is NULL")),
    ("graph_launch", ["NULL", "NULL"], (INVALID, "graph is NULL")),
    ("graph_destroy", ["NULL"], (INVALID, "graph is NULL")),
    ("set_current_device", [-1], (INVALID, "not a CUDA device index")),
    ("set_current_device", [4096], (NO_DEVICE, "does not exist")),
    ("peer_buffer_size", [16, "NULL"], (INVALID, "bytes is NULL")),
    ("norm_stats_slots", [-1, "NULL"], (INVALID, "slots is NULL")),
    ("norm_stats_slots", [-2, "out:int64_t *"], (INVALID, "neither the CPU")),
    ("norm_stats_slots", [4096, "out:int64_t *"], (NO_DEVICE, "does not exist")),
    ("peer_buffer_size", [0, "out:int64_t *"], (INVALID, "max_bytes must be in")),
    ("ipc_get_handle", [0, "fake", "NULL"], (INVALID, "handle is NULL")),
    ("ipc_get_handle", [-1, "fake", "out:bitnet_ipc_handle *"], (INVALID, "not a CUDA device")),
    ("ipc_open_handle", [0, "NULL", "out:void **"], (INVALID, "handle is NULL")),
    ("ipc_open_handle", [-1, "host", "out:void **"], (INVALID, "not a CUDA device index")),
    ("ipc_close_handle", [0, "NULL"], (INVALID, "ptr is NULL")),
    ("ipc_close_handle", [-1, "fake"], (INVALID, "not a CUDA device index")),
    ("peer_abort", [-1, "fake"], (INVALID, "not a CUDA device index")),
    ("peer_allreduce", [-1, 0, 0, 4, "host", "host", "NULL", 1, 0, 4608, "NULL"],
     (INVALID, "buffers is NULL")),
    ("peer_allreduce", [-1, 0, 4, 4, "host", "host", "NULL", 1, 0, 4608, "NULL"],
     (UNSUPPORTED, "y_dtype int32 is not supported")),
    ("peer_allreduce", [-1, 0, 0, 0, "host", "host", "NULL", 1, 0, 4608, "NULL"],
     (INVALID, "n must be at least 1")),
    ("peer_allreduce_rms", [-1, 2, 1, 3, 3, 1e-5, "host", "host", "NULL", 1, 0, 4608, "NULL"],
     (INVALID, "buffers is NULL")),
    ("peer_allreduce_rms", [-1, 3, 1, 3, 3, 1e-5, "host", "host", "NULL", 1, 0, 4608, "NULL"],
     (UNSUPPORTED, "y_dtype int8 is not supported")),
    ("peer_allreduce_rms", [-1, 2, 1, 3, 0, 1e-5, "host", "host", "NULL", 1, 0, 4608, "NULL"],
     (INVALID, "must be at least 1")),
    ("peer_allreduce_rms", [-1, 2, 1, 3, 3, -1.0, "host", "host", "NULL", 1, 0, 4608, "NULL"],
     (INVALID, "eps must be finite")),
    ("peer_allreduce_rms", [-1, 2, 1 << 40, 1 << 40, 3, 1e-5, "host", "host", "NULL", 1, 0, 4608,
                            "NULL"], (INVALID, "overflows")),
    ("peer_allgather", [-1, 0, "host", "host", "host", "NULL", 0, 0, 4608, "NULL"],
     (INVALID, "world must be in [1, 8]")),
    ("peer_allgather", [-1, 0, "host", "host", "host", "NULL", 9, 0, 4608, "NULL"],
     (INVALID, "world must be in [1, 8]")),
    ("peer_allgather", [-1, 0, "NULL", "host", "host", "NULL", 1, 0, 4608, "NULL"],
     (INVALID, "counts is NULL")),
]
if not CUDA_BUILD:  # with CUDA, a NULL stream is the legacy default stream: nothing to reject
    RUNTIME_CASES.append(("stream_synchronize", ["NULL"], WITHOUT_CUDA))


@pytest.mark.cpu
@pytest.mark.parametrize("entry,args,expected", RUNTIME_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(RUNTIME_CASES)])
def test_cpu_runtime_entry(entry, args, expected):
    host = np.full(16, 0x7F, np.uint8)
    converted, outputs = [], []
    for a in args:
        if a == "NULL":
            a = ffi.NULL
        elif a == "host":
            a = ffi.cast("void *", host.ctypes.data)
        elif a == "fake":
            a = ffi.cast("void *", 0x1000)
        elif isinstance(a, str):
            a = ffi.new(a[4:])
            size = ffi.sizeof(ffi.typeof(a).item)
            ffi.memmove(a, b"\x5e" * size, size)
            outputs.append(a)
        converted.append(a)
    before = [bytes(ffi.buffer(o)) for o in outputs]
    status = getattr(_ffi.lib(), "bitnet_" + entry)(*converted)
    message = _ffi.last_error()
    assert (int(status), expected[1] in message) == (expected[0], True), (status, message)
    assert [bytes(ffi.buffer(o)) for o in outputs] == before, "an output was written"
    assert (host == 0x7F).all(), "the host buffer was written"


# ---------------------------------------------------------------- the Python API


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def nan_like(shape, dtype="float32"):
    return np.full(shape, np.nan, _arrays.numpy_dtype(dtype))


def read_only(array):
    """A copy that numpy marks read-only (its memory stays writable, so a write would show)."""
    copy = array.copy()
    copy.flags.writeable = False
    return copy


def python_cases(rng):
    """(name, function to call, exception type, message fragment, arrays that must stay as they
    are). Each function is a valid call with one argument made wrong."""
    x, w = f32(rng, 3, 8), f32(rng, 8)
    y = nan_like((3, 8))
    residual = f32(rng, 3, 8)
    q, kv = f32(rng, 1, 2, 4, 64), f32(rng, 1, 5, 2, 64)
    att_out = nan_like((1, 2, 4, 64))
    rqkv, rout, cache = f32(rng, 2, 3, 8, 8), nan_like((2, 3, 4, 8)), nan_like((2, 6, 2, 8))
    gate, gate_out = f32(rng, 3, 10), nan_like((3, 5))
    gq = (np.full((3, 5), 0x7F, np.int8), nan_like((3,)))  # relu2_rmsnorm_quantize's codes, scales
    hw = rng.standard_normal((3, 16)).astype(_arrays.numpy_dtype("bfloat16"))
    hx, hy = f32(rng, 2, 16), nan_like((2, 3))
    logits, index = f32(rng, 2, 7), np.full(2, 0x7F7F7F7F, np.int32)
    table, emb_out = f32(rng, 5, 8), nan_like((3, 8))
    counter = np.arange(4, dtype=np.int32)
    wt = f32(rng, 3, 128)
    tw = bn.pack_ternary(rng.integers(-1, 2, (3, 128), dtype=np.int8), 0.5)
    x_q, x_s = rng.integers(-128, 128, (2, 128), dtype=np.int8), np.full(2, 9.0, np.float32)
    gy = nan_like((2, 3))
    bad_w_q = np.full((3, 128), 3, np.int8)
    strided = f32(rng, 3, 16)[:, ::2]
    ro_y, ro_residual, ro_codes = read_only(y), read_only(residual), read_only(np.zeros((3, 8), np.int8))
    ro_gate_out, ro_att_out, ro_rout = read_only(gate_out), read_only(att_out), read_only(rout)
    ro_cache, ro_index, ro_counter = read_only(cache), read_only(index), read_only(counter)
    ro_gy = read_only(gy)
    aqkv, acache, aout = f32(rng, 2, 1, 8, 64), f32(rng, 2, 5, 2, 64), nan_like((2, 1, 4, 64))
    ro_aout, acache2 = read_only(aout), acache.copy()
    return [
        ("attention_rope two tokens", lambda: bn.attention_rope_append_kv(
            f32(rng, 2, 2, 8, 64), acache, acache2, [0, 3], out=aout),
         InvalidArgumentError, "takes one (a decode step)", [aout, acache, acache2]),
        ("attention_rope positions range", lambda: bn.attention_rope_append_kv(
            aqkv, acache, acache2, [0, 5], out=aout),
         InvalidArgumentError, "positions[1] = 5: 1 new tokens do not fit", [aout, acache, acache2]),
        ("attention_rope positions count", lambda: bn.attention_rope_append_kv(
            aqkv, acache, acache2, [0], out=aout),
         InvalidArgumentError, "positions", [aout, acache, acache2]),
        ("attention_rope theta 1", lambda: bn.attention_rope_append_kv(
            aqkv, acache, acache2, [0, 3], theta=1.0, out=aout),
         InvalidArgumentError, "theta must be finite and > 1", [aout, acache, acache2]),
        ("attention_rope scale nan", lambda: bn.attention_rope_append_kv(
            aqkv, acache, acache2, [0, 3], scale=math.nan, out=aout),
         InvalidArgumentError, "scale must be finite", [aout, acache, acache2]),
        ("attention_rope one cache for k and v", lambda: bn.attention_rope_append_kv(
            aqkv, acache, acache, [0, 3], out=aout),
         InvalidArgumentError, "overlap", [aout, acache]),
        ("attention_rope read-only out", lambda: bn.attention_rope_append_kv(
            aqkv, acache, acache2, [0, 3], out=ro_aout),
         InvalidArgumentError, "read-only", [ro_aout, acache, acache2]),
        ("attention_rope no query heads", lambda: bn.attention_rope_append_kv(
            aqkv[:, :, :4].copy(), acache, acache2, [0, 3], out=aout),
         InvalidArgumentError, "leave no query heads", [aout, acache, acache2]),
        ("rmsnorm weight shape", lambda: bn.rmsnorm(x, w[:7], out=y), InvalidArgumentError,
         "weight: expected shape [8]", [y]),
        ("rmsnorm weight dtype", lambda: bn.rmsnorm(x, w.astype(np.float16), out=y),
         InvalidArgumentError, "weight: expected dtype float32", [y]),
        ("rmsnorm int32 x", lambda: bn.rmsnorm(x.astype(np.int32), w), InvalidArgumentError,
         "x: expected dtype", []),
        ("rmsnorm float64 x", lambda: bn.rmsnorm(x.astype(np.float64), w), InvalidArgumentError,
         "dtype float64 is not supported", []),
        ("rmsnorm strided x", lambda: bn.rmsnorm(strided, w, out=y), InvalidArgumentError,
         "not C-contiguous", [y]),
        ("rmsnorm read-only out", lambda: bn.rmsnorm(x, w, out=ro_y), InvalidArgumentError,
         "out: the array is read-only, and the op writes it", [ro_y]),
        ("add_rmsnorm read-only residual", lambda: bn.add_rmsnorm(x, ro_residual, w, out=y),
         InvalidArgumentError, "residual: the array is read-only", [ro_residual, y]),
        ("rmsnorm_quantize read-only codes",
         lambda: bn.rmsnorm_quantize(x, w, out=(ro_codes, nan_like((3,)))), InvalidArgumentError,
         "y_q: the array is read-only", [ro_codes]),
        ("relu2_rmsnorm read-only y_out",
         lambda: bn.relu2_rmsnorm_quantize(gate, w[:5], out=gq, y_out=ro_gate_out),
         InvalidArgumentError, "y_out: the array is read-only", [ro_gate_out, *gq]),
        ("attention out is q", lambda: bn.attention(q, kv, kv, out=q), InvalidArgumentError,
         "q and out overlap", [q]),
        ("gemv_w2a8 out over x_q's bytes",
         lambda: bn.gemv_w2a8(tw, x_q, x_s, out=x_q.view(np.float32).reshape(-1)[:6].reshape(2, 3)),
         InvalidArgumentError, "x_q and y overlap", [x_q]),
        ("relu2_gate out over gate_up's first rows",
         lambda: bn.relu2_gate(gate, out=gate.reshape(-1)[:15].reshape(3, 5)), InvalidArgumentError,
         "gate_up and out overlap", [gate]),
        ("rope one cache for k and v", lambda: bn.rope_append_kv(rqkv, cache, cache, [0, 3], out=rout),
         InvalidArgumentError, "k_cache and v_cache overlap", [rout, cache]),
        ("attention read-only out", lambda: bn.attention(q, kv, kv, out=ro_att_out),
         InvalidArgumentError, "out: the array is read-only", [ro_att_out]),
        ("attention read-only workspace",
         lambda: bn.attention(q, kv, kv, out=att_out, workspace=read_only(np.zeros(64, np.uint8))),
         InvalidArgumentError, "workspace: the array is read-only", [att_out]),
        ("rope read-only out", lambda: bn.rope_append_kv(rqkv, cache, cache, [0, 3], out=ro_rout),
         InvalidArgumentError, "out: the array is read-only", [ro_rout, cache]),
        ("rope read-only v_cache", lambda: bn.rope_append_kv(rqkv, cache, ro_cache, [0, 3], out=rout),
         InvalidArgumentError, "v_cache: the array is read-only", [rout, cache, ro_cache]),
        ("relu2_gate read-only out", lambda: bn.relu2_gate(gate, out=ro_gate_out),
         InvalidArgumentError, "out: the array is read-only", [ro_gate_out]),
        ("gemv_bf16 read-only out", lambda: bn.gemv_bf16(hw, hx, out=read_only(hy)),
         InvalidArgumentError, "out: the array is read-only", []),
        ("argmax read-only out", lambda: bn.argmax(logits, out=ro_index), InvalidArgumentError,
         "out: the array is read-only", [ro_index]),
        ("embedding read-only out", lambda: bn.embedding(table, [0, 1, 2], out=read_only(emb_out)),
         InvalidArgumentError, "out: the array is read-only", []),
        ("add_int32 read-only x", lambda: bn.add_int32(ro_counter, 1), InvalidArgumentError,
         "x: the array is read-only", [ro_counter]),
        ("gemv_w2a8 read-only out", lambda: bn.gemv_w2a8(tw, x_q, x_s, out=ro_gy),
         InvalidArgumentError, "out: the array is read-only", [ro_gy]),
        ("rmsnorm byte-swapped x", lambda: bn.rmsnorm(x.astype(x.dtype.newbyteorder()), w, out=y),
         InvalidArgumentError, "not in this machine's byte order", [y]),
        ("quantize_a8 byte-swapped x", lambda: bn.quantize_a8(wt.astype(wt.dtype.newbyteorder())),
         InvalidArgumentError, "not in this machine's byte order", []),
        ("gemv_w2a8 byte-swapped out",
         lambda: bn.gemv_w2a8(tw, x_q, x_s, out=gy.astype(gy.dtype.newbyteorder())),
         InvalidArgumentError, "out: dtype >f4 is not in this machine's byte order", []),
        ("rmsnorm eps nan", lambda: bn.rmsnorm(x, w, eps=math.nan, out=y), InvalidArgumentError,
         "eps must be finite", [y]),
        ("rmsnorm eps inf", lambda: bn.rmsnorm(x, w, eps=math.inf, out=y), InvalidArgumentError,
         "eps must be finite", [y]),
        ("rmsnorm eps negative", lambda: bn.rmsnorm(x, w, eps=-1.0, out=y), InvalidArgumentError,
         "eps must be finite and >= 0", [y]),
        ("rmsnorm out shape", lambda: bn.rmsnorm(x, w, out=nan_like((3, 7))), InvalidArgumentError,
         "out: expected shape [3, 8]", []),
        ("rmsnorm scalar x", lambda: bn.rmsnorm(np.ones((), np.float32), w),
         InvalidArgumentError, "got a scalar", []),
        ("add_rmsnorm residual shape", lambda: bn.add_rmsnorm(x, residual[:2], w, out=y),
         InvalidArgumentError, "residual: expected shape [3, 8]", [y, residual]),
        ("add_rmsnorm eps nan", lambda: bn.add_rmsnorm(x, residual, w, eps=math.nan, out=y),
         InvalidArgumentError, "eps must be finite", [y, residual]),
        ("rmsnorm_quantize out not a pair", lambda: bn.rmsnorm_quantize(x, w, out=y),
         InvalidArgumentError, "expected a pair", [y]),
        ("rmsnorm_quantize scales shape",
         lambda: bn.rmsnorm_quantize(x, w, out=(np.zeros((3, 8), np.int8), nan_like((2,)))),
         InvalidArgumentError, "scales: expected shape [3]", []),
        ("rmsnorm_partial weight shape",
         lambda: bn.rmsnorm_partial(x, w[:7], out=(np.zeros((3, 8), np.int8), nan_like((3,)))),
         InvalidArgumentError, "weight: expected shape [8]", []),
        ("rmsnorm_partial sumsq shape", lambda: bn.rmsnorm_partial(x, w, sumsq=nan_like((2,))),
         InvalidArgumentError, "sumsq: expected shape [3]", []),
        ("glu_rmsnorm_partial odd width", lambda: bn.glu_rmsnorm_partial(f32(rng, 3, 9), w[:4]),
         InvalidArgumentError, "gate_up: expected an array [..., 2F]", []),
        ("glu_rmsnorm_partial activation", lambda: bn.glu_rmsnorm_partial(gate, w[:5], "gelu"),
         InvalidArgumentError, "activation must be", []),
        ("relu2_rmsnorm odd width", lambda: bn.relu2_rmsnorm_quantize(f32(rng, 3, 9), w[:4]),
         InvalidArgumentError, "gate_up: expected shape [..., 2F]", []),
        ("relu2_rmsnorm weight shape", lambda: bn.relu2_rmsnorm_quantize(gate, w[:4], out=gq),
         InvalidArgumentError, "weight: expected shape [5]", list(gq)),
        ("relu2_rmsnorm weight dtype",
         lambda: bn.relu2_rmsnorm_quantize(gate, w[:5].astype(np.float16), out=gq),
         InvalidArgumentError, "weight: expected dtype float32", list(gq)),
        ("relu2_rmsnorm int8 gate_up",
         lambda: bn.relu2_rmsnorm_quantize(np.ones((3, 10), np.int8), w[:5], out=gq),
         InvalidArgumentError, "gate_up: expected dtype", list(gq)),
        ("relu2_rmsnorm float64 gate_up",
         lambda: bn.relu2_rmsnorm_quantize(gate.astype(np.float64), w[:5], out=gq),
         InvalidArgumentError, "dtype float64 is not supported", list(gq)),
        ("relu2_rmsnorm eps nan", lambda: bn.relu2_rmsnorm_quantize(gate, w[:5], eps=math.nan,
                                                                    out=gq, y_out=gate_out),
         InvalidArgumentError, "eps must be finite", [*gq, gate_out]),
        ("relu2_rmsnorm eps negative", lambda: bn.relu2_rmsnorm_quantize(gate, w[:5], eps=-1.0,
                                                                         out=gq),
         InvalidArgumentError, "eps must be finite and >= 0", list(gq)),
        ("relu2_rmsnorm y_out shape",
         lambda: bn.relu2_rmsnorm_quantize(gate, w[:5], out=gq, y_out=nan_like((3, 10))),
         InvalidArgumentError, "y_out: expected shape [3, 5]", list(gq)),
        ("relu2_rmsnorm codes shape",
         lambda: bn.relu2_rmsnorm_quantize(gate, w[:5], out=(np.zeros((3, 10), np.int8), gq[1])),
         InvalidArgumentError, "y_q: expected shape [3, 5]", [gq[1]]),
        ("relu2_rmsnorm out not a pair", lambda: bn.relu2_rmsnorm_quantize(gate, w[:5], out=gq[0]),
         InvalidArgumentError, "expected a pair", list(gq)),
        ("relu2_rmsnorm scalar", lambda: bn.relu2_rmsnorm_quantize(np.ones((), np.float32), w),
         InvalidArgumentError, "got a scalar", []),
        ("relu2_rmsnorm empty", lambda: bn.relu2_rmsnorm_quantize(np.ones((3, 0), np.float32),
                                                                  w[:0]),
         InvalidArgumentError, "must be >= 1", []),
        ("attention scale nan", lambda: bn.attention(q, kv, kv, scale=math.nan, out=att_out),
         InvalidArgumentError, "scale must be finite", [att_out]),
        ("attention scale inf", lambda: bn.attention(q, kv, kv, scale=math.inf, out=att_out),
         InvalidArgumentError, "scale must be finite", [att_out]),
        ("attention k dtype", lambda: bn.attention(q, kv.astype(np.float16), kv, out=att_out),
         InvalidArgumentError, "k: expected dtype float32", [att_out]),
        ("attention v shape", lambda: bn.attention(q, kv, kv[:, :4], out=att_out),
         InvalidArgumentError, "v: expected shape", [att_out]),
        ("attention heads", lambda: bn.attention(f32(rng, 1, 2, 3, 64), kv, kv),
         InvalidArgumentError, "not a multiple", []),
        ("attention head_dim 96", lambda: bn.attention(f32(rng, 1, 1, 2, 96), f32(rng, 1, 3, 2, 96),
                                                       f32(rng, 1, 3, 2, 96)),
         UnsupportedError, "head_dim D = 96", []),
        ("attention seq_lens range", lambda: bn.attention(q, kv, kv, seq_lens=[6], out=att_out),
         InvalidArgumentError, "seq_lens[0] = 6 is outside", [att_out]),
        ("attention seq_lens float", lambda: bn.attention(q, kv, kv, seq_lens=[4.0], out=att_out),
         InvalidArgumentError, "seq_lens: expected 1 integers", [att_out]),
        ("attention out shape", lambda: bn.attention(q, kv, kv, out=nan_like((1, 2, 4, 32))),
         InvalidArgumentError, "out: expected shape", []),
        ("attention_workspace_size device", lambda: bn.attention_workspace_size(4096, 1, 1, 4, 2,
                                                                                 64, 5),
         NoDeviceError, "does not exist", []),
        ("rope theta nan", lambda: bn.rope_append_kv(rqkv, cache, cache, [0, 3], out=rout,
                                                     theta=math.nan),
         InvalidArgumentError, "theta must be finite", [rout, cache]),
        ("rope theta inf", lambda: bn.rope_append_kv(rqkv, cache, cache, [0, 3], out=rout,
                                                     theta=math.inf),
         InvalidArgumentError, "theta must be finite", [rout, cache]),
        ("rope theta 1", lambda: bn.rope_append_kv(rqkv, cache, cache, [0, 3], out=rout, theta=1.0),
         InvalidArgumentError, "theta must be finite and > 1", [rout, cache]),
        ("rope positions range", lambda: bn.rope_append_kv(rqkv, cache, cache, [0, 4], out=rout),
         InvalidArgumentError, "positions[1] = 4", [rout, cache]),
        ("rope positions negative", lambda: bn.rope_append_kv(rqkv, cache, cache, [-1, 0], out=rout),
         InvalidArgumentError, "positions[0] = -1", [rout, cache]),
        ("rope positions count", lambda: bn.rope_append_kv(rqkv, cache, cache, [0], out=rout),
         InvalidArgumentError, "positions: expected 2 integers", [rout, cache]),
        ("rope k_cache shape", lambda: bn.rope_append_kv(rqkv, nan_like((2, 6, 2, 4)), cache,
                                                         [0, 3], out=rout),
         InvalidArgumentError, "k_cache: expected shape", [rout, cache]),
        ("rope odd head_dim", lambda: bn.rope_append_kv(f32(rng, 1, 1, 3, 7), nan_like((1, 2, 1, 7)),
                                                        nan_like((1, 2, 1, 7)), [0]),
         InvalidArgumentError, "must be even", []),
        ("rope no query heads", lambda: bn.rope_append_kv(rqkv[:, :, :4].copy(), cache, cache, [0, 3],
                                                          out=rout),
         InvalidArgumentError, "leave no query heads", [rout, cache]),
        ("relu2_gate odd width", lambda: bn.relu2_gate(f32(rng, 3, 9)), InvalidArgumentError,
         "expected shape [..., 2F]", []),
        ("relu2_gate out shape", lambda: bn.relu2_gate(gate, out=nan_like((3, 4))),
         InvalidArgumentError, "out: expected shape [3, 5]", []),
        ("relu2_gate out dtype", lambda: bn.relu2_gate(gate, out=nan_like((3, 5), "float16")),
         InvalidArgumentError, "out: expected dtype float32", []),
        ("relu2_gate int8", lambda: bn.relu2_gate(np.ones((3, 10), np.int8), out=gate_out),
         InvalidArgumentError, "gate_up: expected dtype", [gate_out]),
        ("relu2_gate empty", lambda: bn.relu2_gate(np.ones((3, 0), np.float32)),
         InvalidArgumentError, "must be positive", []),
        ("gemv_bf16 float32 w", lambda: bn.gemv_bf16(f32(rng, 3, 16), hx, out=hy),
         InvalidArgumentError, "w: expected dtype bfloat16", [hy]),
        ("gemv_bf16 x width", lambda: bn.gemv_bf16(hw, f32(rng, 2, 8), out=hy),
         InvalidArgumentError, "x: expected shape [2, 16]", [hy]),
        ("gemv_bf16 out dtype", lambda: bn.gemv_bf16(hw, hx, out_dtype="float16"),
         InvalidArgumentError, "out_dtype must be float32 or bfloat16", []),
        ("gemv_bf16 K not multiple of 8", lambda: bn.gemv_bf16(hw[:, :12].copy(), hx[:, :12].copy()),
         InvalidArgumentError, "multiple of 8", []),
        ("gemv_bf16 3-D x", lambda: bn.gemv_bf16(hw, f32(rng, 1, 2, 16)), InvalidArgumentError,
         "expected shape [K] or [N, K]", []),
        ("argmax float64", lambda: bn.argmax(logits.astype(np.float64), out=index),
         InvalidArgumentError, "dtype float64 is not supported", [index]),
        ("argmax out dtype", lambda: bn.argmax(logits, out=np.zeros(2, np.int8)),
         InvalidArgumentError, "out: expected dtype int32", []),
        ("argmax out shape", lambda: bn.argmax(logits, out=np.zeros(3, np.int32)),
         InvalidArgumentError, "out: expected shape [2]", []),
        ("argmax empty row", lambda: bn.argmax(np.ones((2, 0), np.float32), out=index),
         InvalidArgumentError, "size must be positive", [index]),
        ("embedding id range", lambda: bn.embedding(table, [0, 5, 1], out=emb_out),
         InvalidArgumentError, "ids[1] = 5 is outside [0, 5)", [emb_out]),
        ("embedding negative id", lambda: bn.embedding(table, [-1, 0, 1], out=emb_out),
         InvalidArgumentError, "ids[0] = -1", [emb_out]),
        ("embedding 2-D ids", lambda: bn.embedding(table, [[0, 1]], out=emb_out),
         InvalidArgumentError, "expected a 1-D integer array", [emb_out]),
        ("embedding float ids", lambda: bn.embedding(table, [0.0, 1.0, 2.0], out=emb_out),
         InvalidArgumentError, "expected a 1-D integer array", [emb_out]),
        ("embedding int table", lambda: bn.embedding(np.ones((5, 8), np.int32), [0]),
         InvalidArgumentError, "table: expected dtype", []),
        ("embedding out shape", lambda: bn.embedding(table, [0, 1, 2], out=nan_like((3, 7))),
         InvalidArgumentError, "out: expected shape [3, 8]", []),
        ("add_int32 float", lambda: bn.add_int32(counter.astype(np.float32), 1),
         InvalidArgumentError, "x: expected dtype int32", []),
        ("add_int32 delta too large", lambda: bn.add_int32(counter, 1 << 40), InvalidArgumentError,
         "bitnet_add_int32: integer 1099511627776 does not fit 'int32_t'", [counter]),
        ("add_int32 delta 2^31", lambda: bn.add_int32(counter, 1 << 31), InvalidArgumentError,
         "does not fit 'int32_t'", [counter]),
        ("quantize_i2s K=100", lambda: bn.quantize_i2s(f32(rng, 3, 100)), UnsupportedError,
         "not a multiple of 128", []),
        ("quantize_i2s segments sum", lambda: bn.quantize_i2s(wt, row_segments=[1, 1]),
         InvalidArgumentError, "summing to M = 3", []),
        ("quantize_i2s zero segment", lambda: bn.quantize_i2s(wt, row_segments=[0, 3]),
         InvalidArgumentError, "must be positive", []),
        ("quantize_i2s int8 w", lambda: bn.quantize_i2s(wt.astype(np.int8)), InvalidArgumentError,
         "w: expected dtype", []),
        ("pack_ternary value 3", lambda: bn.pack_ternary(bad_w_q, 1.0), InvalidArgumentError,
         "is not -1, 0 or 1", [bad_w_q]),
        ("pack_ternary scales shape", lambda: bn.pack_ternary(np.zeros((3, 128), np.int8),
                                                              np.ones(2, np.float32)),
         InvalidArgumentError, "scales: expected shape [3]", []),
        ("quantize_a8 3-D", lambda: bn.quantize_a8(f32(rng, 1, 2, 128)), InvalidArgumentError,
         "expected shape [K] or [N, K]", []),
        ("quantize_a8 K=64", lambda: bn.quantize_a8(f32(rng, 2, 64)), UnsupportedError,
         "not a multiple of 128", []),
        ("gemv_w2a8 w not weights", lambda: bn.gemv_w2a8(wt, x_q, x_s, out=gy),
         InvalidArgumentError, "expected TernaryWeights", [gy]),
        ("gemv_w2a8 out_dtype", lambda: bn.gemv_w2a8(tw, x_q, x_s, out_dtype="int8"),
         InvalidArgumentError, "out_dtype must be one of", []),
        ("gemv_w2a8 x_q width", lambda: bn.gemv_w2a8(tw, x_q[:, :64].copy(), x_s, out=gy),
         InvalidArgumentError, "x_q: expected shape [2, 128]", [gy]),
        ("gemv_w2a8 scales shape", lambda: bn.gemv_w2a8(tw, x_q, x_s[:1], out=gy),
         InvalidArgumentError, "s: expected shape [2]", [gy]),
        ("gemv_w2a8 x_q dtype", lambda: bn.gemv_w2a8(tw, x_q.astype(np.int32), x_s, out=gy),
         InvalidArgumentError, "x_q: expected dtype int8", [gy]),
        ("TernaryWeights scales", lambda: bn.TernaryWeights(np.zeros((3, 32), np.uint8),
                                                            np.ones(4, np.float32)),
         InvalidArgumentError, "scales: expected shape [3]", []),
        ("set_cpu_isa name", lambda: bn.set_cpu_isa("sse"), InvalidArgumentError,
         "CPU path must be one of", []),
        ("DeviceArray device", lambda: bn.DeviceArray((4,), "float32", 4096), NoDeviceError,
         "does not exist", []),
        ("DeviceArray dtype", lambda: bn.DeviceArray((4,), "float64", 0), InvalidArgumentError,
         "is not one of", []),
        ("DeviceArray negative", lambda: bn.DeviceArray((-4,), "float32", 0), InvalidArgumentError,
         "negative dimension", []),
        ("Stream device", lambda: bn.Stream(4096), NoDeviceError, "does not exist", []),
        ("Event device", lambda: bn.Event(4096), NoDeviceError, "does not exist", []),
        ("Stream negative device", lambda: bn.Stream(-1), InvalidArgumentError,
         "not a CUDA device index", []),
        ("not an array", lambda: bn.argmax([1.0, 2.0]), InvalidArgumentError,
         "expected a numpy array", []),
        # Wrong types: ArgumentTypeError, a TypeError (and an InvalidArgumentError), never a bare
        # IndexError / AttributeError / TypeError from inside the package, nothing written.
        ("quantize_a8 None", lambda: bn.quantize_a8(None), ArgumentTypeError,
         "x: expected an array, got None", []),
        ("gemv_w2a8 x_q and s None", lambda: bn.gemv_w2a8(tw, None, None, out=gy),
         ArgumentTypeError, "x_q: expected an array, got None", [gy]),
        ("rmsnorm weight None", lambda: bn.rmsnorm(x, None, out=y), ArgumentTypeError,
         "weight: expected an array, got None", [y]),
        ("embedding table None", lambda: bn.embedding(None, [0]), ArgumentTypeError,
         "table: expected a numpy array", []),
        ("relu2_gate a list", lambda: bn.relu2_gate([[1.0, 2.0]]), ArgumentTypeError,
         "got list; pass np.asarray(gate_up)", []),
        ("quantize_a8 a float", lambda: bn.quantize_a8(1.5), ArgumentTypeError,
         "x: expected a numpy array", []),
        ("quantize_i2s row_segments an int", lambda: bn.quantize_i2s(wt, row_segments=3),
         ArgumentTypeError, "row_segments must be a sequence of integer row counts, got 3", []),
        ("quantize_i2s row_segments floats", lambda: bn.quantize_i2s(wt, row_segments=[1.5, 1.5]),
         ArgumentTypeError, "row_segments must be integer row counts", []),
        ("pack_ternary scales None", lambda: bn.pack_ternary(bad_w_q.clip(-1, 1), None),
         ArgumentTypeError, "scales: expected a numpy array", []),
        ("pack_ternary scales text", lambda: bn.pack_ternary(bad_w_q.clip(-1, 1), "1"),
         ArgumentTypeError, "scales: expected a numpy array", []),
        ("gemv_w2a8 w an array", lambda: bn.gemv_w2a8(wt, x_q, x_s, out=gy), ArgumentTypeError,
         "w: expected TernaryWeights", [gy]),
        ("add_int32 float delta", lambda: bn.add_int32(counter, 1.7), ArgumentTypeError,
         "delta: expected an integer, got 1.7 (float)", [counter]),
        ("add_int32 integral float delta", lambda: bn.add_int32(counter, 2.0), ArgumentTypeError,
         "delta: expected an integer, got 2.0", [counter]),
        ("rmsnorm eps None", lambda: bn.rmsnorm(x, w, eps=None, out=y), ArgumentTypeError,
         "eps: expected a number, got None", [y]),
        ("rmsnorm_quantize eps text", lambda: bn.rmsnorm_quantize(x, w, eps="1e-5"),
         ArgumentTypeError, "eps: expected a number, got '1e-5'", []),
        ("attention scale text", lambda: bn.attention(q, kv, kv, scale="0.1", out=att_out),
         ArgumentTypeError, "scale: expected a number", [att_out]),
        ("rope theta None", lambda: bn.rope_append_kv(rqkv, cache, cache, [0, 3], out=rout, theta=None),
         ArgumentTypeError, "theta: expected a number", [rout, cache]),
        ("op stream text", lambda: bn.quantize_a8(wt, stream="default"), ArgumentTypeError,
         "stream: expected a CUDA stream", []),
        ("attention_workspace_size float size",
         lambda: bn.attention_workspace_size(-1, 1, 1.5, 4, 2, 64, 5), ArgumentTypeError,
         "Sq: expected an integer, got 1.5", []),
        ("device_synchronize float device", lambda: bn.device_synchronize(0.5), ArgumentTypeError,
         "device: expected an integer", []),
        ("resolve float device", lambda: bn.resolve(0.5), ArgumentTypeError,
         "device: expected a name", []),
        ("DeviceArray float shape", lambda: bn.DeviceArray((2.5,), "float32", 0), ArgumentTypeError,
         "DeviceArray: shape: expected an integer, got 2.5", []),
        ("DeviceArray text shape", lambda: bn.DeviceArray("4", "float32", 0), ArgumentTypeError,
         "shape must be an integer or a tuple of integers", []),
        ("Stream float device", lambda: bn.Stream(0.5), ArgumentTypeError,
         "device: expected an integer", []),
        ("Graph of an int", lambda: bn.Graph(3), ArgumentTypeError,
         "stream: expected a bitnet_ffi.Stream, got int", []),
        ("glu_gate activation", lambda: bn.glu_gate(gate, "gelu", out=gate_out),
         InvalidArgumentError, "activation must be 'relu2' or 'silu'", [gate_out]),
        ("glu_gate out shape", lambda: bn.glu_gate(gate, "silu", out=nan_like((3, 10))),
         InvalidArgumentError, "out: expected shape", []),
        ("glu_rmsnorm activation", lambda: bn.glu_rmsnorm_quantize(gate, w[:5], "tanh", out=gq),
         InvalidArgumentError, "activation must be 'relu2' or 'silu'", list(gq)),
        ("glu_rmsnorm weight shape", lambda: bn.glu_rmsnorm_quantize(gate, w[:4], "silu", out=gq),
         InvalidArgumentError, "weight: expected shape", list(gq)),
        ("glu_rmsnorm no weight, y_out shape",
         lambda: bn.glu_rmsnorm_quantize(gate, None, "silu", out=gq, y_out=nan_like((3, 4))),
         InvalidArgumentError, "y_out: expected shape", list(gq)),
        ("relu2_rmsnorm weight None", lambda: bn.relu2_rmsnorm_quantize(gate, None, out=gq),
         InvalidArgumentError, "weight: expected an array", list(gq)),
        ("sample top_k", lambda: bn.sample(logits, 1, [0, 1], top_k=1025, out=index),
         InvalidArgumentError, "top_k must be an integer in [0, 1024]", [index]),
        ("sample top_p", lambda: bn.sample(logits, 1, [0, 1], top_p=0.0, out=index),
         InvalidArgumentError, "top_p must be in (0, 1]", [index]),
        ("sample temperature", lambda: bn.sample(logits, 1, [0, 1], temperature=-1.0, out=index),
         InvalidArgumentError, "temperature must be finite and >= 0", [index]),
        ("sample seed", lambda: bn.sample(logits, -3, [0, 1], out=index),
         InvalidArgumentError, "seed must be an integer in [0, 2**64)", [index]),
        ("sample counters count", lambda: bn.sample(logits, 1, [0], out=index),
         InvalidArgumentError, "counters: expected 2 integers", [index]),
        ("sample counters dtype", lambda: bn.sample(logits, 1, np.zeros(2, np.float32), out=index),
         InvalidArgumentError, "counters: expected 2 integers", [index]),
        ("sample logits dtype", lambda: bn.sample(logits.astype(np.float16), 1, [0, 1], out=index),
         InvalidArgumentError, "dtype", [index]),
    ] + decode_layer_cases(rng)


def decode_layer_cases(rng):
    """python_cases' rows for decode_layer: a valid float32 call (H = I = Hq D = 128, C = 4,
    position 2) with one argument made wrong; h, the caches and the workspace stay as they were."""
    config = decode_config(128, 128, 2, 1, 64, activation="silu")
    layer, h, kc, vc = decode_layer_case(rng, config, "float32", 4, 2)
    ws = np.full(bn.decode_layer_workspace_size(config, -1, "float32"), 0x5A, np.uint8)
    state = [h, kc, vc, ws]

    def call(config=config, layer=layer, h=h, kc=kc, vc=vc, position=(2,), workspace=ws):
        return lambda: bn.decode_layer(config, layer, h, kc, vc, list(position), workspace)

    def changed(**parts):
        return Layer(**{**layer.__dict__, **parts})

    scaled = bn.pack_ternary(np.zeros((128, 256), np.int8), 1.0, block_scales=np.ones((128, 1),
                                                                                     np.float32))
    return [
        ("decode_layer config None", call(config=None), ArgumentTypeError,
         "config: expected a bitnet_ffi.config.Config, got NoneType", state),
        ("decode_layer layer None", call(layer=None), ArgumentTypeError,
         "layer: expected an object with attributes qkv", state),
        ("decode_layer layer.o an array", call(layer=changed(o=layer.o.packed)), ArgumentTypeError,
         "layer.o: expected TernaryWeights, got ndarray", state),
        ("decode_layer block-scaled weights", call(layer=changed(down=scaled)), UnsupportedError,
         "layer.down has block_scales: the fused layer needs one scale per row", state),
        ("decode_layer qkv shape", call(layer=changed(qkv=layer.o)), InvalidArgumentError,
         "layer.qkv: expected weights of shape [256, 128], got [128, 128]", state),
        ("decode_layer attn_norm None", call(layer=changed(attn_norm=None)), ArgumentTypeError,
         "layer.attn_norm: expected an array, got None", state),
        ("decode_layer ffn_norm dtype", call(layer=changed(ffn_norm=layer.ffn_norm.astype(np.float16))),
         InvalidArgumentError, "layer.ffn_norm: expected dtype float32, got float16", state),
        ("decode_layer sub-norm shape", call(layer=changed(ffn_sub_norm=layer.ffn_sub_norm[:64])),
         InvalidArgumentError, "layer.ffn_sub_norm: expected shape [128], got [64]", state),
        ("decode_layer h shape", call(h=np.zeros((2, 128), np.float32)), InvalidArgumentError,
         "h: expected shape [1, 128], got [2, 128]", state),
        ("decode_layer h dtype", call(h=h.astype(np.float64)), InvalidArgumentError,
         "dtype float64 is not supported", state),
        ("decode_layer h read-only", call(h=read_only(h)), InvalidArgumentError,
         "h: the array is read-only, and the op writes it", state),
        ("decode_layer k_cache heads", call(kc=np.zeros((4, 2, 64), np.float32)),
         InvalidArgumentError, "k_cache: expected shape [*, 1, 64], got [4, 2, 64]", state),
        ("decode_layer v_cache length", call(vc=vc[:3].copy()), InvalidArgumentError,
         "v_cache: expected shape [4, 1, 64], got [3, 1, 64]", state),
        ("decode_layer v_cache dtype", call(vc=vc.astype(np.float16)), InvalidArgumentError,
         "v_cache: expected dtype float32, got float16", state),
        ("decode_layer position range", call(position=(4,)), InvalidArgumentError,
         "position = 4 is outside [0, C = 4)", state),
        ("decode_layer position count", call(position=(1, 2)), InvalidArgumentError,
         "position: expected 1 integers", state),
        ("decode_layer workspace small", call(workspace=ws[:64]), InvalidArgumentError,
         "workspace of 64 bytes is too small", state),
        ("decode_layer workspace read-only", call(workspace=read_only(ws)), InvalidArgumentError,
         "workspace: the array is read-only", state),
        ("decode_layer h inside the workspace", call(h=ws[:512].view(np.float32)),
         InvalidArgumentError, "h and workspace overlap", state),
        ("decode_layer activation", call(config=decode_config(128, 128, 2, 1, 64, "gelu")),
         InvalidArgumentError, "activation must be 'relu2' or 'silu'", state),
        ("decode_layer eps", call(config=dataclasses.replace(config, eps=0.0)),
         InvalidArgumentError, "config eps must be finite and > 0", state),
        ("decode_layer float heads", call(config=dataclasses.replace(config, heads=2.0)),
         ArgumentTypeError, "config.heads: expected an integer, got 2.0", state),
        ("decode_layer_workspace_size dtype",
         lambda: bn.decode_layer_workspace_size(config, -1, "int8"), InvalidArgumentError,
         "dtype 3 (int8) is not float32, float16 or bfloat16", []),
        ("decode_layer_workspace_size head_dim",
         lambda: bn.decode_layer_workspace_size(decode_config(128, 128, 1, 1, 96), -1),
         UnsupportedError, "head_dim D = 96 is not supported", []),
        ("decode_layer_workspace_size device", lambda: bn.decode_layer_workspace_size(config, 4096),
         NoDeviceError, "does not exist", []),
    ]


PYTHON_CASE_NAMES = [case[0] for case in python_cases(np.random.default_rng(0))]


@pytest.mark.cpu
@pytest.mark.parametrize("name", PYTHON_CASE_NAMES)
def test_python_api_rejects(name, rng):
    case = {c[0]: c for c in python_cases(rng)}[name]
    _, function, exception, fragment, untouched = case
    before = [a.tobytes() for a in untouched]
    with pytest.raises(exception) as raised:
        function()
    assert fragment in str(raised.value)
    assert [a.tobytes() for a in untouched] == before, "an output was written"


def public_callables():
    for name in bn.__all__:
        item = getattr(bn, name)
        if callable(item) and not (inspect.isclass(item) and issubclass(item, BaseException)):
            yield name, item


@pytest.mark.cpu
@pytest.mark.parametrize("name,function", list(public_callables()))
def test_python_api_none_for_any_argument_is_a_bitnet_error(name, function):
    """Every public function and class called with None for its required positional parameters,
    then for all of them: a BitNetError, or a normal return where None means a default (detect,
    select, resolve); never an exception from inside the package (IndexError, AttributeError)."""
    parameters = [p for p in inspect.signature(function).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in parameters if p.default is inspect.Parameter.empty]
    for count in sorted({len(required), len(parameters)}):
        try:
            function(*[None] * count)
        except bn.BitNetError:
            pass


@pytest.mark.cpu
def test_python_api_refuses_a_read_only_memory_map_as_output(tmp_path):
    """Writing this map's pages would kill the process with SIGSEGV (as the package did at
    5a22711): the op must refuse it before the C call."""
    path = tmp_path / "out.bin"
    np.full((3, 8), np.nan, np.float32).tofile(path)
    y = np.memmap(path, dtype=np.float32, mode="r", shape=(3, 8))
    with pytest.raises(InvalidArgumentError, match="out: the array is read-only"):
        bn.rmsnorm(np.ones((3, 8), np.float32), np.ones(8, np.float32), out=y)
    assert np.isnan(y).all()


@pytest.mark.cpu
def test_python_api_reads_read_only_inputs(rng):
    """Only what an op writes must be writable: read-only inputs (np.frombuffer over bytes, a
    memory map opened for reading) give the same results as writable ones."""
    x, w = f32(rng, 3, 128), f32(rng, 128)
    np.testing.assert_array_equal(bn.rmsnorm(read_only(x), read_only(w)), bn.rmsnorm(x, w))
    x_q, s = bn.quantize_a8(read_only(x))
    want_q, want_s = bn.quantize_a8(x)
    np.testing.assert_array_equal(x_q, want_q)
    np.testing.assert_array_equal(s, want_s)
    w_q = rng.integers(-1, 2, (5, 128), dtype=np.int8)
    tw = bn.pack_ternary(read_only(w_q), read_only(np.full(5, 0.5, np.float32)))
    np.testing.assert_array_equal(bn.gemv_w2a8(tw, read_only(x_q), read_only(s), out_dtype="int32"),
                                  x_q.astype(np.int64) @ w_q.T.astype(np.int64))


# ---------------------------------------------------------------- coverage and the case count


def declared_entry_points():
    return set(re.findall(r"\bbitnet_status\s+bitnet_(\w+)\s*\(", _ffi._header_declarations()))


@pytest.mark.cpu
def test_every_entry_point_is_in_the_matrix(capsys):
    covered = set(MUTATIONS) | {case[0] for case in RUNTIME_CASES} | {"stream_synchronize"}
    missing = declared_entry_points() - covered
    assert not missing, f"entry points without bad-input cases: {sorted(missing)}"
    c_cpu = len(mutation_cases("cpu")) + len(RUNTIME_CASES)
    c_gpu = len(mutation_cases("gpu"))
    with capsys.disabled():
        print(f"\n[bad-input matrix] {len(declared_entry_points())} entry points; C ABI: {c_cpu} "
              f"CPU cases (tier 1), {c_gpu} GPU cases (tier 3); Python API: "
              f"{len(PYTHON_CASE_NAMES)} cases (tier 1)")
    assert c_cpu >= 250 and c_gpu >= 150 and len(PYTHON_CASE_NAMES) >= 60


# ---------------------------------------------------------------- tier 3: C ABI on CUDA device 0


@pytest.mark.gpu
@pytest.mark.parametrize("entry", OP_ENTRIES)
def test_the_valid_call_succeeds_on_the_gpu(entry, rng):
    pytest.importorskip("torch")
    mem = Memory(True)
    call = valid_call(entry, mem, rng)
    status, message, before, after = run_call(mem, call, {})
    assert status == OK, message
    assert any(after[n] != before[n] for n in call.outputs), "the valid call wrote nothing"


@pytest.mark.gpu
@pytest.mark.parametrize("entry,mutation", mutation_cases("gpu"))
def test_gpu_op_mutation(entry, mutation, rng):
    pytest.importorskip("torch")
    check_mutation(Memory(True), entry, mutation, rng)


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.parametrize("entry", [e for e in OP_ENTRIES if not e.endswith("workspace_size")])
def test_gpu_pointer_on_another_device(entry, rng):
    """Arrays on device 0, the op asked to run on device 1."""
    pytest.importorskip("torch")
    mem = Memory(True)
    call = valid_call(entry, mem, rng)
    status, message, before, after = run_call(mem, call, {"device": 1})
    assert status == INVALID and "is on CUDA device 0" in message, message
    assert after == before


@pytest.mark.gpu
def test_gpu_python_api_rejects_host_and_mixed_memory(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 8, device="cuda")
    w = torch.randn(8, device="cuda")
    y = torch.full((3, 8), float("nan"), device="cuda")
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bn.rmsnorm(x, w.cpu().numpy(), out=y)
    assert torch.isnan(y).all()
    table = bn.DeviceArray.from_numpy(np.ones((5, 8), np.float32))
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bn.embedding(table, torch.zeros(3, dtype=torch.int32), out=np.zeros((3, 8), np.float32))
    with pytest.raises(UnsupportedError, match="float32 runs on the CPU only"):
        bn.relu2_gate(torch.ones(2, 4, device="cuda"))
    with pytest.raises(NoDeviceError, match="does not exist"):
        bn.DeviceArray((4,), "float32", torch.cuda.device_count())


@pytest.mark.gpu
def test_gpu_device_array_with_an_overflowing_shape_is_refused():
    with pytest.raises(InvalidArgumentError, match="more than a 64-bit size holds"):
        bn.DeviceArray((1 << 32, 1 << 32), "uint8", 0)


@pytest.mark.cpu
def test_torch_objects_that_are_not_plain_tensors_are_refused(rng):
    """A torch module passed as an array is an ArgumentTypeError; a lazily negated view
    (x._neg_view(), whose memory holds -x) is refused rather than read without its sign; a
    conjugate view is complex, a dtype no op takes. CPU torch tensors: skipped where torch is not
    installed (CI has none)."""
    torch = pytest.importorskip("torch", reason="needs torch (CPU tensors are enough)")
    x = torch.from_numpy(f32(rng, 2, 128))
    with pytest.raises(ArgumentTypeError, match="got torch.nn.modules.linear.Linear"):
        bn.quantize_a8(torch.nn.Linear(128, 4))
    negated = x._neg_view()
    assert negated.is_neg()
    with pytest.raises(InvalidArgumentError, match="lazy negative view.*resolve_neg"):
        bn.quantize_a8(negated)
    np.testing.assert_array_equal(bn.quantize_a8(negated.resolve_neg())[0], -bn.quantize_a8(x)[0])
    with pytest.raises(InvalidArgumentError, match="complex64 is not supported"):
        bn.quantize_a8(x.to(torch.complex64).conj())


# Per-op rejection tests, moved here from the op test files: checks beyond the one-argument
# mutations above (several arguments at once, Python shapes, non-ternary weights, GPU memory
# mixes), each against its op's own call.


# attention (from test_attention.py)
def raw_attention(device, dtype, q, k, v, out, B=None, Sq=None, Hq=None, Hkv=None, D=None, C=None,
                  seq_lens=None, causal=1, scale=0.0, workspace=None, workspace_bytes=0, like=None):
    """bitnet_attention with sizes taken from q (or `like`) and v unless given;
    returns the status."""
    ffi = _ffi.ffi
    qa, va = _arrays.as_array(q if like is None else like, "q"), _arrays.as_array(v, "v")
    sizes = dict(B=qa.shape[0], Sq=qa.shape[1], Hq=qa.shape[2], D=qa.shape[3], C=va.shape[1],
                 Hkv=va.shape[2])
    given = dict(B=B, Sq=Sq, Hq=Hq, Hkv=Hkv, D=D, C=C)
    sizes.update({n: x for n, x in given.items() if x is not None})
    ptr = (lambda a: ffi.NULL if a is None else
           a if isinstance(a, ffi.CData) else _arrays.as_array(a, "a").cptr())
    return _ffi.lib().bitnet_attention(
        device, _arrays.DTYPE_CODES[dtype], sizes["B"], sizes["Sq"], sizes["Hq"], sizes["Hkv"],
        sizes["D"], ptr(q), ptr(k), ptr(v), sizes["C"],
        ffi.cast("int32_t *", ptr(seq_lens)), causal, scale, ptr(out), ptr(workspace),
        workspace_bytes, ffi.NULL)


@pytest.mark.cpu
def test_cpu_bad_input_at_the_c_abi(rng):
    q, k, v = make_qkv(rng, "float32", 2, 2, 8, 2, 64, 10)
    out = attention_poisoned(q.shape, "float32")
    lib, ffi = _ffi.lib(), _ffi.ffi
    cases = [
        (dict(Hkv=3), lib.BITNET_ERR_INVALID_ARGUMENT, "not a multiple"),
        (dict(seq_lens=np.array([4, 11], np.int32)), lib.BITNET_ERR_INVALID_ARGUMENT, "seq_lens[1]"),
        (dict(seq_lens=np.array([1, 5], np.int32)), lib.BITNET_ERR_INVALID_ARGUMENT, "seq_lens[0]"),
        (dict(D=80), lib.BITNET_ERR_UNSUPPORTED, "head_dim"),
        (dict(B=0), lib.BITNET_ERR_INVALID_ARGUMENT, "positive"),
        (dict(C=1), lib.BITNET_ERR_INVALID_ARGUMENT, "causal"),
        (dict(causal=2), lib.BITNET_ERR_INVALID_ARGUMENT, "causal"),
        (dict(scale=float("nan")), lib.BITNET_ERR_INVALID_ARGUMENT, "scale"),
    ]
    for kwargs, status, words in cases:
        assert raw_attention(-1, "float32", q, k, v, out, **kwargs) == status, kwargs
        assert words in _ffi.last_error(), (kwargs, _ffi.last_error())
    status = lib.bitnet_attention(-1, 9, 2, 2, 8, 2, 64, ffi.cast("void *", q.ctypes.data),
                                  ffi.cast("void *", k.ctypes.data), ffi.cast("void *", v.ctypes.data),
                                  10, ffi.NULL, 1, 0.0, ffi.cast("void *", out.ctypes.data), ffi.NULL,
                                  0, ffi.NULL)
    assert status == lib.BITNET_ERR_INVALID_ARGUMENT and "dtype" in _ffi.last_error()
    assert raw_attention(-1, "float32", None, k, v, out, like=q) == lib.BITNET_ERR_INVALID_ARGUMENT
    assert "q is NULL" in _ffi.last_error()
    misaligned = ffi.cast("void *", out.ctypes.data + 2)
    assert raw_attention(-1, "float32", q, k, v, misaligned) == lib.BITNET_ERR_INVALID_ARGUMENT
    assert "aligned" in _ffi.last_error()
    assert np.isnan(out).all(), "out was written by a rejected call"


@pytest.mark.cpu
def test_cpu_bad_input_in_python(rng):
    q, k, v = make_qkv(rng, "float16", 2, 1, 8, 2, 64, 10)
    out = attention_poisoned(q.shape, "float16")
    bad = [
        dict(q=q[:, :, :7].copy(), match="multiple"),
        dict(k=k.astype(np.float32), match="dtype"),
        dict(seq_lens=[0, 5], match=r"seq_lens\[0\]"),
        dict(seq_lens=[5, 11], match=r"seq_lens\[1\]"),
        dict(seq_lens=[5], match="seq_lens"),
        dict(q=q[..., :32].copy(), k=k[..., :32].copy(), v=v[..., :32].copy(), out=None, match="head_dim",
             error=UnsupportedError),
        dict(out=np.empty((2, 1, 8, 63), np.float16), match="shape"),
        dict(v=v[:, :9].copy(), match="shape"),
        dict(scale=float("inf"), match="scale"),
    ]
    for case in bad:
        args = dict(q=q, k=k, v=v, out=out)
        error, match = case.pop("error", InvalidArgumentError), case.pop("match")
        args.update(case)
        with pytest.raises(error, match=match):
            bitnet_ffi.attention(**args)
        assert np.isnan(out).all()


@pytest.mark.gpu
def test_gpu_bad_input(rng):
    import torch
    lib = _ffi.lib()
    q, k, v = torch_inputs(rng, "bfloat16", 1, 1, 20, 5, 128, 4096)
    out = torch.full_like(q, float("nan"))
    need = bitnet_ffi.attention_workspace_size(0, 1, 1, 20, 5, 128, 4096)
    assert need > 0 and bitnet_ffi.attention_workspace_size("cuda:0", 1, 1, 20, 5, 128, 4096) == need
    ws = torch.empty(need, dtype=torch.uint8, device="cuda")
    assert raw_attention(0, "bfloat16", q, k, v, out, workspace=ws, workspace_bytes=need - 1) \
        == lib.BITNET_ERR_INVALID_ARGUMENT and "workspace" in _ffi.last_error()
    assert raw_attention(0, "bfloat16", q, k, v, out) == lib.BITNET_ERR_INVALID_ARGUMENT
    host_q = np.zeros((1, 1, 20, 128), np.float16)
    assert raw_attention(0, "bfloat16", host_q, k, v, out, workspace=ws, workspace_bytes=need) \
        == lib.BITNET_ERR_INVALID_ARGUMENT and "host memory" in _ffi.last_error()
    misaligned = _ffi.ffi.cast("void *", k.data_ptr() + 2)
    assert raw_attention(0, "bfloat16", q, misaligned, v, out, workspace=ws,
                         workspace_bytes=need) == lib.BITNET_ERR_INVALID_ARGUMENT
    assert raw_attention(0, "float32", q.float(), k.float(), v.float(), out.float(), workspace=ws,
                         workspace_bytes=need) == lib.BITNET_ERR_UNSUPPORTED
    assert raw_attention(0, "bfloat16", q, k, v, out, D=96, workspace=ws,
                         workspace_bytes=need) == lib.BITNET_ERR_UNSUPPORTED
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bitnet_ffi.attention(q, k.cpu(), v)
    with pytest.raises(InvalidArgumentError, match="seq_lens"):
        bitnet_ffi.attention(q, k, v, seq_lens=[4097])
    with pytest.raises(InvalidArgumentError, match="dtype"):
        bitnet_ffi.attention(q, k.half(), v)
    with pytest.raises(InvalidArgumentError, match="workspace"):  # its size is checked in C
        bitnet_ffi.attention(q, k, v, out=out, workspace=ws[:need - 1])
    with pytest.raises(InvalidArgumentError, match="different devices: .*workspace on cpu"):
        bitnet_ffi.attention(q, k, v, out=out, workspace=np.zeros(need, np.uint8))
    torch.cuda.synchronize()
    assert torch.isnan(out).all()


# gemv_w2a8 (from test_gemv_w2a8.py)
def c_gemv(w, ws, M, K, x, xs, N, y, y_dtype, device=-1, stream=None):
    ffi = _ffi.ffi
    status = _ffi.lib().bitnet_gemv_w2a8(
        device, ffi.cast("uint8_t *", w), ffi.cast("float *", ws), M, K, ffi.cast("int8_t *", x),
        ffi.cast("float *", xs), N, ffi.cast("void *", y), y_dtype,
        ffi.cast("void *", stream or 0))
    return int(status), _ffi.last_error()


@pytest.mark.cpu
def test_gemv_bad_input_c_abi(rng):
    M, K, N = 16, 256, 2
    w = np.zeros((M, K // 4), np.uint8)
    ws = np.ones(M, np.float32)
    x = np.zeros((N, K), np.int8)
    xs = np.ones(N, np.float32)
    y = np.full((N, M), -7, np.int32)
    p = lambda a: a.ctypes.data  # noqa: E731
    cases = [
        (c_gemv(p(w), p(ws), M, 200, p(x), p(xs), N, p(y), 4), 2, "multiple of 128"),
        (c_gemv(p(w), p(ws), M, K, p(x), p(xs), 0, p(y), 4), 1, "N must be"),
        (c_gemv(p(w), p(ws), 0, K, p(x), p(xs), N, p(y), 4), 1, "M must be"),
        (c_gemv(p(w), p(ws), M, K, p(x), p(xs), N, p(y), 99), 1, "not a bitnet_dtype"),
        (c_gemv(p(w), p(ws), M, K, p(x), p(xs), N, p(y), 3), 2, "int8"),
        (c_gemv(0, p(ws), M, K, p(x), p(xs), N, p(y), 4), 1, "w_packed is NULL"),
        (c_gemv(p(w), p(ws), M, K, p(x), 0, N, p(y), 4), 1, "x_scales is NULL"),
        (c_gemv(p(w) + 4, p(ws), M, K, p(x), p(xs), N, p(y), 4), 1, "not aligned"),
        (c_gemv(p(w), p(ws), M, K, p(x) + 8, p(xs), N, p(y), 4), 1, "not aligned"),
        (c_gemv(p(w), p(ws), M, K, p(x), p(xs), N, p(y) + 2, 4), 1, "not aligned"),
        (c_gemv(p(w), p(ws), M, K, p(x), p(xs), 2 ** 60, p(y), 4), 1, "overflow"),
        (c_gemv(p(w), p(ws), 2 ** 61, K, p(x), p(xs), N, p(y), 4), 1, "overflow"),
        (c_gemv(p(w), p(ws), M, K, p(x), p(xs), N, p(y), 4, device=-7), 1, "neither"),
    ]
    for (status, message), want_status, want_text in cases:
        assert status == want_status and want_text in message, (status, message, want_text)
    assert np.all(y == -7)


@pytest.mark.cpu
def test_gemv_python_bad_input(rng):
    w_q, w_scales, x_q, x_scales = make_problem(rng, 8, 256, 2)
    tw = bn.pack_ternary(w_q, w_scales)
    out = np.full((2, 8), np.nan, np.float32)
    with pytest.raises(InvalidArgumentError, match="TernaryWeights"):
        bn.gemv_w2a8(tw.packed, x_q, x_scales)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        bn.gemv_w2a8(tw, x_q.astype(np.int32), x_scales, out=out)
    with pytest.raises(InvalidArgumentError, match="shape"):
        bn.gemv_w2a8(tw, np.ascontiguousarray(x_q[:, :128]), x_scales, out=out)
    with pytest.raises(InvalidArgumentError, match="shape"):
        bn.gemv_w2a8(tw, x_q, x_scales[:1], out=out)
    with pytest.raises(InvalidArgumentError, match="out_dtype"):
        bn.gemv_w2a8(tw, x_q, x_scales, out_dtype="int8")
    with pytest.raises(InvalidArgumentError, match="shape"):
        bn.gemv_w2a8(tw, x_q, x_scales, out=np.zeros((2, 9), np.float32))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        bn.gemv_w2a8(tw, x_q, x_scales, out=np.zeros((2, 8), np.float16))
    assert np.all(np.isnan(out))


@pytest.mark.gpu
def test_gemv_gpu_bad_input(rng):
    torch = pytest.importorskip("torch")
    tw, tw_cpu, x_gpu, xs_gpu, x_q, x_scales = torch_problem(torch, rng, 64, 256, 2)
    out = torch.full((2, 64), -7, dtype=torch.int32, device="cuda")
    status, message = c_gemv(tw.packed.data_ptr(), tw.scales.data_ptr(), 64, 256, x_q.ctypes.data,
                             xs_gpu.data_ptr(), 2, out.data_ptr(), 4, device=0)
    assert status == 1 and "host memory" in message
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bn.gemv_w2a8(tw, x_q, x_scales, out_dtype="int32")
    with pytest.raises(InvalidArgumentError, match="x_q on cpu"):
        bn.gemv_w2a8(tw, torch.from_numpy(x_q), xs_gpu, out=out, out_dtype="int32")
    with pytest.raises(UnsupportedError, match="multiple of 128"):
        bn.gemv_w2a8(bn.TernaryWeights(tw.packed[:, :24].contiguous(), tw.scales),
                     x_gpu[:, :96].contiguous(), xs_gpu)
    assert bool((out == -7).all())


# head (from test_head.py)
@pytest.mark.cpu
def test_bad_inputs_leave_outputs_untouched(rng):
    w, x = random_bf16(rng, (10, 16)), random_bf16(rng, (2, 16))
    out = np.full((2, 10), 7.0, dtype=np.float32)
    cases = [
        (lambda: bitnet_ffi.gemv_bf16(w.astype(np.float32), x, out=out), "w: expected dtype bfloat16"),
        (lambda: bitnet_ffi.gemv_bf16(w, x[:1], out=out), r"out: expected shape \[1, 10\]"),
        (lambda: bitnet_ffi.gemv_bf16(w, random_bf16(rng, (2, 24)), out=out), r"x: expected shape \[2, 16\]"),
        (lambda: bitnet_ffi.gemv_bf16(w, x, out=out[:, :5]), "out: the array is not C-contiguous"),
        (lambda: bitnet_ffi.gemv_bf16(w, x, out_dtype="int8"), "out_dtype must be"),
        (lambda: bitnet_ffi.gemv_bf16(w[:, ::2], x, out=out), "not C-contiguous"),
        (lambda: bitnet_ffi.embedding(w, [0, 10]), r"ids\[1\] = 10 is outside \[0, 10\)"),
        (lambda: bitnet_ffi.embedding(w, [-1]), r"ids\[0\] = -1"),
        (lambda: bitnet_ffi.argmax(x), "x: expected dtype float32"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            call()
    assert (out == 7.0).all()


@pytest.mark.cpu
def test_c_abi_rejects_bad_arguments():
    lib, ffi = _ffi.lib(), _ffi.ffi
    w = np.ones((4, 12), dtype=BF16)
    x = np.ones((1, 12), dtype=BF16)
    y = np.full((1, 4), 3.0, dtype=np.float32)
    ids = np.array([5], dtype=np.int32)
    table = np.ones((4, 8), dtype=np.float32)
    emb = np.full((1, 8), 3.0, dtype=np.float32)
    p = lambda a, off=0: ffi.cast("void *", a.ctypes.data + off)  # noqa: E731
    cases = [
        (lambda: lib.bitnet_gemv_bf16(-1, p(w), 4, 12, p(x), 2, 1, p(y), 0, ffi.NULL), "multiple of 8"),
        (lambda: lib.bitnet_gemv_bf16(-1, ffi.NULL, 4, 16, p(x), 2, 1, p(y), 0, ffi.NULL), "w is NULL"),
        (lambda: lib.bitnet_gemv_bf16(-1, p(w, 2), 4, 8, p(x), 2, 1, p(y), 0, ffi.NULL), "not aligned"),
        (lambda: lib.bitnet_gemv_bf16(-1, p(w), 4, 8, p(x), 9, 1, p(y), 0, ffi.NULL), "x dtype"),
        (lambda: lib.bitnet_gemv_bf16(-1, p(w), 4, 8, p(x), 2, 1, p(y), 3, ffi.NULL), "y dtype"),
        (lambda: lib.bitnet_gemv_bf16(-1, p(w), 1 << 62, 8, p(x), 2, 1, p(y), 0, ffi.NULL), "overflow"),
        (lambda: lib.bitnet_gemv_bf16(-1, p(w), 0, 8, p(x), 2, 1, p(y), 0, ffi.NULL), "must be positive"),
        (lambda: lib.bitnet_argmax(-1, ffi.cast("float *", y.ctypes.data), 1, -4,
                           ffi.cast("int32_t *", ids.ctypes.data), ffi.NULL), "must be positive"),
        (lambda: lib.bitnet_embedding(-1, 0, p(table), 4, 8, ffi.cast("int32_t *", ids.ctypes.data), 1,
                              p(emb), ffi.NULL), "ids[0] = 5 is outside [0, 4)"),
        (lambda: lib.bitnet_embedding(-1, 3, p(table), 4, 8, ffi.cast("int32_t *", ids.ctypes.data), 1,
                              p(emb), ffi.NULL), "dtype must be float32"),
    ]
    for call, message in cases:
        assert call() == lib.BITNET_ERR_INVALID_ARGUMENT
        assert message in _ffi.last_error()
    assert (y == 3.0).all() and (emb == 3.0).all() and ids[0] == 5


# layer_glue (from test_layer_glue.py)
@pytest.mark.cpu
def test_cpu_rope_bad_input(rng):
    q, k, v, qkv, k_cache, v_cache = rope_case(rng, "float16", 2, 3, 8, 2, 64, 10)
    out = np.full(q.shape, np.nan, q.dtype)
    for kwargs, match in [(dict(positions=[8, 0]), r"positions\[0\]"), (dict(positions=[0, -1]),
                          r"positions\[1\]"), (dict(positions=[0]), "positions"),
                          (dict(theta=0.5), "theta"), (dict(out=out[:, :, :1].copy()), "shape"),
                          (dict(v_cache=v_cache.astype(np.float32)), "dtype")]:
        args = dict(qkv=qkv, k_cache=k_cache, v_cache=v_cache, positions=[0, 7], out=out)
        args.update(kwargs)
        with pytest.raises(InvalidArgumentError, match=match):
            bitnet_ffi.rope_append_kv(**args)
    lib, ffi = _ffi.lib(), _ffi.ffi
    ptr = (lambda a: ffi.cast("void *", a.ctypes.data))
    positions = np.array([0, 8], np.int32)

    def call(D=64, qkv_ptr=ptr(qkv), q_ptr=ptr(out)):
        return lib.bitnet_rope_append_kv(-1, 1, 2, 3, 8, 2, D, qkv_ptr, q_ptr, ptr(k_cache),
                                         ptr(v_cache), 10,
                                         ffi.cast("int32_t *", positions.ctypes.data), 500000.0,
                                         ffi.NULL)
    assert call() == lib.BITNET_ERR_INVALID_ARGUMENT and "positions[1]" in _ffi.last_error()
    assert call(D=63) == lib.BITNET_ERR_INVALID_ARGUMENT and "even" in _ffi.last_error()
    assert call(qkv_ptr=ffi.NULL) == lib.BITNET_ERR_INVALID_ARGUMENT
    assert "qkv is NULL" in _ffi.last_error()
    assert call(q_ptr=ptr(qkv)) == lib.BITNET_ERR_INVALID_ARGUMENT
    assert "qkv and q overlap" in _ffi.last_error()
    assert np.isnan(out.astype(np.float32)).all()
    assert np.isnan(k_cache.astype(np.float32)).all() and np.isnan(v_cache.astype(np.float32)).all()


@pytest.mark.cpu
def test_cpu_relu2_gate_bad_input(rng):
    gate_up = cast(rng.standard_normal((3, 10)), "bfloat16")
    out = np.full((3, 5), np.nan, dtype=gate_up.dtype)
    with pytest.raises(InvalidArgumentError, match="2F"):
        bitnet_ffi.relu2_gate(gate_up[:, :9].copy())
    with pytest.raises(InvalidArgumentError, match="shape"):
        bitnet_ffi.relu2_gate(gate_up, out=np.empty((3, 4), gate_up.dtype))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        bitnet_ffi.relu2_gate(gate_up.astype(np.int8))
    lib, ffi = _ffi.lib(), _ffi.ffi
    status = lib.bitnet_relu2_gate(-1, 2, 3, 5, ffi.cast("void *", gate_up.ctypes.data + 1),
                                   ffi.cast("void *", out.ctypes.data), ffi.NULL)
    assert status == lib.BITNET_ERR_INVALID_ARGUMENT and "aligned" in _ffi.last_error()
    status = lib.bitnet_relu2_gate(-1, 2, 0, 5, ffi.cast("void *", gate_up.ctypes.data),
                                   ffi.cast("void *", out.ctypes.data), ffi.NULL)
    assert status == lib.BITNET_ERR_INVALID_ARGUMENT and "positive" in _ffi.last_error()
    assert np.isnan(out.astype(np.float32)).all()


@pytest.mark.gpu
def test_gpu_glue_bad_input(rng):
    import torch
    lib, ffi = _ffi.lib(), _ffi.ffi
    gate_up = torch.randn(3, 10, device="cuda", dtype=torch.bfloat16)
    out = torch.full((3, 5), float("nan"), device="cuda", dtype=torch.bfloat16)
    host = np.zeros((3, 10), np.float16)
    status = lib.bitnet_relu2_gate(0, 2, 3, 5, ffi.cast("void *", host.ctypes.data),
                                   ffi.cast("void *", out.data_ptr()), ffi.NULL)
    assert status == lib.BITNET_ERR_INVALID_ARGUMENT and "host memory" in _ffi.last_error()
    with pytest.raises(UnsupportedError):
        bitnet_ffi.relu2_gate(gate_up.float(), out=out.float())
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bitnet_ffi.relu2_gate(gate_up, out=out.cpu())
    q, k, v, qkv, k_cache, v_cache = (to_torch(x) for x in
                                      rope_case(rng, "float16", 2, 3, 8, 2, 64, 10))
    with pytest.raises(InvalidArgumentError, match=r"positions\[1\]"):
        bitnet_ffi.rope_append_kv(qkv, k_cache, v_cache, [0, 8])
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and torch.isnan(k_cache).all()


# quantize (from test_quantize.py)
@pytest.mark.cpu
@pytest.mark.parametrize("bad", [2, -2, 127, -128])
def test_pack_rejects_non_ternary_untouched(rng, bad):
    w_q = rng.integers(-1, 2, (5, 256), dtype=np.int8)
    w_q[3, 200] = bad
    packed = np.full((5, 64), 0xA5, np.uint8)
    status, message = status_and_message(_ffi.lib().bitnet_pack_ternary(
        -1, _ffi.ffi.cast("int8_t *", w_q.ctypes.data), 5, 256,
        _ffi.ffi.cast("uint8_t *", packed.ctypes.data), _ffi.ffi.NULL))
    assert status == 1 and f"w_q[3, 200] = {bad} is not -1, 0 or 1" in message
    assert np.all(packed == 0xA5)
    with pytest.raises(InvalidArgumentError):
        bn.pack_ternary(w_q, 1.0)


@pytest.mark.cpu
def test_quantize_i2s_bad_input_c_abi():
    ffi = _ffi.ffi
    w = np.ones((4, 256), np.float32)
    packed = np.full((4, 64), 0x5A, np.uint8)
    scales = np.full(4, np.nan, np.float32)
    wp, pp, sp = (ffi.cast("void *", w.ctypes.data), ffi.cast("uint8_t *", packed.ctypes.data),
                  ffi.cast("float *", scales.ctypes.data))
    cases = [
        (c_quantize_i2s(wp, 4, 200, ffi.NULL, 0, pp, sp), 2, "multiple of 128"),
        (c_quantize_i2s(wp, 0, 256, ffi.NULL, 0, pp, sp), 1, "M must be"),
        (c_quantize_i2s(wp, 4, 256, ffi.NULL, 0, pp, sp, dtype=3), 2, "int8"),
        (c_quantize_i2s(wp, 4, 256, ffi.NULL, 0, pp, sp, dtype=17), 1, "not a bitnet_dtype"),
        (c_quantize_i2s(ffi.NULL, 4, 256, ffi.NULL, 0, pp, sp), 1, "w is NULL"),
        (c_quantize_i2s(wp, 4, 256, ffi.NULL, 0, ffi.NULL, sp), 1, "w_packed is NULL"),
        (c_quantize_i2s(wp, 4, 256, ffi.NULL, 0, pp + 1, sp), 1, "not aligned"),
        (c_quantize_i2s(wp, 4, 256, ffi.new("int64_t[]", [3, 2]), 2, pp, sp), 1, "sum to M"),
        (c_quantize_i2s(wp, 4, 256, ffi.new("int64_t[]", [4, 0]), 2, pp, sp), 1, ">= 1 rows"),
        (c_quantize_i2s(wp, 4, 256, ffi.NULL, 3, pp, sp), 1, "n_segments"),
        (c_quantize_i2s(wp, 2 ** 62, 256, ffi.NULL, 0, pp, sp), 1, "overflow"),
        (c_quantize_i2s(wp, 4, 2 ** 23, ffi.NULL, 0, pp, sp), 2, "largest supported K"),
    ]
    for (status, message), want_status, want_text in cases:
        assert status == want_status and want_text in message, (status, message, want_text)
    assert np.all(packed == 0x5A) and np.all(np.isnan(scales))


@pytest.mark.cpu
def test_quantize_a8_bad_input_c_abi():
    ffi = _ffi.ffi
    x = np.ones((2, 128), np.float32)
    x_q = np.full((2, 128), 7, np.int8)
    s = np.full(2, np.nan, np.float32)
    lib = _ffi.lib()

    def call(xp, dtype, N, K, qp, sp):
        return status_and_message(lib.bitnet_quantize_a8(-1, xp, dtype, N, K, qp, sp, ffi.NULL))

    xp, qp, sp = (ffi.cast("void *", x.ctypes.data), ffi.cast("int8_t *", x_q.ctypes.data),
                  ffi.cast("float *", s.ctypes.data))
    assert call(xp, 0, 2, 100, qp, sp)[0] == 2
    assert call(xp, 4, 2, 128, qp, sp)[0] == 2
    assert call(xp, -1, 2, 128, qp, sp)[0] == 1
    assert call(xp, 0, 2, 128, qp, ffi.NULL)[0] == 1
    assert call(xp, 0, -2, 128, qp, sp)[0] == 1
    assert call(xp + 2, 0, 2, 128, qp, sp)[0] == 1
    assert np.all(x_q == 7) and np.all(np.isnan(s))


@pytest.mark.cpu
def test_python_bad_input(rng):
    with pytest.raises(InvalidArgumentError, match="dtype"):
        bn.quantize_i2s(np.ones((4, 128), np.int32))
    with pytest.raises(InvalidArgumentError, match="shape"):
        bn.quantize_i2s(np.ones(128, np.float32))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        bn.quantize_i2s(np.ones((128, 8), np.float32).T)
    with pytest.raises(UnsupportedError, match="multiple of 128"):
        bn.quantize_i2s(np.ones((4, 96), np.float32))
    with pytest.raises(InvalidArgumentError, match="row_segments"):
        bn.quantize_i2s(np.ones((4, 128), np.float32), row_segments=[1, 2])
    with pytest.raises(InvalidArgumentError, match="integer row counts"):  # not truncated to [2, 2]
        bn.quantize_i2s(np.ones((4, 128), np.float32), row_segments=[2.7, 2.2])
    with pytest.raises(InvalidArgumentError, match="N must be at least 1"):
        bn.quantize_a8(np.ones((0, 128), np.float32))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        bn.quantize_a8(np.ones((2, 128), np.int8))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        bn.pack_ternary(np.ones((2, 128), np.int32), 1.0)
    with pytest.raises(InvalidArgumentError, match="shape"):
        bn.pack_ternary(np.ones((2, 128), np.int8), np.ones(3, np.float32))
    with pytest.raises(InvalidArgumentError, match="a scalar or 2 values"):
        bn.pack_ternary(np.ones((2, 128), np.int8), [1.0, 2.0, 3.0])


@pytest.mark.gpu
def test_pack_gpu_rejects_non_ternary_untouched(rng):
    torch = pytest.importorskip("torch")
    w_q = torch.randint(-1, 2, (64, 512), dtype=torch.int8, device="cuda")
    w_q[63, 511] = 2
    packed = torch.full((64, 128), 0xA5, dtype=torch.uint8, device="cuda")
    status, message = status_and_message(_ffi.lib().bitnet_pack_ternary(
        0, _ffi.ffi.cast("int8_t *", w_q.data_ptr()), 64, 512,
        _ffi.ffi.cast("uint8_t *", packed.data_ptr()),
        _ffi.ffi.cast("void *", torch.cuda.current_stream().cuda_stream)))
    assert status == 1 and "w_q[63, 511] = 2 is not -1, 0 or 1" in message
    assert bool((packed == 0xA5).all())


@pytest.mark.gpu
def test_quantize_gpu_bad_input(rng):
    torch = pytest.importorskip("torch")
    ffi = _ffi.ffi
    host = np.ones((4, 128), np.float32)
    packed = torch.full((4, 32), 0x5A, dtype=torch.uint8, device="cuda")
    scales = torch.full((4,), float("nan"), device="cuda")
    status, message = c_quantize_i2s(ffi.cast("void *", host.ctypes.data), 4, 128, ffi.NULL, 0,
                                     ffi.cast("uint8_t *", packed.data_ptr()),
                                     ffi.cast("float *", scales.data_ptr()), device=0)
    assert status == 1 and "host memory" in message
    assert bool((packed == 0x5A).all()) and bool(scales.isnan().all())
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bn.pack_ternary(torch.zeros((4, 128), dtype=torch.int8, device="cuda"),
                        np.ones(4, np.float32))


# rmsnorm (from test_rmsnorm.py)
BAD_ABI_CASES = {
    "int8 dtype": (dict(dtype=3), "not float32"),
    "dtype outside the enum": (dict(dtype=99), "dtype 99"),
    "T = 0": (dict(T=0), "must be >= 1"),
    "negative H": (dict(H=-8), "must be >= 1"),
    "T*H overflows": (dict(T=2**62, H=8), "overflow"),
    "T*H*size overflows": (dict(T=2**60, H=4), "overflow"),
    "negative eps": (dict(eps=-1e-5), "eps"),
    "NaN eps": (dict(eps=math.nan), "eps"),
    "infinite eps": (dict(eps=math.inf), "eps"),
    "no output": (dict(y=None, y_q=None, y_scales=None), "both NULL"),
    "y_q without scales": (dict(y_scales=None), "go together"),
    "NULL x": (dict(x=None), "x is NULL"),
    "NULL weight": (dict(weight=None), "weight is NULL"),
    "misaligned x": (dict(x="x+2"), "aligned"),
    "misaligned scales": (dict(y_scales="s+1"), "aligned"),
    "y overlaps residual": (dict(y="residual+32"), "overlap"),
    "residual is x": (dict(residual="x"), "overlap"),
    "y_q inside x": (dict(y_q="x+4"), "overlap"),
    "not a device": (dict(device=-2), "neither the CPU"),
}


@pytest.mark.cpu
@pytest.mark.parametrize("case", BAD_ABI_CASES)
def test_abi_rejects_bad_arguments(rng, case):
    changes, message = BAD_ABI_CASES[case]
    b = Buffers(rng)
    args = {}
    for key, value in changes.items():
        if isinstance(value, str):  # "name+offset": a pointer into one of the buffers
            name, _, offset = value.partition("+")
            value = b.ptr(name, int(offset or 0))
        args[key] = value
    status = raw_call(**{k: v for k, v in {**b.args(), **args}.items()})
    assert status == _ffi.lib().BITNET_ERR_INVALID_ARGUMENT, (status, _ffi.last_error())
    assert message in _ffi.last_error()
    b.assert_untouched()


@pytest.mark.cpu
def test_abi_rejects_missing_gpu(rng):
    b = Buffers(rng)
    count = _ffi.ffi.new("int32_t *")
    _ffi.call("device_count", count, _ffi.ffi.NULL)
    status = raw_call(device=count[0], **b.args())
    assert status == _ffi.lib().BITNET_ERR_NO_DEVICE
    assert "does not exist" in _ffi.last_error()
    b.assert_untouched()


def python_bad_cases(rng):
    x, weight, residual = make_inputs(rng, 4, 16, "bfloat16")
    y = poisoned((4, 16), "bfloat16")
    return x, weight, residual, y, {
        "int8 x": (lambda: bitnet_ffi.rmsnorm(x.view(np.int8), weight, out=y), "dtype"),
        "weight dtype": (lambda: bitnet_ffi.rmsnorm(x, weight.astype(np.float32), out=y), "weight"),
        "weight length": (lambda: bitnet_ffi.rmsnorm(x, np.concatenate([weight, weight[:1]]), out=y),
                          r"weight: expected shape \[16\]"),
        "out dtype": (lambda: bitnet_ffi.rmsnorm(x, weight, out=np.zeros((4, 16), np.float32)), "out"),
        "out shape": (lambda: bitnet_ffi.rmsnorm(x, weight, out=y[:2]), "out"),
        "residual shape": (lambda: bitnet_ffi.add_rmsnorm(x, residual[:3], weight, out=y), "residual"),
        "residual dtype": (lambda: bitnet_ffi.add_rmsnorm(x, residual.astype(np.float16), weight, out=y),
                           "residual"),
        "negative eps": (lambda: bitnet_ffi.add_rmsnorm(x, residual, weight, eps=-1.0, out=y), "eps"),
        "NaN eps": (lambda: bitnet_ffi.rmsnorm(x, weight, eps=math.nan, out=y), "eps"),
        "strided x": (lambda: bitnet_ffi.rmsnorm(x[:, ::2], weight[::2].copy(), out=y[:, :8]),
                      "contiguous"),
        "bad out pair": (lambda: bitnet_ffi.rmsnorm_quantize(x, weight, out=y), "pair"),
        "scales shape": (lambda: bitnet_ffi.rmsnorm_quantize(
            x, weight, out=(np.zeros((4, 16), np.int8), np.zeros(5, np.float32))), "scales"),
        "scalar x": (lambda: bitnet_ffi.rmsnorm(np.array(1.0, np.float32), weight), "scalar"),
        "empty x": (lambda: bitnet_ffi.rmsnorm(x[:0], weight), ">= 1"),
    }


@pytest.mark.cpu
@pytest.mark.parametrize("case", python_bad_cases(np.random.default_rng(0))[4])
def test_python_rejects_bad_arguments(rng, case):
    x, weight, residual, y, cases = python_bad_cases(rng)
    before = residual.copy()
    call, message = cases[case]
    with pytest.raises(InvalidArgumentError, match=message):
        call()
    assert np.isnan(y.astype(np.float32)).all()
    np.testing.assert_array_equal(residual.view(np.uint16), before.view(np.uint16))


@pytest.mark.gpu
def test_gpu_rejects_host_memory_and_mixed_devices(rng):
    import torch
    b = Buffers(rng)
    xd = torch_put(b.x)
    status = raw_call(device=0, **b.args(x=_ffi.ffi.cast("void *", xd.data_ptr())))
    assert status == _ffi.lib().BITNET_ERR_INVALID_ARGUMENT
    assert "host memory" in _ffi.last_error()
    b.assert_untouched()
    y = torch.full((4, 8), float("nan"), device="cuda")
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bitnet_ffi.rmsnorm(xd, b.weight, out=y)
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bitnet_ffi.add_rmsnorm(xd, b.residual, torch_put(b.weight), out=y)
    assert torch.isnan(y).all()
    np.testing.assert_array_equal(b.residual, b.residual_before)
