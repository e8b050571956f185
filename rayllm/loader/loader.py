"""Weights from GGUF or a Hugging Face directory, fed to each parameter's own `weight_loader`.

Both formats are turned into one stream of (Hugging Face name, full tensor); the loader then checks
that every parameter was loaded exactly once and that nothing unexpected was in the checkpoint.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from rayllm.loader import model_sources
from rayllm.loader.fp8 import iter_fp8_dequantized
from rayllm.loader.gguf_file import GGUFFile, dequantize
from rayllm.models.registry import UnsupportedModelError, check_supported
from rayllm.quant.gguf_blocks import RawBlocks, unpermute_rotary
from rayllm.schema.config import LlamaArch

GGUF_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> GGUFFile:
    """A GGUF's header and tensor index, parsed once per file; one part of a split GGUF is refused (its
    tensors are spread over the other parts, which are not read)."""
    reader = GGUFFile(path)
    parts = reader.get("split.count", 1)
    if isinstance(parts, int) and parts > 1:
        raise ValueError(f"{path}: split GGUF ({parts} parts) is not supported; merge the parts into one file "
                         "with llama.cpp's `llama-gguf-split --merge <first part> <output.gguf>`")
    return reader


def _gguf_field(reader: GGUFFile, key: str, default=None):
    return reader.get(key, default)


def read_arch(model_path: str) -> LlamaArch:
    if model_sources.is_gguf(model_path):
        reader = open_gguf(model_path)
        arch = check_supported(_gguf_field(reader, "general.architecture"), f"GGUF {model_path}")

        def f(key, default=None):
            return _gguf_field(reader, f"{arch}.{key}", default)

        where = f"GGUF {model_path}"

        def need(key: str, default: object = None) -> int:
            return _positive_int(f(key, default), f"{arch}.{key}", where)

        hidden = need("embedding_length")
        heads = need("attention.head_count")
        names = {t.name for t in reader.tensors}
        vocab = f("vocab_size") or reader.array_len("tokenizer.ggml.tokens")
        return LlamaArch(
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_layers=need("block_count"),
            num_heads=heads,
            num_kv_heads=need("attention.head_count_kv", heads),
            # llama.cpp: key_length when the converter wrote one, else hidden / heads; rope dimensions
            # may be fewer than the head's (partial rotary, Phi-4-mini), so they say nothing then.
            head_dim=int(f("attention.key_length") or (hidden // heads if arch == "phi3"
                                                       else f("rope.dimension_count", hidden // heads))),
            vocab_size=_positive_int(vocab, f"{arch}.vocab_size (or tokenizer.ggml.tokens)", where),
            rms_norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(f("rope.freq_base", 10000.0)),
            max_position_embeddings=int(f("context_length", 4096)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_gguf_field(reader, "tokenizer.ggml.eos_token_id"),
            # llama.cpp writes Mixtral as `llama` with experts.
            model_type="mixtral" if arch == "llama" and f("expert_count") else arch,
            hf_config=_sorted_items(gguf_hf_config(reader, arch)),
        )
    where = os.path.join(model_path, "config.json")
    with open(where) as fh:
        cfg = json.load(fh)
    if cfg.get("text_config") or cfg.get("vision_config"):  # e.g. Gemma3ForConditionalGeneration (model_type gemma3)
        raise UnsupportedModelError(
            f"{where}: multimodal checkpoints ({cfg.get('architectures') or cfg.get('model_type')}, with "
            "text_config / vision_config) are not supported; serve the text-only model (or its GGUF)")
    model_type = check_supported(cfg.get("model_type"), where)
    quant = cfg.get("quantization_config")
    method = (quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown") if quant else None
    if method is not None and not is_fp8_checkpoint(quant):  # GPTQ/AWQ int4, bitsandbytes...: packed tensors would load as garbage
        raise ValueError(f"{os.path.join(model_path, 'config.json')}: quantized safetensors checkpoints "
                         f"(quantization_config.quant_method {method!r}) are not supported; use the unquantized "
                         "checkpoint, or a GGUF (model.weights: quantized keeps its Q4/Q5/Q6/Q8 weights quantized)")

    def need(key: str, default: object = None) -> int:
        value = cfg.get(key)
        return _positive_int(default if value is None else value, key, where)

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    eos = cfg.get("eos_token_id")
    # transformers 5 writes "rope_parameters" (theta inside); older configs: rope_theta + rope_scaling.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0
    rope.pop("rope_theta", None)
    if rope.get("rope_type", rope.get("type")) in (None, "default"):
        rope = {}
    return LlamaArch(
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=need("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or hidden // heads,
        vocab_size=need("vocab_size"),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", cfg.get("qkv_bias", model_type in ("qwen2", "qwen2_moe"))),
        rope_scaling=tuple(sorted(rope.items())),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        model_type=model_type,
        hf_config=_sorted_items(cfg),
    )


def _positive_int(value: object, field: str, where: str) -> int:
    """A config's size field, or an error that names the file and the field (not a KeyError in a replica)."""
    if value is None:
        raise ValueError(f"{where}: missing required field {field!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: field {field!r} must be a positive integer, not {value!r}")
    return value


