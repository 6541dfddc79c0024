"""Real checkpoints end to end: ``Model.load(path)`` (a Hugging Face directory or a GGUF file),
``model.generate(prompts)``, and ``python -m bitnet_ffi generate`` (one prompt, or an interactive
chat that keeps its KV cache between turns).

Step API, for your own loop::

    model = Model.load("bitnet-b1.58-2B-4T", device="cuda")
    session = model.session(batch=1, capacity=1024)
    first = session.prefill([model.tokenizer.encode("Hello")])   # next ids, [batch]
    logits = session.logits                                     # float32 [batch, V], on the device
    nxt = session.decode()                                      # one step (a CUDA graph replay)
"""
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .device import resolve, select
from .errors import InvalidArgumentError
from .loader import open_source
from .model import Session
from .tokenizer import TextStream, Tokenizer


@dataclass
class Generation:
    prompt_ids: list
    ids: list                 # generated ids, the stop token included when one ended the run
    text: str                 # the generated text (without the stop token)
    timings: dict = field(default_factory=dict)


class Model:
    """Weights on a device, the config they follow, and the tokenizer."""

    def __init__(self, config, weights, tokenizer, device):
        self.config, self.weights, self.tokenizer, self.device = config, weights, tokenizer, device
        self._session = None
        self.load_seconds = None

    @classmethod
    def load(cls, path, device=None, progress=True):
        """From a model directory (config.json, safetensors, tokenizer.json) or a .gguf file, to
        `device` ("cpu", "cuda", "cuda:N", "auto"; default BITNET_DEVICE)."""
        start = time.perf_counter()
        device = resolve(device)
        source = open_source(path)
        model = cls(source.config, source.load(device, progress), _tokenizer(path, source), device)
        model.load_seconds = time.perf_counter() - start
        return model

    def session(self, batch=1, capacity=None):
        """A Session (model.Session) of `batch` sequences of up to `capacity` tokens; the last one
        is kept and reused when the shape matches."""
        capacity = capacity or self.config.max_positions
        s = self._session
        if s is None or s.batch != batch or s.capacity != capacity:
            self._session = s = None  # free the old KV cache first
            self._session = s = Session(self.weights, batch, capacity, self.device)
        return s

    def encode(self, prompt):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        bad = [i for i in ids if not 0 <= i < self.config.vocab]
        if not ids or bad:
            raise InvalidArgumentError(f"prompt ids must be 1 or more ids in [0, "
                                       f"{self.config.vocab}), got {len(ids)} ids {bad[:3]}")
        return ids

    def generate(self, prompts, max_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 stop=True, on_text=None):
        """Generates from each prompt (text, or a list of ids) of a batch of any lengths.

        Stops a sequence at its first stop token (``stop=False``: never) or after max_tokens;
        ``on_text(index, text)`` receives each sequence's text as it is produced. Returns one
        Generation per prompt, its timings those of the whole batch."""
        single = isinstance(prompts, str) or (len(prompts) and
                                              isinstance(prompts[0], (int, np.integer)))
        prompts = [prompts] if single else list(prompts)
        ids = [self.encode(p) for p in prompts]
        if max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be at least 1, got {max_tokens}")
        lengths = np.array([len(p) for p in ids])
        B, P = len(ids), int(lengths.max())
        if P + max_tokens > self.config.max_positions:
            raise InvalidArgumentError(f"{P} prompt tokens + {max_tokens} new ones exceed the "
                                       f"model's {self.config.max_positions} positions")
        session = self.session(B, min(self.config.max_positions, _round_up(P + max_tokens, 64)))
        session.set_sampling(temperature, top_k, top_p, seed)
        padded = np.zeros((B, P), np.int32)
        for b, p in enumerate(ids):
            padded[b, :len(p)] = p
        streams = [TextStream(self.tokenizer) for _ in range(B)]
        out, done = [[] for _ in range(B)], np.zeros(B, bool)

        def accept(tokens):
            for b, t in enumerate(tokens):
                if done[b]:
                    continue
                out[b].append(int(t))
                if stop and int(t) in self.tokenizer.stop_ids:
                    done[b] = True
                elif on_text is not None:
                    text = streams[b].push(t)
                    if text:
                        on_text(b, text)
                if len(out[b]) >= max_tokens:
                    done[b] = True
                if done[b] and on_text is not None:
                    rest = streams[b].flush()
                    if rest:
                        on_text(b, rest)

        start = time.perf_counter()
        accept(session.prefill(padded, lengths))
        prefill_s = time.perf_counter() - start
        steps = 0
        start = time.perf_counter()
        while not done.all():
            accept(session.decode())
            steps += 1
        decode_s = time.perf_counter() - start
        timings = speed_timings(int(lengths.sum()), prefill_s, B, steps, decode_s)
        results = []
        for p, o in zip(ids, out):
            body = o[:-1] if o and stop and o[-1] in self.tokenizer.stop_ids else o
            results.append(Generation(p, o, self.tokenizer.decode(body), timings))
        return results


