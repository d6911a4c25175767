"""Workers for tests/parallel/test_tensor_parallel.py (TP=2 against one process)."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from megatron_tc.model import HybridLM
from megatron_tc.parallel.losses import vocab_parallel_cross_entropy, vocab_parallel_kl
from megatron_tc.parallel.state import destroy_parallel, init_parallel
from megatron_tc.parallel.tensor_parallel import (apply_tensor_parallel, gather_full,
                                                  gather_full_state_dict, gather_vocab_shards)
from tests.parallel._workers_common import VOCAB, assert_close, assert_same_weights, on, place, rel_err, tiny_arch

# Two layouts that between them exercise every sharding rule: q/k norms, q/k/v biases, short convs,
# tied and untied heads, GDN with its own GQA (gdn_expand_kv=False), Gemma's sandwich norms,
# embedding scale, logit soft-cap and GeGLU, packed documents.
VARIANTS = {
    "qwen3_tied_conv": dict(pattern="AGGA", family="qwen3", qk_norm=True, attention_bias=True, tie_embeddings=True,
                            gdn_conv_size=4),
    "gemma3_untied_gqa_gdn": dict(pattern="GAAG", family="gemma3", qk_norm=True, sandwich_norm=True,
                                  norm_unit_offset=True, embed_scale=math.sqrt(32), final_logit_softcap=30.0,
                                  mlp_activation="gelu_tanh", gdn_expand_kv=False, sliding_window=8,
                                  attn_layer_types=["sliding", "full", "sliding", "full"]),
}


def _loss_full(logits: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Single-process reference: CE + KL(teacher || student) at T=2, full vocabulary."""
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
    kl = F.kl_div(torch.log_softmax(logits / 2, -1), torch.log_softmax(teacher[..., :VOCAB] / 2, -1),
                  log_target=True, reduction="none").sum(-1).mean()
    return ce + kl


def _loss_tp(local: torch.Tensor, teacher_local: torch.Tensor, target: torch.Tensor, ctx) -> torch.Tensor:
    ce = vocab_parallel_cross_entropy(local, target, VOCAB, tp_group=ctx.tp_group).mean()
    kl = vocab_parallel_kl(local, teacher_local, VOCAB, temperature=2.0, tp_group=ctx.tp_group).mean()
    return ce + kl


def tp_and_single_forward_backward(variant: str, ctx, dtype: torch.dtype, device: str = "cpu") -> dict:
    """One forward + backward of the TP model and of the unsharded model, same weights and data.

    Returns {"tp_logits", "logits": [2, 24, VOCAB]; "tp_grads", "grads": {name: full gradient}}
    (TP values gathered over the TP group, on every rank)."""
    opts = dict(VARIANTS[variant])
    arch = tiny_arch(opts.pop("pattern"), tp=ctx.tp_size, **opts)
    torch.manual_seed(0)
    reference = place(HybridLM(arch, init_std=0.2), device, dtype)
    full_state = {k: v.clone() for k, v in reference.state_dict().items()}
    model = apply_tensor_parallel(copy.deepcopy(reference), ctx)
    assert sorted(model.state_dict()) == sorted(full_state), "sharded state dict must keep HybridLM's names"
    for name, tensor in gather_full_state_dict(model, ctx).items():
        assert torch.equal(tensor, full_state[name]), f"gathered {name} differs from the unsharded weight"
    assert all(p.device.type == torch.device(device).type for p in model.parameters()), f"TP model not on {device}"

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    target = torch.randint(0, VOCAB, (2, 24), generator=g)
    doc_ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    teacher = (torch.randn(2, 24, arch.padded_vocab_size, generator=g) * 3).to(dtype)
    ids, target, doc_ids, teacher = on(device, (ids, target, doc_ids, teacher))

    want = reference(ids, doc_ids=doc_ids)
    _loss_full(want, teacher, target).backward()
    local = model(ids, doc_ids=doc_ids)
    assert local.shape[-1] == arch.padded_vocab_size // ctx.tp_size
    teacher_local = teacher.chunk(ctx.tp_size, -1)[ctx.tp_rank]
    _loss_tp(local, teacher_local, target, ctx).backward()

    ref_params = dict(reference.named_parameters())
    tp_grads, grads = {}, {}
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{variant}: {name} got no gradient"
        tp_grads[name] = gather_full(param.grad, param, ctx)
        grads[name] = ref_params[name].grad
    assert len(tp_grads) == len(ref_params)
    return {"tp_logits": gather_vocab_shards(local, VOCAB, ctx).detach(), "logits": want.detach(),
            "tp_grads": tp_grads, "grads": grads}


def all_grads(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[k].flatten() for k in sorted(grads)])


def check_model(variant: str, ctx, dtype: torch.dtype, device: str = "cpu") -> None:
    """fp32: logits within 1e-5 and all gradients together within 1e-5 (relative). Per tensor,
    fp32 cannot resolve 1e-5: the single-process model's own fp32 gradients differ from its fp64
    ones by up to ~3e-5 on small tensors such as A_log (summation order). So the fp64 run checks
    every tensor's gradient to 1e-5 (the model keeps GDN gates and output norm in fp32 even
    then, which leaves ~1e-6 of rounding); sharding mistakes show up as 1e-2 or more."""
    out = tp_and_single_forward_backward(variant, ctx, dtype, device)
    tol = 1e-5 if dtype == torch.float32 else 1e-7  # fp64 logits: only the fp32 GDN islands round
    assert_close(out["tp_logits"], out["logits"], f"{variant} {dtype} logits", tol)
    if dtype == torch.float64:
        for name, want in out["grads"].items():
            assert_close(out["tp_grads"][name], want, f"{variant} grad of {name}", 1e-5)
    err = rel_err(all_grads(out["tp_grads"]), all_grads(out["grads"]))
    assert err <= 1e-5, f"{variant} {dtype}: all gradients, relative error {err:.3g} > 1e-5"


