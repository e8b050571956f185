"""/health (rayllm/serve/routes/ops_routes.py) on Serve's status as the controller sends it (the details dict of
tests/serve/test_model_status.py); the replicas' handles are never called by /health, so plain names stand in
for them. test_scale_to_zero.py and test_operations.py probe /health through the real app."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from ray.serve._private.common import DeploymentStatus

from rayllm.serve.model_status import ServeModelStatus
from rayllm.serve.routes.ops_routes import HealthLog, health
from tests.serve.test_model_status import serve_status

STARTING = serve_status(llm=(DeploymentStatus.UPDATING, {"STARTING": 1}))
UP = serve_status(llm=(DeploymentStatus.HEALTHY, {"RUNNING": 1}))


async def test_a_starting_model_is_503_and_logged_once_per_change(caplog):
    """A load balancer probes every few seconds while a model starts: one warning when it goes down, one line
    when it is back, not one per probe."""
    current = [STARTING]

    def read() -> dict:
        if current[0] is None:
            raise ConnectionError("controller gone\nsecond line")
        return current[0]

    status = ServeModelStatus("app", ttl_s=0, unhealthy_ttl_s=0, read=read)
    llms, health_log = [SimpleNamespace(deployment_name="llm")], HealthLog()
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        codes = [(await health(llms, status, health_log)).status_code for _ in range(5)]
        current[0] = UP
        codes += [(await health(llms, status, health_log)).status_code for _ in range(3)]
        current[0] = None
        codes += [(await health(llms, status, health_log)).status_code for _ in range(3)]
    assert codes == [503] * 5 + [200] * 3 + [503] * 3
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "/health: model deployments not healthy: llm"),
        ("INFO", "/health: every model deployment healthy again (was: llm)"),
        ("WARNING", "/health: model deployments not healthy: (status unavailable) (controller gone)"),
    ]
