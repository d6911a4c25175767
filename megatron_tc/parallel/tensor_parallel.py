"""Tensor parallelism applied in place to a single-device `HybridLM`.

`apply_tensor_parallel(model, ctx)` swaps the model's Linear / Embedding modules for megatron-core
parallel layers and loads into each the shard of the existing weights that this TP rank owns:

  attention    q_proj rows of the group's query heads, k/v rows of the group's KV head(s)
               (column-parallel, so query group g lives whole on one rank), o_proj row-parallel
  GDN          q/k/v/a/b/g column-parallel by head, o_proj row-parallel; A_log, dt_bias and the
               short-conv channels split by head
  MLP          gate/up column-parallel, down row-parallel
  vocabulary   VocabParallelEmbedding; the LM head is column-parallel over the padded vocabulary
               (tied: it multiplies by the embedding's shard)

The mixers read their head counts from module attributes (`num_heads`, `num_kv_heads`,
`kv_heads`), which are set to the local counts, so the model code runs unchanged. Parameters that
are replicated but see only the local heads (q_norm / k_norm / o_norm weights, shared by all heads)
get their gradient summed over the TP group by a hook. State-dict names stay those of HybridLM.

After the swap, `model(...)` returns this rank's vocabulary shard of the logits,
[B, T, padded_vocab_size / TP], padding columns included: feed it to `parallel.losses` (which
mask the padding) or gather it with `gather_vocab_shards` for inspection.
Every sharded parameter carries megatron's attributes (`tensor_model_parallel`,
`partition_dim`), which DeepSpeed's gradient clipping and `gather_full_state_dict` read.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from megatron_tc.model import Attention, GatedDeltaNet, GatedMLP, HybridLM

from .comm import all_gather
from .state import ParallelContext

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes


def _plain_state_dict(module: nn.Module) -> None:
    """Drop megatron's `_extra_state` load hook (kept for TransformerEngine checkpoints), so a
    sharded model's state dict has exactly HybridLM's names."""
    module._load_state_dict_pre_hooks.clear()


class ColumnLinear(ColumnParallelLinear):
    """megatron-core ColumnParallelLinear called like nn.Linear: returns the local output only."""

    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _plain_state_dict(self)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, weight)[0]


class RowLinear(RowParallelLinear):
    """megatron-core RowParallelLinear (input already split) called like nn.Linear."""

    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _plain_state_dict(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0]


class TensorParallelHybridLM(HybridLM):
    """The class of a HybridLM after `apply_tensor_parallel` (never constructed directly): the
    LM head produces this rank's vocabulary shard instead of the sliced full logits."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normed hidden [B, T, hidden] -> local logits [B, T, padded_vocab / TP]."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = self.output_layer(hidden, self.embed_tokens.weight)
        cap = self.arch.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap is not None else logits


