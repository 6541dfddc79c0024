"""Where a fused decode layer's time goes: per-block %globaltimer stamps at decode_layer_kernel's
stage boundaries, in the steady state of decode steps replayed as CUDA graphs.

    python tools/dev/decode_timeline.py build              # build-timeline/libbitnet.so (sm_90)
    python tools/dev/decode_layer_timeline.py [1024 4096]  # on the GPU machine, after build

The timeline build (-DBITNET_TIMELINE) has thread 0 of every block stamp, after a block barrier,
the start, the L2 requests issued, and the end of every norm, GEMV, attention, combine and grid
barrier (STAMPS; native/src/cuda/decode_layer.cu's STAMP(s) follows this order). This prints, for
2B4T shapes at batch 1, the median over the layers of two decode steps of each stamp's median and
latest block, in µs after the layer's first block started, and the gap from a layer's last block
to the next layer's first. The block barriers behind the stamps add a little to every stage.
"""
import argparse
import ctypes
import os
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
STAMPS = ["started", "L2 requests issued", "input norm", "QKV GEMV", "barrier 1", "attention",
          "barrier 2", "combine", "barrier 3", "sub-norm", "o GEMV", "barrier 4", "FFN norm",
          "gate|up GEMV", "barrier 5", "FFN sub-norm", "down GEMV"]
CALLS, BLOCKS = 64, 192  # kStampCalls, kStampBlocks of decode_layer.cu
STEPS = 2


def run(contexts):
    from bitnet_ffi.model import BITNET_2B4T, Session, random_weights
    lib = ctypes.CDLL(os.environ["BITNET_LIB"])  # the library bitnet_ffi loads
    stamps = np.zeros((CALLS, BLOCKS, len(STAMPS)), np.uint64)
    tickets = ctypes.c_uint(0)
    weights = random_weights(BITNET_2B4T, 0, seed=0)

    def read():
        assert lib.bitnet_decode_layer_timeline(stamps.ctypes.data_as(ctypes.c_void_p),
                                                ctypes.byref(tickets)) == 0
        return tickets.value

    for context in contexts:
        prompt = np.random.default_rng(context).integers(0, BITNET_2B4T.vocab, (1, context - 1))
        session = Session(weights, 1, context + 40, 0, fused=True)
        session.prefill(prompt)
        step_ms, _ = session.time_decode(20)
        read()
        for _ in range(STEPS):
            session.decode()
        blocks = read() // (STEPS * BITNET_2B4T.layers)
        layers = stamps[:STEPS * BITNET_2B4T.layers, :blocks].astype(np.int64)
        starts = layers[:, :, 0].min(axis=1)
        t = (layers - starts[:, None, None]) / 1000.0
        median = np.median(np.median(t, axis=1), axis=0)
        latest = np.median(t.max(axis=1), axis=0)
        gaps = (starts[1:] - layers[:-1, :, -1].max(axis=1)) / 1000.0
        gaps = gaps[np.arange(1, len(starts)) % BITNET_2B4T.layers != 0]  # not across the head
        print(f"\ncontext {context}: {step_ms:.3f} ms per step (graph replays), {blocks} blocks; "
              f"µs after the layer's first block started, median over {len(t)} layers")
        print("| stamp | median block | latest block | latest, from the previous stamp's latest |")
        print("| --- | --- | --- | --- |")
        for i, name in enumerate(STAMPS):
            step = latest[i] - latest[i - 1] if i else latest[i]
            print(f"| {name} | {median[i]:.2f} | {latest[i]:.2f} | {step:.2f} |")
        print(f"gap from a layer's last block to the next layer's first: median {np.median(gaps):.2f} µs")
        del session


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("contexts", nargs="*", type=int, default=[1024, 4096])
    args = parser.parse_args()
    os.environ.setdefault("BITNET_LIB", str(REPO / "build-timeline" / "libbitnet.so"))
    run(args.contexts)


if __name__ == "__main__":
    main()
