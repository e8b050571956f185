"""Rewrite the KubeRay manifests' embedded Serve configs from their sources: deploy/rayservice.yaml from
cluster.yaml, deploy/rayservice-gpu.yaml from deploy/cluster-gpu.yaml. Two differences, both for pods: HTTP
listens on 0.0.0.0, and `device: auto` becomes `device: cuda` (the manifests' workers are GPU pods).

    python deploy/render_rayservice.py          # rewrite in place
    python deploy/render_rayservice.py --check  # exit 1 if a manifest is stale (tests/deploy/test_deploy.py)
    python deploy/render_rayservice.py --listen-all cluster.yaml   # print it listening on 0.0.0.0 (the Dockerfile)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "rayservice.yaml"
# manifest -> the Serve config it embeds
SOURCES = {MANIFEST: ROOT / "cluster.yaml", ROOT / "deploy" / "rayservice-gpu.yaml": ROOT / "deploy" / "cluster-gpu.yaml"}
BLOCK = re.compile(r"(  serveConfigV2: \|\n)(.*?)(\n  rayClusterConfig:)", re.S)
AUTO_DEVICE = re.compile(r"^(\s+device: )auto\b", re.M)


def listening_on_all_interfaces(serve_config: str) -> str:
    """The Serve config as a pod or container runs it: cluster.yaml's 127.0.0.1 is reachable from inside only."""
    return serve_config.replace("host: 127.0.0.1", "host: 0.0.0.0", 1)


def on_gpu_workers(serve_config: str) -> str:
    """`device: cuda` for `auto`: KubeRay submits the config once the head pod is Ready, often before a GPU
    worker has joined, and `auto` is decided then, from the cluster's GPUs (rayllm/serve/builder.py
    resolve_device): it would pick cpu for good."""
    return AUTO_DEVICE.sub(r"\1cuda", serve_config)


def rendered(manifest: Path = MANIFEST) -> str:
    serve_config = on_gpu_workers(listening_on_all_interfaces(SOURCES[manifest].read_text()))
    body = "\n".join(("    " + line).rstrip() for line in serve_config.rstrip("\n").split("\n"))
    text = manifest.read_text()
    if not BLOCK.search(text):
        raise SystemExit(f"{manifest.name} has no serveConfigV2 block followed by rayClusterConfig")
    return BLOCK.sub(lambda m: m.group(1) + body + m.group(3), text, count=1)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--listen-all"] and len(argv) == 2:
        sys.stdout.write(listening_on_all_interfaces(Path(argv[1]).read_text()))
        return 0
    stale = 0
    for manifest in SOURCES:
        text = rendered(manifest)
        if "--check" in argv:
            stale += text != manifest.read_text()
        else:
            manifest.write_text(text)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
