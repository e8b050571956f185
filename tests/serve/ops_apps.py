"""Shared by the operations tests: small extra apps deployed into the session's Serve cluster."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from tests.ports import direct_ingress_env, free_port

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "SmolLM2-135M-Instruct"
# fp32: its apps start sooner than the bf16 path's (docs/benchmarks.md, test time), and the tests that pace
# their load by time (Pace) gain nothing from cheaper tokens; also conftest.fp32_client's app.
SMALL_ENGINE = {"model": {"dtype": "float32", "max_model_len": 1024},
                "cache": {"kv_cache_bytes": 96 << 20},
                "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256}}


def own_haproxy_env() -> dict[str, str]:
    """Ports of its own for one more Serve instance on this machine: HAProxy's stats and metrics (Serve's
    fixed defaults would clash; its config and socket files already sit in a per-instance folder) and its
    ingress replicas' direct-ingress ranges (tests/ports.py)."""
    return {"RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            **direct_ingress_env()}


def wait_healthy(base: str, wait_s: float = 300) -> str:
    """Poll `base`/health until it answers 200 (the app's replicas are up); returns `base`."""
    deadline = time.time() + wait_s
    with httpx.Client(timeout=15) as http:  # one client: each new one builds an SSL context (~20 ms of CPU)
        while time.time() < deadline:
            try:
                if http.get(f"{base}/health").status_code == 200:
                    return base
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    raise RuntimeError(f"{base} did not become healthy in {wait_s:.0f} s")


def run_app(server: str, app, name: str, wait_s: float = 300) -> str:
    """Deploy a built app into the session's Serve instance under /name; its URL once healthy."""
    from ray import serve

    serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
    return wait_healthy(f"{server}/{name}", wait_s)


def small_app(args: dict):
    """An app of `args` on half a CPU per replica, with SMALL_ENGINE unless `args` brings its engines."""
    from rayllm.serve.builder import build_app

    small = {} if "models" in args else {"engine": SMALL_ENGINE}  # a `models` list brings its own engines
    return build_app({"replica_num_cpus": 0.5} | small | args)


def deploy(server: str, name: str, args: dict, wait_s: float = 300) -> str:
    return run_app(server, small_app(args), name, wait_s)


def deploy_all(server: str, specs: dict[str, dict], wait_s: float = 300) -> dict[str, str]:
    """Several apps (name -> args) submitted at once, so their replicas start side by side rather than one
    app after another; their URLs once every one is healthy."""
    from ray import serve

    serve.run_many([serve.RunTarget(small_app(args), name=name, route_prefix=f"/{name}")
                    for name, args in specs.items()], wait_for_applications_running=False)
    return {name: wait_healthy(f"{server}/{name}", wait_s) for name in specs}


def sse_lines(r: httpx.Response) -> list[str]:
    return [ln for ln in r.iter_lines() if ln]


def chat_body(max_tokens: int, stream: bool = False, **kw) -> dict:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True, **kw}


class Pace:
    """How fast an app serves on this machine now, measured through HTTP at the start of a test, so that
    token counts and time bounds scale with the machine instead of being fixed seconds.

    request_s: a 1-token chat request end to end (HTTP, template, tokenizer, prefill, one step).
    step_s: one more decode step (the slope between a 1-token and a (1 + tokens)-token request).
    """

    def __init__(self, base: str, tokens: int = 32, headers: dict | None = None) -> None:
        def timed(n: int) -> float:
            t0 = time.monotonic()
            r = httpx.post(f"{base}/v1/chat/completions", json=chat_body(n), headers=headers, timeout=600)
            assert r.status_code == 200, r.text
            return time.monotonic() - t0

        timed(1)  # warm: the first request pays one-time costs
        # Minima of two: one request slowed by a neighbour (another test lane) would make every later count
        # too small, so that a stream meant to outlast a signal or a drain ends before it.
        self.request_s = min(timed(1) for _ in range(2))
        self.step_s = max((min(timed(1 + tokens) for _ in range(2)) - self.request_s) / tokens, 1e-3)

    def tokens_for(self, seconds: float, cap: int) -> int:
        """Enough decode steps to take `seconds` at the measured pace (at most `cap`)."""
        return max(1, min(cap, int(seconds / self.step_s) + 1))

    def bound(self, tokens: int, margin: float = 4.0) -> float:
        """An upper bound for a request of `tokens` steps: `margin` times its measured cost."""
        return margin * (self.request_s + tokens * self.step_s)

    def __repr__(self) -> str:
        return f"Pace(request {self.request_s * 1e3:.0f} ms, step {self.step_s * 1e3:.1f} ms)"


