"""zeroth's GGUF reader (``zeroth.data.gguf.read_gguf``) against the ``gguf`` package's own reader.

The file is written by ``gguf.GGUFWriter`` (every value type zeroth meets: strings, string arrays
with multi-byte UTF-8, integer and bool arrays, floats; F32, F16 and Q8_0 tensors with alignment
padding), so the two readers are compared on bytes produced by an independent writer.
"""

import importlib.util

import numpy as np
import pytest

from zeroth.data import gguf as zgguf

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None, reason="needs the gguf package: pip install gguf"
)


def _write(path):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "Ġthe", "é", "日本", "", "<|endoftext|>"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 1, 1, 3, 3])
    w.add_array("tokenizer.ggml.merges", ["Ġ t", "h e"])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint64("some.count", 2**40 + 3)
    r = np.random.default_rng(0)
    w.add_tensor("f32", r.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", r.standard_normal((7,)).astype(np.float16))
    q8 = gguf.quants.quantize(r.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _reference(path):
    import gguf

    rd = gguf.GGUFReader(str(path))
    meta = {}
    for key, field in rd.fields.items():
        if key.startswith("GGUF."):
            continue
        types = list(field.types)
        if types[0] == gguf.GGUFValueType.ARRAY:
            if types[-1] == gguf.GGUFValueType.STRING:
                meta[key] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                meta[key] = [field.parts[i].tolist()[0] for i in field.data]
        elif types[0] == gguf.GGUFValueType.STRING:
            meta[key] = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            v = field.parts[field.data[0]].tolist()[0]
            meta[key] = bool(v) if types[0] == gguf.GGUFValueType.BOOL else v
    return meta, rd.tensors


def test_read_gguf_equals_the_gguf_packages_reader(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path)
    f = zgguf._parse(path)
    meta, tensors = _reference(path)
    assert f.metadata == meta
    assert f.metadata["tokenizer.ggml.tokens"][3] == "日本" and f.metadata["some.count"] == 2**40 + 3
    assert f.metadata["tokenizer.ggml.add_bos_token"] is False
    assert sorted(f.tensors) == sorted(t.name for t in tensors) == ["f16", "f32", "q8"]
    for t in tensors:
        mine = f.tensors[t.name]
        assert mine.ggml_type == t.tensor_type.name
        assert mine.shape == tuple(int(n) for n in reversed(list(t.shape)))
        ref = np.asarray(t.data)
        assert mine.data.dtype == ref.dtype and mine.data.shape == ref.shape
        np.testing.assert_array_equal(mine.data, ref)
    assert f.tensors["q8"].data.shape == (2, 2 * 34)  # two Q8_0 blocks of 34 bytes per row
    assert not f.tensors["f32"].data.flags.writeable


def test_truncated_or_foreign_files_are_named(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path)
    data = path.read_bytes()
    for n, what in ((len(data) - 40, "tensor 'q8'"), (200, "truncated GGUF file"), (6, "truncated GGUF file")):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError, match="truncated GGUF file") as e:
            zgguf._parse(cut)
        assert what in str(e.value) and str(cut) in str(e.value)
    other = tmp_path / "other.bin"
    other.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        zgguf.read_gguf(other)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        zgguf.read_gguf(tmp_path / "missing.gguf")
