"""The GPU lane (`pytest -m gpu`): every test of a test_gpu_*.py file here needs CUDA and is skipped, with the
reason printed, where there is none, so `make test` stays green on CPU machines. The other test files check the
device run's own tooling (its clock, its readings of the driver) and run everywhere."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    # serve_device.sh's rehearsal on a CPU machine runs the served tests against CPU engines (their CUDA-only
    # checks skip themselves): it checks the tests before a GPU call does.
    rehearsal = os.environ.get("RAYLLM_GPU_REHEARSAL") == "1"
    for item in items:
        if str(item.fspath).startswith(here) and item.fspath.basename.startswith("test_gpu_"):
            item.add_marker(pytest.mark.gpu)
            if rehearsal and item.fspath.basename == "test_gpu_serving.py":
                continue
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (the gpu lane: pytest -m gpu)"))


def xformers_or_skip() -> None:
    from rayllm.attention.xformers import XformersAttention

    try:
        XformersAttention().probe(torch.device("cuda"))
    except Exception as exc:  # not installed (make install-gpu), or built for another torch: no kernels
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        pytest.skip(f"xformers unavailable: {reason} (python -m xformers.info says why)")


def triton_or_skip() -> None:
    try:
        from rayllm.attention.triton import TritonAttention

        TritonAttention().probe(torch.device("cuda"))
    except Exception as exc:  # no triton, or no compiler for this GPU
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        pytest.skip(f"triton kernels unavailable: {reason}")


@pytest.fixture(params=["xformers", "triton", "sdpa"])
def backend(request) -> str:
    if request.param == "xformers":
        xformers_or_skip()
    if request.param == "triton":
        triton_or_skip()
    return request.param


@pytest.fixture(scope="session")
def gguf_path() -> str:
    """The default model; RAYLLM_GPU_TEST_GGUF names another file (e.g. a copy cut to its first layers by
    trim_gguf.py, real weights, where the 98 MB file cannot travel to the GPU machine)."""
    from rayllm.loader.model_files import default_model_path

    return os.environ.get("RAYLLM_GPU_TEST_GGUF") or default_model_path()
