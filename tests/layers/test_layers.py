"""Rope scaling kinds: our inverse frequencies and cos/sin factor equal transformers' ROPE_INIT_FUNCTIONS."""

from __future__ import annotations

import pytest
import torch

from rayllm.layers.basic import RotaryEmbedding, rope_inv_freq

HEAD_DIM, MAX_POS, THETA = 32, 512, 10000.0
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.7,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 128,
                 "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.5 + 0.25 * i for i in range(HEAD_DIM // 2)]},
}


def _hf(scaling: dict, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=MAX_POS,
                      rope_parameters={"rope_theta": THETA, **scaling})
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("kind", list(CASES))
def test_inv_freq_and_attention_factor_match_transformers(kind):
    scaling = CASES[kind]
    # Within max_model_len (at most max_position_embeddings), which is all the engine serves.
    inv, factor = rope_inv_freq(HEAD_DIM, THETA, scaling, MAX_POS, context_len=MAX_POS)
    ref_inv, ref_factor = _hf(scaling, seq_len=MAX_POS)
    torch.testing.assert_close(inv.float(), ref_inv.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-9)


def test_longrope_short_factors_within_the_original_context():
    inv, _ = rope_inv_freq(HEAD_DIM, THETA, CASES["longrope"], MAX_POS, context_len=128)
    torch.testing.assert_close(inv.float(), _hf(CASES["longrope"], seq_len=128)[0].float(), rtol=1e-6, atol=0)


def test_attention_factor_scales_cos_and_sin_and_partial_rotary_keeps_the_rest():
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, CASES["yarn"], rotary_dim=HEAD_DIM // 2)
    _, factor = rope_inv_freq(HEAD_DIM // 2, THETA, CASES["yarn"], MAX_POS)
    assert factor > 1
    torch.testing.assert_close(rotary.cos[0], torch.full((HEAD_DIM // 4,), factor))
    x = torch.randn(5, 3, HEAD_DIM)
    out = rotary.apply(x, rotary.tables(torch.arange(5)))
    assert torch.equal(out[..., HEAD_DIM // 2:], x[..., HEAD_DIM // 2:])
    assert not torch.allclose(out[1:, :, : HEAD_DIM // 2], x[1:, :, : HEAD_DIM // 2])