def _tokenizer(path, source):
    """The tokenizer of a checkpoint opened by loader.open_source."""
    if os.path.isdir(path):
        return Tokenizer.from_directory(path, source.config)
    return Tokenizer.from_gguf(source.file.metadata, str(path))


def _round_up(n, multiple):
    return -(-n // multiple) * multiple


# ---- python -m bitnet_ffi generate -------------------------------------------------------------

def add_arguments(parser):
    parser.add_argument("--model", required=True, help="model directory or .gguf file")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text to continue")
    what.add_argument("--chat", action="store_true", help="interactive chat (empty line ends)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = all tokens")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor parallelism over this many GPUs, one process each")
    parser.add_argument("--tp-exact", action="store_true",
                        help="with --tp: one GPU's logits bit for bit (same greedy tokens), for "
                             "more work per GPU: every GPU runs attention for all heads")


def main(args):
    if args.tp_exact and args.tp == 1:
        raise InvalidArgumentError("--tp-exact needs --tp N with N >= 2")
    if args.tp != 1:
        return main_tensor_parallel(args)
    say = (lambda *a, **k: None) if args.json else print
    say(select(args.device).summary(), file=sys.stderr)
    model = Model.load(args.model, args.device, progress=not args.json)
    say(f"loaded {args.model} in {model.load_seconds:.2f} s", file=sys.stderr)
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed)
    if args.chat:
        return chat(model, sampling)
    show = None if args.json else (lambda b, text: print(text, end="", flush=True))
    result = model.generate(args.prompt, on_text=show, **sampling)[0]
    t = dict(result.timings, load_s=model.load_seconds)
    if args.json:
        print(json.dumps({"prompt_ids": result.prompt_ids, "generated_ids": result.ids,
                          "text": result.text, "timings": t}, indent=2))
    else:
        print()
        print(_speed(t), file=sys.stderr)
    return 0


