"""A GGUF file's metadata and tensor index, read without gguf-py's `GGUFReader`.

`GGUFReader` builds numpy views for every part of every metadata entry: for a vocabulary and its merges
that is ~300k small arrays, seconds of a replica's cold start spent before the first weight is read.
Here the header is walked with `struct`; arrays of strings (the vocabulary, merges) are only skipped
and decoded when asked for. Values and tensors are what `GGUFReader` gives (`ReaderField.contents()`;
each tensor's name, `GGMLQuantizationType`, GGUF-order shape and a numpy view of its bytes in a
read-only memory map), which tests/loader/test_gguf_file.py checks field by field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types: struct format and numpy dtype of each scalar (STRING = 8, ARRAY = 9).
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "u1"), 1: ("b", "i1"), 2: ("H", "u2"), 3: ("h", "i2"), 4: ("I", "u4"), 5: ("i", "i4"),
    6: ("f", "f4"), 7: ("?", "?"), 10: ("Q", "u8"), 11: ("q", "i8"), 12: ("d", "f8"),
}
# Unquantized tensor types (GGMLQuantizationType values) viewed as their own dtype; the rest as bytes.
_PLAIN_TENSORS = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8"}


@dataclass(frozen=True)
class _Strings:
    """An array of strings left undecoded: where its first length prefix is, and how many there are."""
    offset: int
    count: int


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order (innermost first), as GGUFReader gives it
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # a view of the file: numpy shape (outermost first), bytes per row for quantized types


class GGUFFile:
    """The header of a GGUF v2/v3 file (either byte order): `get(key)`, `fields` (keys), `tensors`."""

    def __init__(self, path: str):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        self._buf = np.memmap(path, mode="r")
        buf = memoryview(self._buf)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ValueError(f"{path}: GGUF magic invalid")
        self._end = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._end = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = struct.unpack_from(self._end + "QQ", buf, 8)
        offs = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key, offs = self._str(buf, offs)
            (vtype,) = struct.unpack_from(self._end + "I", buf, offs)
            if key in self.fields:
                raise KeyError(f"{path}: duplicate metadata key {key}")
            self.fields[key], offs = self._value(buf, offs + 4, vtype)
        infos = []
        for _ in range(n_tensors):
            name, offs = self._str(buf, offs)
            (n_dims,) = struct.unpack_from(self._end + "I", buf, offs)
            dims = struct.unpack_from(f"{self._end}{n_dims}Q", buf, offs + 4)
            offs += 4 + 8 * n_dims
            ttype, rel = struct.unpack_from(self._end + "IQ", buf, offs)
            offs += 12
            infos.append((name, dims, ttype, rel))
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"{path}: invalid general.alignment {align!r}")
        self.data_offset = offs + (-offs) % align
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, ttype, rel in infos:
            if name in seen:
                raise ValueError(f"{path}: duplicated tensor {name}")
            seen.add(name)
            qtype = GGMLQuantizationType(ttype)
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = n_elems * type_size // block
            start = self.data_offset + rel
            np_shape = tuple(reversed(dims))
            plain = _PLAIN_TENSORS.get(ttype)
            if plain is None:
                if np_shape[-1] % block:
                    raise ValueError(f"{path}: {name}: row of {np_shape[-1]} is not a multiple of {block}")
                np_shape = (*np_shape[:-1], np_shape[-1] // block * type_size)
            dtype = np.dtype(plain or "u1").newbyteorder(self._end if plain else "=")
            data = self._buf[start:start + n_bytes].view(dtype).reshape(np_shape)
            self.tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), n_elems, n_bytes,
                                           start, data))

    def get(self, key: str, default: Any = None) -> Any:
        """The value as GGUFReader's `fields[key].contents()` (a list for arrays), or `default`."""
        if key not in self.fields:
            return default
        value = self.fields[key]
        if isinstance(value, _Strings):
            value = self.fields[key] = self._strings(value)
        return list(value) if isinstance(value, list) else value

    # ---- parsing ----

    def _str(self, buf: memoryview, offs: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(self._end + "Q", buf, offs)
        return str(buf[offs + 8:offs + 8 + n], "utf-8"), offs + 8 + n

    def _value(self, buf: memoryview, offs: int, vtype: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._str(buf, offs)
        if vtype in _SCALARS:
            fmt = self._end + _SCALARS[vtype][0]
            return struct.unpack_from(fmt, buf, offs)[0], offs + struct.calcsize(fmt)
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        itype, count = struct.unpack_from(self._end + "IQ", buf, offs)
        offs += 12
        if itype == _STRING:  # skipped here: decoded on first get()
            start, fmt = offs, self._end + "Q"
            for _ in range(count):
                offs += 8 + struct.unpack_from(fmt, buf, offs)[0]
            return _Strings(start, count), offs
        if itype in _SCALARS:
            dtype = np.dtype(_SCALARS[itype][1]).newbyteorder(self._end)
            end = offs + dtype.itemsize * count
            return np.frombuffer(buf[offs:end], dtype=dtype).tolist(), end
        items = []
        for _ in range(count):  # arrays of arrays: rare and small
            item, offs = self._value(buf, offs, itype)
            items.extend(self._strings(item) if isinstance(item, _Strings) else item)  # GGUFReader flattens nested arrays
        return items, offs

    def _strings(self, ref: _Strings) -> list[str]:
        buf, offs, out = memoryview(self._buf), ref.offset, []
        fmt = self._end + "Q"
        for _ in range(ref.count):
            (n,) = struct.unpack_from(fmt, buf, offs)
            out.append(str(buf[offs + 8:offs + 8 + n], "utf-8"))
            offs += 8 + n
        return out


# Values per call of a quant type's row dequantizer: ~16 MB of float32 (and a few times that in temporaries).
_DEQUANT_CHUNK = 1 << 22


def dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    """`gguf.quants.dequantize`, in chunks of ~4M values rather than of 16 rows: the same per-block arithmetic
    (bit-equal results), without the per-group overhead that made it most of a small model's load time."""
    import gguf.quants

    cls = getattr(gguf.quants, qtype.name, None)
    if cls is None or not hasattr(cls, "dequantize_rows") or data.ndim < 1:
        return gguf.quants.dequantize(data, qtype)
    cls.init_grid()
    rows = np.asarray(data).reshape(-1, data.shape[-1])  # a plain view: memmap slicing costs per call
    out = np.empty((rows.shape[0], rows.shape[1] // cls.type_size * cls.block_size), dtype=np.float32)
    step = max(1, _DEQUANT_CHUNK // max(1, out.shape[1]))
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = cls.dequantize_rows(rows[start:start + step])
    return out.reshape(*data.shape[:-1], out.shape[1])
