"""Where a prefill's time goes, kernel by kernel: one graph-replayed prefill of a random-weight model
of 2B4T shapes (batch 1), its kernels' device times from CUPTI (torch.profiler), summed by what
each kernel does (the op that launched it, the projection or norm it serves).

    python tools/dev/prefill_kernels.py [--prompt-len 960] [--layers 30]

The op of each kernel comes from the op sequence of an eager prefill of the same length (the
replay runs the same kernels in the same order; memsets and copies are left out). Two columns:
the kernels' durations summed, and each kernel's own share of the pass's span (the time from the
later of its start and the previous kernel's end to its end): programmatic dependent launch starts
a kernel before its predecessor ends, so durations overlap and only the second column adds up to
the span. Needs PyTorch with CUDA, on the GPU machine.
"""
import argparse
import collections
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


def main():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bitnet_ffi.model import BITNET_2B4T, Config, Session, random_weights
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=960)
    parser.add_argument("--layers", type=int, default=BITNET_2B4T.layers)
    args = parser.parse_args()
    config = Config(**{**BITNET_2B4T.__dict__, "layers": args.layers})
    session = Session(random_weights(config, 0, seed=0), 1, args.prompt_len + 8, 0)
    prompt = np.random.default_rng(args.prompt_len).integers(0, config.vocab, (1, args.prompt_len))
    labels = op_labels(session, prompt)
    for _ in range(2):  # the second prefill of a length captures its graph; later ones replay it
        session.prefill(prompt)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        session.prefill(prompt)
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA
                     and not any(w in e.name.lower() for w in ("memcpy", "memset")))
    if len(kernels) != len(labels):
        sys.exit(f"{len(kernels)} kernels for {len(labels)} ops: an op launched more than one "
                 "kernel, so they cannot be matched by order")
    duration, own = collections.defaultdict(float), collections.defaultdict(float)
    last_end = kernels[0][0]
    for label, (start, end) in zip(labels, kernels):
        duration[label] += end - start
        own[label] += max(0.0, end - max(last_end, start))
        last_end = max(last_end, end)
    span = kernels[-1][1] - kernels[0][0]
    print(f"prompt {args.prompt_len}, {args.layers} layers, {torch.cuda.get_device_name()}: "
          f"{len(kernels)} kernels over {span / 1e3:.3f} ms ({args.prompt_len / span * 1e6:,.0f} "
          "tokens/s)")
    print(f"{'op':42s} {'kernels':>7s} {'durations ms':>12s} {'own ms':>8s} {'own %':>6s}")
    counts = collections.Counter(labels)
    for label in sorted(own, key=own.get, reverse=True):
        print(f"{label:42s} {counts[label]:7d} {duration[label] / 1e3:12.3f} "
              f"{own[label] / 1e3:8.3f} {100 * own[label] / span:6.1f}")


if __name__ == "__main__":
    main()
