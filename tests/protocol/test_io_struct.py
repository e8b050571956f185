"""rayllm.protocol.io_struct: the generation path's messages, defined once, light enough for the ingress to import."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

from rayllm.protocol.io_struct import GenerateRequest, GenerationDelta, StopOptions
from rayllm.schema.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def test_the_ingress_imports_neither_torch_nor_the_model_replica():
    """A fresh interpreter (this one has loaded torch for other tests) imports the ingress and lists what came."""
    code = ("import json, sys; import rayllm.serve.ingress; "
            "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'rayllm.serve.llm_server', "
            "'rayllm.serve.detokenizer', 'rayllm.serve.tokenizer', 'rayllm.engine.engine') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_messages_survive_pickling_with_the_replica_id():
    """Ray pickles these between the ingress and the model replica."""
    req = GenerateRequest("r", [[1, 2]], SamplingParams(max_tokens=3), StopOptions(stop=("\n",)), n=2, trace_id="t")
    assert pickle.loads(pickle.dumps(req)) == req
    d = GenerationDelta(index=1, text="hi", token_ids=[5], logprobs=None, finish_reason=None, matched_stop=None,
                        prompt_tokens=2, cached_tokens=0, completion_tokens=1, replica_id="abc")
    back = pickle.loads(pickle.dumps([d]))
    assert back == [d] and back[0].replica_id == "abc"