def _sorted_items(cfg: dict) -> tuple[tuple[str, object], ...]:
    return tuple(sorted(cfg.items()))


# Per-layer settings at most: a longer array under `<arch>.` is not a setting (and would be decoded into the config).
MAX_CONFIG_ARRAY = 1 << 16


def gguf_hf_config(reader: GGUFFile, arch: str) -> dict:
    """The GGUF's `<arch>.*` metadata under its own key names (minus the prefix), for `LlamaArch.cfg`:
    families read what they need from it (e.g. `expert_count`, `attention.sliding_window`)."""
    prefix = f"{arch}."
    names = [name for name in reader.fields if name.startswith(prefix)]
    for name in names:
        if (n := reader.array_len(name) or 0) > MAX_CONFIG_ARRAY:
            raise ValueError(f"{reader.path}: metadata {name} holds {n} values, more than {MAX_CONFIG_ARRAY}: "
                             "not an architecture setting")
    cfg = {name[len(prefix):]: _gguf_field(reader, name) for name in names}
    # LongRoPE's per-frequency factors are tensors in GGUF (rope_factors_long/short.weight), though
    # they shape the rotary tables built before any weight is loaded: read them with the metadata.
    for t in reader.tensors:
        if t.name.startswith("rope_factors_"):
            cfg[t.name.removesuffix(".weight")] = [float(x) for x in np.asarray(t.data, dtype=np.float32).ravel()]
    return cfg


# Families whose q/k rows llama.cpp's converter permutes for its interleaved rotary (LlamaModel and
# its subclasses); Qwen-family GGUFs keep Hugging Face's layout (llama.cpp runs them with NEOX rope).
GGUF_PERMUTED_QK = {"llama", "mistral", "mixtral"}


def _gguf_bits(tensor_type) -> int:
    """Bits per weight of a GGUF tensor type's quantised values (16 for unquantised)."""
    name = tensor_type.name
    if name.startswith(("Q4", "IQ4", "Q3", "Q2", "IQ3", "IQ2", "IQ1")):
        return 4
    if name.startswith(("Q5", "Q6", "Q8")):
        return 8
    return 16


