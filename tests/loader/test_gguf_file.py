"""rayllm.loader.gguf_file against gguf-py's own GGUFReader (the reference): every metadata value and
every tensor (name, type, shape, offset, bytes) the same, on the real default model and on files
written here with gguf-py's writer (random values, every value type, nested arrays, both byte orders)."""

from __future__ import annotations

import struct

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


def _write(path: str, fill) -> str:
    w = gguf.GGUFWriter(path, "llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_large_metadata_array_takes_no_memory_until_read(tmp_path):
    """A 256 kB u8 array: opening the file allocates almost nothing (it was a list of Python ints, ~9 bytes
    of memory per byte of file: 2.6 GB for a 300 MB array); get() gives what GGUFReader gives."""
    import tracemalloc

    path = _write(str(tmp_path / "big.gguf"), lambda w: (w.add_array("t.blob", bytes(range(256)) * 1024),
                                                         w.add_array("t.words", ["a", "bc"] * 1000)))
    tracemalloc.start()
    try:
        ours = GGUFFile(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200_000, peak
    assert (ours.array_len("t.blob"), ours.array_len("t.words"), ours.array_len("general.architecture")) == \
           (256 * 1024, 2000, None)
    assert_same(path)


def _cut(src: str, dst, n: int) -> str:
    with open(src, "rb") as fh:
        dst.write_bytes(fh.read(n))
    return str(dst)


def test_a_truncated_file_names_itself_and_what_is_cut(tmp_path):
    """The default model cut at places GGUFReader locates: in a string array, a number array, a tensor's
    info, the last tensor's data, the header."""
    src = default_model_path()
    ref = gguf.GGUFReader(src)
    last = ref.tensors[-1]
    first_info = ref.tensors[0].field.offset + 8 + len(ref.tensors[0].name) + 2
    for at, what in [(ref.fields["tokenizer.ggml.tokens"].offset + 5000, "metadata tokenizer.ggml.tokens"),
                     (ref.fields["tokenizer.ggml.token_type"].offset + 100, "metadata tokenizer.ggml.token_type"),
                     (first_info, f"tensor {ref.tensors[0].name}'s info"),
                     (last.data_offset + last.n_bytes - 1, f"tensor {last.name}'s data"),
                     (10, "the header")]:
        path = _cut(src, tmp_path / "cut.gguf", at)
        with pytest.raises(ValueError, match="truncated") as err:
            GGUFFile(path)
        assert path in str(err.value) and what in str(err.value), (what, str(err.value))


def _crafted(tmp_path, n_tensors: int, n_kv: int, body: bytes) -> str:
    """A little-endian GGUF v3 header followed by `body` (keys, values and tensor infos packed here)."""
    path = tmp_path / "crafted.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body + bytes(64))
    return str(path)


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("n_tensors, n_kv, body, message", [
    (2**40, 0, b"", "counts 1099511627776 tensors, more than"),
    (0, 2**40, b"", "counts 1099511627776 metadata entries, more than"),
    (1, 0, _s(b"x") + struct.pack("<I", 5) + bytes(56), "tensor x has 5 dimensions"),
    (1, 0, _s(b"x") + struct.pack("<IQIQ", 1, 4, 99, 0), "tensor x: unknown tensor type 99"),
    (1, 0, _s(b"x") + struct.pack("<IQIQ", 1, 2**62, 0, 0), "truncated: tensor x's data"),
    (0, 1, struct.pack("<Q", 2**62) + b"k", "truncated: metadata key #0"),
    (0, 1, _s(b"t.s") + struct.pack("<IIQ", 9, 8, 2**60), "truncated: metadata t.s"),  # 2**60 strings
    (0, 1, _s(b"t.s") + struct.pack("<IIQ", 9, 8, 1) + struct.pack("<Q", 2**40), "truncated: metadata t.s"),
    (0, 1, _s(b"t.n") + struct.pack("<IIQ", 9, 6, 2**40), "truncated: metadata t.n"),  # 2**40 floats
    (0, 1, _s(b"t.v") + struct.pack("<I", 77), "metadata t.v: unknown GGUF value type 77"),
])
def test_corrupt_counts_and_lengths_are_refused(tmp_path, n_tensors, n_kv, body, message):
    path = _crafted(tmp_path, n_tensors, n_kv, body)
    with pytest.raises(ValueError, match=message) as err:
        GGUFFile(path)
    assert path in str(err.value)


def test_a_string_that_is_not_utf8_names_its_key(tmp_path):
    path = _crafted(tmp_path, 0, 1, _s(b"t.s") + struct.pack("<IIQ", 9, 8, 2) + _s(b"ok") + _s(b"\xff"))
    ours = GGUFFile(path)  # string arrays are decoded when read
    with pytest.raises(ValueError, match="metadata t.s is not UTF-8"):
        ours.get("t.s")
