"""python -m bitnet_ffi demo: BitNet b1.58 2B4T shapes, prefill then greedy decode through libbitnet,
with a per-op time breakdown, bandwidth, and the same model in PyTorch bf16 beside it on a GPU."""
import argparse
import json
import sys
import time

import numpy as np
from tqdm import tqdm

from . import _arrays
from .device import resolve, select
from .errors import NoDeviceError
from .model import BITNET_2B4T, TINY, Config, Session, random_weights

CPU_DEFAULT_LAYERS = 4
TIMED_REPLAYS = 20
# Seconds between a bar's updates where stderr is not a terminal (a log gets a line each time).
LOG_INTERVAL = 5.0


def progress(label, total, unit="layer"):
    """A tqdm bar on stderr, started now: progress(label, total)(done, total). Redrawn in place on
    a terminal; in a log (stderr not a terminal) a new line at most every LOG_INTERVAL seconds and
    at the end, so that a long run shows that it moves."""
    tty = sys.stderr.isatty()
    bar = tqdm(total=total, desc=label, unit=unit, file=sys.stderr, dynamic_ncols=tty,
               mininterval=0.1 if tty else LOG_INTERVAL, ascii=not tty)

    def show(done, _total):
        bar.update(done - bar.n)
        if done == bar.total:
            bar.close()
    return show


def plural(count, noun):
    return f"{count} {noun}" + ("" if count == 1 else "s")


class Clock:
    """Wall time of the work inside, the session's stream waited for at both ends."""

    def __init__(self, session):
        self.session = session

    def __enter__(self):
        self.session.synchronize()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.session.synchronize()
        self.seconds = time.perf_counter() - self.start


def step_bytes(config, batch, context):
    """Bytes one decode step must read: ternary weights, the bfloat16 output head, the KV cache."""
    kv = 2 * config.layers * batch * context * config.kv_dim * 2
    return config.ternary_bytes() + config.vocab * config.hidden * 2 + kv


