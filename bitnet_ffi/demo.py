"""python -m bitnet_ffi demo: BitNet b1.58 2B4T shapes, prefill then greedy decode through libbitnet,
with a per-op time breakdown, bandwidth, and the same model in PyTorch bf16 beside it on a GPU."""
import json
import sys
import time

import numpy as np

from . import _arrays
from .device import resolve, select
from .errors import InvalidArgumentError
from .model import BITNET_2B4T, TINY, Config, Session, random_weights

CPU_DEFAULT_LAYERS = 4
TIMED_REPLAYS = 20


def progress(label):
    """A progress bar on stderr: progress(label)(done, total). Redrawn in place on a terminal;
    elsewhere (a log) written once, when done."""
    def show(done, total):
        if not sys.stderr.isatty() and done != total:
            return
        filled = 30 * done // total
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show


class Clock:
    """Wall time on the CPU; device time between events on a GPU (the work is asynchronous)."""

    def __init__(self, session):
        self.session = session

    def __enter__(self):
        self.session.synchronize()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.session.synchronize()
        self.seconds = time.perf_counter() - self.start


def op_breakdown(session):
    """Milliseconds per op kind of one decode step: on a GPU, each kind's ops captured alone and
    replayed; on the CPU, the wall time of each op in one step."""
    if session.stream is None:
        session.times = {}
        session.decode()
        times, session.times = session.times, None
        return {kind: 1e3 * t for kind, t in times.items()}
    saved = session.download(session.positions).copy(), session.download(session.seq_lens).copy()
    breakdown = {}
    for kind in Session.KINDS:
        session.only = {kind}
        graph = session.capture()
        breakdown[kind] = graph.time_ms(5)
        session.upload(saved[0], session.positions)
        session.upload(saved[1], session.seq_lens)
    session.only = None
    return breakdown


def step_bytes(config, batch, context):
    """Bytes one decode step must read: ternary weights, the bfloat16 output head, the KV cache."""
    kv = 2 * config.layers * batch * context * config.kv_dim * 2
    return config.ternary_bytes() + config.vocab * config.hidden * 2 + kv


