"""Pipeline-parallel distillation on DeepSpeed's pipeline engine (ZeRO stage 0 or 1).

The student and the frozen teacher run side by side: a stage holds the student's *and* the
teacher's layers of its span, and passes both hidden states on. The pipeline's layers are

    0        student embedding        (ids, pos, doc)            -> (s, ids, pos, doc)
    1        teacher embedding        (s, ids, pos, doc)         -> (s, t, pos, doc)
    2..L+1   StudentTeacherLayer i    (s, t, pos, doc)           -> (s, t, pos, doc)
    L+2      FinalNorms               (s, t, pos, doc)           -> (norm(s), teacher logits)
    L+3      student LM head          (norm(s), teacher logits)  -> (student logits, teacher logits)

and the last stage's `loss_fn` is the (vocab-parallel) KL. Teacher tensors travel bit-cast to an
integer dtype of the same width (`pack`): DeepSpeed then neither gives them `requires_grad` nor
expects a gradient for them on the way back, so no backward pass ever runs through the teacher.
With tied student embeddings the embedding and the LM head are one `TiedLayerSpec`: DeepSpeed
keeps the first and last stage's copies equal and sums their gradients.

Stages split the layers by trainable parameter count (`partition="parameters"`) or at the '|'
marks of the layer pattern (`partition="pattern"`, e.g. "AGGG|GAGG" puts four layers on each of
two stages; the embeddings go with the first stage, the heads with the last).
"""
from __future__ import annotations

from functools import partial
from typing import Iterator, Literal

import torch
import torch.distributed as dist
from torch import nn

from megatron_tc.model import DecoderLayer, HybridLM
from megatron_tc.model.ops.masks import positions_from_doc_ids

from .losses import vocab_parallel_cross_entropy, vocab_parallel_kl
from .state import ParallelContext

Partition = Literal["parameters", "pattern"]
# Integer types NCCL can send (it has no int16): bf16 travels as two int8 per element, so the last
# dimension doubles on the way and halves on arrival. fp16 would be ambiguous with bf16: bf16/fp32 only.
_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int8, torch.float64: torch.int64}
_FLOAT_OF = {v: k for k, v in _INT_OF.items()}


def pack(x: torch.Tensor) -> torch.Tensor:
    """A teacher activation as raw bits (an integer tensor, no autograd) for transport: DeepSpeed's
    pipeline engine sends gradients back for every floating-point activation, not for integers."""
    if x.dtype not in _INT_OF:
        raise TypeError(f"teacher activations must be fp32 or bf16 to cross pipeline stages, got {x.dtype}")
    return x.detach().contiguous().view(_INT_OF[x.dtype])


