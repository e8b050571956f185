"""rayllm/loader/loader.py on checkpoints it must refuse or read selectively: which *.safetensors of a
directory are the checkpoint (the index's, never Mistral's consolidated copy), config.json / GGUF metadata
without a required field, multimodal configs, split GGUFs and a GGUF array too long to be a setting.

Every checkpoint here is tiny with RANDOM weights, built by transformers (from_config, save_pretrained);
the GGUFs are written with the gguf package's own writer."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch

from rayllm.loader.loader import read_arch, safetensors_files
from rayllm.models.registry import UnsupportedModelError

SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=128)


def _mistral(path, **save) -> str:
    """A tiny random Mistral saved by transformers, with Mistral's own consolidated.safetensors beside it (as
    Mistral's repos ship it): the same weights under Mistral's names (layers.N.attention.wq.weight, ...)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("mistral", **SIZES), dtype=torch.float32)
    model.save_pretrained(str(path), safe_serialization=True, **save)
    names = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output",
             "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
             "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
             "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
             "post_attention_layernorm": "ffn_norm"}
    consolidated = {}
    for name, t in model.state_dict().items():
        for hf, ours in names.items():
            name = name.replace(hf, ours)
        consolidated[name.removeprefix("model.")] = t.contiguous()
    save_file(consolidated, os.path.join(path, "consolidated.safetensors"))
    return str(path)


@pytest.mark.slow  # runs the engine on the checkpoint
@pytest.mark.parametrize("sharded", [True, False])
def test_mistral_repo_layout_loads_the_hugging_face_weights(tmp_path, sharded):
    """Shards named by model.safetensors.index.json, or model.safetensors alone: consolidated.safetensors
    is not read, and the logits are transformers' own for the same directory."""
    from transformers import AutoModelForCausalLM

    from rayllm.executor.executor import make_executor
    from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

    path = _mistral(tmp_path / "m", **({"max_shard_size": "100KB"} if sharded else {}))
    ids = [int(x) for x in torch.randint(0, SIZES["vocab_size"], (24,), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    config = EngineConfig(model=ModelConfig(model=path, dtype="float32"), cache=CacheConfig(kv_cache_bytes=16 << 20),
                          parallel=ParallelConfig(tensor_parallel_size=1, device="cpu"))
    executor = make_executor(config, path, read_arch(path))
    try:
        got = executor.score(ids)
    finally:
        executor.shutdown()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    index = os.path.join(path, "model.safetensors.index.json")
    assert os.path.isfile(index) == sharded
    if sharded:
        with open(index) as fh:
            assert safetensors_files(path) == sorted(set(json.load(fh)["weight_map"].values()))
        assert len(safetensors_files(path)) > 1
    else:
        assert safetensors_files(path) == ["model.safetensors"]


def test_an_index_naming_a_missing_shard_is_refused(tmp_path):
    path = _mistral(tmp_path / "m", max_shard_size="100KB")
    first = safetensors_files(path)[0]
    os.remove(os.path.join(path, first))
    with pytest.raises(FileNotFoundError, match=f"maps weights to files that are not in .*{first}"):
        safetensors_files(path)


def _hf_config(tmp_path, drop: str | None = None) -> str:
    from transformers import AutoConfig

    AutoConfig.for_model("llama", **SIZES).save_pretrained(str(tmp_path))
    where = tmp_path / "config.json"
    cfg = json.loads(where.read_text())
    if drop:
        cfg.pop(drop)
    where.write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "vocab_size"])
def test_a_config_without_a_required_field_names_it(tmp_path, field):
    arch = read_arch(_hf_config(tmp_path / "whole"))
    assert (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (64, 4, 2, 16)
    path = _hf_config(tmp_path / "cut", drop=field)
    with pytest.raises(ValueError, match=f"config.json: missing required field '{field}'"):
        read_arch(path)


def test_a_multimodal_gemma3_config_is_refused(tmp_path):
    """transformers' Gemma3ForConditionalGeneration config: model_type gemma3 (GGUF's name for the text
    model), its sizes under text_config."""
    from transformers import Gemma3Config

    Gemma3Config().save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma3"
    with pytest.raises(UnsupportedModelError, match=r"config.json: multimodal checkpoints \(gemma3, with text_config"):
        read_arch(str(tmp_path))


def _gguf(path, drop: str | None = None, split: int = 0, **arrays) -> str:
    """A tiny llama GGUF from the gguf package's writer: its metadata, three random F32 tensors."""
    w = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split)
    for key, add, value in [("embedding_length", w.add_embedding_length, 64),
                            ("feed_forward_length", w.add_feed_forward_length, 96),
                            ("block_count", w.add_block_count, 1), ("attention.head_count", w.add_head_count, 4)]:
        if key != drop:
            add(value)
    w.add_token_list([f"t{i}" for i in range(128)])
    for key, value in arrays.items():
        w.add_array(f"llama.{key}", value)
    rng = np.random.default_rng(0)
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        w.add_tensor(name, rng.standard_normal((4, 64)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("field", ["embedding_length", "feed_forward_length", "block_count", "attention.head_count"])
def test_a_gguf_without_a_required_field_names_it(tmp_path, field):
    arch = read_arch(_gguf(tmp_path / "whole.gguf"))
    assert (arch.hidden_size, arch.intermediate_size, arch.num_layers, arch.num_heads, arch.vocab_size) == \
           (64, 96, 1, 4, 128)
    path = _gguf(tmp_path / "cut.gguf", drop=field)
    with pytest.raises(ValueError, match=f"missing required field 'llama.{field}'") as err:
        read_arch(path)
    assert path in str(err.value)


def test_one_part_of_a_split_gguf_is_refused(tmp_path):
    """The gguf package's writer splits the file (one tensor a part) and writes split.count."""
    _gguf(tmp_path / "m.gguf", split=1)
    first = tmp_path / "m-00001-of-00003.gguf"
    assert sorted(os.listdir(tmp_path)) == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert gguf.GGUFReader(str(first)).fields["split.count"].contents() == 3
    with pytest.raises(ValueError, match=r"split GGUF \(3 parts\) is not supported; .*gguf-split --merge"):
        read_arch(str(first))


def test_an_architecture_array_too_long_for_a_setting_is_refused(tmp_path):
    """Arrays under `llama.` become the config (decoded): per-layer values are, 70000 bytes are not."""
    arch = read_arch(_gguf(tmp_path / "ok.gguf", per_layer=[1]))
    assert arch.cfg("per_layer") == [1]
    with pytest.raises(ValueError, match="metadata llama.blob holds 70000 values"):
        read_arch(_gguf(tmp_path / "bad.gguf", blob=bytes(70000)))
