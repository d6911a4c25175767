"""Activation checkpointing: every decoder layer (attention and GDN) is recomputed in backward,
and the loss and every gradient equal the run without it."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.model import ArchConfig, HybridLM


def tiny_model(pattern: str, **overrides) -> HybridLM:
    arch = ArchConfig(family="llama", vocab_size=90, padded_vocab_size=128, hidden_size=64, num_layers=len(pattern),
                      num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96, layer_pattern=pattern,
                      gdn_chunk_size=8, **overrides)
    torch.manual_seed(0)
    return HybridLM(arch, init_std=0.2)


def loss_and_grads(model: HybridLM, ids: torch.Tensor, doc_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    logits = model(ids, doc_ids=doc_ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 90), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pattern,overrides,mixers_only", [
    ("AGAG", {}, False), ("GAGG", {"gdn_conv_size": 4, "tie_embeddings": True}, False), ("AGGA", {}, True)])
def test_checkpointed_gradients_equal_plain_ones_and_layers_are_recomputed(pattern, overrides, mixers_only):
    model = tiny_model(pattern, **overrides)
    if mixers_only:  # stage 2's `trainable: mixers`: the embedding is frozen
        for name, param in model.named_parameters():
            param.requires_grad_(".mixer." in name)
    ids = torch.randint(0, 90, (2, 20), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.tensor([[0] * 12 + [1] * 8, [0] * 20])  # packed documents go through the recompute too
    want_loss, want = loss_and_grads(model, ids, doc_ids)

    calls = {i: 0 for i in range(len(pattern))}
    for i, layer in enumerate(model.layers):
        layer.mixer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    model.set_activation_checkpointing(True)
    got_loss, got = loss_and_grads(model, ids, doc_ids)
    assert calls == {i: 2 for i in range(len(pattern))}  # forward, then the recompute in backward
    assert torch.equal(got_loss, want_loss)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sorted(got) == sorted(want) and len(want) == len(trainable)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)

