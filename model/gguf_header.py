"""A bounded walk of a GGUF file's header before gguf-py reads it: every count and length the file claims (tensors,
metadata entries, strings, arrays, tensor dimensions) is checked against the bytes that are left, so no list or
array is ever sized by a number the file merely claims.

gguf-py's reader trusts them: a metadata array whose count says 2^62 (in a 5 KB file) made it build a list that
ran the process out of memory (found by `python -m fuzz gguf`). The walk reads the header once, O(its size), and
returns a one-line reason the file is malformed, or None.

    if why := header_problem(path):
        raise GGUFError(f"{path}: {why}")
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

# GGUF metadata value types (gguf-py's GGUFValueType): fixed sizes; 8 = string, 9 = array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_DEPTH = 4  # arrays of arrays (llama.cpp writes none nested)


class _Malformed(Exception):
    pass


class _Walk:
    def __init__(self, data):
        self.data, self.at = data, 0

    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.left():
            raise _Malformed(f"{what} needs {n} bytes at offset {self.at} but the file has {self.left()} left")
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> None:
        self.take(self.u64(f"{what}'s length"), what)

    def value(self, vtype: int, what: str, depth: int = 0) -> None:
        if vtype in _SIZES:
            self.take(_SIZES[vtype], what)
        elif vtype == _STRING:
            self.string(what)
        elif vtype == _ARRAY:
            if depth >= _MAX_DEPTH:
                raise _Malformed(f"{what}: arrays nested more than {_MAX_DEPTH} deep")
            itype, count = self.u32(f"{what}'s item type"), self.u64(f"{what}'s count")
            least = _SIZES.get(itype, 8 if itype == _STRING else 12 if itype == _ARRAY else 0)
            if not least:
                raise _Malformed(f"{what}: unknown item type {itype}")
            if count * least > self.left():  # each item takes at least `least` bytes
                raise _Malformed(
                    f"{what} claims {count} items but the {self.left()} bytes left hold at most {self.left() // least}"
                )
            if itype in _SIZES:
                self.take(count * least, what)
            else:
                for i in range(count):
                    self.value(itype, f"{what}[{i}]", depth + 1)
        else:
            raise _Malformed(f"{what}: unknown value type {vtype}")


def header_problem(path: str | Path) -> str | None:
    """Why the header of GGUF file `path` cannot be what it claims (a count or length past the file), or None."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            return f"{size} bytes: too short for a GGUF header"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:  # pages of the header only are read
            return _walk(_Walk(data), size)


def _walk(w: _Walk, size: int) -> str | None:
    try:
        if w.take(4, "the magic") != b"GGUF":
            return "not a GGUF file (no GGUF magic)"
        version = w.u32("the version")
        if version < 2:
            return f"GGUF version {version} is not read (2 and 3 are)"
        n_tensors, n_kv = w.u64("the tensor count"), w.u64("the metadata count")
        # every metadata entry takes >= 8 (key length) + 4 (type) + 1 bytes; every tensor info >= 8 + 4 + 8 + 4 + 8
        if n_kv * 13 > w.left() or n_tensors * 32 > w.left():
            return (
                f"claims {n_tensors} tensors and {n_kv} metadata entries but the {w.left()} bytes after its header "
                "cannot hold them"
            )
        for i in range(n_kv):
            w.string(f"metadata entry {i}'s key")
            w.value(w.u32(f"metadata entry {i}'s type"), f"metadata entry {i}")
        for i in range(n_tensors):
            w.string(f"tensor {i}'s name")
            n_dims = w.u32(f"tensor {i}'s dimension count")
            if n_dims > _MAX_DIMS:
                return f"tensor {i} claims {n_dims} dimensions (GGML has at most {_MAX_DIMS})"
            elements = 1
            for d in range(n_dims):
                elements *= w.u64(f"tensor {i}'s dimension {d}")
            if elements > 8 * size:  # no GGML type stores a weight in under one bit
                return f"tensor {i} claims {elements} values, far more than any file holds"
            w.take(12, f"tensor {i}'s type and offset")
    except _Malformed as exc:
        return str(exc)
    return None
