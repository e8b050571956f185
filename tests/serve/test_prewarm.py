"""rayllm/serve/prewarm.py (`make install`'s last step) on the shipped cluster.yaml and the real default model
(SmolLM2-135M-Instruct's GGUF): it leaves, in empty caches, exactly what the replica's start looks for, so that
start builds nothing: the tokenizer snapshot (equal to transformers' tokenizer on text) and the weight cache
entry that an engine of the shipped settings restores without writing another. A remote model is left to the
replicas and a missing one is reported, not raised."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from rayllm.engine.client.engine_client import make_engine_client
from rayllm.serve import prewarm
from rayllm.serve.builder import with_resolved_device
from rayllm.serve.chat_template import _snapshot_dir
from rayllm.serve.rust_tokenizer import RustTokenizer, load_snapshot

pytestmark = [pytest.mark.slow, pytest.mark.engine_only]

CLUSTER_YAML = str(Path(__file__).resolve().parents[2] / "cluster.yaml")
TEXT = "Grüße aus Köln! The capital of France is Paris. 東京タワー 🎉\n\n  def f(x): return x**2"


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Each file's inode and size: a hit only touches its entry's mtime (the newest are kept), a save writes a
    new file."""
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_size) for p in root.rglob("*") if p.is_file()}


def test_prewarm_fills_what_the_shipped_replica_reads(tmp_path, monkeypatch, gguf_path, hf_tokenizer):
    weights, tokenizers = tmp_path / "weights", tmp_path / "tokenizers"
    monkeypatch.setenv("RAYLLM_WEIGHT_CACHE", str(weights))
    monkeypatch.setenv("TOKENIZER_CACHE", str(tokenizers))
    # The image build's prewarm (the Dockerfile's `--tokenizer-only`) first: the snapshot, no weight cache entry.
    assert prewarm.main(["--tokenizer-only", "--strict", CLUSTER_YAML]) == 0
    snapshot = load_snapshot(_snapshot_dir(gguf_path))  # the serving processes' tokenizer, without transformers
    assert isinstance(snapshot, RustTokenizer)
    assert snapshot.encode(TEXT, add_special_tokens=False) == hf_tokenizer.encode(TEXT, add_special_tokens=False)
    assert not weights.exists() or not any(weights.iterdir())

    # Then `make install`'s: the snapshot is there already; the weights and kernels are built.
    out = io.StringIO()
    assert prewarm.prewarm(CLUSTER_YAML, out) == 0
    lines = out.getvalue().splitlines()
    assert any("tokenizer" in line for line in lines) and any("weights and kernels" in line for line in lines)
    entries = sorted(p.name for p in weights.glob("*.safetensors"))
    assert len(entries) == 1
    before = _files(weights)
    (config,) = prewarm.server_configs(CLUSTER_YAML)
    engine = with_resolved_device(config).models[0].engine  # as build_app hands it to the model replica
    client = make_engine_client(engine, own_process=False)
    try:
        assert client.engine.model_path == gguf_path
    finally:
        client.shutdown()
    assert _files(weights) == before  # a hit: a miss would have saved a new entry (weight_cache.save)


def test_remote_models_are_left_to_the_replicas_and_a_missing_one_is_reported(tmp_path, monkeypatch):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "applications:\n"
        "  - name: remote\n    import_path: rayllm.serve.builder:build_app\n"
        "    args: {engine: {model: {model: 's3://bucket/llama/', served_model_name: remote}}}\n"
        "  - name: missing\n    import_path: rayllm.serve.builder:build_app\n"
        f"    args: {{engine: {{model: {{model: '{tmp_path / 'nowhere.gguf'}', served_model_name: gone}}}}}}\n"
        "  - name: quantized\n    import_path: rayllm.serve.builder:build_app\n"
        "    args: {engine: {model: {served_model_name: q, weights: quantized}, parallel: {device: cpu}}}\n"
        "  - name: other\n    import_path: some.other:app\n")
    out = io.StringIO()
    monkeypatch.setenv("RAYLLM_WEIGHT_CACHE", str(tmp_path / "weights"))
    assert prewarm.prewarm(str(config), out) == 1
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    assert "remote: skipped" in lines[0] and "s3://bucket/llama/" in lines[0]
    assert "not prewarmed" in lines[1] and "nowhere.gguf" in lines[1]
    # weights kept quantized use no weight cache: the tokenizer and the kernels only, no engine built
    assert lines[2].startswith("rayllm prewarm: q: tokenizer") and lines[3].startswith("rayllm prewarm: q: kernels")
    assert not (tmp_path / "weights").exists()
    assert prewarm.main([str(config)]) == 0 and prewarm.main([str(config), "--strict"]) == 1
