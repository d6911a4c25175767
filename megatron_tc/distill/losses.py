"""The stage-2 objective: KL(teacher || student) on logits, optional CE and hidden-state terms.

    loss = T^2 * mean_t KL(softmax(z_t / T) || softmax(z_s / T))
         + ce_weight * mean_t CE(z_s, next token)
         + hidden_weight * mean ||h_s - h_t||^2 / d          (final-norm hidden states)

Both means run over the positions t that have a next token in the same document (labels != -100:
not the last position, not a document's last token, not padding), as the pipeline-parallel loss
(`megatron_tc.parallel.pipeline.DistillLoss`) does, so PP=1 and PP>1 optimize the same objective.

The T^2 factor keeps gradient magnitudes comparable across temperatures (Hinton et al.). Logits
may be vocabulary shards under tensor parallelism: the vocab-parallel losses of
`megatron_tc.parallel.losses` reduce over the TP group and never gather full logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_tc.parallel.chunked_losses import chunked_cross_entropy, chunked_kl
from megatron_tc.parallel.losses import vocab_parallel_cross_entropy, vocab_parallel_kl

IGNORE = -100
# "chunked": per chunk of tokens, fused on CUDA, no [tokens, vocab] fp32 tensors (the default);
# "reference": the closed-form autograd functions over the whole batch (parity tests, benchmarks)
LOSS_IMPLS = {"chunked": (chunked_kl, chunked_cross_entropy),
              "reference": (vocab_parallel_kl, vocab_parallel_cross_entropy)}


@dataclass(frozen=True)
class LossWeights:
    temperature: float = 1.0
    ce_weight: float = 0.0
    hidden_weight: float = 0.0


def next_token_labels(input_ids: Tensor, doc_ids: Tensor | None) -> Tensor:
    """Targets [B, T]: the next token, or IGNORE at the last position and across a document end."""
    labels = torch.full_like(input_ids, IGNORE)
    labels[:, :-1] = input_ids[:, 1:]
    if doc_ids is not None:
        crosses = doc_ids[:, 1:] != doc_ids[:, :-1]
        labels[:, :-1] = labels[:, :-1].masked_fill(crosses, IGNORE)
    return labels


def distill_loss(student_logits: Tensor, teacher_logits: Tensor, input_ids: Tensor, vocab_size: int,
                 weights: LossWeights, doc_ids: Tensor | None = None, labels: Tensor | None = None, tp_group=None,
                 student_hidden: Tensor | None = None, teacher_hidden: Tensor | None = None,
                 impl: str = "chunked") -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss and its detached parts ({"kl", "ce", "hidden"} as present).

    student_logits, teacher_logits: [B, T, V_local]; input_ids, doc_ids: [B, T]; labels [B, T]: the
    packer's next-token targets (IGNORE where none), else derived from input_ids and doc_ids;
    student_hidden, teacher_hidden: [B, T, d] (needed when weights.hidden_weight > 0).
    "kl" in the parts is the per-token KL at the temperature, without the T^2 factor.
    impl: "chunked" (default) or "reference": the same values and gradients (to fp32 rounding),
    see megatron_tc.parallel.chunked_losses.
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss impl {impl!r} is unknown; use one of {sorted(LOSS_IMPLS)}")
    kl_fn, ce_fn = LOSS_IMPLS[impl]
    temp = weights.temperature
    if labels is None:
        labels = next_token_labels(input_ids, doc_ids)
    keep = (labels != IGNORE).to(torch.float32)
    count = keep.sum().clamp(min=1.0)
    per_token_kl = kl_fn(student_logits, teacher_logits.detach(), vocab_size, temp, tp_group)
    kl = (per_token_kl * keep).sum() / count
    loss = kl * temp**2
    parts = {"kl": kl.detach()}
    if weights.ce_weight:
        per_token = ce_fn(student_logits, labels, vocab_size, IGNORE, tp_group)
        ce = per_token.sum() / count
        loss = loss + weights.ce_weight * ce
        parts["ce"] = ce.detach()
    if weights.hidden_weight:
        if student_hidden is None or teacher_hidden is None:
            raise ValueError("hidden_weight > 0 needs the student's and the teacher's final hidden states")
        hidden = (student_hidden.float() - teacher_hidden.detach().float()).pow(2).mean()
        loss = loss + weights.hidden_weight * hidden
        parts["hidden"] = hidden.detach()
    parts["loss"] = loss.detach()
    return loss, parts
