"""Read a GGUF file (metadata + tensors) with the ``gguf`` package.

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


def _field_value(field) -> Any:
    from gguf import GGUFValueType

    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        inner = types[-1]
        if inner == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]].tolist()[0]
    return bool(value) if types[0] == GGUFValueType.BOOL else value


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
    gguf = _res.require("gguf")
    reader = gguf.GGUFReader(str(path))
    metadata = {name: _field_value(field) for name, field in reader.fields.items()}
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(list(t.shape)))
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, np.asarray(t.data))
    return GGUFFile(path, metadata, tensors)
