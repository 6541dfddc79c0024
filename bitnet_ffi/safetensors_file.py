"""Reads safetensors files (one file, or shards listed by model.safetensors.index.json) as
memory-mapped numpy views; knows the container, nothing about models.

The header is parsed here rather than by the safetensors package because its numpy backend has
no bfloat16; bfloat16 views use ml_dtypes. Every structural fault (a truncated file, a header that
is not JSON, a tensor whose byte range does not match its dtype and shape or leaves the data
section) is a CorruptFileError naming the file and the tensor."""
import json
import math
import os
import struct

import numpy as np

from ._arrays import numpy_dtype
from .errors import CorruptFileError

DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
          "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64"}
MAX_HEADER = 100 << 20


class SafetensorsFile:
    """One .safetensors file: ``names()``, ``dtype(name)``, ``shape(name)``, ``tensor(name)``."""

    def __init__(self, path):
        self.path = str(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptFileError(f"{self.path}: truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise CorruptFileError(f"{self.path}: header length {n} does not fit the file "
                                       f"of {size} bytes (truncated or not safetensors)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise CorruptFileError(f"{self.path}: corrupt header ({exc})") from None
        if not isinstance(header, dict):
            raise CorruptFileError(f"{self.path}: corrupt header (not a JSON object)")
        header.pop("__metadata__", None)
        self.data_start, data_size = 8 + n, size - 8 - n
        self.entries = {}
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
                shape = tuple(int(d) for d in shape)
            except (KeyError, TypeError, ValueError):
                raise CorruptFileError(f"{self.path}: tensor {name}: corrupt header entry "
                                       f"{entry!r}") from None
            if dtype not in DTYPES:
                raise CorruptFileError(f"{self.path}: tensor {name}: unknown dtype {dtype!r}")
            nbytes = math.prod(shape) * np.dtype(numpy_dtype(DTYPES[dtype])).itemsize
            if min(shape, default=1) < 0 or not 0 <= begin <= end <= data_size \
                    or end - begin != nbytes:
                raise CorruptFileError(
                    f"{self.path}: tensor {name}: bytes [{begin}, {end}) do not hold {dtype} "
                    f"{list(shape)} inside the {data_size} data bytes (truncated or corrupt)")
            self.entries[name] = (DTYPES[dtype], shape, begin)
        self._map = None

    def names(self):
        return list(self.entries)

    def dtype(self, name):
        return self.entries[name][0]

    def shape(self, name):
        return self.entries[name][1]

    def tensor(self, name):
        """A read-only memory-mapped numpy view (no copy)."""
        dtype, shape, begin = self.entries[name]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        count = math.prod(shape) * np.dtype(numpy_dtype(dtype)).itemsize
        start = self.data_start + begin
        return self._map[start:start + count].view(numpy_dtype(dtype)).reshape(shape)


class SafetensorsCheckpoint:
    """The tensors of a model directory: model.safetensors, or the shards that
    model.safetensors.index.json lists. ``file_of(name)`` says which file holds a tensor."""

    def __init__(self, directory):
        self.directory = str(directory)
        index = os.path.join(self.directory, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (KeyError, TypeError, ValueError) as exc:
                raise CorruptFileError(f"{index}: corrupt index ({exc})") from None
            files = {shard: SafetensorsFile(os.path.join(self.directory, shard))
                     for shard in sorted(set(weight_map.values()))}
            self.files = {}
            for name, shard in weight_map.items():
                if name not in files[shard].entries:
                    raise CorruptFileError(f"{files[shard].path}: tensor {name}, listed in "
                                           f"{index}, is not in the file")
                self.files[name] = files[shard]
        else:
            single = SafetensorsFile(os.path.join(self.directory, "model.safetensors"))
            self.files = {name: single for name in single.names()}

    def names(self):
        return list(self.files)

    def file_of(self, name):
        return self.files[name].path

    def dtype(self, name):
        return self.files[name].dtype(name)

    def shape(self, name):
        return self.files[name].shape(name)

    def tensor(self, name):
        return self.files[name].tensor(name)
