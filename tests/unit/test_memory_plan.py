"""tools/plan.py's memory plan: parameter counts from the model, ZeRO / TP / checkpointing terms,
the attention layer's activation bytes against what autograd actually saves, bad layouts."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.model import ArchConfig, HybridLM
from megatron_tc.parallel import memory_plan as mp
from megatron_tc.parallel.plan_cli import main as plan_main


def arch(**overrides) -> ArchConfig:
    fields = dict(family="llama", vocab_size=256, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=64, intermediate_size=768)
    fields.update(overrides)
    return ArchConfig(**fields)


def test_parameter_counts_are_the_models():
    a = arch(layer_pattern="AGAG")
    model = HybridLM(a)
    counts = mp.parameter_counts(a, "mixers")
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["trainable"] == sum(p.numel() for n, p in model.named_parameters() if ".mixer." in n)
    assert counts["largest_layer"] == max(sum(p.numel() for p in layer.parameters()) for layer in model.layers)


def test_zero_stages_shard_what_deepspeed_shards_and_checkpointing_keeps_layer_inputs():
    base = mp.PlanInput(arch(), "AGGG", dp=1, zero_stage=0, micro_batch_size=2, seq_len=64)
    plain = mp.plan_memory(base)["bytes"]
    for stage, sharded in ((1, {"optimizer"}), (2, {"optimizer", "gradients"}), (3, {"optimizer", "gradients"})):
        got = mp.plan_memory(mp.PlanInput(**{**base.__dict__, "dp": 4, "zero_stage": stage}))["bytes"]
        for part in ("optimizer", "gradients"):
            assert got[part] == (plain[part] // 4 if part in sharded else plain[part]), (stage, part)
    offload = mp.plan_memory(mp.PlanInput(**{**base.__dict__, "offload_optimizer": True}))
    assert offload["bytes"]["optimizer"] == 0 and offload["host_optimizer_bytes"] == plain["optimizer"]
    ckpt = mp.plan_memory(mp.PlanInput(**{**base.__dict__, "activation_checkpointing": True}))["bytes"]
    a = arch()
    per_layer = [mp.layer_activation_bytes(a, k) for k in "AGGG"]
    assert ckpt["activations"] == 128 * (2 * a.hidden_size * 4 + max(per_layer))
    assert plain["activations"] == 128 * sum(per_layer)


def test_attention_layer_activation_bytes_match_what_autograd_saves():
    """bf16 training forward of one attention layer on CPU: bytes of the tensors autograd keeps
    for backward (weights excluded, shared storage counted once) against the plan's formula."""
    a = arch(num_layers=1)
    layer = HybridLM(a).to(torch.bfloat16).layers[0]
    seq = 128
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(1, seq, a.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, torch.arange(seq)[None], None, None)
    measured = sum(saved.values()) / seq
    assert abs(mp.layer_activation_bytes(a, "A") - measured) <= 0.2 * measured


def test_bad_layouts_are_refused_with_one_line(capsys):
    with pytest.raises(mp.PlanError, match="tp=3 does not divide"):
        mp.plan_memory(mp.PlanInput(arch(), "AAAA", tp=3))
    with pytest.raises(mp.PlanError, match="ZeRO-1 at most"):
        mp.plan_memory(mp.PlanInput(arch(), "AAAA", pp=2, zero_stage=3))
    assert plan_main(["--teacher", "llama3-8b", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: tp=3 does not divide") and "\n" not in err


def test_search_lists_fitting_layouts_fastest_first():
    from megatron_tc.parallel.plan_cli import search

    base = mp.PlanInput(arch(num_layers=8), "AGGGAGGG", seq_len=256)
    fits = search(base, gpus=2, gpu_gib=0.5)
    assert fits and all(r["total_bytes"] <= 0.45 * mp.GIB for _, r in fits)
    speeds = [r["tokens_per_s"] for _, r in fits]
    assert speeds == sorted(speeds, reverse=True)
    assert all(p.tp * p.pp * p.dp == 2 for p, _ in fits)
