"""Vendor KubeRay's RayService CRD schema (v1) for tests/deploy/test_deploy.py, descriptions stripped.

    python deploy/vendor_kuberay_crd.py VERSION CRD
        VERSION: the KubeRay release, e.g. v1.7.0
        CRD: ray.io_rayservices.yaml from that release: ray-operator/config/crd/bases/ in the repository,
             or crds/ in the kuberay-operator Helm chart (a .tgz is read directly)

Writes deploy/kuberay/rayservice-crd.json.gz: {"kuberay_version", "schema"}. Descriptions are
documentation only (dropping them changes no validation) and are ~85 % of the file's 1 MB.
"""

from __future__ import annotations

import gzip
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parent / "kuberay" / "rayservice-crd.json.gz"


def strip_descriptions(node: Any) -> Any:
    if isinstance(node, dict):  # a property *named* description has a dict value: kept
        return {k: strip_descriptions(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def read_crd(path: str) -> dict[str, Any]:
    if path.endswith((".tgz", ".tar.gz")):
        with tarfile.open(path) as tar:
            (member,) = [m for m in tar.getmembers() if m.name.endswith("crds/ray.io_rayservices.yaml")]
            return yaml.safe_load(tar.extractfile(member).read())  # type: ignore[union-attr]
    return yaml.safe_load(Path(path).read_text())


def main(version: str, path: str) -> None:
    crd = read_crd(path)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    payload = {"kuberay_version": version, "schema": strip_descriptions(v1["schema"]["openAPIV3Schema"])}
    OUT.parent.mkdir(exist_ok=True)
    # mtime=0: the same input gives the same bytes
    OUT.write_bytes(gzip.compress(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode(), 9, mtime=0))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