# ---- shard loading ------------------------------------------------------------------------------
class _Sharder:
    """Builds megatron layers for one TP rank and copies this rank's slice of the old weights."""

    def __init__(self, ctx: ParallelContext):
        self.ctx, self.tp, self.rank = ctx, ctx.tp_size, ctx.tp_rank

    def piece(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous 1/TP slice of `full` along `dim`."""
        return full.chunk(self.tp, dim)[self.rank]

    def _config(self, like: torch.Tensor) -> ModelParallelConfig:
        # Layers are allocated on the CPU without random init (the real weights are copied in).
        return ModelParallelConfig(tensor_model_parallel_size=self.tp, use_cpu_initialization=True,
                                   perform_initialization=False, params_dtype=like.dtype)

    def _load(self, new: nn.Module, old: nn.Module, dim: int) -> nn.Module:
        with torch.no_grad():
            new.weight.copy_(self.piece(old.weight, dim))
            if getattr(old, "bias", None) is not None:
                new.bias.copy_(self.piece(old.bias, 0) if dim == 0 else old.bias)
        for name in ("weight", "bias"):
            if getattr(old, name, None) is not None:
                param = getattr(new, name)
                param.requires_grad_(getattr(old, name).requires_grad)
                # megatron sets these only when it initializes the weights itself
                if not hasattr(param, "tensor_model_parallel") and (name == "weight" or dim == 0):
                    set_tensor_model_parallel_attributes(param, True, dim, 1)
        return new.to(old.weight.device)

    def column(self, old: nn.Linear) -> ColumnLinear:
        new = ColumnLinear(old.in_features, old.out_features, config=self._config(old.weight),
                           init_method=nn.init.zeros_, bias=old.bias is not None, gather_output=False,
                           tp_group=self.ctx.tp_group)
        return self._load(new, old, dim=0)

    def row(self, old: nn.Linear) -> RowLinear:
        if old.bias is not None:
            raise ValueError("row-parallel projections (o_proj, down_proj) must have no bias")
        new = RowLinear(old.in_features, old.out_features, config=self._config(old.weight),
                        init_method=nn.init.zeros_, bias=False, input_is_parallel=True, skip_bias_add=False,
                        tp_group=self.ctx.tp_group)
        return self._load(new, old, dim=1)

    def embedding(self, old: nn.Embedding) -> VocabParallelEmbedding:
        new = VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, config=self._config(old.weight),
                                     init_method=nn.init.zeros_, tp_group=self.ctx.tp_group)
        return self._load(new, old, dim=0)

    def head_parameter(self, old: nn.Parameter) -> nn.Parameter:
        """A per-head vector (A_log, dt_bias): this rank's heads."""
        new = nn.Parameter(self.piece(old.detach(), 0).clone(), requires_grad=old.requires_grad)
        set_tensor_model_parallel_attributes(new, True, 0, 1)
        return new

    def depthwise_conv(self, old: nn.Conv1d) -> nn.Conv1d:
        """A depthwise short conv [C, 1, K]: this rank's channels."""
        channels = old.out_channels // self.tp
        new = nn.Conv1d(channels, channels, old.kernel_size[0], groups=channels, bias=False,
                        device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(self.piece(old.weight, 0))
        new.weight.requires_grad_(old.weight.requires_grad)
        set_tensor_model_parallel_attributes(new.weight, True, 0, 1)
        return new

    def sum_grad_over_tp(self, param: nn.Parameter) -> None:
        """A replicated parameter that sees only the local heads: its gradient is a partial sum."""
        group = self.ctx.tp_group

        def all_reduce(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad

        # Registered even on a frozen parameter (the hook survives requires_grad toggling), so
        # unfreezing it later (trainable-subset selection) still gives the full gradient.
        trainable = param.requires_grad
        param.requires_grad_(True)
        param.register_hook(all_reduce)
        param.requires_grad_(trainable)
        param.tp_partial_grad = True


def _shard_attention(mixer: Attention, s: _Sharder) -> None:
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(mixer, name, s.column(getattr(mixer, name)))
    mixer.o_proj = s.row(mixer.o_proj)
    for norm in (mixer.q_norm, mixer.k_norm):
        if norm is not None:
            s.sum_grad_over_tp(norm.weight)
    mixer.num_heads //= s.tp
    mixer.num_kv_heads //= s.tp


def _shard_gdn(mixer: GatedDeltaNet, s: _Sharder) -> None:
    for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj"):
        setattr(mixer, name, s.column(getattr(mixer, name)))
    mixer.o_proj = s.row(mixer.o_proj)
    mixer.A_log = s.head_parameter(mixer.A_log)
    mixer.dt_bias = s.head_parameter(mixer.dt_bias)
    if mixer.conv_size > 0:
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(mixer, name, s.depthwise_conv(getattr(mixer, name)))
    s.sum_grad_over_tp(mixer.o_norm.weight)
    mixer.num_heads //= s.tp
    mixer.kv_heads //= s.tp


def _shard_mlp(mlp: GatedMLP, s: _Sharder) -> None:
    mlp.gate_proj, mlp.up_proj = s.column(mlp.gate_proj), s.column(mlp.up_proj)
    mlp.down_proj = s.row(mlp.down_proj)


def check_tensor_parallel_fits(model: HybridLM, tp: int) -> None:
    """Raise ValueError unless `tp` divides every dimension that is split (heads, MLP, vocab)."""
    arch, kinds = model.arch, model.arch.layer_kinds
    sizes = {"num_heads": arch.num_heads, "intermediate_size": arch.intermediate_size,
             "padded_vocab_size": arch.padded_vocab_size}
    if "A" in kinds:
        sizes["num_kv_heads"] = arch.num_kv_heads
    if "G" in kinds:
        sizes["GDN k/v heads"] = arch.gdn_kv_heads
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise ValueError(f"tensor parallel size {tp} does not divide {bad}; choose a TP size dividing all of "
                         f"{sizes} (padded_vocab_size: use pad_vocab(vocab_size, tp))")


def apply_tensor_parallel(model: HybridLM, ctx: ParallelContext) -> HybridLM:
    """Shard `model` in place over ctx's TP group; returns it. A no-op when TP = 1.

    Every TP rank must hold the same full weights before the call (same seed or same checkpoint).
    """
    if ctx.tp_size == 1:
        return model
    if isinstance(model, TensorParallelHybridLM):
        raise ValueError("the model is already tensor-parallel")
    check_tensor_parallel_fits(model, ctx.tp_size)
    s = _Sharder(ctx)
    tied = model.lm_head is None
    embed = model.embed_tokens
    model.embed_tokens = s.embedding(embed)
    if tied:
        # weightless head: multiplies by the (sharded) embedding passed at call time
        model.output_layer = ColumnLinear(embed.embedding_dim, embed.num_embeddings, config=s._config(embed.weight),
                                          init_method=nn.init.zeros_, bias=False, gather_output=False,
                                          skip_weight_param_allocation=True, tp_group=ctx.tp_group)
    else:
        model.lm_head = s.column(model.lm_head)
    for layer in model.layers:
        if isinstance(layer.mixer, Attention):
            _shard_attention(layer.mixer, s)
        elif isinstance(layer.mixer, GatedDeltaNet):
            _shard_gdn(layer.mixer, s)
        else:
            raise TypeError(f"layer {layer.layer_idx}: no tensor-parallel rule for {type(layer.mixer).__name__}")
        _shard_mlp(layer.mlp, s)
    model.__class__ = TensorParallelHybridLM
    model.tp_size, model.tp_rank = ctx.tp_size, ctx.tp_rank
    return model


# ---- gathering (tests, export) ------------------------------------------------------------------
def _all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return torch.cat(all_gather(x, group), dim=dim)


def gather_vocab_shards(local_logits: torch.Tensor, vocab_size: int, ctx: ParallelContext) -> torch.Tensor:
    """Local logits [..., V_pad / TP] -> full logits [..., vocab_size] (for tests and inspection
    only: training never gathers logits)."""
    full = _all_gather(local_logits, -1, ctx.tp_group) if ctx.tp_size > 1 else local_logits
    return full[..., :vocab_size]


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def gather_full(local: torch.Tensor, param: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The unsharded version of `local` (param's value or gradient) on every TP rank."""
    if not is_tensor_parallel(param) or ctx.tp_size == 1:
        return local
    return _all_gather(local, param.partition_dim, ctx.tp_group)


def gather_full_state_dict(model: nn.Module, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """The unsharded HybridLM state dict of a tensor-parallel model (every TP rank gets it)."""
    return _full_state(model, ctx.tp_group) if ctx.tp_size > 1 else model.state_dict()


def _full_state(model: nn.Module, tp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {name: _all_gather(tensor, params[name].partition_dim, tp_group)
            if name in params and is_tensor_parallel(params[name]) else tensor
            for name, tensor in model.state_dict().items()}


def full_grad_slice(full: torch.Tensor, param: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The part of an unsharded tensor `full` (a weight or its gradient) that `param` holds here."""
    if not is_tensor_parallel(param) or ctx.tp_size == 1:
        return full
    return full.chunk(ctx.tp_size, param.partition_dim)[ctx.tp_rank]
