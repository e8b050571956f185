"""A GGUF's weights as the CPU engine runs them, kept on local disk between starts.

A CPU start from a GGUF dequantizes every tensor to the model's dtype and then re-quantizes the layers whose
checkpoint was 4- or 8-bit into their small-batch copies (layers/linear.PackedWeight, the int4 x int8 VNNI
layout of platforms/cpu/qgemm.py): together most of the weights' load time (docs/benchmarks.md). The first
start writes both, the dense parameters and each layer's packed copy, to one safetensors file (no pickle:
tensors and a JSON header); later starts read it instead. oneDNN's reordered layout is rebuilt from the dense
weights as before (it depends on the CPU's oneDNN build and is quick).

An entry is used only when everything it was made from is unchanged: the GGUF file (path, size, mtime), the
model's architecture, the dtype and `parallel.cpu` settings that shape the packing, the tensor-parallel shard,
the versions of torch, numpy and gguf (gguf's dequantizers, numpy's arithmetic in them, torch's conversions and
packing make the values), the CPU (its flags, aarch64's Features, VNNI) and the source of the loader, layers, quantization, models
and CPU kernels; anything else is a different key, so a stale entry is never read. Each tensor carries a CRC-32 that is
checked before any weight is replaced, and a parameter that is missing or mis-shaped rejects the whole entry,
so a damaged file costs a normal load, never wrong weights. Writes go to a temporary file renamed into place.

Where: `RAYLLM_WEIGHT_CACHE` (a directory; `off` turns the cache off), else `$XDG_CACHE_HOME/rayllm-weights`
(~/.cache). One entry per GGUF path and shard (`RAYLLM_WEIGHT_CACHE_ENTRIES` keeps more: a node that starts
one model in several configurations) and the newest `KEEP` times that in all are kept (~2.6 bytes per
parameter: ~350 MB for SmolLM2-135M).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from torch import nn

from rayllm.layers.linear import PackedWeight, TPGroup
from rayllm.layers.linear_method import DENSE, LinearBase, SmallBatchMethod
from rayllm.loader.model_sources import is_gguf
from rayllm.platforms.cpu import kernels as cpu_kernels
from rayllm.platforms.cpu import qgemm as cpu_qgemm
from rayllm.platforms.interface import Platform
from rayllm.schema.config import EngineConfig, LlamaArch

log = logging.getLogger(__name__)

FORMAT = 1
KEEP = 4
# The packages whose code decides the cached values (any change there is a new key).
SOURCES = ("loader", "layers", "quant", "models", "platforms/cpu")
# The attributes the cache writes and restores; an object with others was changed since: it is not cached.
PACKED_FIELDS = {"max_tokens", "bits", "vnni", "packed", "scales"}
VNNI_FIELDS = {"_gemm", "passes", "zero_offset", "n", "k", "packed"}
PLANES_FIELDS = {"k", "inner"}  # cpu_qgemm.Int8VnniWeight: a Q8_0 weight as two 4-bit planes of one VNNI weight


def cache_dir() -> Path | None:
    where = os.environ.get("RAYLLM_WEIGHT_CACHE")
    if where is not None:
        return None if where.strip().lower() in ("off", "0", "") else Path(where)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rayllm-weights"


def entries_per_model() -> int:
    """Entries kept per GGUF path and shard: `RAYLLM_WEIGHT_CACHE_ENTRIES`, default 1 (a start in a new
    configuration replaces the old one's entry)."""
    raw = os.environ.get("RAYLLM_WEIGHT_CACHE_ENTRIES", "1")
    try:
        return max(1, int(raw))
    except ValueError:
        log.warning("RAYLLM_WEIGHT_CACHE_ENTRIES=%r is not a number: 1 entry per model", raw)
        return 1


def source_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for sub in SOURCES:
        for path in sorted((root / sub).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".c", ".h"):
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def cache_key(config: EngineConfig, model_path: str, arch: LlamaArch, dtype: torch.dtype, tp: TPGroup,
              platform: Platform) -> str:
    st = os.stat(model_path)
    cpu = config.parallel.cpu
    parts = (FORMAT, os.path.realpath(model_path), st.st_size, st.st_mtime_ns, repr(arch), str(dtype),
             cpu.small_batch_quant, cpu.int8_passes, cpu.int8_one_pass_layers, config.scheduler.batch_invariant,
             platform.small_batch_weights(dtype), tp.rank, tp.size, torch.__version__, np.__version__,
             importlib.metadata.version("gguf"), cpu_kernels._cpu_tag(), cpu_qgemm.available(), source_digest())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class WeightCache:
    """One model shard's entry: `restore` fills the model from it (False: load as usual), `save` writes it."""

    def __init__(self, directory: Path, model_path: str, key: str, shard: str = "0/1"):
        self.directory = directory
        # Per file and tensor-parallel shard: a new entry replaces that shard's older one.
        self.prefix = hashlib.sha256(f"{os.path.realpath(model_path)}:{shard}".encode()).hexdigest()[:16]
        self.key = key
        self.path = directory / f"{self.prefix}-{key[:24]}.safetensors"
        self.hit = False

    def restore(self, model: nn.Module) -> bool:
        """Fill every parameter and small-batch copy from the entry, or change nothing and return False."""
        if not self.path.is_file():
            return False
        t0 = time.perf_counter()
        try:
            params, packs = self._read(model)
        except Exception as exc:  # damaged, truncated, another layout: the normal load follows
            log.warning("weight cache %s not used: %s", self.path, exc)
            return False
        for name, p in _parameters(model).items():
            p.data.copy_(params[name])
        modules = dict(model.named_modules())
        for name, small in packs.items():
            module = modules[name]
            module.set_method(SmallBatchMethod(small, module.large_batch_method))
        try:
            os.utime(self.path)  # the newest entries are the ones kept
        except OSError:
            pass
        self.hit = True
        log.info("weights from the cache %s in %.2f s", self.path, time.perf_counter() - t0)
        return True

    def _read(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, PackedWeight]]:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as fh:
            meta = json.loads(fh.metadata()["rayllm"])
            if meta["key"] != self.key:
                raise ValueError("written for other inputs")
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        if set(tensors) != set(meta["crc"]):
            raise ValueError("tensor list differs from its checksums")
        for name, t in tensors.items():
            if _crc(t) != meta["crc"][name]:
                raise ValueError(f"checksum mismatch in {name}")
        params = {name[len("param."):]: t for name, t in tensors.items() if name.startswith("param.")}
        expected = _parameters(model)
        if set(params) != set(expected):
            raise ValueError("parameters differ from the model's")
        for name, p in expected.items():
            if params[name].shape != p.shape or params[name].dtype != p.dtype:
                raise ValueError(f"{name}: {tuple(params[name].shape)} {params[name].dtype} vs the model's")
        modules = dict(model.named_modules())
        packs = {}
        for name, fields in meta["packs"].items():
            module = modules.get(name)
            if not isinstance(module, LinearBase) or module.method is not DENSE:
                raise ValueError(f"{name} is not a dense linear layer")
            packs[name] = _packed_weight(fields, {k[len(f"pack.{name}."):]: t for k, t in tensors.items()
                                                  if k.startswith(f"pack.{name}.")})
        return params, packs

    def save(self, model: nn.Module) -> None:
        """Write the loaded model's entry (after choose_weight_methods); a model with weight methods the cache
        does not know is left uncached. Errors are logged, never raised: the engine is already loaded."""
        t0 = time.perf_counter()
        try:
            tensors, packs = _snapshot(model)
        except ValueError as exc:
            log.info("weights not cached: %s", exc)
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            from safetensors.torch import save_file

            meta = {"key": self.key, "packs": packs, "crc": {name: _crc(t) for name, t in tensors.items()}}
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".safetensors")
            os.close(fd)
            try:
                save_file(tensors, tmp, metadata={"rayllm": json.dumps(meta)})
                os.replace(tmp, self.path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self._evict()
        except Exception as exc:  # a full or read-only disk: the next start loads as usual
            log.warning("weight cache %s not written: %s", self.path, exc)
            return
        log.info("weights cached in %s in %.2f s", self.path, time.perf_counter() - t0)

    def _evict(self) -> None:
        """Keep this entry, the newest `entries_per_model()` of its model and shard, `KEEP` times that in all."""
        per_model = entries_per_model()
        entries = sorted(self.directory.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
        entries.sort(key=lambda p: p != self.path)  # stable: this one first, then newest first
        kept = mine = 0
        for path in entries:
            same = path.name.startswith(self.prefix + "-")
            if kept < KEEP * per_model and (not same or mine < per_model):
                kept, mine = kept + 1, mine + same
            else:
                path.unlink(missing_ok=True)


def applies(config: EngineConfig, model_path: str) -> bool:
    """Whether a CPU start of this model reads and writes the cache: a dense load from a GGUF file, the cache on."""
    return (cache_dir() is not None and is_gguf(model_path) and config.model.weights != "quantized"
            and config.model.quantization is None)


def for_worker(config: EngineConfig, model_path: str, arch: LlamaArch, dtype: torch.dtype, tp: TPGroup,
               platform: Platform) -> WeightCache | None:
    """The entry of a dense CPU load from a GGUF file; None where the cache is off or does not apply."""
    directory = cache_dir()
    if directory is None or platform.device.type != "cpu" or not applies(config, model_path):
        return None
    try:
        return WeightCache(directory, model_path, cache_key(config, model_path, arch, dtype, tp, platform),
                           f"{tp.rank}/{tp.size}")
    except OSError as exc:
        log.warning("weight cache off for this start: %s", exc)
        return None


def _parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters())  # a tied weight once


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0


def _snapshot(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    tensors = {f"param.{name}": p.detach() for name, p in _parameters(model).items()}
    packs: dict[str, dict] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or not isinstance(module.method, SmallBatchMethod):
            continue
        small = module.method.small
        if type(small) is not PackedWeight or not set(vars(small)) <= PACKED_FIELDS:
            raise ValueError(f"{name}: a small-batch method the cache does not know")
        fields: dict = {"max_tokens": small.max_tokens, "bits": small.bits, "vnni": None}
        if small.vnni is not None:
            vnni, planes = small.vnni, False
            if type(vnni) is cpu_qgemm.Int8VnniWeight and set(vars(vnni)) == PLANES_FIELDS:
                vnni, planes = vnni.inner, True
            if type(vnni) is not cpu_qgemm.Int4VnniWeight or set(vars(vnni)) != VNNI_FIELDS:
                raise ValueError(f"{name}: a VNNI weight the cache does not know")
            fields["vnni"] = {"passes": vnni.passes, "zero_offset": vnni.zero_offset, "n": vnni.n, "k": vnni.k,
                              "planes": planes}
            tensors[f"pack.{name}.vnni"] = vnni.packed
        else:
            tensors[f"pack.{name}.packed"] = small.packed
            tensors[f"pack.{name}.scales"] = small.scales
        packs[name] = fields
    return {k: v.contiguous() for k, v in tensors.items()}, packs


def _owned(t: torch.Tensor) -> torch.Tensor:
    """The tensor in torch's own (64-byte aligned) memory. safetensors places tensors 8-byte aligned in the file,
    and torch's int8 weight kernel read the LM head's copy at such an address out of bounds (SIGSEGV in the
    engine process at steps of 4 rows)."""
    return t.clone()


def _packed_weight(fields: dict, tensors: dict[str, torch.Tensor]) -> PackedWeight:
    """A PackedWeight as its constructor left it, from the entry's fields and tensors (no re-quantization)."""
    tensors = {name: _owned(t) for name, t in tensors.items()}
    small = PackedWeight.__new__(PackedWeight)
    small.max_tokens, small.bits, small.vnni = int(fields["max_tokens"]), int(fields["bits"]), None
    if fields["vnni"] is None:
        small.packed, small.scales = tensors["packed"], tensors["scales"]
        return small
    lib = cpu_qgemm._lib()
    if lib is None:
        raise ValueError("the entry has VNNI weights and this process has no VNNI kernel")
    vnni = cpu_qgemm.Int4VnniWeight.__new__(cpu_qgemm.Int4VnniWeight)
    v = fields["vnni"]
    vnni._gemm, vnni.passes, vnni.zero_offset, vnni.n, vnni.k = lib.gemm, int(v["passes"]), int(v["zero_offset"]), int(v["n"]), int(v["k"])
    vnni.packed = tensors["vnni"]
    small.vnni = vnni
    if v.get("planes"):
        planes = cpu_qgemm.Int8VnniWeight.__new__(cpu_qgemm.Int8VnniWeight)
        planes.k, planes.inner = vnni.k // 2, vnni
        small.vnni = planes
    return small
