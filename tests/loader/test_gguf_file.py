"""rayllm.loader.gguf_file against gguf-py's own GGUFReader (the reference): every metadata value and
every tensor (name, type, shape, offset, bytes) the same, on the real default model and on files
written here with gguf-py's writer (random values, every value type, nested arrays, both byte orders)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from rayllm.loader.gguf_file import GGUFFile
from rayllm.loader.model_files import default_model_path


def assert_same(path: str) -> None:
    ref, ours = gguf.GGUFReader(path), GGUFFile(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # the header's own counts, not metadata
    assert list(ours.fields) == keys
    for key in keys:
        want, got = ref.fields[key].contents(), ours.get(key)
        assert type(got) is type(want) and got == want, key
    assert ours.get("no.such.key", "dflt") == "dflt"
    assert ours.data_offset == ref.data_offset
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ref.tensors, ours.tensors, strict=True):
        assert (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset) == \
               (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset)
        assert b.shape.tolist() == a.shape.tolist()
        assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape
        assert np.array_equal(b.data, a.data)


def test_default_model_reads_as_gguf_reader_does():
    assert_same(default_model_path())


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_and_tensor_type(tmp_path, endian):
    rng = np.random.default_rng(7)  # random values and weights
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama", endianess=endian)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 1e-5)  # not exact in float32: both must give the same double
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.tokens", ["<s>", "", "▁a", "ü", "\n"] * 50)
    w.add_array("t.ints", [int(x) for x in rng.integers(-1000, 1000, 300)])
    w.add_array("t.floats", [float(x) for x in rng.standard_normal(17)])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3, 4, 5]])
    w.add_array("t.nested_str", [["a", "b"], ["c"]])
    w.add_uint32("general.alignment", 64)
    for name, arr in [("a.weight", rng.standard_normal((3, 64)).astype(np.float32)),
                      ("b.weight", rng.standard_normal((2, 5, 8)).astype(np.float16)),
                      ("c.bias", rng.integers(-100, 100, 7).astype(np.int8)),
                      ("d.idx", rng.integers(0, 9, (4, 4)).astype(np.int32))]:
        w.add_tensor(name, arr)  # native order in, the writer swaps for a big-endian file
    q = rng.integers(0, 255, (4, 2 * 18), dtype=np.uint8)  # two Q4_0 blocks per row, raw bytes
    w.add_tensor("q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same(path)
    ours = GGUFFile(path)
    assert ours.get("t.f32") == float(np.float32(1e-5)) and ours.get("t.str") == "héllo ✓"
    assert ours.tensors[1].data.astype(np.float16).shape == (2, 5, 8)


def test_rejects_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(str(bad))


def test_dequantize_equals_gguf_py_bit_for_bit(monkeypatch):
    """The chunked dequantizer against gguf-py's own: the default model's tensors, and random blocks of every
    quant type gguf-py dequantizes, with chunks small enough that rows split across several calls."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize as reference

    from rayllm.loader import gguf_file

    model = GGUFFile(default_model_path())
    for t in model.tensors:
        assert np.array_equal(gguf_file.dequantize(t.data, t.tensor_type), reference(t.data, t.tensor_type)), t.name
    monkeypatch.setattr(gguf_file, "_DEQUANT_CHUNK", 1000)
    rng = np.random.default_rng(3)  # random bytes: every bit pattern of scales and quants
    for qtype in gguf.GGMLQuantizationType:
        cls = getattr(gguf.quants, qtype.name, None)
        if cls is None or not hasattr(cls, "dequantize_rows"):
            continue
        block, size = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (7, 3 * size), dtype=np.uint8)  # 7 rows of 3 blocks
        with np.errstate(all="ignore"):  # random scales include NaN and inf
            try:
                want = reference(data, qtype)
            except NotImplementedError:
                continue
            got = gguf_file.dequantize(data, qtype)
        assert got.shape == want.shape == (7, 3 * block) and got.dtype == want.dtype, qtype.name
        assert np.array_equal(got, want, equal_nan=True), qtype.name
