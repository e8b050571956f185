"""Rewrite the KubeRay manifests' embedded Serve configs from their sources (HTTP host 0.0.0.0 in pods):
deploy/rayservice.yaml from cluster.yaml, deploy/rayservice-gpu.yaml from deploy/cluster-gpu.yaml.

    python deploy/render_rayservice.py          # rewrite in place
    python deploy/render_rayservice.py --check  # exit 1 if a manifest is stale (tests/deploy/test_deploy.py)
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


def rendered(manifest: Path = MANIFEST) -> str:
    serve_config = SOURCES[manifest].read_text().replace("host: 127.0.0.1", "host: 0.0.0.0", 1)
    body = "\n".join(("    " + line).rstrip() for line in serve_config.rstrip("\n").split("\n"))
    text = manifest.read_text()
    if not BLOCK.search(text):
        raise SystemExit(f"{manifest.name} has no serveConfigV2 block followed by rayClusterConfig")
    return BLOCK.sub(lambda m: m.group(1) + body + m.group(3), text, count=1)


def main() -> int:
    stale = 0
    for manifest in SOURCES:
        text = rendered(manifest)
        if "--check" in sys.argv:
            stale += text != manifest.read_text()
        else:
            manifest.write_text(text)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
