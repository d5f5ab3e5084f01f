"""Dequantize the tensors of a GGUF file to float32 and read their per-block grids.

The file itself is read by :mod:`zeroth.data.gguf` (:func:`read_gguf`, re-exported here with
:class:`GGUFFile`, :class:`GGUFTensor` and :func:`smollm2_path`). Quantized tensors keep their
raw bytes (``u8[ne1, ne0/32 * block_bytes]``) so that callers can both dequantize them
(:func:`dequantize`) and read their per-block grid (:func:`grid`).

Example:
  >>> f = read_gguf(smollm2_path())                      # doctest: +SKIP
  >>> dequantize(f.tensors["blk.0.attn_q.weight"]).dtype  # doctest: +SKIP
  dtype('float32')
"""

from __future__ import annotations

import numpy as np

from zeroth.data.gguf import GGUFFile, GGUFTensor, read_gguf
from zeroth.data.resources import smollm2_path
from zeroth.models.pretrained import quant as _quant

__all__ = ["GGUFTensor", "GGUFFile", "read_gguf", "dequantize", "grid", "QUANT_FORMATS", "smollm2_path"]

# ggml type name -> zeroth.models.pretrained.quant format
QUANT_FORMATS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}


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
