"""Serving across several Ray nodes, on a real multi-node Ray cluster on this machine (`ray.cluster_utils.
Cluster`, as Ray tests itself): the scenario runs in its own process with its own cluster (never the
session's Ray instance; see tests/serve/multi_node_scenario.py) and reports what it saw as JSON.

What it shows (the README's "Several machines" section says the same): the two model replicas are placed
on different nodes, each with its TP rank on its own node; the ingress reaches both; when one node is
removed while requests stream, the streams on the other node finish, those on the lost node end with an
error event (a 503 `model_replica_failed` before a stream starts), and Serve starts the lost replica on the
remaining free node. A tensor-parallel size wider than any node is refused when the app is built."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.serve.ops_apps import own_haproxy_env

pytestmark = [pytest.mark.slow, pytest.mark.own_ray]  # `make test-fast` skips it; its own Ray: the first pass

ROOT = Path(__file__).resolve().parents[2]


def test_replicas_on_several_nodes_survive_losing_one():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    env.pop("RAY_ADDRESS", None)  # its own cluster, not one this process may have joined
    env |= own_haproxy_env()  # the session app's HAProxy holds conftest's
    # Ray's files in a folder of its own: ray.cluster_utils.Cluster writes its head's address to
    # <Ray's temp dir>/ray_current_cluster, which every `ray.init()` without an address on this machine would
    # join (other tests' Ray instances and `serve run`s run beside this one in `make test`'s first pass).
    tmp = tempfile.mkdtemp(prefix="rmn-", dir="/tmp")  # short: Ray's socket paths live below it
    env["RAY_TMPDIR"] = tmp
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("multi_node_scenario.py"))], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    r = json.loads(line[len("RESULT "):])
    print(f"phases (s since the scenario's start): {r['timings']}; streams: {len(r['streams'])}")

    assert "tensor_parallel_size 3 needs 4 CPU on one node" in r["tp_refused"]
    assert "largest node has 2 CPU" in r["tp_refused"]
    before = r["before"]  # per replica placement group: the nodes its bundles sit on
    assert len(before) == 2 and all(len(nodes) == 1 for nodes in before)  # each replica packed on one node
    assert before[0] != before[1] and ["head"] not in before  # on two different worker nodes
    assert r["replicas_reached"] == 2  # the ingress reached both
    lost = [s for s in r["streams"] if s["on_lost_node"] and s["live_at_loss"]]
    kept = [s for s in r["streams"] if not s["on_lost_node"]]
    assert lost and kept
    for s in kept:  # the other node's streams ran to their max_tokens
        assert s["status"] == 200 and s["finish"] == "length" and s["error"] is None, s
    for s in lost:  # the lost node's streams end with an error event, not a silent cut or a hang
        assert s["finish"] is None and s["error"] is not None and s["error"].get("code") == "model_replica_failed", s
    assert r["recovered"] == {"RUNNING": 2}
    after = r["after"]
    assert len(after) == 2 and all(len(nodes) == 1 for nodes in after) and after[0] != after[1]
    assert [r["victim"]] not in after  # the lost replica came back on the free node
    assert r["after_status"] == 200