# Extra apps that several modules share (conftest.SharedApps): app name -> the module fixtures that use it.
# {"url": the session app's URL} while conftest.server runs it: tests that can run on a Ray instance of their
# own join it instead (pytest loads conftest.py as a module of its own, so the flag lives here).
SESSION: dict[str, str] = {}

SHARED_APPS: dict[str, frozenset[str]] = {
    "prio": frozenset({"prio", "traced"}),  # test_priority_serving.py, test_tracing_serving.py
    "multi": frozenset({"multi", "families"}),  # test_multi_model.py, test_model_families.py (Llama's tools too)
    "fp32": frozenset({"fp32_server"}),  # conftest.fp32_client: transformers-reference tests
    "abuse": frozenset({"abuse", "timeout_app"}),  # test_abuse.py, test_embeddings.py (ABUSE)
}

# The `abuse` app (SMALL_ENGINE, no API keys): request chat templates on, a 2 s request timeout and a cap on
# the tokens a request may ask for (test_abuse.py); also the app behind test_embeddings.py's request-timeout
# test, whose 64 inputs are the default cap on sequences per request (max_sequences_per_request).
ABUSE = {"allow_request_chat_template": True, "request_timeout_s": 2, "max_sequences_per_request": 64,
         "max_requested_tokens": 4000}


def prio_args(otlp_port: int) -> dict:
    """test_priority_serving.py's app: two running slots, priority order, at most one slot per key (three
    keys), and a model queue of 6 + 2 requests, 4 per key (the ingress's share of it). test_tracing_serving.py
    traces through the same app: its spans go to an OTLP receiver on `otlp_port` (the session's)."""
    from tests.serve.conftest import ADMIN_KEY, API_KEY, API_KEY_2

    return {"api_keys": [API_KEY, API_KEY_2], "admin_api_keys": [ADMIN_KEY],
            "llm_deployment_options": {"max_ongoing_requests": 6, "max_queued_requests": 2},
            "engine": {"model": {"dtype": "bfloat16", "max_model_len": 1024}, "cache": {"kv_cache_bytes": 96 << 20},
                       "scheduler": {"max_num_seqs": 2, "max_num_batched_tokens": 256, "policy": "priority",
                                     "max_running_share": 0.5, "batch_invariant": True}},
            "tracing": {"enabled": True, "otlp_endpoint": f"http://127.0.0.1:{otlp_port}/v1/traces",
                        "export_interval_s": 0.2, "service_name": "rayllm-test"}}


