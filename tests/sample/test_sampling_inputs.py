"""Every tensor the sampler receives is on the logits' device, for each sampling feature.

This machine has no CUDA, so CUDA is faked: the logits are fake CUDA tensors under torch's
FakeTensorMode, which runs every op on shapes and devices only and raises on any op that mixes
devices (a CPU-built temperature vector against CUDA logits, as issue 18 found). Two things that need
a real CUDA driver are stood in for and recorded instead: pinning host memory (`sampling_inputs.pin`)
and creating a CUDA generator (`sampling_inputs.new_generator`); FakeTensorMode also cannot draw from
an explicit generator, so the fake draw uses the device's default stream and the seeded generator's
device is asserted on its own. FakeTensorMode's constant propagation (one-element tensors are also run
for real) is turned off, since running them for real would need CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

from rayllm.sample import sampling_inputs
from rayllm.sample.sampler import Penalties, SamplingTensors, sample_on_device, top_logprobs
from rayllm.sample.sampling_inputs import SamplingInputs, allowed_tokens, to_device
from rayllm.schema.sampling_params import SamplingParams
from rayllm.schema.step import SeqStep

VOCAB = 100


def seq_step(rid: str, params: SamplingParams, **extra) -> SeqStep:
    return SeqStep(rid, [5], 9, [0], True, params=params, num_prompt_tokens=6, **extra)


def bitmask(allowed: list[int]) -> torch.Tensor:
    words = torch.zeros(-(-VOCAB // 32), dtype=torch.int64)
    for tok in allowed:
        words[tok // 32] |= 1 << (tok % 32)
    return words.to(torch.int32)  # two's complement: bit 31 is the sign bit, as in xgrammar's masks


FEATURES: dict[str, list[SeqStep]] = {
    "temperature": [seq_step("a", SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05))],
    "seed": [seq_step("a", SamplingParams(temperature=0.7, seed=3)), seq_step("b", SamplingParams(temperature=1))],
    "penalties": [seq_step("a", SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                                               repetition_penalty=1.2), history=[1, 2, 3, 4, 5, 6, 7, 7, 8])],
    "logit_bias": [seq_step("a", SamplingParams(temperature=0.0, logit_bias=((3, 5.0), (7, -100.0))))],
    "min_tokens": [seq_step("a", SamplingParams(temperature=0.7, min_tokens=4), mask_token_ids=(2, 9))],
    "grammar": [seq_step("a", SamplingParams(temperature=0.7), allowed_bitmask=bitmask([1, 31, 40, 99])),
                seq_step("b", SamplingParams(temperature=0.0))],
    "allowed_token_ids": [seq_step("a", SamplingParams(temperature=0.7, allowed_token_ids=(3, 31, 32, 97))),
                          seq_step("b", SamplingParams(temperature=0.0, allowed_token_ids=(5, 6)))],
    "logprobs": [seq_step("a", SamplingParams(temperature=0.7, logprobs=5)),
                 seq_step("b", SamplingParams(temperature=0.0, logprobs=0))],
}


def tensors_in(t: SamplingTensors) -> list[tuple[str, torch.Tensor]]:
    found = []
    for f in dataclasses.fields(t):
        value = getattr(t, f.name)
        if isinstance(value, torch.Tensor):
            found.append((f.name, value))
        elif isinstance(value, Penalties):
            found += [(f"{f.name}.{g.name}", getattr(value, g.name)) for g in dataclasses.fields(value)]
    return found


@pytest.fixture
def recorded(monkeypatch) -> dict[str, list]:
    """Stand-ins for what needs a CUDA driver: pinning (recorded) and CUDA generators (device recorded)."""
    calls: dict[str, list] = {"pinned": [], "generators": []}

    def pin(t: torch.Tensor) -> torch.Tensor:
        calls["pinned"].append(t.device)
        return t

    def new_generator(seed: int, device: torch.device) -> torch.Generator:
        calls["generators"].append(device)
        return torch.Generator().manual_seed(seed)

    monkeypatch.setattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", 0)
    monkeypatch.setattr(sampling_inputs, "pin", pin)
    monkeypatch.setattr(sampling_inputs, "new_generator", new_generator)
    return calls


@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_sampler_input_is_on_the_fake_cuda_logits_device(feature, recorded):
    seqs = FEATURES[feature]
    inputs = SamplingInputs(VOCAB)
    with FakeTensorMode(allow_non_fake_inputs=True):
        logits = torch.empty(len(seqs), VOCAB, dtype=torch.bfloat16, device="cuda")
        rows = [inputs.row(s, logits.device) for s in seqs]
        t = inputs.tensors(rows, logits.device)
        for name, tensor in tensors_in(t):
            assert tensor.device == logits.device, name
        # The whole device computation; any CPU tensor meeting the CUDA logits raises here.
        chosen, logprobs = sample_on_device(logits, dataclasses.replace(t, generators=[None] * len(seqs)))
        assert chosen.device == logits.device
        if t.max_logprobs is not None:
            assert logprobs is not None
            assert all(x.device == logits.device for x in top_logprobs(logprobs, chosen, t.max_logprobs) if x is not None)
    assert recorded["pinned"] and all(d.type == "cpu" for d in recorded["pinned"])  # host copies go through pinned memory
    if feature == "seed":
        assert recorded["generators"] == [logits.device]
    names = {name for name, _ in tensors_in(t)}
    if feature in ("logit_bias", "min_tokens", "grammar"):
        assert "additive" in names
    if feature == "penalties":
        assert {"penalties.seen", "penalties.counts", "penalties.repetition"} <= names


def test_prompt_logprob_targets_are_on_the_fake_cuda_logits_device(recorded):
    with FakeTensorMode(allow_non_fake_inputs=True):
        logits = torch.empty(4, VOCAB, dtype=torch.bfloat16, device="cuda")
        targets = to_device([5, 6, 7, 8], torch.long, logits.device)
        picked, vals, ids = top_logprobs(logits.float().log_softmax(-1), targets, 3)
        assert targets.device == picked.device == vals.device == ids.device == logits.device


def test_the_fake_device_check_catches_a_cpu_built_input(recorded):
    """The check above can fail: sampling tensors built on the CPU against CUDA logits raise."""
    inputs = SamplingInputs(VOCAB)
    seqs = FEATURES["temperature"]
    cpu = torch.device("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        logits = torch.empty(1, VOCAB, device="cuda")
        t = inputs.tensors([inputs.row(s, cpu) for s in seqs], cpu)
        with pytest.raises(FakeTensorDeviceMismatchError):
            sample_on_device(logits, t)


def test_on_cpu_nothing_is_pinned_or_copied(recorded):
    inputs = SamplingInputs(VOCAB)
    seqs = FEATURES["grammar"] + FEATURES["penalties"]
    t = inputs.tensors([inputs.row(s, torch.device("cpu")) for s in seqs], torch.device("cpu"))
    assert all(x.device.type == "cpu" for _, x in tensors_in(t)) and not recorded["pinned"]


def test_grammar_bitmask_expands_to_exactly_the_allowed_tokens():
    allowed = [0, 1, 31, 32, 63, 64, 99]
    got = allowed_tokens(bitmask(allowed).unsqueeze(0), VOCAB)[0]
    assert got.nonzero().flatten().tolist() == allowed
    # A model vocabulary wider than the tokenizer's: the extra rows are never allowed.
    wide = allowed_tokens(bitmask(allowed).unsqueeze(0), 130)[0]
    assert wide.shape == (130,) and wide.nonzero().flatten().tolist() == allowed


def test_greedy_batch_takes_the_fast_path_only_without_bias_masks_or_logprobs():
    """Plain greedy rows skip the sampling tensors; a greedy row with a logit bias, a min_tokens mask or
    logprobs still gets them, and every row matches the full sampler (`sample_on_device`) on the same batch."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    best = logits.float().argmax(-1)
    greedy, boosted = SamplingParams(temperature=0.0), (int(best[1]) + 1) % VOCAB
    seqs = [seq_step("plain", greedy),
            seq_step("bias", dataclasses.replace(greedy, logit_bias=((boosted, 100.0),))),
            seq_step("masked", greedy, mask_token_ids=(int(best[2]),)),
            seq_step("logprobs", dataclasses.replace(greedy, logprobs=2))]
    inputs = SamplingInputs(VOCAB)
    built: list[int] = []
    tensors = inputs.tensors
    inputs.tensors = lambda rows, device: built.append(len(rows)) or tensors(rows, device)  # type: ignore[method-assign]
    alone = inputs.sample(seqs[:1], logits[:1])
    assert built == [] and alone.sampled == {"plain": int(best[0])}
    result = inputs.sample(seqs, logits)
    assert built == [4]
    rows = [inputs.row(s, logits.device) for s in seqs]
    expected, _ = sample_on_device(logits, tensors(rows, logits.device))
    assert [result.sampled[s.request_id] for s in seqs] == expected.tolist()
    assert result.sampled["bias"] == boosted and result.sampled["masked"] != int(best[2])
    assert set(result.logprobs) == {"logprobs"}


