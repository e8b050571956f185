"""Server configuration read from cluster.yaml's application `args` (or passed to build_app)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from rayllm.attention.registry import BACKENDS
from rayllm.schema.config import EngineConfig, ModelConfig
from rayllm.schema.field_checks import SECRET, Bounds, check_fields, check_instance
from rayllm.serve.auth import parse_key
from rayllm.serve.prefix_affinity import RouterConfig
from rayllm.serve.tracing import TracingConfig


def default_storage_url() -> str:
    """SQLite under the user's state dir: survives restarts, shared by every ingress replica on the node."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return "sqlite:///" + os.path.join(state, "rayllm-tp", "conversations.db")


# A model's deployment options that cluster.yaml may set per model (the rest are the server's).
MODEL_ENTRY_KEYS = frozenset({"engine", "served_model_name", "aliases", "deployment"})

# The ranges of the server's numbers, in their fields' types (rayllm.schema.field_checks checks them).
Limit = Annotated[int, Bounds(ge=0)]  # 0 = no limit
Seconds = Annotated[float, Bounds(gt=0)]


@dataclass(frozen=True)
class ModelEntry:
    """One base model of the app: its engine, the other names `model` may use, and the Serve options of its
    own deployment (num_replicas, autoscaling_config, ray_actor_options, ...)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    aliases: tuple[str, ...] = ()
    deployment: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_instance(self)

    @property
    def name(self) -> str:
        return self.engine.model.served_model_name

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelEntry:
        unknown = set(d) - MODEL_ENTRY_KEYS
        if unknown:
            raise ValueError(f"unknown keys in a models entry: {sorted(unknown)} (known: {sorted(MODEL_ENTRY_KEYS)})")
        engine = check_backend(EngineConfig.from_dict(_or(d.get("engine"), {})))
        name = d.get("served_model_name")
        if name is not None:
            check_fields(ModelConfig, {"served_model_name": name})
            engine = replace(engine, model=replace(engine.model, served_model_name=name))
        return cls(engine, _or(d.get("aliases"), ()), _or(d.get("deployment"), {}))


def _or(value: Any, default: Any) -> Any:
    """A YAML key with nothing after it (null) is its default; any other value is checked as given."""
    return default if value is None else value


def deployment_name(index: int, entry: ModelEntry) -> str:
    """`llm` for the first (default) model, `llm-<name>` for the others (Serve's name rules)."""
    return "llm" if index == 0 else "llm-" + re.sub(r"[^A-Za-z0-9_.-]", "-", entry.name)


def check_model_names(models: tuple[ModelEntry, ...]) -> None:
    """Every name and alias addresses one model; `:` is kept for `model:adapter`. Each model has a Serve
    deployment of its own (Serve would rename the second of two alike, and requests would miss it)."""
    seen: dict[str, str] = {}
    deployments: dict[str, str] = {}
    for index, entry in enumerate(models):
        for name in (entry.name, *entry.aliases):
            if not name or ":" in name:
                raise ValueError(f"model name or alias {name!r} must be non-empty and contain no ':'")
            if name in seen:
                raise ValueError(f"model name or alias {name!r} is used twice (by {seen[name]!r} and {entry.name!r})")
            seen[name] = entry.name
        deployment = deployment_name(index, entry)
        if deployment in deployments:
            raise ValueError(f"models {deployments[deployment]!r} and {entry.name!r} would share the Serve deployment "
                             f"name {deployment!r} (characters other than letters, digits, _ . - become -): "
                             "rename one")
        deployments[deployment] = entry.name


@dataclass(frozen=True)
class ServerConfig:
    # The first (default) model's engine; with `models` empty, the app serves this one model.
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Bearer keys accepted on /v1 routes; empty = no auth (local use). Also read from API_KEYS (comma-separated).
    # Entries are plain keys or `sha256:<hex>` digests of them (so the config need not hold the secret).
    api_keys: Annotated[tuple[str, ...], SECRET] = ()
    # Conversations and stored completions: `sqlite:///<path>` (one node) or `postgresql://...` (several).
    # Also read from STORAGE_URL when cluster.yaml leaves it unset.
    storage_url: str = field(default_factory=default_storage_url)
    # Logical CPUs the model replica's own actor reserves (its TP ranks reserve one bundle each).
    replica_num_cpus: Annotated[float, Bounds(gt=0)] = 1.0
    # Minimum seconds between streamed messages of one request (0 = one message per engine step).
    stream_interval_s: Annotated[float, Bounds(ge=0)] = 0.0
    # Run a single-rank engine in its own process (the replica's asyncio loop and Ray's threads then never
    # share its GIL); False = a thread of the replica. Tensor-parallel engines drive their rank actors
    # from a thread either way.
    engine_process: bool = True
    # CPU engines: the nice value added to the serving processes (ingress, tokenizer, the model replica
    # when its engine runs in its own process), so that they yield a shared core to the engine. 0 = off.
    # auto: 10, or 0 when a model schedules by priority (an urgent request's HTTP handling and render must
    # not queue behind the engine: serving_priority.py).
    serving_nice: Annotated[int, Bounds(ge=0, le=19)] | Literal["auto"] = "auto"
    # How thoughts are split from answers: "auto" (the model's chat template writes <think>), "think", "none".
    reasoning_parser: Literal["auto", "think", "none"] = "auto"
    # How tool calls are parsed and constrained: "auto" (from the chat template), "hermes" (<tool_call>),
    # "mistral" ([TOOL_CALLS]), "llama3_json" (Llama 3.1-3.3's bare {"name": ..., "parameters": ...}).
    tool_parser: Literal["auto", "hermes", "mistral", "llama3_json"] = "auto"
    # ---- production limits (issue 8); 0 / None = no limit beyond the model's own ------------------------
    # Seconds from dispatch to the model (after tokenizing) to the last token; beyond it a 504, or an
    # error event and [DONE] once a stream has begun (the generation is aborted).
    request_timeout_s: Seconds | None = None
    max_prompt_tokens: Limit = 0  # prompt tokens per prompt (400 beyond)
    max_total_tokens: Limit = 0  # prompt + max_tokens per prompt (400 beyond; also caps the default max_tokens)
    max_n: Limit = 0  # n and best_of (400 beyond)
    max_request_bytes: Limit = 8 << 20  # HTTP body size (413 beyond, counted while reading)
    # Seconds a client is told to wait (Retry-After) when the model deployment's queue is full (503); the
    # header carries whole seconds, at least 1.
    retry_after_s: Seconds = 1.0
    # A request to a model scaled to zero (min_replicas: 0) waits this long for Serve to start a replica,
    # then answers 503 model_waking with Retry-After (docs/models-and-scaling.md).
    wake_timeout_s: Seconds = 60.0
    # ---- files, keys and tenants (issue 17) --------------------------------------------------------------
    # Keys that may also load and unload LoRA adapters (same forms as api_keys; also ADMIN_API_KEYS). With
    # none here, those routes answer 403. Admin keys are accepted API keys too.
    admin_api_keys: Annotated[tuple[str, ...], SECRET] = ()
    # With no API keys at all (local use), let any client load and unload adapters (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING); off, those routes answer 403 until admin_api_keys are set.
    allow_runtime_lora_updating: bool = False
    # /metrics needs an API key (it names adapters and shows load); default open, for Prometheus scrapers.
    metrics_require_key: bool = False
    # Seconds a storage call waits for a locked SQLite database / a PostgreSQL connection or statement
    # before the request answers 503 storage_unavailable.
    storage_timeout_s: Seconds = 5.0
    # PostgreSQL connections per ingress replica (a pool; SQLite opens one per call).
    storage_pool_size: Annotated[int, Bounds(ge=1)] = 4
    # Extra Ray Serve options for every model deployment (max_ongoing_requests, max_queued_requests,
    # autoscaling_config, graceful_shutdown_timeout_s, ...), for apps built in code; in a Serve config
    # file the `deployments` section is the place for them (it overrides these).
    llm_deployment_options: dict[str, Any] = field(default_factory=dict)
    # ---- abuse bounds (issue 17) ---------------------------------------------------------------------
    # Engine sequences one request may start: prompts x max(n, best_of) (400 beyond; 0 = no limit).
    max_sequences_per_request: Limit = 64
    # Output tokens one request may ask for: sequences x max_tokens, the default max_tokens (what the
    # context leaves) included (400 beyond; 0 = no limit).
    max_requested_tokens: Limit = 262144
    # A request's own `chat_template` (vLLM's switch): off = 400. On, it renders in a child process of
    # the tokenizer replica with a time, memory and output-size bound (rayllm.serve.template_sandbox).
    allow_request_chat_template: bool = False
    # A grammar (structured output, forced tool calls) that takes more than this CPU time to compile answers 400 and
    # its compiler child is replaced (rayllm.sample.grammar_worker).
    grammar_compile_timeout_s: Seconds = 10.0
    # The base models (cluster.yaml `models:`); the first answers requests that name no model. Empty: the
    # single model of `engine` (its deployment options are llm_deployment_options).
    models: tuple[ModelEntry, ...] = ()
    # How the ingress picks a model replica (cluster.yaml `router`; docs/routing-priority-tracing.md).
    router: RouterConfig = field(default_factory=RouterConfig)
    # OpenTelemetry traces of requests, exported over OTLP (off by default; rayllm.serve.tracing).
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        check_instance(self)  # every field against its type and range (a YAML string is no list, no boolean)
        if not self.models:
            object.__setattr__(self, "models", (ModelEntry(self.engine),))
        elif self.engine not in (self.models[0].engine, EngineConfig()):  # replace(cfg, engine=...): the first
            object.__setattr__(self, "models", (replace(self.models[0], engine=self.engine),) + self.models[1:])
        object.__setattr__(self, "engine", self.models[0].engine)
        check_model_names(self.models)
        for key in self.api_keys + self.admin_api_keys:  # fail at start-up, not on the first request
            parse_key(key)

    @property
    def served_model_name(self) -> str:
        return self.engine.model.served_model_name

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> ServerConfig:
        args = dict(args or {})
        models = args.pop("models", None)
        if models is not None and "engine" in args:
            raise ValueError("give either `engine` (one model) or `models` (several), not both")
        if models is not None and (not isinstance(models, list) or not models):
            raise ValueError("models must be a non-empty list of model entries")
        if models:
            args["models"] = tuple(_model_entry(index, m) for index, m in enumerate(models))
        engine = check_backend(EngineConfig.from_dict(_or(args.pop("engine", None), {})))
        args["api_keys"] = _with_env_keys(args.pop("api_keys", None), "API_KEYS")
        args["admin_api_keys"] = _with_env_keys(args.pop("admin_api_keys", None), "ADMIN_API_KEYS")
        args["router"] = RouterConfig.from_value(args.get("router"))
        url = args.pop("storage_url", None) or os.environ.get("STORAGE_URL")
        if url:
            args["storage_url"] = url
        if "tracing" in args:
            args["tracing"] = TracingConfig.from_dict(args["tracing"])
        return cls(engine=engine, **args)


def _model_entry(index: int, entry: Any) -> ModelEntry:
    """cluster.yaml's `models[index]`, its errors naming it."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"models[{index}] must be a mapping (engine, served_model_name, ...), got {entry!r}")
    try:
        return ModelEntry.from_dict(entry)
    except ValueError as exc:
        raise ValueError(f"models[{index}]: {exc}") from None


def _with_env_keys(keys: Any, variable: str) -> Any:
    """A list of keys with those of the comma-separated environment `variable` added. Anything but a list is
    returned as it is, for ServerConfig's check to refuse (a bare string is no list of keys)."""
    env = tuple(k.strip() for k in os.environ.get(variable, "").split(",") if k.strip())
    return tuple(keys or ()) + env if keys is None or isinstance(keys, list | tuple) else keys


def check_backend(engine: EngineConfig) -> EngineConfig:
    """A misspelt attention backend fails when the config is read, not when a replica starts."""
    if engine.parallel.attention_backend not in ("auto", *BACKENDS):
        raise ValueError(f"engine.parallel.attention_backend: {engine.parallel.attention_backend!r} is not auto or one "
                         f"of {', '.join(sorted(BACKENDS))}")
    return engine
