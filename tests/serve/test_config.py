"""cluster.yaml is a valid Serve config whose args build our ServerConfig."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml

from rayllm.schema.config import CacheConfig, CpuConfig, EngineConfig
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


# ---- every value checked against its field's type when the config is read -----------------------------

def shipped_app_args() -> list[tuple[str, dict]]:
    """The `args` of every app config in the repository, read as Serve reads them (the RayServices' embedded
    serveConfigV2 too)."""
    out = []
    for path in [ROOT / "cluster.yaml", *sorted((ROOT / "deploy").glob("*.yaml"))]:
        doc = yaml.safe_load(path.read_text())
        if doc.get("kind") == "RayService":
            doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
        out += [(f"{path.name}:{app['name']}", app["args"]) for app in doc["applications"]]
    return out


def test_every_shipped_app_config_still_parses():
    shipped = dict(shipped_app_args())
    assert {"cluster.yaml:llm", "cluster-gpu.yaml:llm", "cluster-gpu-tp2.yaml:llm", "rayservice.yaml:llm",
            "rayservice-gpu.yaml:llm"} <= set(shipped)
    for name, args in shipped.items():
        cfg = ServerConfig.from_args(args)
        assert isinstance(cfg.api_keys, tuple) and isinstance(cfg.engine_process, bool), name
    cluster = ServerConfig.from_args(shipped["cluster.yaml:llm"])
    assert cluster.retry_after_s == 1 and cluster.stream_interval_s == 0.1 and cluster.serving_nice == "auto"
    assert cluster.engine.parallel.cpu.int8_one_pass_layers == ("o_proj", "down_proj")


def from_yaml(text: str) -> ServerConfig:
    return ServerConfig.from_args(yaml.safe_load(text))


def test_a_bare_string_is_no_list_of_keys(monkeypatch):
    """`api_keys: sk-prod-7f3a` once became the tuple of its characters: `Bearer s` was a valid key (and
    `Bearer a` an admin). Refused, without the key in the message (deploy errors end up in Serve's status)."""
    monkeypatch.delenv("API_KEYS", raising=False)
    monkeypatch.delenv("ADMIN_API_KEYS", raising=False)
    for field in ("api_keys", "admin_api_keys"):
        with pytest.raises(ValueError, match=rf"^{field} must be a list of strings, got a str \(not shown\)$"):
            from_yaml(f"{field}: sk-prod-7f3a")
    cfg = from_yaml("api_keys: [sk-prod-7f3a]\nadmin_api_keys:\n  - adm-1")
    assert (cfg.api_keys, cfg.admin_api_keys) == (("sk-prod-7f3a",), ("adm-1",))
    monkeypatch.setenv("API_KEYS", "env-1, env-2")
    assert from_yaml("api_keys: [k]").api_keys == ("k", "env-1", "env-2")
    assert from_yaml("api_keys:").api_keys == ("env-1", "env-2")  # null: none of its own
    with pytest.raises(ValueError, match="api_keys must be a list of strings"):
        from_yaml("api_keys: [1234]")


@pytest.mark.parametrize("text, message", [
    # strings where booleans belong were truthy: "false" opened the admin routes, "no" kept the engine process
    ('allow_runtime_lora_updating: "false"', "allow_runtime_lora_updating must be true or false, got 'false'"),
    ('metrics_require_key: "false"', "metrics_require_key must be true or false, got 'false'"),
    ('engine_process: "no"', "engine_process must be true or false, got 'no'"),
    ("allow_request_chat_template: 1", "allow_request_chat_template must be true or false, got 1"),
    # numbers: finite, of their kind, within their documented range
    ('retry_after_s: "x"', "retry_after_s must be a finite number > 0, got 'x'"),
    ("retry_after_s: .nan", "retry_after_s must be a finite number > 0, got nan"),
    ("retry_after_s: 0", "retry_after_s must be a finite number > 0, got 0"),
    ("stream_interval_s: -1", "stream_interval_s must be a finite number >= 0, got -1"),
    ("replica_num_cpus: 0", "replica_num_cpus must be a finite number > 0, got 0"),
    ("wake_timeout_s: .nan", "wake_timeout_s must be a finite number > 0, got nan"),
    ("storage_timeout_s: .inf", "storage_timeout_s must be a finite number > 0, got inf"),
    ("request_timeout_s: -.inf", "request_timeout_s must be a finite number > 0 or null, got -inf"),
    ("grammar_compile_timeout_s: 0", "grammar_compile_timeout_s must be a finite number > 0, got 0"),
    ("storage_pool_size: 0", "storage_pool_size must be an integer >= 1, got 0"),
    ("max_n: 1.5", "max_n must be an integer >= 0, got 1.5"),
    ("max_request_bytes: 8MiB", "max_request_bytes must be an integer >= 0, got '8MiB'"),
    ("max_requested_tokens: -1", "max_requested_tokens must be an integer >= 0, got -1"),
    ("max_prompt_tokens: true", "max_prompt_tokens must be an integer >= 0, got True"),
    ('serving_nice: "10"', "serving_nice must be an integer >= 0 and <= 19 or auto, got '10'"),
    ("serving_nice: 20", "serving_nice must be an integer >= 0 and <= 19 or auto, got 20"),
    ("reasoning_parser: deepseek", "reasoning_parser must be one of auto, think, none, got 'deepseek'"),
    ("tool_parser: true", "tool_parser must be one of auto, hermes, mistral, llama3_json, got True"),
    ("storage_url: 5", "storage_url must be a string, got 5"),
    ("llm_deployment_options: [max_queued_requests]", "llm_deployment_options must be a mapping, got"),
    # the engine sections it builds
    ('engine: {cache: {enable_prefix_caching: "false"}}', "engine.cache.enable_prefix_caching must be true or false"),
    ("engine: {cache: {kv_cache_bytes: .nan}}", "engine.cache.kv_cache_bytes must be an integer, got nan"),
    ("engine: {cache: {gpu_memory_utilization: .nan}}", r"cache.gpu_memory_utilization must be a finite number, got nan"),
    ("engine: {cache: 1}", "engine.cache must be a mapping, got 1"),
    ("engine: [model]", r"engine must be a mapping of sections \(model, cache"),
    ("engine: {model: {max_model_len: 8k}}", "engine.model.max_model_len must be an integer or null, got '8k'"),
    ("engine: {model: {served_model_name: 7}}", "engine.model.served_model_name must be a string, got 7"),
    ("engine: {model: {max_model_len: 8}}", "model.max_model_len must be >= 16 or null, got 8"),
    ("engine: {scheduler: {max_num_seqs: 4.0}}", "engine.scheduler.max_num_seqs must be an integer, got 4.0"),
    ('engine: {scheduler: {batch_invariant: "true"}}', "engine.scheduler.batch_invariant must be true or false"),
    ("engine: {parallel: {tensor_parallel_size: .nan}}", "engine.parallel.tensor_parallel_size must be an integer"),
    ("engine: {parallel: {cpu: {int8_one_pass_layers: o_proj}}}",
     "engine.parallel.cpu.int8_one_pass_layers must be a list of strings, got 'o_proj'"),
    ('engine: {parallel: {cpu: {weight_prepack: "no"}}}', "engine.parallel.cpu.weight_prepack must be true or false"),
    ('engine: {model: {cpu_weight_prepack: "no"}}', "engine.parallel.cpu.weight_prepack must be true or false"),
    ("engine: {parallel: {cpu: [1]}}", r"engine.parallel.cpu must be a mapping, got \[1\]"),
    ("engine: {lora: {allowed_roots: /adapters}}", "engine.lora.allowed_roots must be a list of strings, got '/adapters'"),
    ("engine: {lora: {max_loras: 1, adapters: [[a, /p]]}}", "engine.lora.adapters must be a mapping of strings to strings"),
    ("engine: {debug: {fail_step_with_oom_after: x}}", "engine.debug.fail_step_with_oom_after must be an integer or null"),
    # a models entry's own options, its errors naming the entry
    ("models: [{served_model_name: a}, {served_model_name: b, deployment: 2}]", r"models\[1\]: deployment must be a mapping"),
    ("models: [{served_model_name: a, engine: {cache: {enable_prefix_caching: 1}}}]",
     r"models\[0\]: engine.cache.enable_prefix_caching must be true or false, got 1"),
    ("models: [{served_model_name: [a]}]", r"models\[0\]: served_model_name must be a string, got \['a'\]"),
    ("models: [a]", r"models\[0\] must be a mapping"),
])
def test_values_are_checked_against_their_field_types(text, message):
    with pytest.raises(ValueError, match=message):
        from_yaml(text)


def test_values_of_the_right_kind_are_taken_as_written():
    cfg = from_yaml("""
retry_after_s: 2              # an integer where a number belongs
stream_interval_s: 0
request_timeout_s: null
serving_nice: 5
llm_deployment_options: {max_queued_requests: 4}
engine:
  cache:                      # nothing under it: the defaults
  parallel:
    cuda_graphs: off          # YAML 1.1: a boolean
    cpu:                      # every CPU setting commented out: the defaults
  lora:
    max_loras: 1
    adapters: {pirate: /adapters/pirate}
    allowed_roots: [/adapters]
""")
    assert (cfg.retry_after_s, cfg.stream_interval_s, cfg.request_timeout_s, cfg.serving_nice) == (2, 0, None, 5)
    assert cfg.engine.cache == CacheConfig() and cfg.engine.parallel.cpu == CpuConfig()
    assert cfg.engine.parallel.cuda_graphs is False
    assert cfg.engine.lora.adapters == (("pirate", "/adapters/pirate"),) and cfg.engine.lora.allowed_roots == ("/adapters",)
    assert cfg.llm_deployment_options == {"max_queued_requests": 4}
    entry = from_yaml("models: [{served_model_name: a, aliases: [x, y]}]").models[0]
    assert entry.aliases == ("x", "y") and entry.deployment == {}  # a YAML list is stored as a tuple


def test_models_whose_deployment_names_clash_are_refused():
    """Serve deployment names keep letters, digits, `_`, `.` and `-` (deployment_name rewrites the rest to `-`):
    two models that differ only elsewhere would get one deployment, and Serve silently renamed the second."""
    from rayllm.serve.builder import deployment_name

    with pytest.raises(ValueError, match=r"models 'org/m' and 'org-m' would share the Serve deployment name 'llm-org-m'"):
        from_yaml("models: [{served_model_name: base}, {served_model_name: org/m}, {served_model_name: org-m}]")
    with pytest.raises(ValueError, match="'llm-a-b'"):
        from_yaml("models: [{served_model_name: base}, {served_model_name: a b}, {served_model_name: a+b}]")
    # The first model's deployment is `llm` whatever its name: no clash with a later `org-m`.
    cfg = from_yaml("models: [{served_model_name: org/m}, {served_model_name: org-m}, {served_model_name: org.m}]")
    names = [deployment_name(index, entry) for index, entry in enumerate(cfg.models)]
    assert names == ["llm", "llm-org-m", "llm-org.m"]