def test_allowed_token_ids_restrict_sampling_and_meet_a_grammar():
    """vLLM's allowed_token_ids: greedy takes the best allowed token (the reference: argmax over the allowed
    columns), sampling never leaves the set, and beside a grammar only the tokens both allow remain."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    allowed = (0, 31, 32, 63, 99)
    inputs = SamplingInputs(VOCAB)
    greedy = inputs.sample([seq_step("g", SamplingParams(temperature=0.0, allowed_token_ids=allowed))], logits[:1])
    assert greedy.sampled["g"] == allowed[int(logits[0, list(allowed)].argmax())]
    drawn = {inputs.sample([seq_step(f"s{i}", SamplingParams(temperature=2.0, seed=i, allowed_token_ids=allowed))],
                           logits[1:2]).sampled[f"s{i}"] for i in range(200)}
    assert drawn <= set(allowed) and len(drawn) > 1
    both = inputs.sample([seq_step("b", SamplingParams(temperature=2.0, seed=0, allowed_token_ids=allowed),
                                   allowed_bitmask=bitmask([32, 40, 50]))], logits[2:])
    assert both.sampled["b"] == 32  # the one token in both sets
    none = inputs.sample([seq_step("n", SamplingParams(temperature=0.0, allowed_token_ids=allowed),
                                   allowed_bitmask=bitmask([40, 50]))], logits[:1])
    assert none.sampled == {} and "no token is left" in none.errors["n"]
    # min_tokens holds the one allowed token back (it is EOS): that row fails alone, its neighbour samples.
    held = [seq_step("held", SamplingParams(temperature=0.0, allowed_token_ids=(7,)), mask_token_ids=(7,)),
            seq_step("free", SamplingParams(temperature=0.0, logprobs=1))]
    out = inputs.sample(held, logits[:2])
    assert "no token is left" in out.errors["held"] and out.sampled == {"free": int(logits[1].argmax())}
    assert {"g", "b"} <= set(inputs.allowed)
    inputs.forget(["g", "b", "n", "held", *(f"s{i}" for i in range(200))])
    assert inputs.allowed == {}
