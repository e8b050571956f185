"""The served engine's step loop, watched from outside: poll a running app's model replica for its engine
counters (LLMServer.engine_stats through a Serve handle, read off the replica's event loop) and print one JSON
line per interval in which it stepped: steps per second, the mean step and the part of it in the model
(executor.execute), sequences running and waiting. Run beside serve_bench.py to set the served time per token
against the engine's own step at each load (tests/gpu/serve_device.sh does; the engine alone's step comes from
serve_engine.py).

    python benchmarks/engine_stats_watch.py [--app llm] [--deployment llm] [--interval 1] [--duration 600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


async def watch(args: argparse.Namespace) -> None:
    """In an event loop: a handle may route from the caller's loop (RAY_SERVE_THROUGHPUT_OPTIMIZED)."""
    from ray import serve

    handle = serve.get_deployment_handle(args.deployment, app_name=args.app)
    prev, t_prev = await handle.engine_stats.remote(), time.time()
    end = t_prev + args.duration
    while time.time() < end:
        await asyncio.sleep(args.interval)
        cur, now = await handle.engine_stats.remote(), time.time()
        steps = cur["num_steps"] - prev["num_steps"]
        if steps:
            step_s = cur["step_seconds"] - prev["step_seconds"]
            print(json.dumps({"bench": "engine_stats", "t": round(now, 2), "steps_per_s": round(steps / (now - t_prev), 1),
                              "step_ms_mean": round(step_s / steps * 1e3, 3),
                              "execute_ms_mean": round((cur["execute_seconds"] - prev["execute_seconds"]) / steps * 1e3, 3),
                              "busy": round(step_s / (now - t_prev), 3), "running": cur["num_running"],
                              "waiting": cur["num_waiting"]}), flush=True)
        prev, t_prev = cur, now


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--app", default="llm")
    ap.add_argument("--deployment", default="llm", help="the model deployment (llm, llm-<name> for later models)")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=600.0)
    args = ap.parse_args(argv)
    import ray

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    asyncio.run(watch(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
