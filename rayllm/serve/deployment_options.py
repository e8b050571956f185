"""A model deployment's Serve options, layered and checked: what Serve itself accepts but an LLM replica
cannot work with.

The layers (placement, the server-wide `llm_deployment_options`, a model's own `deployment`) merge key by key,
`ray_actor_options` one level deeper, so that `ray_actor_options: {memory: ...}` in a model's options keeps the
GPU the builder reserved (a replaced dict dropped `num_gpus`, so replicas shared GPU 0). An
`autoscaling_config` without a target gets one sized to the engine's batch (Serve's default of 2 ongoing
requests would add a replica at the third concurrent request), and a target above `max_ongoing_requests` is
refused (a replica never holds that many, so the deployment would never scale up).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("ray.serve")

# Keys whose mapping values merge key by key across layers.
NESTED = ("ray_actor_options",)


def layered(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """The layers merged left to right: later keys win, `ray_actor_options` merged one level deeper."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key in NESTED and isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = {**out[key], **value}
            else:
                out[key] = value
    return out


def default_target(max_num_seqs: int) -> int:
    """Three quarters of the engine's running slots: a replica is added before its batch is full."""
    return max(1, 3 * max_num_seqs // 4)


def with_autoscaling_checked(options: dict[str, Any], *, max_num_seqs: int, default_max_ongoing: int,
                             where: str) -> dict[str, Any]:
    """`options` with a sized default target, or ValueError naming `where`'s field when the target can never
    be reached."""
    scaling = options.get("autoscaling_config")
    if not isinstance(scaling, Mapping):
        return options
    target = scaling.get("target_ongoing_requests")
    if target is None:
        scaling = {**scaling, "target_ongoing_requests": default_target(max_num_seqs)}
        options = {**options, "autoscaling_config": scaling}
        target = scaling["target_ongoing_requests"]
    max_ongoing = options.get("max_ongoing_requests", default_max_ongoing)
    if isinstance(target, (int, float)) and isinstance(max_ongoing, (int, float)) and target > max_ongoing:
        raise ValueError(
            f"{where}.autoscaling_config.target_ongoing_requests ({target:g}) is above max_ongoing_requests "
            f"({max_ongoing:g}): a replica never holds that many requests, so the deployment would never scale "
            "up; lower the target (about three quarters of engine.scheduler.max_num_seqs) or raise "
            "max_ongoing_requests")
    return options


def scaling_warnings(deployment_config: Any, max_num_seqs: int) -> list[str]:
    """What this replica's deployment config, as Serve merged it (a Serve config file's `deployments` section
    replaces the builder's autoscaling_config whole, after the build's checks), would get wrong."""
    scaling = getattr(deployment_config, "autoscaling_config", None)
    if scaling is None:
        return []
    target, max_ongoing = scaling.target_ongoing_requests, deployment_config.max_ongoing_requests
    if target > max_ongoing:
        return [f"autoscaling_config.target_ongoing_requests ({target:g}) is above max_ongoing_requests "
                f"({max_ongoing}): a replica never holds that many requests, so this deployment never scales up"]
    if target <= 2 < max_num_seqs // 4:
        return [f"autoscaling_config.target_ongoing_requests is {target:g} (Serve's default when none is set) for "
                f"an engine of {max_num_seqs} running slots: a replica is added at the third concurrent request; "
                f"set it to about {default_target(max_num_seqs)}"]
    return []


def warn_of_scaling(max_num_seqs: int) -> None:
    """Log scaling_warnings for the replica this runs in (nothing outside a Serve replica)."""
    from ray import serve

    try:
        config = serve.get_replica_context()._deployment_config
    except Exception:  # not in a replica (an engine built in a test), or Serve's private field moved
        return
    for warning in scaling_warnings(config, max_num_seqs):
        log.warning("%s", warning)
