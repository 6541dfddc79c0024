"""python -m bitnet_ffi tp --tp N: tensor-parallel greedy decode of a random-weight BitNet model of
a given shape over N GPUs, one process per GPU started here (bitnet_ffi.launcher), with the decode
step's time (CUDA graph replays, device time, the slowest rank). tools/bench_tp.py runs it over
shapes and TP sizes."""
import json
import time

import numpy as np

from .errors import BitNetError, InvalidArgumentError
from .model import BITNET_2B4T, Config

SHAPES = {
    "2b4t": BITNET_2B4T,
    "falcon3-10b": Config(hidden=3072, intermediate=23040, layers=40, heads=12, kv_heads=4,
                          head_dim=256, vocab=131072),
    "70b": Config(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, head_dim=128,
                  vocab=128256),
}
TIMED_REPLAYS = 20


def decode_rank(ctx, configs, prompt_len, tokens, method, seed, exact=False):
    """One rank: for each config in turn, random packed weights on its GPU, the prompt and `tokens`
    greedy tokens, then the decode step's graph timed from the position reached (every timed run
    restarts there: TPSession.time_decode), then the prompt's prefill again, timed by the host
    clock. Returns the rank's figures, one dict per config."""
    import gc

    from . import comm
    from . import tensor_parallel as tp
    group = comm.Group(ctx, method=method, max_bytes=tp.PEER_BYTES)
    figures = []
    for config in configs:
        start = time.perf_counter()
        shard = tp.random_shard(config, ctx.rank, ctx.world, ctx.device, seed, exact)
        weights_s = time.perf_counter() - start
        session = tp.TPSession(shard, group, prompt_len + tokens + TIMED_REPLAYS + 2)
        prompt = np.random.default_rng(seed + 1).integers(0, config.vocab, prompt_len)
        generated = session.generate(prompt, tokens)
        ms = session.time_decode(TIMED_REPLAYS)
        start = time.perf_counter()  # the prompt again, its passes' graph captured by generate
        session.prefill(prompt)
        prefill_s = time.perf_counter() - start
        session.close()
        figures.append({"rank": ctx.rank, "ms_per_token": ms, "tokens": generated,
                        "weights_s": weights_s, "prefill_s": prefill_s})
        del session, shard
        gc.collect()  # the shard's device memory goes before the next config's
    group.close()
    return figures


def run_configs(configs, tp, prompt_len=16, tokens=8, method="peer", seed=0, timeout=900,
                exact=False):
    """Runs decode_rank on `tp` GPUs (one process set for all configs); for each config the
    slowest rank's step time and prefill rate, and rank 0's tokens."""
    from .launcher import run_ranks
    ranks = run_ranks(decode_rank, tp,
                      args=(list(configs), prompt_len, tokens, method, seed, exact), timeout=timeout)
    results = []
    for index, config in enumerate(configs):
        per_rank = [r[index] for r in ranks]
        if any(r["tokens"] != per_rank[0]["tokens"] for r in per_rank):
            raise BitNetError(f"the ranks' greedy tokens differ: {[r['tokens'] for r in per_rank]}")
        results.append({"tp": tp, "method": method, "exact": exact,
                        "ms_per_token": max(r["ms_per_token"] for r in per_rank),
                        "prefill_tokens_per_s": prompt_len / max(r["prefill_s"] for r in per_rank),
                        "tokens": per_rank[0]["tokens"],
                        "weights_s": max(r["weights_s"] for r in per_rank),
                        "ternary_gb": config.ternary_bytes() / 1e9})
    return results


def run(config, tp, prompt_len=16, tokens=8, method="peer", seed=0, timeout=900, exact=False):
    """run_configs of one config."""
    return run_configs([config], tp, prompt_len, tokens, method, seed, timeout, exact)[0]


def add_arguments(parser):
    parser.add_argument("--tp", type=int, default=2, help="GPUs (one process each)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="2b4t")
    parser.add_argument("--layers", type=int, help="override the shape's layer count")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--method", choices=("peer", "nccl"), default="peer",
                        help="collectives: the one-shot peer kernels (default) or NCCL")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exact", action="store_true",
                        help="the exact layout (tensor_parallel.exact_split): one GPU's logits bit "
                             "for bit, attention on every rank, 3 all-gathers per layer")
    parser.add_argument("--json", action="store_true")


def main(args):
    for name in ("tp", "prompt_len", "tokens"):
        if getattr(args, name) < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be at least 1")
    config = SHAPES[args.shape]
    if args.layers:
        config = Config(**{**config.__dict__, "layers": args.layers})
    result = run(config, args.tp, args.prompt_len, args.tokens, args.method, args.seed,
                 exact=args.exact)
    result.update(shape=args.shape, layers=config.layers)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.shape} ({config.layers} layers, {result['ternary_gb']:.1f} GB ternary) on "
              f"{args.tp} GPU(s){', exact layout' if args.exact else ''}, {args.method} "
              f"collectives: {result['ms_per_token']:.3f} ms per "
              f"token (CUDA graph replays, slowest rank), prefill of {args.prompt_len} tokens "
              f"{result['prefill_tokens_per_s']:.0f} tokens/s; greedy tokens {result['tokens']}")
    return 0