def run(args):
    for name in ("layers", "prompt_len", "tokens", "batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    selection = select(args.device)
    device = resolve(args.device)
    report = {"tool": "demo", "summary": selection.summary(), "device": selection.selected}
    say = (lambda *a: None) if args.json else print
    say(selection.summary())
    start = time.perf_counter()
    if args.model:  # a real checkpoint, all its layers; random prompt ids in its vocabulary
        from .generate import Model
        weights = Model.load(args.model, device).weights
        config, layers = weights.config, weights.config.layers
        say(f"weights: {args.model} loaded in {time.perf_counter() - start:.1f} s")
    else:
        layers = args.layers or (BITNET_2B4T.layers if device != _arrays.CPU
                                 else CPU_DEFAULT_LAYERS)
        if device == _arrays.CPU and not args.layers:
            say(f"CPU run: {layers} of the {BITNET_2B4T.layers} layers by default (--layers to "
                "change)")
        config = Config(**{**BITNET_2B4T.__dict__, "layers": layers})
        weights = random_weights(config, device, args.seed, progress("quantizing layers"))
        say(f"weights: {layers} layers quantized by quantize_i2s in "
            f"{time.perf_counter() - start:.1f} s")
    context = args.prompt_len + args.tokens
    report.update(layers=layers, batch=args.batch, prompt_len=args.prompt_len, tokens=args.tokens)
    session = Session(weights, args.batch, context + TIMED_REPLAYS + 1, device)
    prompt = np.random.default_rng(args.seed + 1).integers(0, config.vocab,
                                                           (args.batch, args.prompt_len))
    if device != _arrays.CPU:
        session.prefill(prompt)  # warm-up: module loading and first launches stay out of the time
    with Clock(session) as clock:
        tokens = [session.prefill(prompt)]
    report["prefill_tokens_per_s"] = args.batch * args.prompt_len / clock.seconds
    say(f"prefill: {args.batch}x{args.prompt_len} tokens in {1e3 * clock.seconds:.1f} ms "
        f"({report['prefill_tokens_per_s']:.0f} tokens/s)")

    bar = progress("decoding")
    with Clock(session) as clock:
        for step in range(args.tokens - 1):
            tokens.append(session.decode())
            bar(step + 1, args.tokens - 1)
    generated = np.stack(tokens, axis=1)
    report["tokens_first_sequence"] = generated[0].tolist()
    say(f"greedy tokens of sequence 0: {generated[0][:16].tolist()}"
        f"{' ...' if generated.shape[1] > 16 else ''}")

    if session.stream is not None:
        step_ms = session.graph.time_ms(TIMED_REPLAYS)
        method = "CUDA graph replays, device time"
    else:
        step_ms = 1e3 * clock.seconds / max(1, args.tokens - 1)
        method = "wall time per step"
    gbps = step_bytes(config, args.batch, context) / (step_ms * 1e-3) / 1e9
    report.update(decode_ms_per_token=step_ms, decode_tokens_per_s=args.batch * 1e3 / step_ms,
                  decode_gbps=gbps, timing=method, op_ms=op_breakdown(session))
    say(f"decode: {step_ms:.3f} ms per step ({method}), {report['decode_tokens_per_s']:.1f} "
        f"tokens/s, {gbps:.0f} GB/s of weights and KV cache read")
    say("per-op time of one decode step:")
    for kind, ms in report["op_ms"].items():
        say(f"  {kind:18s} {ms:8.3f} ms  {100 * ms / step_ms:5.1f}%")

    two_b4t_layout = config.activation == "relu2" and config.sub_norms and config.tied_head
    if session.stream is not None and not args.no_torch and two_b4t_layout:
        report.update(torch_comparison(weights, args, context))
        if "torch_ms_per_token" in report:
            say(f"PyTorch bf16, same model, CUDA graph: {report['torch_ms_per_token']:.3f} ms per "
                f"step; bitnet-ffi is {report['torch_ms_per_token'] / step_ms:.2f}x faster")
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def torch_comparison(weights, args, context):
    try:
        from .torch_model import TorchModel
    except ImportError as exc:
        return {"torch_skipped": f"PyTorch is not installed ({exc})"}
    model = TorchModel(weights, args.batch, context + TIMED_REPLAYS + 1)
    return {"torch_ms_per_token": model.step_ms(args.prompt_len, TIMED_REPLAYS)}


# GPU and CPU sum in float32 in different orders (about 1e-7 apart). A value that lands that close
# to a bfloat16 or int8 rounding boundary rounds differently; when it is a token's largest
# activation the token's whole int8 scale moves, and the random network turns that into up to a
# fifth of the logits' norm, which stays in the KV cache for the later steps. Wrong results would be
# unrelated logits, about sqrt(2) apart. The GPU's attention also rounds the softmax probabilities
# to bfloat16 for the tensor cores (the CPU keeps float32), which makes such flips common. So the
# check asks: every step under CHECK_BOUND, and the same greedy picks wherever the logits are equal
# (to CHECK_EXACT).
CHECK_EXACT, CHECK_BOUND, CHECK_STEPS = 1e-5, 0.5, 6


def check(args):
    """The reduced model on the CPU, then on the GPU fed the CPU's tokens (teacher forcing), so
    that every step's logits compare (see CHECK_BOUND); the GPU's greedy picks must equal the CPU's
    wherever the logits agree."""
    gpu = resolve(args.device if args.device not in (None, "auto") else "cuda")
    prompt = np.random.default_rng(args.seed + 1).integers(0, TINY.vocab, (2, 9))
    runs = {}
    for device in (_arrays.CPU, gpu):
        session = Session(random_weights(TINY, device, args.seed), 2, 32, device)
        steps = [(session.prefill(prompt), session.download(session.logits).copy())]
        for i in range(CHECK_STEPS - 1):
            forced = None if device == _arrays.CPU else runs[_arrays.CPU][i][0]
            tokens = session.decode(forced)
            steps.append((tokens, session.download(session.decode_buffers["logits"]).copy()))
        runs[device] = steps
    errors, picks_differ = [], 0
    for (cpu_tokens, cpu_logits), (gpu_tokens, gpu_logits) in zip(runs[_arrays.CPU], runs[gpu]):
        errors.append(float(np.linalg.norm(gpu_logits - cpu_logits) / np.linalg.norm(cpu_logits)))
        picks_differ += errors[-1] < CHECK_EXACT and (cpu_tokens != gpu_tokens).any()
    exact = sum(e < CHECK_EXACT for e in errors)
    passed = max(errors) < CHECK_BOUND and not picks_differ
    print("GPU vs CPU logits, relative error per step: " + " ".join(f"{e:.1e}" for e in errors))
    print(f"{exact} of {CHECK_STEPS} steps equal (< {CHECK_EXACT:.0e}); all under {CHECK_BOUND}: "
          f"{max(errors) < CHECK_BOUND}; greedy picks differ at {picks_differ} equal steps")
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


def add_arguments(parser):
    parser.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument("--model", help="a checkpoint (model directory or .gguf) instead of "
                                        "random weights")
    parser.add_argument("--layers", type=int, help=f"layers (default: 30 on a GPU, "
                                                   f"{CPU_DEFAULT_LAYERS} on the CPU)")
    parser.add_argument("--prompt-len", type=int, default=960)
    parser.add_argument("--tokens", type=int, default=64, help="tokens to generate per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    parser.add_argument("--check", action="store_true",
                        help="compare the GPU with the CPU on a reduced model; PASS or FAIL")


def main(args):
    return check(args) if args.check else run(args)