FAMILIES = ("qwen3", "mixtral")
TINY_ENGINE = {"cache": {"kv_cache_bytes": 32 << 20}, "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64}}
# The tiny Llama, its tokenizer carrying Llama 3.1 Instruct's chat template (Llama's own tool format).
LLAMA31 = "tiny-llama"


def _tiny_llama(path: Path, tok, max_positions: int) -> str:
    """A 2-layer width-64 Llama with RANDOM weights (seed 0) and `tok`'s vocabulary and end ids."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=len(tok), max_position_embeddings=max_positions,
                      initializer_range=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    return str(path)


def tiny_checkpoints(root: Path, tok) -> dict[str, str]:
    """Tiny random models (weights random, built by transformers here; `tok`, SmolLM2's tokenizer, saved
    beside each so chat templates render): a Llama ("tiny-llama", LLAMA31) whose tokenizer carries Llama 3.1
    Instruct's chat template in place of SmolLM2's, so that the server finds Llama's tool format in it as it
    would for the real model, and one model per added family (FAMILIES, SmolLM2's template)."""
    import json

    from tests.tiny_families import make_checkpoint

    paths = {LLAMA31: _tiny_llama(root / LLAMA31, tok, 1024)}
    for family in FAMILIES:
        paths[family] = make_checkpoint(root / family, family, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                        eos_token_id=tok.eos_token_id)
    for path in paths.values():
        tok.save_pretrained(path)
    config_path = Path(paths[LLAMA31]) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)  # the template file below is the only one
    config_path.write_text(json.dumps(config))
    template = Path(__file__).parents[1] / "protocol" / "llama31_chat_template.jinja"
    (Path(paths[LLAMA31]) / "chat_template.jinja").write_text(template.read_text())
    # Each folder's tokenizer snapshot (rayllm.serve.rust_tokenizer), made here once, as the first start of a
    # real deployment leaves it for the next: otherwise every replica, tokenizer and ingress of each app on these
    # new folders imports transformers to load the tokenizer (~15 s a replica while a multi-model app starts).
    from rayllm.serve.chat_template import load_serving_tokenizer

    for path in paths.values():
        load_serving_tokenizer(path)
    return paths


def multi_args(paths: dict[str, str]) -> dict:
    """One app of several base models (a `models` list: each its own model deployment behind one ingress
    and tokenizer), all tiny and random (tiny_checkpoints): the first family's model first ("llm", alias
    "first"), the Llama 3.1-template tiny Llama on two replicas (LLAMA31, alias "tiny", with a LoRA slot:
    adapters loaded at runtime for a model other than the first; 1024 positions: a prompt with tools is
    longer than 256 tokens), and the other families' models; test_multi_model.py and test_model_families.py
    share it. No SmolLM2: the session app serves it, and a model's weights change nothing of the routing."""
    from tests.serve.conftest import ADMIN_KEY, API_KEY

    def engine(name: str, max_model_len: int = 256) -> dict:
        return {"model": {"model": paths[name], "dtype": "float32", "max_model_len": max_model_len}} | TINY_ENGINE

    # Adapters for the tiny Llama may come from beside the tiny models (test_multi_model.py writes one there).
    lora = {"max_loras": 1, "max_lora_rank": 4, "allowed_roots": [str(Path(paths[LLAMA31]).parent)]}
    first, *others = FAMILIES
    return {"api_keys": [API_KEY], "admin_api_keys": [ADMIN_KEY], "models": [
        {"served_model_name": f"tiny-{first}", "aliases": ["first"], "engine": engine(first)},
        {"served_model_name": LLAMA31, "aliases": ["tiny"], "deployment": {"num_replicas": 2},
         "engine": engine(LLAMA31, 1024) | {"lora": lora}},
        *({"served_model_name": f"tiny-{family}", "engine": engine(family)} for family in others)]}


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


class Receiver(ThreadingHTTPServer):
    """POST /v1/traces (OTLP/HTTP protobuf): every span, as a dict, with its process's resource attributes."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(handler) -> None:  # noqa: N805
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                    ExportTraceServiceResponse,
                )

                body = handler.rfile.read(int(handler.headers["Content-Length"]))
                self.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                handler.send_response(200)
                handler.send_header("Content-Type", "application/x-protobuf")
                handler.send_header("Content-Length", str(len(reply)))
                handler.end_headers()
                handler.wfile.write(reply)

            def log_message(handler, *args) -> None:  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def add(self, req) -> None:  # an ExportTraceServiceRequest
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    with self.lock:
                        self.spans.append({
                            "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano, "status": s.status.code,
                            "attrs": {a.key: _value(a.value) for a in s.attributes}, "resource": resource})

    def wait_for(self, match, names: set[str], timeout: float = 60) -> dict[str, list[dict]]:
        """The spans `match` picks, by name, once every name in `names` has arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                got: dict[str, list[dict]] = {}
                for s in self.spans:
                    if match(s):
                        got.setdefault(s["name"], []).append(s)
            if names <= set(got) or time.monotonic() > deadline:
                assert names <= set(got), f"missing spans {names - set(got)}; got {sorted(got)}"
                return got
            time.sleep(0.1)
