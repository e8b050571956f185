"""A GGUF file's metadata and tensor index, read without gguf-py's `GGUFReader`.

`GGUFReader` builds numpy views for every part of every metadata entry: for a vocabulary and its merges
that is ~300k small arrays, seconds of a replica's cold start spent before the first weight is read.
Here the header is walked with `struct`; arrays are left where they are in the file (numbers as numpy
views of it, strings only skipped) and turned into Python values when asked for, so a large array costs
no memory until it is read. Values and tensors are what `GGUFReader` gives (`ReaderField.contents()`;
each tensor's name, `GGMLQuantizationType`, GGUF-order shape and a numpy view of its bytes in a
read-only memory map), which tests/loader/test_gguf_file.py checks field by field.

A hub download cut short or a crafted file fails here with the file and the field or tensor named: every
string, array and tensor must end inside the file, and the header's counts are capped.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Far above any real model's (tens of metadata keys, a few thousand tensors, ggml's 4 dimensions): a
# corrupt count is refused before it drives a long walk.
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20
MAX_DIMS = 4
MAX_NESTING = 8  # arrays of arrays (of arrays...): each level is a recursion of the walk

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
class _Nested:
    """An array of arrays left undecoded (where its first item is, and how many there are)."""
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
    """The header of a GGUF v2/v3 file (either byte order): `get(key)`, `array_len(key)`, `fields` (keys),
    `tensors`."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as fh:
            head = fh.read(24)
        if head[:4] != GGUF_MAGIC:
            raise ValueError(f"{path}: GGUF magic invalid")
        self._size = os.path.getsize(path)
        self._check(24, "the header")
        self._end = "<"
        (version,) = struct.unpack_from("<I", head, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._end = ">"
            (version,) = struct.unpack_from(">I", head, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = struct.unpack_from(self._end + "QQ", head, 8)
        for count, what, cap in ((n_kv, "metadata entries", MAX_KV), (n_tensors, "tensors", MAX_TENSORS)):
            if count > cap:
                raise ValueError(f"{path}: the header counts {count} {what}, more than {cap}: a corrupt file")
        self._buf = np.memmap(path, mode="r")
        buf = memoryview(self._buf)
        offs = 24
        self.fields: dict[str, Any] = {}
        for i in range(n_kv):
            key, offs = self._str(buf, offs, f"metadata key #{i}")
            self._check(offs + 4, f"metadata {key}")
            (vtype,) = struct.unpack_from(self._end + "I", buf, offs)
            if key in self.fields:
                raise ValueError(f"{path}: duplicate metadata key {key}")
            self.fields[key], offs = self._value(buf, offs + 4, vtype, key)
        infos = []
        for i in range(n_tensors):
            name, offs = self._str(buf, offs, f"tensor #{i}'s name")
            self._check(offs + 4, f"tensor {name}'s info")
            (n_dims,) = struct.unpack_from(self._end + "I", buf, offs)
            if n_dims > MAX_DIMS:
                raise ValueError(f"{path}: tensor {name} has {n_dims} dimensions, more than ggml's {MAX_DIMS}")
            self._check(offs + 16 + 8 * n_dims, f"tensor {name}'s info")
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
            self.tensors.append(self._tensor(name, dims, ttype, rel))

    def get(self, key: str, default: Any = None) -> Any:
        """The value as GGUFReader's `fields[key].contents()` (a list for arrays), or `default`. An array is
        decoded from the file on each call: keep what is used."""
        if key not in self.fields:
            return default
        try:
            return self._contents(self.fields[key])
        except UnicodeDecodeError as exc:  # arrays of strings are only walked when the file is opened
            raise ValueError(f"{self.path}: metadata {key} is not UTF-8 ({exc})") from None

    def array_len(self, key: str) -> int | None:
        """How many values `get(key)` gives for an array field, without decoding it; None for other fields."""
        value = self.fields.get(key)
        if isinstance(value, np.ndarray):
            return value.size
        if isinstance(value, _Strings):
            return value.count
        return len(self.get(key)) if isinstance(value, _Nested) else None  # nested: rare and small

    # ---- parsing ----

    def _check(self, end: int, what: str) -> None:
        if end > self._size:
            raise self._truncated(end, what)

    def _truncated(self, end: int, what: str) -> ValueError:
        return ValueError(f"{self.path}: truncated: {what} needs the file's first {end} bytes, "
                          f"it has {self._size}")

    def _str(self, buf: memoryview, offs: int, what: str) -> tuple[str, int]:
        self._check(offs + 8, what)
        (n,) = struct.unpack_from(self._end + "Q", buf, offs)
        end = offs + 8 + n
        self._check(end, what)
        try:
            return str(buf[offs + 8:end], "utf-8"), end
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.path}: {what} is not UTF-8 ({exc})") from None

    def _value(self, buf: memoryview, offs: int, vtype: int, key: str, depth: int = 0) -> tuple[Any, int]:
        """The value at `offs` and where it ends; arrays as numpy views of the file or undecoded references."""
        what = f"metadata {key}"
        if vtype == _STRING:
            return self._str(buf, offs, what)
        if vtype in _SCALARS:
            fmt = self._end + _SCALARS[vtype][0]
            self._check(offs + struct.calcsize(fmt), what)
            return struct.unpack_from(fmt, buf, offs)[0], offs + struct.calcsize(fmt)
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: {what}: unknown GGUF value type {vtype}")
        self._check(offs + 12, what)
        itype, count = struct.unpack_from(self._end + "IQ", buf, offs)
        offs += 12
        if itype in _SCALARS:
            dtype = np.dtype(_SCALARS[itype][1]).newbyteorder(self._end)
            end = offs + dtype.itemsize * count
            self._check(end, what)
            return np.frombuffer(buf, dtype=dtype, count=count, offset=offs), end
        if itype == _STRING:  # skipped here: decoded on get()
            start, fmt = offs, self._end + "Q"
            self._check(offs + 8 * count, what)  # each string has its length at least
            try:
                for _ in range(count):
                    offs += 8 + struct.unpack_from(fmt, buf, offs)[0]
            except struct.error:  # a length that points past the end
                raise self._truncated(offs + 8, what) from None
            self._check(offs, what)
            return _Strings(start, count), offs
        if itype != _ARRAY:
            raise ValueError(f"{self.path}: {what}: unknown GGUF array type {itype}")
        if depth == MAX_NESTING:
            raise ValueError(f"{self.path}: {what}: arrays nested more than {MAX_NESTING} deep")
        start = offs
        self._check(offs + 12 * count, what)  # each item has its type and count at least
        for _ in range(count):
            _, offs = self._value(buf, offs, _ARRAY, key, depth + 1)
        return _Nested(start, count), offs

    def _contents(self, value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return value.tolist()
        if isinstance(value, _Strings):
            buf, offs, out = memoryview(self._buf), value.offset, []
            fmt = self._end + "Q"
            for _ in range(value.count):  # within the file: the walk checked every length
                (n,) = struct.unpack_from(fmt, buf, offs)
                out.append(str(buf[offs + 8:offs + 8 + n], "utf-8"))
                offs += 8 + n
            return out
        if isinstance(value, _Nested):
            buf, offs, items = memoryview(self._buf), value.offset, []
            for _ in range(value.count):  # GGUFReader flattens nested arrays
                item, offs = self._value(buf, offs, _ARRAY, "")
                items.extend(self._contents(item))
            return items
        return value

    def _tensor(self, name: str, dims: tuple[int, ...], ttype: int, rel: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name}: unknown tensor type {ttype}") from None
        n_elems = math.prod(dims)  # Python ints: a corrupt dimension cannot overflow
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * type_size // block
        start = self.data_offset + rel
        self._check(start + n_bytes, f"tensor {name}'s data")
        np_shape = tuple(reversed(dims))
        plain = _PLAIN_TENSORS.get(ttype)
        if plain is None:
            row = np_shape[-1] if np_shape else 1
            if row % block:
                raise ValueError(f"{self.path}: {name}: row of {row} is not a multiple of {block}")
            np_shape = (*np_shape[:-1], row // block * type_size)
        dtype = np.dtype(plain or "u1").newbyteorder(self._end if plain else "=")
        data = self._buf[start:start + n_bytes].view(dtype).reshape(np_shape)
        return GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), n_elems, n_bytes, start, data)


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
