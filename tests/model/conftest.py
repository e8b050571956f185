"""One local Ray instance for every tensor-parallel test of this folder (Ray starts once, not per module),
shut down once the folder's last test has run, before tests/serve starts its own."""

from __future__ import annotations

import pytest


@pytest.fixture
def ray_local() -> None:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)


@pytest.hookimpl(trylast=True)  # after the fixtures' own teardown (an engine's actors go first)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or nextitem.path.parent != item.path.parent:
        import ray

        if ray.is_initialized():
            ray.shutdown()
