"""Read a GGUF file (metadata + tensors).

The parser is zeroth's own: one pass over a memory map (the SmolLM2 file's metadata, ~10^5
tokenizer strings, in about 0.1 s, where ``gguf.GGUFReader`` takes 2.5-5 s), checked against
``gguf.GGUFReader`` in tests/test_gguf.py; the ``gguf`` package's constants name the tensor types
and their block sizes. A truncated file or another format is a ``ValueError`` naming the file.

A GGUF tensor of ggml shape ``[ne0, ne1]`` (``ne0`` contiguous) is returned in NumPy order
``(ne1, ne0)``, i.e. ``[out_features, in_features]`` for a linear layer, like PyTorch. Quantized
tensors keep their raw bytes (``u8[ne1, ne0/32 * block_bytes]``); what they mean (dequantized
values, per-block grids) is :mod:`zeroth.models.pretrained.gguf_file`'s business. The metadata
also holds the tokenizer (:func:`zeroth.data.bpe.smollm2_tokenizer`).

Example:
  >>> f = read_gguf(resources.smollm2_path())                      # doctest: +SKIP
  >>> f.metadata["llama.block_count"], f.tensors["blk.0.attn_q.weight"].ggml_type  # doctest: +SKIP
  (30, 'Q4_1')
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from zeroth.data import resources as _res

__all__ = ["GGUFTensor", "GGUFFile", "read_gguf"]


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file.

    Attributes:
      name: GGUF name, e.g. ``"blk.0.attn_q.weight"``.
      ggml_type: ``"F32"``, ``"F16"``, ``"Q4_1"``, ``"Q8_0"`` ...
      shape: NumPy-order logical shape (``(ne1, ne0)`` for matrices).
      data: ``float32``/``float16`` values of ``shape``, or ``uint8`` block bytes for quantized types.
    """

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile(NamedTuple):
    """A parsed GGUF file: ``metadata`` (key -> int/float/bool/str/list) and ``tensors`` by name."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
# GGUF value types: scalar codes -> NumPy dtypes (little-endian); 8 is a string, 9 an array.
_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


class _Cursor:
    """Sequential little-endian reads from a memory map, each checked against the file's end."""

    def __init__(self, buf: np.ndarray, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> np.ndarray:
        if n < 0 or self.pos + n > self.buf.size:
            raise ValueError(
                f"{self.path}: truncated GGUF file (needs {n} bytes at offset {self.pos}, has {self.buf.size})"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, code: int):
        dt = np.dtype(_SCALARS[code])
        return self.take(dt.itemsize).view(dt)[0].item()

    def string(self) -> str:
        return bytes(self.take(self.scalar(10))).decode("utf-8")

    def value(self, code: int):
        if code == _STRING:
            return self.string()
        if code == _ARRAY:
            inner, n = self.scalar(4), self.scalar(10)
            if inner == _STRING:
                return self.strings(n)
            if inner not in _SCALARS:
                return [self.value(inner) for _ in range(n)]
            dt = np.dtype(_SCALARS[inner])
            values = self.take(n * dt.itemsize).view(dt).tolist()
            return [bool(v) for v in values] if inner == _BOOL else values
        if code not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {code} at offset {self.pos}")
        v = self.scalar(code)
        return bool(v) if code == _BOOL else v

    def strings(self, n: int) -> list[str]:
        # A string array (a tokenizer's vocabulary and merges: ~10^5 entries) is read with one
        # slice per string; lengths are u64 prefixes.
        out = []
        buf, pos, size = self.buf, self.pos, self.buf.size
        raw = buf.data  # memoryview: slicing it copies nothing
        for _ in range(n):
            if pos + 8 > size:
                raise ValueError(f"{self.path}: truncated GGUF file (a string array ends at offset {pos})")
            k = int.from_bytes(raw[pos : pos + 8], "little")
            if pos + 8 + k > size:
                raise ValueError(f"{self.path}: truncated GGUF file (a string of {k} bytes at offset {pos + 8})")
            out.append(str(raw[pos + 8 : pos + 8 + k], "utf-8"))
            pos += 8 + k
        self.pos = pos
        return out


def _parse(path: Path) -> GGUFFile:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    c = _Cursor(buf, path)
    if bytes(c.take(4)) != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (the first 4 bytes are not {_MAGIC!r})")
    version = c.scalar(4)
    if version not in _VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not supported (expected one of {list(_VERSIONS)})")
    n_tensors, n_kv = c.scalar(10), c.scalar(10)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.scalar(4))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.scalar(10) for _ in range(c.scalar(4))]
        infos.append((name, dims, GGMLQuantizationType(c.scalar(4)), c.scalar(10)))
    align = int(metadata.get("general.alignment", 32))
    start = -(-c.pos // align) * align
    tensors = {}
    for name, dims, qtype, offset in infos:
        shape = tuple(int(n) for n in reversed(dims))  # NumPy order: ne0 is the last (contiguous) axis
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if qtype.name in ("F32", "F16"):
            dt = np.dtype("<f4" if qtype.name == "F32" else "<f2")
            nbytes, view_shape = int(np.prod(shape)) * dt.itemsize, shape
        else:
            dt = np.dtype(np.uint8)
            row = dims[0] // block * block_bytes
            nbytes, view_shape = int(np.prod(shape[:-1])) * row, (*shape[:-1], row)
        lo = start + offset
        if lo + nbytes > buf.size:
            raise ValueError(
                f"{path}: truncated GGUF file (tensor {name!r} needs bytes {lo}..{lo + nbytes}, the file has {buf.size})"
            )
        tensors[name] = GGUFTensor(name, qtype.name, shape, buf[lo : lo + nbytes].view(dt).reshape(view_shape))
    return GGUFFile(path, metadata, tensors)


@functools.lru_cache(maxsize=2)
def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file (cached per path; arrays are read-only views of a memory map).

    Raises:
      MissingPackage: the ``gguf`` package is not installed.
      FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    _res.require("gguf")  # its constants name the tensor types and their block sizes
    return _parse(path)