def run(args):
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
        reduced = ""
        say(f"weights: {args.model} loaded in {time.perf_counter() - start:.1f} s")
    else:
        layers = args.layers or (BITNET_2B4T.layers if device != _arrays.CPU
                                 else CPU_DEFAULT_LAYERS)
        if device == _arrays.CPU and not args.layers:
            say(f"CPU run: {layers} of the {BITNET_2B4T.layers} layers by default (--layers to "
                "change)")
        reduced = (f" for this {layers}-layer model, not the full {BITNET_2B4T.layers}"
                   if layers != BITNET_2B4T.layers else "")
        config = Config(**{**BITNET_2B4T.__dict__, "layers": layers})
        weights = random_weights(config, device, args.seed, progress("quantizing layers", layers))
        say(f"weights: {plural(layers, 'layer')} quantized by quantize_i2s in "
            f"{time.perf_counter() - start:.1f} s")
    context = args.prompt_len + args.tokens
    report.update(layers=layers, batch=args.batch, prompt_len=args.prompt_len, tokens=args.tokens)
    session = Session(weights, args.batch, context + TIMED_REPLAYS + 1, device)
    prompt = np.random.default_rng(args.seed + 1).integers(0, config.vocab,
                                                           (args.batch, args.prompt_len))
    if device == _arrays.CPU:
        with Clock(session) as clock:
            tokens = [session.prefill(prompt, progress=progress("prefill", layers))]
        prefill_seconds, how = clock.seconds, "one run"
    else:  # the same prompt length again replays the pass captured by the second prefill
        for _ in range(2):  # warm-up: buffers, the capture, module loading stay out of the time
            session.prefill(prompt)
        times = []
        for _ in range(3):
            with Clock(session) as clock:
                tokens = [session.prefill(prompt)]
            times.append(clock.seconds)
        prefill_seconds, how = sorted(times)[1], "CUDA graph replay, median of 3"
    report["prefill_tokens_per_s"] = args.batch * args.prompt_len / prefill_seconds
    say(f"prefill: {args.batch}x{args.prompt_len} tokens in {1e3 * prefill_seconds:.1f} ms "
        f"({how}; {report['prefill_tokens_per_s']:.0f} tokens/s{reduced})")

    steps = args.tokens - 1  # the first token came from the prefill
    bar = progress("decoding", steps, unit="step")
    if session.stream is None:
        session.times = {}  # every timed step adds its ops' wall time: the per-op table's source
    with Clock(session) as clock:
        for step in range(steps):
            tokens.append(session.decode())
            bar(step + 1, steps)
    generated = np.stack(tokens, axis=1)
    report["tokens_first_sequence"] = generated[0].tolist()
    say(f"greedy tokens of sequence 0: {generated[0][:16].tolist()}"
        f"{' ...' if generated.shape[1] > 16 else ''}")

    if session.stream is not None:
        step_ms, op_ms = session.time_decode(TIMED_REPLAYS)
        method = "CUDA graph replays, device time"
    else:  # the same steps give the step time and the per-op times
        step_ms = 1e3 * clock.seconds / steps
        method = f"wall time, mean of {plural(steps, 'step')}"
        op_ms = {kind: 1e3 * seconds / steps for kind, seconds in session.times.items()}
        session.times = None
    gbps = step_bytes(config, args.batch, context) / (step_ms * 1e-3) / 1e9
    report.update(decode_ms_per_token=step_ms, decode_tokens_per_s=args.batch * 1e3 / step_ms,
                  decode_gbps=gbps, timing=method, op_ms=op_ms)
    say(f"decode: {step_ms:.3f} ms per step ({method}), {report['decode_tokens_per_s']:.1f} "
        f"tokens/s{reduced}, {gbps:.0f} GB/s of weights and KV cache read")
    say("per-op time of one decode step (same steps):" if session.stream is None else
        "per-op time of one decode step (each op kind captured and replayed alone):")
    for kind, ms in report["op_ms"].items():
        say(f"  {kind:18s} {ms:8.3f} ms  {100 * ms / step_ms:5.1f}%")

    two_b4t_layout = config.activation == "relu2" and config.sub_norms and config.tied_head
    if session.stream is not None and not args.no_torch and two_b4t_layout:
        report.update(torch_comparison(weights, args, context))
        if "torch_ms_per_token" in report:
            say(f"PyTorch bf16, same model, CUDA graph: {report['torch_ms_per_token']:.3f} ms per "
                f"step; bitnet-ffi is {report['torch_ms_per_token'] / step_ms:.2f}x faster")
            say(f"PyTorch bf16 prefill, same prompts, CUDA graph: "
                f"{report['torch_prefill_tokens_per_s']:.0f} tokens/s; bitnet-ffi's is "
                f"{report['prefill_tokens_per_s'] / report['torch_prefill_tokens_per_s']:.2f}x")
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def torch_comparison(weights, args, context):
    try:
        from .torch_model import TorchModel
    except ImportError as exc:
        return {"torch_skipped": f"PyTorch is not installed ({exc})"}
    model = TorchModel(weights, args.batch, context + TIMED_REPLAYS + 1)
    return {"torch_ms_per_token": model.step_ms(args.prompt_len, TIMED_REPLAYS),
            "torch_prefill_tokens_per_s": model.prefill_tokens_per_s(args.prompt_len, 5)}


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
    needs = "--check compares the GPU with the CPU, so it needs a CUDA GPU"
    try:
        gpu = resolve(args.device if args.device not in (None, "auto") else "cuda")
    except NoDeviceError as exc:
        raise NoDeviceError(f"{needs}: {exc}") from None
    if gpu == _arrays.CPU:
        raise NoDeviceError(f"{needs}; --device {args.device} is the CPU")
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


def at_least(low):
    """An argparse type: an int >= low (argparse reports anything else as a usage error)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def add_arguments(parser):
    parser.add_argument("--device",
                        help="auto, cpu, cuda or cuda:N (default: BITNET_DEVICE, else auto)")
    parser.add_argument("--model", help="a checkpoint (model directory or .gguf) instead of "
                                        "random weights")
    parser.add_argument("--layers", type=at_least(1),
                        help=f"layers of the model (default: {BITNET_2B4T.layers}, the full model, on "
                             f"a GPU; {CPU_DEFAULT_LAYERS} on the CPU)")
    parser.add_argument("--prompt-len", type=at_least(1), default=960,
                        help="prompt tokens per sequence, the prefill (default: %(default)s)")
    parser.add_argument("--tokens", type=at_least(2), default=64,
                        help="tokens to generate per sequence, at least 2: the first from the "
                             "prefill, the others from the timed decode steps (default: "
                             "%(default)s)")
    parser.add_argument("--batch", type=at_least(1), default=1,
                        help="sequences decoded together (default: %(default)s)")
    parser.add_argument("--seed", type=at_least(0), default=0,
                        help="seed of the random weights and prompt (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    parser.add_argument("--check", action="store_true",
                        help="compare the GPU with the CPU on a reduced model; PASS or FAIL "
                             "(needs a CUDA GPU)")


def main(args):
    return check(args) if args.check else run(args)
