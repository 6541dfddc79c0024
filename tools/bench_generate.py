"""Load-to-first-token and decode speed of a real checkpoint through Model.generate, beside the
demo's decode of random weights at the same shapes (run the demo in the same call for that).

    python tools/make_fixtures.py --full-size /tmp/bitnet-2b4t      # the exact 2B4T layout
    python tools/bench_generate.py /tmp/bitnet-2b4t --prompt-len 960 --tokens 64 [--json]

Load to first token: Model.load (files already in the page cache after a first load), a
session, the prefill and the first token; wall time. Decode: wall time per step of generate's
loop (graph replay, synchronize, token download) and the device time of one replay of its
captured step (the demo's measure), and its per-op breakdown as the demo's."""
import argparse
import json
import time

import numpy as np

from bitnet_ffi.generate import Model

TIMED_REPLAYS = 20


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prompt-len", type=int, default=960)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = {"tool": "bench_generate", "model": args.model}
    start = time.perf_counter()
    Model.load(args.model, args.device, progress=False)  # warms the page cache and CUDA
    report["first_load_s"] = time.perf_counter() - start

    start = time.perf_counter()
    model = Model.load(args.model, args.device, progress=False)
    report["load_s"] = time.perf_counter() - start
    prompt = np.random.default_rng(1).integers(0, model.config.vocab, args.prompt_len).tolist()
    model.generate(prompt, max_tokens=1, stop=False)
    report["load_to_first_token_s"] = time.perf_counter() - start

    result = model.generate(prompt, max_tokens=args.tokens, stop=False)[0]
    t = result.timings
    session = model.session(1, model._session.capacity)
    session.rewind(args.prompt_len)  # the timed replays run at the prompt's context again
    report.update(prefill_tokens_per_s=t["prefill_tokens_per_s"],
                  decode_ms_per_token_wall=t["decode_ms_per_step"],
                  context=args.prompt_len + args.tokens, tokens=len(result.ids))
    if session.stream is not None:
        report["decode_ms_per_token_graph"], report["op_ms"] = session.time_decode(TIMED_REPLAYS)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:28s} {value}")


if __name__ == "__main__":
    main()
