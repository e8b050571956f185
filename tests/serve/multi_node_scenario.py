"""The multi-node scenario of tests/serve/test_multi_node.py, run in its own process (its own Ray cluster,
never the session's): prints one JSON object with what it observed.

A `ray.cluster_utils.Cluster` on this machine (how Ray tests itself): a head with no CPUs for replicas,
where the Serve controller, the HTTP proxy, the ingress and the tokenizer run, and three worker nodes of
2 CPUs each. Two model replicas (`executor: ray`, tensor_parallel_size 1: a placement group of the replica's
bundle and one rank bundle, 1.5 CPUs) cannot share a node, so they land on two workers; streams run on both;
one replica's node is removed; the third worker is where Serve brings the lost replica back.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import httpx

MODEL = "SmolLM2-135M-Instruct"
ENGINE = {"model": {"max_model_len": 512}, "cache": {"kv_cache_bytes": 64 << 20},
          "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256},
          "parallel": {"device": "cpu", "executor": "ray", "tensor_parallel_size": 1}}
MIN_STREAMS, MAX_STREAMS = 4, 12
# Each stream's length: the last one started (on the replica whose node goes) must still stream when its node
# is removed, and the other node's streams run to their end after it (with 120 tokens they ended 2.6 s after
# the removal, session 42).
STREAM_TOKENS = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pinned_to_head(app):
    """The ingress and the tokenizer on the head node (as a cluster's Serve config would pin them with
    `deployments: [{name: ingress, ray_actor_options: {resources: ...}}]`), so that removing a worker
    loses only model replicas."""
    head = {"num_cpus": 0, "resources": {"head": 0.001}}
    ingress = app._bound_deployment
    (config,), bound = ingress.init_args, ingress.init_kwargs
    tok = bound["tokenizer"]._bound_deployment
    tokenizer = tok.options(ray_actor_options=head).bind(*tok.init_args)
    return ingress.options(ray_actor_options=head).bind(config, llms=bound["llms"], tokenizer=tokenizer)


def _replica_nodes() -> dict[str, list[str]]:
    """Each live model-replica placement group's nodes (one per bundle)."""
    from ray.util import placement_group_table

    out = {}
    for pg_id, pg in placement_group_table().items():
        if pg["state"] == "CREATED" and "llm" in pg.get("name", ""):
            out[pg_id] = sorted(set(pg["bundles_to_node_id"].values()))
    return out


def _stream(base: str, out: dict, started: threading.Event) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to one hundred."}],
            "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}
    chunks, finish, error = 0, None, None
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=180) as r:
            out["status"] = r.status_code
            out["replica"] = r.headers.get("x-replica-id")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    continue
                for choice in event.get("choices", []):
                    chunks += 1
                    finish = choice.get("finish_reason") or finish
                if chunks:
                    started.set()
    except httpx.HTTPError as exc:
        error = {"client": type(exc).__name__}
    out.update(chunks=chunks, finish=finish, error=error)
    started.set()


def main() -> dict:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from rayllm.serve.builder import build_app

    result: dict = {}
    t0 = time.monotonic()
    timings = result["timings"] = {}  # seconds since the start at each phase's end (printed by the test)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "resources": {"head": 1}, "include_dashboard": False})  # GCS: 6379 or a free port
    workers = [cluster.add_node(num_cpus=2, resources={f"worker{i}": 1}) for i in range(3)]
    names = {w.node_id: f"worker{i}" for i, w in enumerate(workers)} | {cluster.head_node.node_id: "head"}
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    cluster.wait_for_nodes()
    timings["cluster_up"] = round(time.monotonic() - t0, 1)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    try:  # wider than any node: refused while building, before anything is deployed
        build_app({"engine": ENGINE | {"parallel": {"device": "cpu", "executor": "ray", "tensor_parallel_size": 3}}})
    except ValueError as exc:
        result["tp_refused"] = str(exc)
    app = build_app({"replica_num_cpus": 0.5, "engine": ENGINE, "llm_deployment_options": {
        "num_replicas": 2, "health_check_period_s": 2, "health_check_timeout_s": 5}})
    serve.run(_pinned_to_head(app), name="multinode", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while serve.status().applications["multinode"].deployments.get("llm") is None or \
            serve.status().applications["multinode"].deployments["llm"].replica_states != {"RUNNING": 2}:
        if time.time() > deadline:
            raise RuntimeError(f"replicas did not start: {serve.status()}")
        time.sleep(0.5)
    timings["replicas_running"] = round(time.monotonic() - t0, 1)
    before = _replica_nodes()
    result["before"] = [[names.get(n, n) for n in nodes] for nodes in before.values()]

    # Streams start one at a time, each once the previous one streams, until both replicas serve some:
    # the router's choice between two replicas is random when their queues look alike, so a fixed
    # number of streams started at once can all land on one.
    outs: list[dict] = []
    threads: list[threading.Thread] = []
    while len(outs) < MAX_STREAMS:
        out, started = {}, threading.Event()
        thread = threading.Thread(target=_stream, args=(base, out, started))
        thread.start()
        started.wait(180)
        outs.append(out)
        threads.append(thread)
        if len(outs) >= MIN_STREAMS and len({o.get("replica") for o in outs if o.get("replica")}) == 2:
            break
    replicas = sorted({o.get("replica") for o in outs if o.get("replica")})
    result["replicas_reached"] = len(replicas)
    # The node of the replica the last stream reached, which still streams (the GCS's actor table; no
    # dashboard here).
    from ray._private.state import actors

    victim_replica = outs[-1].get("replica")
    victim_node = next((a["Address"]["NodeID"] for a in actors().values()
                        if a["State"] == "ALIVE" and victim_replica and victim_replica in a["Name"]), None)
    result["victim"] = names.get(victim_node)
    live = [t.is_alive() for t in threads]
    timings["node_removed"] = round(time.monotonic() - t0, 1)
    cluster.remove_node(next(w for w in workers if w.node_id == victim_node), allow_graceful=False)
    for t in threads:
        t.join(200)
    timings["streams_done"] = round(time.monotonic() - t0, 1)
    result["streams"] = [{"on_lost_node": o.get("replica") == victim_replica, "live_at_loss": alive,
                          "status": o.get("status"), "chunks": o.get("chunks"), "finish": o.get("finish"),
                          "error": o.get("error")} for o, alive in zip(outs, live, strict=True)]
    def recovered() -> bool:
        """Two replicas RUNNING and none placed on the lost node: Serve reports 2 RUNNING until it has seen the
        loss, so the count alone passes at once when the streams end before that."""
        return (serve.status().applications["multinode"].deployments["llm"].replica_states == {"RUNNING": 2}
                and all(victim_node not in nodes for nodes in _replica_nodes().values()))

    deadline = time.time() + 180
    while not recovered() and time.time() < deadline:
        time.sleep(0.5)
    timings["recovered"] = round(time.monotonic() - t0, 1)
    result["recovered"] = serve.status().applications["multinode"].deployments["llm"].replica_states
    result["after"] = [[names.get(n, n) for n in nodes] for nodes in _replica_nodes().values()]
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
    result["after_status"] = r.status_code
    timings["answered_after"] = round(time.monotonic() - t0, 1)
    ray.shutdown()  # the cluster's nodes stop their replicas (no graceful serve.shutdown: seconds, and untested here)
    cluster.shutdown()
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
    sys.exit(0)
