"""The models and the Serve config that tests/gpu/serve_device.sh serves on the GPU machine.

    python tests/gpu/serve_device_models.py tokenizer DEST        # here: the default model's tokenizer as HF files
    python tests/gpu/serve_device_models.py build DEST TOKENIZER  # there: models, adapter, DEST/serve.yaml
    python tests/gpu/serve_device_models.py build DEST TOKENIZER --cpu  # a rehearsal of the device run here

Every model has RANDOM weights (transformers' own initialisation, seeded): they check that the server computes
what transformers computes and how fast it serves an 8B shape, not what the answers say. `build` writes:
  DEST/tiny        a tiny Llama (fp32, GQA), for reference checks against transformers and PEFT on CUDA
  DEST/adapters/gpu-lora   a PEFT LoRA adapter of the tiny model (random A and B, so it changes the logits)
  DEST/big         Llama-3.1-8B's shape in bf16, with the carried tokenizer's vocabulary (49,152 tokens)
  DEST/serve.yaml  deploy/cluster-gpu.yaml with three models on the one GPU: the 8B one (0.8 of the GPU's
                   memory, half the GPU in Ray's accounting), the tiny one and `tiny-faults` (the tiny model
                   again, with a 512-token KV cache and a forced CUDA out-of-memory in its first step:
                   `debug.fail_step_with_oom_after: 0`), each with a fixed small cache and a quarter GPU.
--cpu (a rehearsal on a machine without a GPU: the script, the config and the tests' plumbing): the "8B" model
is tiny too, and every engine runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY, BIG, ADAPTER, FAULTS = "tiny-llama", "llama-8b-shape", "gpu-lora", "tiny-faults"
FAULTS_BLOCKS = 8  # x block size 64: a 512-token cache under a 2,048-token context
# Llama-3.1-8B's config.json (benchmarks/engine_bench_shape.py's SHAPES) but its vocabulary: the tokenizer's.
BIG_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                 rope_theta=500000.0, tie_word_embeddings=False,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})
TINY_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1)


def export_tokenizer(dest: str) -> None:
    """The default model's tokenizer (from its GGUF, by transformers) as tokenizer.json + config + template."""
    from transformers import AutoTokenizer

    from rayllm.loader.model_files import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.save_pretrained(dest)
    config = Path(dest) / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name older transformers (the GPU image's) know too
    config.write_text(json.dumps(data, indent=2))
    print(f"{dest}: {sum(f.stat().st_size for f in Path(dest).iterdir()) / 1e6:.1f} MB, {len(tok)} tokens")


def save_llama(dest: Path, shape: dict, tok, dtype, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on the device: no fp32 copy of 8B weights on the host
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    return model


def save_adapter(model, dest: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    get_peft_model(model, config).save_pretrained(dest)


def serve_config(models: Path, cpu: bool = False) -> dict:
    """deploy/cluster-gpu.yaml, served as it ships but for the models: the 8B shape first (the default model),
    then the tiny one with LoRA adapters allowed from DEST/adapters, then the faults one; all on the one GPU."""
    import yaml

    doc = yaml.safe_load((ROOT / "deploy" / "cluster-gpu.yaml").read_text())
    (app,) = doc["applications"]
    args = app["args"]
    engine = args.pop("engine")
    big = json.loads(json.dumps(engine))
    big["model"] |= {"model": str(models / "big"), "served_model_name": BIG}
    big["cache"]["gpu_memory_utilization"] = 0.8  # the tiny replica and the test process share the GPU
    tiny = json.loads(json.dumps(engine))
    tiny["model"] |= {"model": str(models / "tiny"), "served_model_name": TINY, "dtype": "float32",
                      "max_model_len": 2048}
    tiny["cache"] = {"block_size": 64, "num_blocks_override": 512}  # a fixed cache: no sizing race with the 8B one
    tiny["scheduler"] |= {"max_num_seqs": 16, "max_num_batched_tokens": 1024}
    tiny["lora"]["allowed_roots"] = [str(models / "adapters")]
    faults = json.loads(json.dumps(tiny))
    faults["model"]["served_model_name"] = FAULTS
    faults["cache"]["num_blocks_override"] = FAULTS_BLOCKS
    faults["lora"] = {"max_loras": 0}
    faults["debug"] = {"fail_step_with_oom_after": 0}
    engines = [big, tiny, faults]
    if cpu:
        for engine in engines:
            engine["parallel"] |= {"device": "cpu", "cuda_graphs": False}
            engine["model"]["dtype"] = "float32"
        big["cache"] = {"block_size": 64, "num_blocks_override": 256}
    args["models"] = [{"engine": e} for e in engines]
    gpus = (lambda share: {}) if cpu else (lambda share: {"num_gpus": share})
    for deployment in app["deployments"]:
        if deployment["name"] == "llm":
            deployment["ray_actor_options"] = {"num_cpus": 1 if cpu else 2} | gpus(0.5)
            deployment["autoscaling_config"] |= {"min_replicas": 1, "max_replicas": 1}
    for name in (TINY, FAULTS):
        app["deployments"].append({"name": f"llm-{name}", "num_replicas": 1,
                                   "ray_actor_options": {"num_cpus": 0 if cpu else 1} | gpus(0.25)})
    return doc


def build(dest: str, tokenizer: str, cpu: bool = False) -> None:
    import time

    import torch
    import yaml
    from transformers import AutoTokenizer

    out = Path(dest)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    t0 = time.time()
    tiny = save_llama(out / "tiny", TINY_SHAPE, tok, torch.float32, "cpu")
    save_adapter(tiny, out / "adapters" / ADAPTER)
    print(f"tiny model and adapter: {time.time() - t0:.1f} s", flush=True)
    t0 = time.time()
    if cpu:
        save_llama(out / "big", TINY_SHAPE | {"max_position_embeddings": 16384}, tok, torch.float32, "cpu")
    else:
        big = save_llama(out / "big", BIG_SHAPE, tok, torch.bfloat16, "cuda")
        del big
        torch.cuda.empty_cache()
    print(f"8B-shaped model: {time.time() - t0:.1f} s", flush=True)
    (out / "serve.yaml").write_text(yaml.safe_dump(serve_config(out, cpu), sort_keys=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("tokenizer").add_argument("dest")
    b = sub.add_parser("build")
    b.add_argument("dest")
    b.add_argument("tokenizer")
    b.add_argument("--cpu", action="store_true", help="a rehearsal without a GPU: tiny models, CPU engines")
    c = sub.add_parser("config", help="only DEST/serve.yaml (a dry run of the config, for tests)")
    c.add_argument("dest")
    args = ap.parse_args(argv)
    if args.what == "tokenizer":
        export_tokenizer(args.dest)
    elif args.what == "build":
        build(args.dest, args.tokenizer, args.cpu)
    else:
        import yaml

        print(yaml.safe_dump(serve_config(Path(args.dest)), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