def iter_gguf(path: str, arch: LlamaArch, bits: dict[str, int] | None = None,
              extra_names: dict[str, str] | None = None,
              raw_types: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor | RawBlocks]]:
    """extra_names: a family's own GGUF -> Hugging Face name fragments, on top of GGUF_TO_HF.
    raw_types: GGUF type names (e.g. "Q4_K") of 2-D tensors yielded as RawBlocks, not dequantized."""
    names = GGUF_TO_HF | (extra_names or {})
    reader = open_gguf(path)
    for t in reader.tensors:
        base, _, suffix = t.name.rpartition(".")  # suffix: weight | bias
        parts = base.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{names.get(parts[2], parts[2])}.{suffix}"
        else:
            name = f"{names.get(base, base)}.{suffix}"
        if bits is not None:
            bits[name] = _gguf_bits(t.tensor_type)
        if t.tensor_type.name in raw_types and len(t.shape) == 2:
            heads = {"attn_q": arch.num_heads, "attn_k": arch.num_kv_heads}.get(parts[2]) if parts[0] == "blk" else None
            rows, cols = int(t.shape[1]), int(t.shape[0])
            yield name, RawBlocks(np.asarray(t.data).reshape(rows, -1), t.tensor_type, (rows, cols), heads)
            continue
        w = dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        if parts[0] == "blk" and parts[2] in ("attn_q", "attn_k") and arch.model_type in GGUF_PERMUTED_QK:
            w = unpermute_rotary(w, arch.num_heads if parts[2] == "attn_q" else arch.num_kv_heads)
        yield name, torch.from_numpy(w if w.flags.writeable else w.copy())  # F32 tensors are read-only memmaps


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's shards: those model.safetensors.index.json maps weights to, where it exists (as
    transformers and vLLM read them); else every *.safetensors but Mistral's consolidated*.safetensors
    (the same weights under Mistral's own names, shipped beside the Hugging Face ones) when others exist."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if absent:
            raise FileNotFoundError(f"{index} maps weights to files that are not in {model_dir}: {absent[:10]}")
        return files
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return [f for f in files if not f.startswith("consolidated")] or files


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = safetensors_files(model_dir)
    if is_fp8_checkpoint(_quant_config(model_dir)):  # FP8 weights with scales: dequantized on CPU (rayllm.loader.fp8)
        yield from iter_fp8_dequantized(model_dir, files)
        return
    for fname in files:
        with safe_open(os.path.join(model_dir, fname), framework="pt") as fh:  # memory-mapped
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def _quant_config(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        quant = json.load(fh).get("quantization_config")
    return quant if isinstance(quant, dict) else None


def is_fp8_checkpoint(quant: dict | None) -> bool:
    """quant_method fp8, compressed-tensors FP8 (llm-compressor) or ModelOpt FP8 (rayllm.quant.fp8)."""
    from rayllm.quant.fp8 import read_fp8_scheme

    return isinstance(quant, dict) and read_fp8_scheme(quant) is not None


def count_tensors(model_path: str) -> int:
    if model_sources.is_gguf(model_path):
        return len(open_gguf(model_path).tensors)
    return 0


def load_weights(model: nn.Module, model_path: str, *, show_progress: bool = True) -> dict[str, int]:
    """Load every parameter from the checkpoint; fail loudly on missing, unexpected or mis-shaped tensors.

    Returns, per parameter, the fewest bits any of its checkpoint tensors was quantised to (GGUF only).
    """
    arch: LlamaArch = model.arch  # type: ignore[assignment]
    params = dict(model.named_parameters())
    loaded: dict[str, int] = {}
    unexpected: list[str] = []
    ckpt_bits: dict[str, int] = {}
    is_gguf = model_sources.is_gguf(model_path)
    extra_names = getattr(model, "gguf_tensor_names", None)
    stream = (iter_gguf(model_path, arch, ckpt_bits, extra_names) if is_gguf
              else iter_safetensors(model_path))
    # A family whose GGUF tensors differ in value from its checkpoint's (Gemma's norms are stored +1).
    adjust = getattr(model, "from_gguf", None) if is_gguf else None
    source_bits: dict[str, int] = {}
    total = count_tensors(model_path) or None
    for name, tensor in tqdm(stream, total=total, desc="loading weights", unit="tensor", disable=not show_progress):
        target = model.checkpoint_to_param(name)  # type: ignore[operator]
        if target is None:
            continue
        param_name, shard = target
        if adjust is not None:
            tensor = adjust(name, tensor)
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        try:
            filled = param.weight_loader(param, tensor.to(param.dtype), shard)  # type: ignore[attr-defined]
        except (ValueError, RuntimeError) as exc:  # shape checks, or a slice past a too-small tensor
            raise ValueError(f"{name} {tuple(tensor.shape)} does not fit {param_name}: {exc}") from None
        # A loader may say it filled several shards at once (a GGUF's experts stacked in one tensor).
        loaded[param_name] = loaded.get(param_name, 0) + (filled if isinstance(filled, int) else 1)
        if name in ckpt_bits:
            source_bits[param_name] = min(source_bits.get(param_name, 99), ckpt_bits[name])
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint: {unexpected[:10]}")
    # A fused parameter (q/k/v, gate/up, stacked experts) says how many checkpoint tensors fill it.
    expected_counts = {n: getattr(p, "num_shards", 1) for n, p in params.items()}
    missing = [n for n, c in expected_counts.items() if loaded.get(n, 0) != c]
    if missing:
        raise ValueError(f"parameters missing from checkpoint (or loaded partially): {missing[:10]}")
    return source_bits
