"""Tiny random HF models of every supported family (hidden 64, 4 layers, 4 heads / 2 KV groups)."""
from __future__ import annotations

import torch
import transformers as tf

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

FAMILIES = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, tie_word_embeddings=False)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=5, head_dim=16)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        **COMMON, head_dim=16, sliding_window=5, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


def random_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny model with every parameter perturbed (HF starts norms/biases at constants)."""
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()
