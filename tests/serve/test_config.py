"""cluster.yaml is a valid Serve config whose args build our ServerConfig."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml

from rayllm.schema.config import CpuConfig, EngineConfig
from rayllm.serve.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_builds_server_config():
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    ServeDeploySchema.model_validate(doc) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema(**doc)
    (app,) = doc["applications"]
    assert app["import_path"] == "rayllm.serve.builder:build_app"
    cfg = ServerConfig.from_args(app["args"])
    assert cfg.served_model_name == "SmolLM2-135M-Instruct"
    assert cfg.engine.parallel.tensor_parallel_size == 1
    assert doc["http_options"] == {"host": "127.0.0.1", "port": 8000, "request_timeout_s": 600}


def test_builder_takes_exactly_one_argument_as_serve_requires():
    from rayllm.serve.builder import build_app

    assert len(inspect.signature(build_app).parameters) == 1


def test_bad_engine_config_is_rejected():
    with pytest.raises(ValueError):
        EngineConfig.from_dict({"cache": {"block_size": 12}})
    with pytest.raises(ValueError):
        EngineConfig.from_dict({"bogus": {}})
    with pytest.raises(TypeError):
        EngineConfig.from_dict({"model": {"not_a_field": 1}})
    with pytest.raises(ValueError, match="parallel.cpu.allreduce"):
        EngineConfig.from_dict({"parallel": {"cpu": {"allreduce": "mpi"}}})
    assert EngineConfig.from_dict({"parallel": {"cpu": {"allreduce": "shm"}}}).parallel.cpu.allreduce == "shm"
    with pytest.raises(ValueError, match="deepspeed was replaced by shm"):  # an older config says what changed
        EngineConfig.from_dict({"parallel": {"cpu": {"allreduce": "deepspeed"}}})


def test_legacy_cpu_keys_move_into_parallel_cpu_with_a_warning(caplog):
    """Configs written before parallel.cpu existed still load, each old key saying where it went."""
    legacy = {"model": {"dtype": "float32", "small_batch_quant": "weight_only", "cpu_weight_prepack": False},
              "parallel": {"device": "cpu", "cpu_threads_per_rank": 1, "cpu_threads_single_sequence": 2,
                           "cpu_wide_step_tokens": 256, "cpu_half_step_tokens": 48, "cpu_allreduce": "gloo"}}
    with caplog.at_level("WARNING", logger="rayllm.schema.config"):
        config = EngineConfig.from_dict(legacy)
    assert config.parallel.cpu == CpuConfig(small_batch_quant="weight_only", weight_prepack=False, threads_per_rank=1,
                                            threads_single_sequence=2, wide_step_tokens=256, half_step_tokens=48,
                                            allreduce="gloo")
    assert config.model.dtype == "float32" and config.parallel.device == "cpu"
    assert "engine.model.small_batch_quant is now engine.parallel.cpu.small_batch_quant" in caplog.text
    assert legacy["parallel"]["cpu_allreduce"] == "gloo"  # the caller's mapping is left as it was
    with pytest.raises(ValueError, match="parallel.cpu.small_batch_quant"):
        EngineConfig.from_dict({"model": {"small_batch_quant": "int2"}})


def test_tp_placement_bundles():
    from rayllm.serve.builder import placement_bundles

    cfg = ServerConfig.from_args({"engine": {"parallel": {"tensor_parallel_size": 2, "device": "cpu"}}})
    assert placement_bundles(cfg) == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert placement_bundles(ServerConfig()) is None


def test_serving_nice_is_bounded_and_only_for_cpu_engines():
    from rayllm.serve.builder import model_config
    from rayllm.serve.serving_priority import ServingPriority

    def serving_nice(config: ServerConfig) -> int:
        return ServingPriority.of(config).nice

    with pytest.raises(ValueError):
        ServerConfig(serving_nice=20)
    with pytest.raises(ValueError):
        ServerConfig(serving_nice=-1)
    with pytest.raises(ValueError, match="serving_nice"):
        ServerConfig(serving_nice="high")
    with pytest.raises(ValueError, match="serving_nice"):
        ServerConfig(serving_nice=True)
    assert serving_nice(ServerConfig.from_args({"serving_nice": 7, "engine": {"parallel": {"device": "cpu"}}})) == 7
    # A GPU engine does not compete with the serving processes for cores (this checks the config only).
    assert serving_nice(ServerConfig.from_args({"serving_nice": 7, "engine": {"parallel": {"device": "cuda"}}})) == 0
    # auto (the default): the serving processes step back for a CPU engine, unless a model schedules by
    # priority, where the urgent request's own handling must not wait for the engine's threads.
    cpu = {"parallel": {"device": "cpu"}}
    assert serving_nice(ServerConfig.from_args({"engine": cpu})) == 10
    assert serving_nice(ServerConfig.from_args({"engine": cpu | {"scheduler": {"policy": "priority"}}})) == 0
    assert serving_nice(ServerConfig.from_args({"engine": cpu | {"scheduler": {"policy": "priority"}},
                                                "serving_nice": 3})) == 3
    fcfs, prio = {"model": {"served_model_name": "a"}} | cpu, {"model": {"served_model_name": "b"}} | cpu
    prio |= {"scheduler": {"policy": "priority"}}
    both = ServerConfig.from_args({"models": [{"engine": fcfs}, {"engine": prio}]})
    assert serving_nice(both) == 0  # the ingress and tokenizer serve the priority model too
    assert [serving_nice(model_config(both, m)) for m in both.models] == [10, 0]  # each model replica its own


# ---- several base models (issue 20) ------------------------------------------------------------------

def test_single_model_form_is_one_models_entry():
    cfg = ServerConfig.from_args({"engine": {"model": {"served_model_name": "solo", "dtype": "float32"}},
                                  "llm_deployment_options": {"max_queued_requests": 3}})
    (entry,) = cfg.models
    assert entry.name == "solo" == cfg.served_model_name and entry.engine is cfg.engine
    assert entry.aliases == () and entry.deployment == {}
    assert ServerConfig.from_args({}).models[0].name == "SmolLM2-135M-Instruct"  # the default


def test_models_list_form():
    cfg = ServerConfig.from_args({"models": [
        {"engine": {"model": {"dtype": "float32"}}, "aliases": ["smol"]},
        {"served_model_name": "tiny", "engine": {"model": {"model": "/m/tiny"}, "parallel": None},
         "deployment": {"num_replicas": 2}},
    ]})
    first, second = cfg.models
    assert (first.name, first.aliases, first.engine.model.dtype) == ("SmolLM2-135M-Instruct", ("smol",), "float32")
    assert (second.name, second.engine.model.model, second.deployment) == ("tiny", "/m/tiny", {"num_replicas": 2})
    assert cfg.engine == first.engine and cfg.served_model_name == first.name  # the first is the default


@pytest.mark.parametrize("models, match", [
    ([{"served_model_name": "a"}, {"served_model_name": "a"}], "'a' is used twice"),
    ([{"served_model_name": "a", "aliases": ["x"]}, {"served_model_name": "b", "aliases": ["x"]}], "'x' is used twice"),
    ([{"served_model_name": "a"}, {"served_model_name": "b", "aliases": ["a"]}], "'a' is used twice"),
    ([{"served_model_name": "a", "aliases": ["a"]}], "'a' is used twice"),
    ([{"served_model_name": "a", "aliases": ["a:b"]}], "contain no ':'"),
    ([{"served_model_name": "a", "aliases": "x"}], "aliases must be a list"),
    ([{"served_model_name": "a", "replicas": 2}], r"unknown keys in a models entry: \['replicas'\]"),
    ([], "non-empty list"),
])
def test_models_list_refusals(models, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig.from_args({"models": models})


def test_engine_and_models_together_refused():
    with pytest.raises(ValueError, match="either `engine`"):
        ServerConfig.from_args({"engine": {}, "models": [{"served_model_name": "a"}]})
