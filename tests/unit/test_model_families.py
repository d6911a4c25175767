"""Teacher parity: tiny random HF models of each family, loaded into HybridLM (all attention),
give the same logits; state-dict mapping round-trips bitwise."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from megatron_tc.convert.hf_mapping import HFMappingError, arch_from_hf_config, hf_to_tc_state_dict, tc_to_hf_state_dict
from megatron_tc.model import HybridLM

COMMON = dict(vocab_size=200, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    "llama_gqa_llama3rope_untied": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        **COMMON, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama_mha_tied": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        **COMMON, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2_bias_tied": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(
        **COMMON, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "mistral_sliding": lambda: tf.MistralForCausalLM(tf.MistralConfig(
        **COMMON, num_key_value_heads=2, sliding_window=7, head_dim=16)),
    "qwen3_qknorm": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(
        **COMMON, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False)),
    "gemma3_mixed": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        **COMMON, num_key_value_heads=2, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


def randomized(hf_model: torch.nn.Module) -> torch.nn.Module:
    """Perturb every parameter (biases and norm weights start at constants in HF)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return hf_model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case):
    hf = randomized(CASES[case]())
    arch = arch_from_hf_config(hf.config, padded_vocab_size=256)
    model = HybridLM(arch).eval()
    model.load_state_dict(hf_to_tc_state_dict(hf.state_dict(), arch), strict=True)
    ids = torch.randint(0, 200, (2, 21))  # longer than every sliding window above
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = model(ids)
    assert got.shape == want.shape == (2, 21, 200)
    assert (got - want).abs().max().item() <= 1e-4


def test_family_features_reach_arch():
    arch = arch_from_hf_config(CASES["gemma3_mixed"]().config)
    assert (arch.family, arch.norm_unit_offset, arch.sandwich_norm, arch.qk_norm) == ("gemma3", True, True, True)
    assert arch.attn_layer_types == ["sliding", "full", "sliding"] and arch.sliding_window == 6
    assert arch.rope_local_theta == 1e4 and arch.rope_theta == 1e6 and arch.query_scale == 24**-0.5
    assert arch.embed_scale == 64**0.5 and arch.mlp_activation == "gelu_tanh"
    arch = arch_from_hf_config(CASES["mistral_sliding"]().config)
    assert arch.sliding_window == 7 and arch.layer_type(0) == "sliding"
    assert arch_from_hf_config(CASES["qwen2_bias_tied"]().config).attention_bias


@pytest.mark.parametrize("case", ["llama_mha_tied", "gemma3_mixed", "qwen2_bias_tied"])
def test_state_dict_round_trip_is_exact(case):
    hf = randomized(CASES[case]())
    arch = arch_from_hf_config(hf.config, padded_vocab_size=256)
    sd = hf.state_dict()
    tc = hf_to_tc_state_dict(sd, arch)
    assert tc["embed_tokens.weight"].shape == (256, 64) and not tc["embed_tokens.weight"][200:].any()
    back = tc_to_hf_state_dict(tc, arch)
    assert set(back) == set(sd)
    for name, tensor in sd.items():
        assert torch.equal(back[name], tensor), name


def test_unsupported_inputs_raise_clearly():
    with pytest.raises(HFMappingError, match="supported model types: .*llama"):
        arch_from_hf_config(tf.GPT2Config())
    hf = CASES["llama_mha_tied"]()
    arch = arch_from_hf_config(hf.config)
    sd = hf.state_dict()
    sd.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(HFMappingError, match="missing .*layers.1.mlp.up_proj"):
        hf_to_tc_state_dict(sd, arch)
    with pytest.raises(HFMappingError, match="Gated DeltaNet"):
        hf_to_tc_state_dict(hf.state_dict(), arch.with_pattern("AGA"))
