"""Rewrite deploy/rayservice.yaml's embedded Serve config from cluster.yaml (HTTP host 0.0.0.0 in pods).

    python deploy/render_rayservice.py          # rewrite in place
    python deploy/render_rayservice.py --check  # exit 1 if the manifest is stale (tests/deploy/test_deploy.py)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "rayservice.yaml"
BLOCK = re.compile(r"(  serveConfigV2: \|\n)(.*?)(\n  rayClusterConfig:)", re.S)


def rendered() -> str:
    serve_config = (ROOT / "cluster.yaml").read_text().replace("host: 127.0.0.1", "host: 0.0.0.0", 1)
    body = "\n".join(("    " + line).rstrip() for line in serve_config.rstrip("\n").split("\n"))
    text = MANIFEST.read_text()
    if not BLOCK.search(text):
        raise SystemExit("deploy/rayservice.yaml has no serveConfigV2 block followed by rayClusterConfig")
    return BLOCK.sub(lambda m: m.group(1) + body + m.group(3), text, count=1)


def main() -> int:
    text = rendered()
    if "--check" in sys.argv:
        return 0 if text == MANIFEST.read_text() else 1
    MANIFEST.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