def tp_model_matches_single_process(rank: int, world_size: int) -> None:
    ctx = init_parallel(tp=2, pp=1)
    try:
        assert (ctx.tp_size, ctx.dp_size, ctx.pp_size) == (2, 1, 1)
        for variant in VARIANTS:
            for dtype in (torch.float32, torch.float64):
                check_model(variant, ctx, dtype)
    finally:
        destroy_parallel()


def vocab_parallel_losses_match_full(rank: int, world_size: int) -> None:
    """KL and CE on vocabulary shards == full-vocabulary losses, values and gradients. With
    V=100 padded to 256 over 2 ranks, rank 1's shard is all padding: the edge case is included."""
    ctx = init_parallel(tp=2, pp=1)
    try:
        g = torch.Generator().manual_seed(7)
        for vocab, padded in ((100, 256), (250, 256)):
            student = (torch.randn(3, 5, padded, generator=g) * 4).requires_grad_()
            teacher = (torch.randn(3, 5, padded, generator=g) * 4).requires_grad_()
            target = torch.randint(0, vocab, (3, 5), generator=g)
            target[0, 0] = -100
            weights = torch.rand(3, 5, generator=g)

            kl_ref = F.kl_div(torch.log_softmax(student[..., :vocab] / 1.5, -1),
                              torch.log_softmax(teacher[..., :vocab] / 1.5, -1), log_target=True,
                              reduction="none").sum(-1)
            ce_ref = F.cross_entropy(student[..., :vocab].reshape(-1, vocab), target.reshape(-1),
                                     reduction="none").view(3, 5)
            ((kl_ref + ce_ref) * weights).sum().backward()

            s_local = student.detach().chunk(2, -1)[ctx.tp_rank].clone().requires_grad_()
            t_local = teacher.detach().chunk(2, -1)[ctx.tp_rank].clone().requires_grad_()
            kl = vocab_parallel_kl(s_local, t_local, vocab, temperature=1.5, tp_group=ctx.tp_group)
            ce = vocab_parallel_cross_entropy(s_local, target, vocab, tp_group=ctx.tp_group)
            assert_close(kl, kl_ref, f"KL values (vocab {vocab})")
            assert_close(ce, ce_ref, f"CE values (vocab {vocab})")
            ((kl + ce) * weights).sum().backward()
            assert_close(s_local.grad, student.grad.chunk(2, -1)[ctx.tp_rank], f"student grad (vocab {vocab})")
            assert_close(t_local.grad, teacher.grad.chunk(2, -1)[ctx.tp_rank], f"teacher grad (vocab {vocab})")
            padding = s_local.grad[..., max(0, vocab - ctx.tp_rank * padded // 2):]
            assert torch.count_nonzero(padding) == 0, "padding columns must get zero gradient"
    finally:
        destroy_parallel()


def tp_zero3_training_matches_single_process(rank: int, world_size: int) -> None:
    """TP=2 inside DeepSpeed ZeRO-3 (DP=1): gradient clipping over the TP group through the mpu,
    the partial-gradient hooks of q/k/o norms under ZeRO-3, the tied vocab-parallel head, the
    TP teacher engine. Three distillation steps == single-process AdamW."""
    import deepspeed

    from megatron_tc.parallel import deepspeed_engine as dse

    ctx = init_parallel(tp=2, pp=1)
    try:
        arch = tiny_arch("AGGA", tp=2, qk_norm=True, tie_embeddings=True)
        torch.manual_seed(0)
        reference, teacher = HybridLM(arch, init_std=0.2), HybridLM(arch.with_pattern("AAAA"), init_std=0.2)
        teacher.requires_grad_(False)
        engine = dse.build_student_engine(
            apply_tensor_parallel(copy.deepcopy(reference), ctx),
            dse.build_deepspeed_config(zero_stage=3, micro_batch_size=2, global_batch_size=2, dp_size=1, lr=1e-3,
                                       grad_clip=0.5), ctx)
        teacher_engine = dse.build_teacher(apply_tensor_parallel(copy.deepcopy(teacher), ctx), engine.config, ctx,
                                           mode="engine")
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        g = torch.Generator().manual_seed(1)
        clipped = 0
        for _ in range(3):
            ids = torch.randint(0, VOCAB, (2, 16), generator=g)
            with torch.no_grad():
                teacher_local, teacher_full = teacher_engine(ids), teacher(ids)
            loss = vocab_parallel_kl(engine(ids), teacher_local, VOCAB, 2.0, ctx.tp_group).mean()
            engine.backward(loss)
            engine.step()
            want = vocab_parallel_kl(reference(ids), teacher_full, VOCAB, 2.0).mean()
            want.backward()
            clipped += int(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5) > 0.5)
            opt.step()
            opt.zero_grad()
            assert_close(loss.detach(), want.detach(), "TP+ZeRO-3 loss")
        assert clipped, "clipping never engaged: the TP gradient norm would go untested"
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            got = {n: gather_full(p.detach(), p, ctx).clone() for n, p in engine.module.named_parameters()}
        assert_same_weights(got, {n: p.detach() for n, p in reference.named_parameters()}, "TP+ZeRO-3")
    finally:
        destroy_parallel()


def tp_worker(rank: int, world_size: int) -> None:
    """Every TP check in one pair of processes (start-up dominates their cost)."""
    vocab_parallel_losses_match_full(rank, world_size)
    tp_model_matches_single_process(rank, world_size)
    tp_zero3_training_matches_single_process(rank, world_size)
