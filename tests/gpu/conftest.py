"""The GPU lane (`pytest -m gpu`): every test here needs CUDA and is skipped, with the reason printed,
where there is none, so `make test` stays green on CPU machines."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (the gpu lane: pytest -m gpu)"))


def xformers_or_skip() -> None:
    try:
        from xformers.ops import fmha  # noqa: F401
    except Exception as exc:  # not installed (make install-gpu), or built for another torch
        pytest.skip(f"xformers unavailable: {exc}")


@pytest.fixture(params=["xformers", "sdpa"])
def backend(request) -> str:
    if request.param == "xformers":
        xformers_or_skip()
    return request.param
