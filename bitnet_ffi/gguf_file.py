"""Reads GGUF files with the gguf package (memory-mapped), plus bitnet.cpp's I2_S tensors (type
36), which the package does not know: their raw bytes are handed out as they are. Knows the
container, nothing about models."""
import os

import numpy as np

from .errors import CorruptFileError, UnsupportedError

I2_S = 36
I2_S_TAIL = 32  # bytes after the codes; the first 4 are the float32 per-tensor scale


def _reader_class():
    from gguf import GGMLQuantizationType, GGUFReader
    known_types = {int(t) for t in GGMLQuantizationType}

    class Reader(GGUFReader):
        """GGUFReader that sets tensors of types the package does not know aside (as
        ``foreign``: name -> (type, dims, offset)) instead of failing on them."""

        def _build_tensors(self, start_offs, fields):
            known = []
            self.foreign = {}
            for field in fields:
                _, name, _, dims, raw_dtype, offset = field.parts
                if int(raw_dtype[0]) in known_types:
                    known.append(field)
                else:
                    self.foreign[str(bytes(name), "utf-8")] = (
                        int(raw_dtype[0]), tuple(int(d) for d in dims), start_offs + int(offset[0]))
            super()._build_tensors(start_offs, known)

    return Reader


class GGUFFile:
    """``metadata`` (key -> Python value), ``names()``, ``kind(name)`` (the GGML type name, e.g.
    "F16", "TQ2_0", "I2_S"), ``shape(name)`` (numpy order, [rows, columns]) and ``raw(name)``
    (the tensor's bytes, or its typed values for F16/F32, as a memory-mapped view)."""

    def __init__(self, path):
        self.path = str(path)
        size = os.path.getsize(self.path)
        try:
            reader = _reader_class()(self.path)
        except ImportError:
            raise
        except Exception as exc:  # the package raises ValueError, KeyError, struct errors ...
            raise CorruptFileError(f"{self.path}: not a readable GGUF file (truncated or corrupt "
                                   f"header: {type(exc).__name__}: {exc})") from None
        self.metadata = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or not field.types:
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception as exc:
                raise CorruptFileError(f"{self.path}: metadata {key}: {exc}") from None
        self.tensors = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            end = t.data_offset + t.n_bytes
            if end > size or t.data.size * t.data.itemsize != t.n_bytes:
                raise CorruptFileError(f"{self.path}: tensor {t.name}: data ends at byte {end}, "
                                       f"past the end of the file ({size} bytes): truncated")
            self.tensors[t.name] = (t.tensor_type.name, shape, t.data)
        for name, (ggml_type, dims, offset) in reader.foreign.items():
            shape = tuple(reversed(dims))
            if ggml_type != I2_S:
                self.tensors[name] = (f"unknown type {ggml_type}", shape, None)
                continue
            n = int(np.prod(shape))
            nbytes = n // 4 + I2_S_TAIL
            if len(shape) != 2 or shape[1] % 16 or n % 128 or offset + nbytes > size:
                raise CorruptFileError(f"{self.path}: tensor {name}: I2_S {list(shape)} of "
                                       f"{nbytes} bytes at {offset} does not fit the file of "
                                       f"{size} bytes or is not [rows, 16k] of 128-weight "
                                       "blocks")
            self.tensors[name] = ("I2_S", shape, reader.data[offset:offset + nbytes])

    def names(self):
        return list(self.tensors)

    def kind(self, name):
        return self.tensors[name][0]

    def shape(self, name):
        return self.tensors[name][1]

    def raw(self, name):
        return self.tensors[name][2]


def require(gguf_file, name, kinds):
    """The tensor's kind, if it is one of `kinds`; an UnsupportedError naming file and tensor
    otherwise."""
    kind = gguf_file.kind(name)
    if kind not in kinds:
        raise UnsupportedError(f"{gguf_file.path}: tensor {name}: type {kind} is not supported "
                               f"here (supported: {', '.join(kinds)})")
    return kind
