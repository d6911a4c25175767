"""tools/plan.py's memory plan: parameter counts from the model, ZeRO / TP / checkpointing terms,
the peak as the larger of two phases, the loss buffers and the attention layer's activation bytes
against what the loss and the layer actually keep, bad layouts."""
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
        # ZeRO-3 partitions the weights and keeps the full bf16 parameters gathered while they are used
        assert got["student_weights"] == (plain["student_weights"] // 4 if stage == 3 else plain["student_weights"])
        assert got["gathered_weights"] == (plain["student_weights"] if stage == 3 else 0)
    offload = mp.plan_memory(mp.PlanInput(**{**base.__dict__, "offload_optimizer": True}))
    assert offload["bytes"]["optimizer"] == offload["bytes"]["optimizer_step"] == 0
    assert offload["host_optimizer_bytes"] == plain["optimizer"]
    ckpt = mp.plan_memory(mp.PlanInput(**{**base.__dict__, "activation_checkpointing": True}))["bytes"]
    a = arch()
    per_layer = [mp.layer_activation_bytes(a, k) for k in "AGGG"]
    assert ckpt["activations"] == 128 * (2 * a.hidden_size * 4 + max(per_layer))
    assert plain["activations"] == 128 * sum(per_layer)


def test_the_peak_is_the_larger_phase_not_the_sum_of_all_parts():
    """Forward + backward holds activations and logits, the optimizer step its fp32 buffers; a
    long sequence peaks in the first, a short one with the same model in the second."""
    for seq, phase in ((4096, "fwd_bwd"), (8, "step")):
        got = mp.plan_memory(mp.PlanInput(arch(vocab_size=4096), "AGGG", seq_len=seq))
        parts = got["bytes"]
        static = sum(parts[k] for k in ("student_weights", "gradients", "grad_bucket", "optimizer", "teacher"))
        fwd_bwd = static + parts["gathered_weights"] + parts["activations"] + parts["loss_buffers"]
        step = static + 2 * seq * 4096 + parts["optimizer_step"]  # the teacher's bf16 logits live until the step ends
        assert got["peak_phase"] == phase
        assert abs(got["total_bytes"] - max(fwd_bwd, step)) <= 2 and got["total_bytes"] < sum(parts.values())
        q = got["parameters"]["student_trainable"]
        assert parts["optimizer_step"] == 8 * q and parts["optimizer"] == 12 * q  # one sub-group: the whole shard


def test_loss_buffers_are_what_the_chunked_kl_keeps():
    """The plan's 6 bytes per logit: the bf16 logits of both models that the chunked KL saves for
    backward and the student's logit gradient it writes (no fp32 [tokens, vocab] tensor)."""
    from megatron_tc.distill.losses import LossWeights, distill_loss

    vocab, b, t = 512, 2, 64
    student = torch.randn(b, t, vocab, dtype=torch.bfloat16, requires_grad=True)
    teacher = torch.randn(b, t, vocab, dtype=torch.bfloat16)
    saved: dict[int, int] = {}

    def pack(x):
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss, _ = distill_loss(student, teacher, torch.randint(0, vocab, (b, t)), vocab, LossWeights(), impl="chunked")
    loss.backward()
    held = sum(saved.values()) + student.grad.numel() * student.grad.element_size()
    planned = mp.plan_memory(mp.PlanInput(arch(vocab_size=vocab), "AGGG", micro_batch_size=b, seq_len=t))
    assert abs(planned["bytes"]["loss_buffers"] - held) <= 0.03 * held  # the rest: per-token fp32 sums


def test_attention_layer_activation_bytes_match_what_autograd_saves(monkeypatch):
    """bf16 training forward of one attention layer with the compiled blocks (inductor's C++
    backend here, as on CUDA): bytes of the tensors autograd keeps for backward, the input
    included, weights excluded, against the plan's per-layer term. The GDN term describes fla's
    CUDA kernel and is checked on the GPU (tests/gpu/test_memory_plan_cuda.py)."""
    from megatron_tc.bench.activation_memory import layer_saved_bytes
    from megatron_tc.model import fused

    monkeypatch.setenv("MEGATRON_TC_COMPILE", "force")
    monkeypatch.setattr(fused, "_COMPILED", {})
    a = arch(num_layers=1)
    measured = layer_saved_bytes(a, "A", 1, 128, torch.device("cpu"))
    assert abs(mp.layer_activation_bytes(a, "A") - measured) <= 0.02 * measured


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
