"""RoPE frequencies for every scaling variant, against transformers' own definitions."""
import pytest
import torch

from tidal.config import ModelConfig
from tidal.layers.rotary import inv_frequencies

VARIANTS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_inv_freq_matches_transformers(name):
    from transformers import Qwen3MoeConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**VARIANTS[name], "rope_theta": 50000.0}
    ref_cfg = Qwen3MoeConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=2048,
                             rope_parameters=params, num_experts=4, num_experts_per_tok=2)
    ours = ModelConfig.from_hf({**ref_cfg.to_dict(), "model_type": "qwen3_moe"})
    kind = params["rope_type"]
    if kind == "default":
        want = 1.0 / (50000.0 ** (torch.arange(0, 64, 2).float() / 64))
        want_scale = 1.0
    else:
        kwargs = {"seq_len": 4096} if kind == "dynamic" else {}
        want, want_scale = ROPE_INIT_FUNCTIONS[kind](ref_cfg, "cpu", **kwargs)
    got, scale = inv_frequencies(ours.rope, 64, 2048, seq_len=4096 if kind == "dynamic" else None)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert abs(scale - want_scale) < 1e-6