def main_tensor_parallel(args):
    """--tp N: the prompt's continuation on N GPUs, one process each
    (tensor_parallel.generate_rank; every rank reads the checkpoint a layer at a time and uploads
    its shard). The text is printed when the ranks are done, with rank 0's prefill and decode
    speeds. With --chat, the turns run here against the ranks (tensor_parallel.chat_over_ranks)."""
    from .launcher import run_ranks
    from .sampling import sampling_settings
    from .tensor_parallel import generate_rank
    if args.tp < 2:
        raise InvalidArgumentError(f"--tp {args.tp}: tensor parallelism takes 2 or more GPUs")
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    seed=args.seed)
    sampling_settings(**sampling)  # checked here, before the ranks start
    if args.max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens must be at least 1, got {args.max_tokens}")
    source = open_source(args.model)
    tokenizer = _tokenizer(args.model, source)
    if args.chat:
        from .tensor_parallel import chat_over_ranks
        return chat_over_ranks(args.model, args.tp, source.config.max_positions, sampling,
                               args.tp_exact,
                               lambda session: chat_turns(tokenizer, session, args.max_tokens))
    prompt = tokenizer.encode(args.prompt)
    if len(prompt) + args.max_tokens > source.config.max_positions:
        raise InvalidArgumentError(f"{len(prompt)} prompt tokens + {args.max_tokens} new ones "
                                   f"exceed the model's {source.config.max_positions} positions")
    start = time.perf_counter()
    ids, timings = run_ranks(generate_rank, args.tp,
                             args=(args.model, prompt, args.max_tokens, "peer", sampling,
                                   args.tp_exact))[0]
    total = time.perf_counter() - start
    stop = next((i for i, t in enumerate(ids) if t in tokenizer.stop_ids), None)
    ids = ids if stop is None else ids[:stop + 1]
    text = tokenizer.decode(ids if stop is None else ids[:-1])
    timings.update(tp=args.tp, tp_exact=args.tp_exact, total_s=total)
    if args.json:
        print(json.dumps({"prompt_ids": prompt, "generated_ids": ids, "text": text,
                          "timings": timings}, indent=2))
    else:
        print(text)
        print(f"tp = {args.tp}: {_speed(timings)}; {total:.1f} s with loading", file=sys.stderr)
    return 0


def speed_timings(prompt_tokens, prefill_s, sequences, steps, decode_s):
    """The timings a generation reports: prefill and decode rates from host-clock seconds."""
    return {"prefill_s": prefill_s, "prefill_tokens_per_s": prompt_tokens / prefill_s,
            "decode_steps": steps, "decode_s": decode_s,
            "decode_ms_per_step": 1e3 * decode_s / steps if steps else None,
            "decode_tokens_per_s": sequences * steps / decode_s if steps else None}


def _speed(t):
    line = f"prefill: {t['prefill_tokens_per_s']:.0f} tokens/s"
    if t["decode_steps"]:
        line += (f"; decode: {t['decode_tokens_per_s']:.1f} tokens/s "
                 f"({t['decode_ms_per_step']:.2f} ms per token)")
    return line


def chat(model, sampling):
    """Turns read from stdin; the KV cache keeps the conversation, and each turn prefills only
    the tokens after the part of the cache that still matches."""
    session = model.session(1, model.config.max_positions)
    session.set_sampling(sampling["temperature"], sampling["top_k"], sampling["top_p"],
                         sampling["seed"])
    return chat_turns(model.tokenizer, session, sampling["max_tokens"])


def chat_turns(tok, session, max_tokens):
    """chat's loop over any session with model.Session's rewind(length), extend([ids]) and
    decode() (next tokens, [batch]) and capacity: one GPU's, or tensor_parallel.RankSession."""
    messages, cached = [], []
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = tok.chat(messages)
        common = 0
        while common < min(len(ids), len(cached)) and ids[common] == cached[common]:
            common += 1
        common = min(common, len(ids) - 1)  # at least one new token to prefill
        if len(ids) + max_tokens > session.capacity:
            print("[the conversation is longer than the model's context: ended]", file=sys.stderr)
            break
        session.rewind(common)
        stream, reply = TextStream(tok), []
        start = time.perf_counter()
        token = int(session.extend([ids[common:]])[0])
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        while True:
            reply.append(token)
            if token in tok.stop_ids:
                break
            print(stream.push(token), end="", flush=True)
            if len(reply) >= max_tokens:
                break
            token = int(session.decode()[0])
        decode_s = time.perf_counter() - start
        print(stream.flush())
        steps = len(reply) - 1
        print(_speed(speed_timings(len(ids) - common, prefill_s, 1, steps, decode_s)),
              file=sys.stderr)
        body = reply[:-1] if reply[-1] in tok.stop_ids else reply
        messages.append({"role": "assistant", "content": tok.decode(body)})
        cached = ids + reply
    return 0