def unpack(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(_FLOAT_OF[bits.dtype])


def _embed(embedding: nn.Module, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """HybridLM.embed for a detached embedding module: lookup, then the (Gemma) scale."""
    x = embedding(ids)
    return x * torch.tensor(scale, dtype=x.dtype, device=x.device) if scale != 1.0 else x


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap if cap is not None else logits


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """hidden [B, T, H] @ weight [V_local, H]^T; under TP the input gradient is summed over TP."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1 and torch.is_grad_enabled():
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    return hidden @ weight.t()


# ---- pipeline layers ----------------------------------------------------------------------------
class StudentEmbedding(nn.Module):
    def __init__(self, embed_tokens: nn.Module, scale: float):
        super().__init__()
        self.embed_tokens, self.scale = embed_tokens, scale

    def forward(self, inputs):
        return embed_student(self.embed_tokens, inputs, self.scale)


def embed_student(embedding: nn.Module, inputs, scale: float):
    """(ids, pos, doc) -> (student hidden, ids, pos, doc); also the tied spec's forward_fn."""
    ids, pos, doc = inputs
    return _embed(embedding, ids, scale), ids, pos, doc


class TeacherEmbedding(nn.Module):
    def __init__(self, embed_tokens: nn.Module, scale: float):
        super().__init__()
        self.embed_tokens, self.scale = embed_tokens, scale

    def forward(self, inputs):
        s, ids, pos, doc = inputs
        with torch.no_grad():
            return s, pack(_embed(self.embed_tokens, ids, self.scale)), pos, doc


class StudentTeacherLayer(nn.Module):
    """Layer i of the student (trained) and of the teacher (frozen, no graph)."""

    def __init__(self, student: DecoderLayer, teacher: DecoderLayer):
        super().__init__()
        self.student, self.teacher = student, teacher

    def forward(self, inputs):
        s, t_bits, pos, doc = inputs
        s = self.student(s, pos, doc)
        with torch.no_grad():
            t = self.teacher(unpack(t_bits), pos, doc)
        return s, pack(t), pos, doc


class FinalNorms(nn.Module):
    """Both final norms; the teacher's logits (its vocabulary shard) as well."""

    def __init__(self, student: HybridLM, teacher: HybridLM):
        super().__init__()
        self.student_norm, self.teacher_norm = student.norm, teacher.norm
        self.teacher_out = teacher.lm_head if teacher.lm_head is not None else teacher.embed_tokens
        self.teacher_cap = teacher.arch.final_logit_softcap

    def forward(self, inputs):
        s, t_bits, _pos, _doc = inputs
        with torch.no_grad():
            t = self.teacher_norm(unpack(t_bits))
            t_logits = _softcap(_head_logits(t, self.teacher_out.weight, None), self.teacher_cap)
        return self.student_norm(s), pack(t_logits)


class StudentHead(nn.Module):
    def __init__(self, lm_head: nn.Module, cap: float | None):
        super().__init__()
        self.lm_head, self.cap = lm_head, cap

    def forward(self, inputs):
        s, t_bits = inputs
        return _softcap(self.lm_head(s), self.cap), t_bits


def tied_student_logits(embedding: nn.Module, inputs, cap: float | None, tp_group: dist.ProcessGroup | None):
    s, t_bits = inputs
    return _softcap(_head_logits(s, embedding.weight, tp_group), cap), t_bits


class DistillLoss:
    """loss_fn(outputs, labels): mean KL(teacher || student) over tokens whose label is not
    `ignore_index`, plus `ce_weight` x cross-entropy against the labels. labels: [B, T] token ids."""

    def __init__(self, vocab_size: int, temperature: float = 1.0, ce_weight: float = 0.0,
                 tp_group: dist.ProcessGroup | None = None, ignore_index: int = -100):
        self.vocab_size, self.temperature, self.ce_weight = vocab_size, temperature, ce_weight
        self.tp_group, self.ignore_index = tp_group, ignore_index
        self.__name__ = "DistillLoss"

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        student_logits, teacher_bits = outputs
        teacher_logits = unpack(teacher_bits)
        keep = (labels != self.ignore_index).to(torch.float32)
        count = keep.sum().clamp(min=1.0)
        kl = vocab_parallel_kl(student_logits, teacher_logits, self.vocab_size, self.temperature, self.tp_group)
        loss = (kl * keep).sum() / count
        if self.ce_weight:
            ce = vocab_parallel_cross_entropy(student_logits, labels, self.vocab_size, self.ignore_index, self.tp_group)
            loss = loss + self.ce_weight * ce.sum() / count
        return loss


# ---- building -----------------------------------------------------------------------------------
class Existing(nn.Module):
    """LayerSpec type whose "construction" hands DeepSpeed a module we already built and loaded
    (LayerSpec insists on an nn.Module subclass): Existing(m) is m itself."""

    def __new__(cls, module: nn.Module) -> nn.Module:  # type: ignore[misc]
        return module


def pipeline_layers(student: HybridLM, teacher: HybridLM, ctx: ParallelContext) -> list:
    """The layer list described in the module doc (nn.Modules and TiedLayerSpecs)."""
    from deepspeed.pipe import TiedLayerSpec

    if student.arch.num_layers != teacher.arch.num_layers:
        raise ValueError(f"student has {student.arch.num_layers} layers, teacher {teacher.arch.num_layers}: "
                         "the pipeline pairs layer i of both")
    tp_group = ctx.tp_group if ctx.tp_size > 1 else None
    arch = student.arch
    if student.lm_head is None:  # tied: one module, present on the first and the last stage
        first = TiedLayerSpec("student_embedding", Existing, student.embed_tokens,
                              forward_fn=partial(embed_student, scale=arch.embed_scale), tied_weight_attr=["weight"])
        last = TiedLayerSpec("student_embedding", Existing, student.embed_tokens,
                             forward_fn=partial(tied_student_logits, cap=arch.final_logit_softcap, tp_group=tp_group),
                             tied_weight_attr=["weight"])
    else:
        first = StudentEmbedding(student.embed_tokens, arch.embed_scale)
        last = StudentHead(student.lm_head, arch.final_logit_softcap)
    pairs = [StudentTeacherLayer(s, t) for s, t in zip(student.layers, teacher.layers)]
    return [first, TeacherEmbedding(teacher.embed_tokens, teacher.arch.embed_scale), *pairs,
            FinalNorms(student, teacher), last]


def pattern_parts(layer_pattern: str, num_layers: int, pp: int) -> list[int]:
    """Stage boundaries over the pipeline layer list from the '|' marks of the pattern."""
    spans = [len(s) for s in layer_pattern.split("|")]
    if len(spans) != pp or 0 in spans or sum(spans) != num_layers:
        raise ValueError(f"layer pattern {layer_pattern!r} must have {pp} non-empty '|'-separated stages covering "
                         f"{num_layers} layers for pipeline_partition='pattern'")
    parts, edge = [0], 2  # the two embeddings precede the first layer
    for span in spans[:-1]:
        edge += span
        parts.append(edge)
    parts.append(num_layers + 4)
    return parts


def _pipeline_module_class():
    from deepspeed.pipe import PipelineModule

    class DistillPipelineModule(PipelineModule):
        """PipelineModule that also accepts explicit stage boundaries (partition 'pattern')."""

        def _partition_layers(self, method="uniform"):
            if method != "explicit":
                return super()._partition_layers(method)
            self.parts = list(self._explicit_parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return DistillPipelineModule


def build_pipeline_module(student: HybridLM, teacher: HybridLM, ctx: ParallelContext, loss_fn: DistillLoss,
                          partition: Partition = "parameters", activation_checkpointing: bool = False):
    """A DeepSpeed PipelineModule over ctx's PP x DP x TP layout (same rank order as megatron-core).

    `student` and `teacher` are full models (tensor-parallel already if TP > 1); each rank keeps
    only its stage's modules, which stay the very objects of `student` / `teacher`.
    """
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    for p in teacher.parameters():
        p.requires_grad_(False)
    teacher.eval()
    layers = pipeline_layers(student, teacher, ctx)
    topology = PipeModelDataParallelTopology(num_pp=ctx.pp_size, num_mp=ctx.tp_size, num_dp=ctx.dp_size)
    cls = _pipeline_module_class()
    method = "parameters"
    if partition == "pattern":
        explicit = pattern_parts(student.arch.layer_pattern, student.arch.num_layers, ctx.pp_size)
        method = "explicit"
    elif partition != "parameters":
        raise ValueError(f"pipeline partition {partition!r}: use 'parameters' or 'pattern'")
    module = cls.__new__(cls)
    object.__setattr__(module, "_explicit_parts", explicit if method == "explicit" else None)
    cls.__init__(module, layers=layers, topology=topology, loss_fn=loss_fn, partition_method=method,
                 activation_checkpoint_interval=1 if activation_checkpointing else 0,
                 checkpointable_layers=["StudentTeacherLayer"])
    return module


def build_pipeline_engine(student: HybridLM, teacher: HybridLM, ds_config: dict, ctx: ParallelContext,
                          loss_fn: DistillLoss, partition: Partition = "parameters",
                          activation_checkpointing: bool = False):
    """`deepspeed.initialize` on the pipeline module; returns DeepSpeed's PipelineEngine
    (`engine.train_batch(data_iter)` runs one optimizer step over gradient_accumulation_steps
    micro-batches; see `pipeline_batches`)."""
    import deepspeed

    from .deepspeed_engine import init_deepspeed_comm

    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage > 1:
        raise ValueError(f"DeepSpeed's pipeline engine supports ZeRO stage 0 or 1, not {stage}; set "
                         "parallel.zero_stage=1 with parallel.pp > 1")
    init_deepspeed_comm()
    module = build_pipeline_module(student, teacher, ctx, loss_fn, partition, activation_checkpointing)
    trainable = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, model_parameters=trainable, config=ds_config,
                                      dist_init_required=False)
    return engine


def pipeline_batch(input_ids: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None):
    """One micro-batch as the pipeline engine reads it: ((ids, positions, doc_ids), labels).

    input_ids, labels, doc_ids: [B, T]; doc_ids None means one document per row."""
    if doc_ids is None:
        doc_ids = torch.zeros_like(input_ids)
    return (input_ids, positions_from_doc_ids(doc_ids), doc_ids), labels


def pipeline_batches(micro_batches) -> Iterator:
    """An iterator for `engine.train_batch(data_iter=...)` from (input_ids, labels[, doc_ids]) tuples."""
    for mb in micro_batches:
        yield pipeline_batch(*mb)
