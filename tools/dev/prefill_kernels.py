"""Where a prefill's or a decode step's time goes, kernel by kernel: one graph-replayed prefill of a
random-weight model of 2B4T shapes (batch 1), or with --decode-batch B five graph-replayed decode
steps of B sequences at --context positions, its kernels' device times from CUPTI (torch.profiler).

    python tools/dev/prefill_kernels.py [--prompt-len 960] [--layers 30]
    python tools/dev/prefill_kernels.py --decode-batch 8 [--context 1024] [--layers 30]

A prefill's kernels are summed by what each does (the op that launched it, the projection or norm
it serves): the op of each kernel comes from the op sequence of an eager prefill of the same length
(the replay runs the same kernels in the same order; memsets and copies are left out). A decode
step's are summed by kernel name (its attention op launches two kernels where it splits the
context), per step. Two columns: the kernels' durations summed, and each kernel's own share of the
span (the time from the later of its start and the previous kernel's end to its end): programmatic
dependent launch starts a kernel before its predecessor ends, so durations overlap and only the
second column adds up to the span. Needs PyTorch with CUDA, on the GPU machine.
"""
import argparse
import collections
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def op_labels(session, prompt):
    """The label of each op an eager prefill issues, in order."""
    from bitnet_ffi.model import Session
    parts = {}  # id of a layer's weight -> its field name
    for layer in session.w.layers:
        for name, value in vars(layer).items():
            parts[id(value)] = name
    labels, original = [], Session.op

    def op(self, kind, fn, *args, **kwargs):
        names = [parts[id(a)] for a in args if id(a) in parts]
        labels.append(f"{kind} ({names[0]})" if names else kind)
        return original(self, kind, fn, *args, **kwargs)

    Session.op = op
    try:
        session.prefill(prompt)
    finally:
        Session.op = original
    return labels


def kernel_name(name):
    """A CUDA kernel's name without its parameter list and namespace noise."""
    name = re.sub(r"^void ", "", name).replace("(anonymous namespace)::", "")
    return re.match(r"[^<(]*(<[^(]*>)?", name).group(0)[:80]


def profiled_kernels(run):
    """(start, end, name) of every kernel that run() launches, in start order, in µs."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    return sorted((e.time_range.start, e.time_range.end, kernel_name(e.name)) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA
                  and not any(w in e.name.lower() for w in ("memcpy", "memset")))


def print_table(title, column, labels, kernels, span, passes=1):
    """Durations and own shares summed per label (one per kernel, `column` says what labels are),
    per pass."""
    duration, own = collections.defaultdict(float), collections.defaultdict(float)
    last_end = kernels[0][0]
    for label, (start, end, _) in zip(labels, kernels):
        duration[label] += end - start
        own[label] += max(0.0, end - max(last_end, start))
        last_end = max(last_end, end)
    print(title)
    print(f"{column:80s} {'count':>5s} {'durations ms':>12s} "
          f"{'own ms':>8s} {'own %':>6s}")
    counts = collections.Counter(labels)
    for label in sorted(own, key=own.get, reverse=True):
        print(f"{label:80s} {counts[label] // passes:5d} {duration[label] / passes / 1e3:12.3f} "
              f"{own[label] / passes / 1e3:8.3f} {100 * own[label] / passes / span:6.1f}")


def prefill(config, prompt_len):
    import torch

    from bitnet_ffi.model import Session, random_weights
    session = Session(random_weights(config, 0, seed=0), 1, prompt_len + 8, 0)
    prompt = np.random.default_rng(prompt_len).integers(0, config.vocab, (1, prompt_len))
    labels = op_labels(session, prompt)
    for _ in range(2):  # the second prefill of a length captures its graph; later ones replay it
        session.prefill(prompt)
    kernels = profiled_kernels(lambda: session.prefill(prompt))
    if len(kernels) != len(labels):
        sys.exit(f"{len(kernels)} kernels for {len(labels)} ops: an op launched more than one "
                 "kernel, so they cannot be matched by order")
    span = kernels[-1][1] - kernels[0][0]
    print_table(f"prompt {prompt_len}, {config.layers} layers, {torch.cuda.get_device_name()}: "
                f"{len(kernels)} kernels over {span / 1e3:.3f} ms ({prompt_len / span * 1e6:,.0f} "
                "tokens/s)", "op", labels, kernels, span)


def decode(config, batch, context, steps=5):
    import torch

    from bitnet_ffi.model import Session, random_weights
    session = Session(random_weights(config, 0, seed=0), batch, context + 64, 0)
    session.prefill(np.random.default_rng(batch).integers(0, config.vocab, (batch, context - 1)))
    for _ in range(3):  # the first decode step captures the graph
        session.decode()

    def replay():
        for _ in range(steps):
            session.graph.launch()
        session.stream.synchronize()
    kernels = profiled_kernels(replay)
    per_step = len(kernels) // steps
    spans = [kernels[(s + 1) * per_step - 1][1] - kernels[s * per_step][0] for s in range(steps)]
    span = float(np.median(spans))
    print_table(f"decode batch {batch}, context {context}, {config.layers} layers, "
                f"{torch.cuda.get_device_name()}: {per_step} kernels a step, median span "
                f"{span / 1e3:.3f} ms over {steps} replays", "kernel", [k[2] for k in kernels],
                kernels, span, passes=steps)


def main():
    from bitnet_ffi.model import BITNET_2B4T, Config
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=960)
    parser.add_argument("--decode-batch", type=int, help="profile decode steps of this batch")
    parser.add_argument("--context", type=int, default=1024, help="a decode step's positions")
    parser.add_argument("--layers", type=int, default=BITNET_2B4T.layers)
    args = parser.parse_args()
    config = Config(**{**BITNET_2B4T.__dict__, "layers": args.layers})
    if args.decode_batch:
        decode(config, args.decode_batch, args.context)
    else:
        prefill(config, args.prompt_len)


if __name__ == "__main__":
    main()
