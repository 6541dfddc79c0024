"""Text to token ids and back with Hugging Face ``tokenizers``: from a model directory's
tokenizer.json (or sentencepiece tokenizer.model), or built from the vocabulary, merges and special
tokens a GGUF file embeds. Also
the chat format: the files' jinja2 chat template, else BitNet b1.58 2B4T's."""
import json
import os

from .errors import CorruptFileError, UnsupportedError

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZERS = ("llama-bpe", "llama3", "gpt2", "default")
EOT = "<|eot_id|>"
SPIECE_SPACE = "\u2581"
BOS = "<|begin_of_text|>"


class Tokenizer:
    """``encode(text)`` (the bos id first when the model has one), ``decode(ids)``,
    ``chat(messages)`` (ids of the conversation so far plus the assistant's prompt), ``stop_ids``
    (generation ends at any of them)."""

    def __init__(self, tokenizer, bos_id=None, stop_ids=(), chat_template=None, source=""):
        self.tokenizer, self.bos_id, self.source = tokenizer, bos_id, source
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.chat_template = chat_template

    @classmethod
    def from_directory(cls, directory, config=None):
        """tokenizer.json, or where there is none a sentencepiece tokenizer.model (1bitLLM's,
        Llama 2's), with the special tokens of tokenizer_config.json and generation_config.json."""
        from tokenizers import Tokenizer as HFTokenizer
        path = os.path.join(directory, "tokenizer.json")
        model_path = os.path.join(directory, "tokenizer.model")
        if not os.path.exists(path) and os.path.exists(model_path):
            path, tokenizer = model_path, _from_sentencepiece_model(model_path)
        else:
            try:
                tokenizer = HFTokenizer.from_file(path)
            except Exception as exc:
                raise CorruptFileError(f"{path}: not a readable tokenizer.json ({exc})") from None
        settings = {}
        for name in ("tokenizer_config.json", "generation_config.json"):
            try:
                with open(os.path.join(directory, name)) as f:
                    settings[name] = json.load(f)
            except FileNotFoundError:
                settings[name] = {}
            except ValueError as exc:
                raise CorruptFileError(f"{os.path.join(directory, name)}: not JSON ({exc})") from None
        tc, gc = settings["tokenizer_config.json"], settings["generation_config.json"]

        def token_id(token):
            token = token.get("content") if isinstance(token, dict) else token
            return tokenizer.token_to_id(token) if token else None

        bos = config.bos_id if config is not None and config.bos_id is not None else None
        bos = bos if bos is not None else token_id(tc.get("bos_token"))
        stops = set(config.eos_ids if config is not None else ())
        eos = gc.get("eos_token_id")
        stops.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        stops.update(i for i in (token_id(tc.get("eos_token")), tokenizer.token_to_id(EOT))
                     if i is not None)
        return cls(tokenizer, bos, stops, tc.get("chat_template"), path)

    @classmethod
    def from_gguf(cls, metadata, source="GGUF"):
        """The tokenizer a GGUF file embeds: llama.cpp's byte-level BPE ('gpt2') or its
        sentencepiece BPE ('llama')."""
        kind = metadata.get("tokenizer.ggml.model")
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if not (kind == "llama" or kind == "gpt2" and pre in GGUF_PRE_TOKENIZERS):
            raise UnsupportedError(f"{source}: tokenizer {kind!r} with pre-tokenizer {pre!r} is "
                                   f"not supported (sentencepiece BPE, 'llama'; byte-level BPE, "
                                   f"'gpt2', with {', '.join(GGUF_PRE_TOKENIZERS)})")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise CorruptFileError(f"{source}: tokenizer.ggml.tokens is missing")
        tokenizer = _gguf_sentencepiece_bpe(metadata, tokens, source) if kind == "llama" else \
            _byte_level_bpe(metadata, tokens, pre, source)
        _add_special_tokens(tokenizer, tokens, metadata.get("tokenizer.ggml.token_type"))
        stops = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
        if tokenizer.token_to_id(EOT) is not None:
            stops.append(tokenizer.token_to_id(EOT))
        return cls(tokenizer, metadata.get("tokenizer.ggml.bos_token_id"),
                   [s for s in stops if s is not None], metadata.get("tokenizer.chat_template"),
                   source)

    @property
    def vocab_size(self):
        return self.tokenizer.get_vocab_size()

    def encode(self, text, bos=True):
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids

    def decode(self, ids):
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_text(self, messages, add_generation_prompt=True):
        """The conversation as text: the chat template where the files have one, else 2B4T's
        format (bos, then "Role: content<|eot_id|>" per message, then "Assistant: ")."""
        if self.chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise UnsupportedError(f"{self.source}: chat template: {message}")
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            bos = self.tokenizer.id_to_token(self.bos_id) if self.bos_id is not None else ""
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                eos_token=EOT)
        text = BOS + "".join(f"{m['role'].capitalize()}: {m['content']}{EOT}" for m in messages)
        return text + ("Assistant: " if add_generation_prompt else "")

    def chat(self, messages, add_generation_prompt=True):
        """Token ids of chat_text (special tokens in it are read as such)."""
        return self.encode(self.chat_text(messages, add_generation_prompt), bos=False)


def _add_special_tokens(tokenizer, tokens, types):
    """The control (3) and user-defined (4) tokens, by sentencepiece's and GGUF's token types, as
    special tokens: read whole in a text, left out of decoded text."""
    from tokenizers import AddedToken
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types or ()) if kind in (3, 4)])


def _from_sentencepiece_model(path):
    """A sentencepiece tokenizer.model, read with sentencepiece's own protobuf schema and built as
    a GGUF 'llama' tokenizer is (_sentencepiece_bpe of the same pieces, scores and types; llama.cpp's
    converter copies them so). BPE models with the identity normalization only, as Llama 2's."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as exc:
        raise UnsupportedError(f"{path}: a sentencepiece tokenizer.model needs the sentencepiece "
                               f"and protobuf packages (pip install 'bitnet-ffi[models]'): "
                               f"{exc}") from None
    model = sentencepiece_model_pb2.ModelProto()
    try:
        with open(path, "rb") as f:
            model.ParseFromString(f.read())
    except Exception as exc:
        raise CorruptFileError(f"{path}: not a sentencepiece model ({exc})") from None
    if not model.pieces:
        raise CorruptFileError(f"{path}: a sentencepiece model without pieces")
    trainer, normalizer = model.trainer_spec, model.normalizer_spec
    if trainer.model_type != trainer.BPE:
        raise UnsupportedError(f"{path}: sentencepiece model type "
                               f"{trainer.ModelType.Name(trainer.model_type)} is not supported "
                               "(BPE only)")
    if normalizer.name not in ("", "identity") or normalizer.remove_extra_whitespaces:
        raise UnsupportedError(f"{path}: sentencepiece normalization {normalizer.name!r} "
                               f"(remove_extra_whitespaces {normalizer.remove_extra_whitespaces})"
                               " is not supported (identity only)")
    tokens = [p.piece for p in model.pieces]
    types = [p.type for p in model.pieces]
    unknown = [i for i, kind in enumerate(types) if kind == 2]
    tokenizer = _sentencepiece_bpe(tokens, [p.score for p in model.pieces],
                                   unknown[0] if unknown else None, normalizer.add_dummy_prefix)
    _add_special_tokens(tokenizer, tokens, types)
    return tokenizer


def _byte_level_bpe(metadata, tokens, pre, source):
    """llama.cpp's 'gpt2' tokenizer: byte-level BPE with the file's merges, after Llama 3's split
    ('llama-bpe') or GPT-2's."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise CorruptFileError(f"{source}: tokenizer.ggml.merges is missing")
    tokenizer = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                       [tuple(m.split(" ", 1)) for m in merges]))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=pre in ("gpt2", "default"))
    tokenizer.pre_tokenizer = byte_level if pre in ("gpt2", "default") else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                 byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _gguf_sentencepiece_bpe(metadata, tokens, source):
    """llama.cpp's 'llama' tokenizer: _sentencepiece_bpe of the GGUF file's scores, unknown token
    and add_space_prefix."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise CorruptFileError(f"{source}: tokenizer.ggml.scores is missing or does not match "
                               f"the {len(tokens)} tokens")
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    if unk is not None and not 0 <= unk < len(tokens):
        raise CorruptFileError(f"{source}: tokenizer.ggml.unknown_token_id = {unk} is not one of "
                               f"the {len(tokens)} tokens")
    return _sentencepiece_bpe(tokens, scores, unk,
                              metadata.get("tokenizer.ggml.add_space_prefix", True))


def _sentencepiece_bpe(tokens, scores, unk, add_space_prefix):
    """llama.cpp's 'llama' tokenizer (sentencepiece BPE) of `tokens`, their `scores` and the index
    of the unknown token (`unk`, or None): spaces become U+2581, one is prefixed to every text
    between special tokens where `add_space_prefix` says so, then the adjacent pair whose
    concatenation is the token of highest score merges, leftmost first, until none does; a piece
    outside the vocabulary becomes its UTF-8 bytes' <0xXX> tokens. As a
    `tokenizers` BPE: every split of every token into two tokens is a merge, ranked by the whole
    token's score. Decoding turns U+2581 back into spaces and keeps the prefixed one."""
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = sorted((-scores[i], i, k) for i, t in enumerate(tokens) for k in range(1, len(t))
                    if t[:k] in vocab and t[k:] in vocab)
    merges = [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]
    tokenizer = HFTokenizer(models.BPE(vocab, merges, unk_token=None if unk is None else tokens[unk],
                                       fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", SPIECE_SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(" "))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "),
                                           decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


class TextStream:
    """Incremental decoding: ``push(id)`` returns the text the new token completes. A token may
    end inside a multi-byte character: its bytes wait for the next token. (Byte-level BPE decodes
    piece by piece exactly.)"""

    def __init__(self, tokenizer):
        self.tokenizer, self.pending = tokenizer, []

    def push(self, token):
        self.pending.append(int(token))
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd"):
            return ""
        self.pending = []
        return text

    def flush(self):
        """The text still waiting (an incomplete character at the end, decoded as it is)."""
        text, self.pending = self.tokenizer.decode(self.pending), []
        return text
