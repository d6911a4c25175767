"""Megatron-style tensor/pipeline layout of a HybridLM state dict.

`to_megatron_shards` cuts an unsharded HybridLM state dict (names in `megatron_tc.model.config`)
into one state dict per (tp_rank, pp_rank) with Megatron-core names and layouts;
`from_megatron_shards` is its exact inverse. Layer indices inside a pipeline stage are local
(0-based per stage), as in Megatron-LM's per-rank checkpoints; `stage_ranges` gives the global
span of every stage.

Per-rank names and layouts (``j`` = layer index local to the stage)::

    embedding.word_embeddings.weight            [padded_vocab / tp, hidden]   rows   (first stage)
    output_layer.weight                         [padded_vocab / tp, hidden]   rows   (last stage;
                                                 tied models keep a copy there only when pp > 1)
    decoder.final_layernorm.weight              [hidden]                       replicated (last stage)
    decoder.layers.j.input_layernorm.weight     [hidden]                       replicated
    decoder.layers.j.pre_mlp_layernorm.weight   [hidden]                       replicated
    decoder.layers.j.post_{attn,mlp}_layernorm.weight  (Gemma3 sandwich norms) replicated
    decoder.layers.j.mlp.linear_fc1.weight      [2 * ffn / tp, hidden]  [gate rows of rank; up rows of rank]
    decoder.layers.j.mlp.linear_fc2.weight      [hidden, ffn / tp]             columns
  attention ('A')::
    decoder.layers.j.self_attention.linear_qkv.{weight,bias}
        [groups/tp * (heads/groups + 2) * head_dim, hidden]: per query group g of the rank, the rows
        of g's query heads, then k_g, then v_g (Megatron's grouped QKV)
    decoder.layers.j.self_attention.linear_proj.weight   [hidden, heads/tp * head_dim]  columns
    decoder.layers.j.self_attention.{q,k}_layernorm.weight  [head_dim]            replicated
  Gated DeltaNet ('G'), split by head (names follow flash-linear-attention)::
    decoder.layers.j.self_attention.{q,k,v,g}_proj.{weight,bias}  rows of the rank's heads
    decoder.layers.j.self_attention.{a,b}_proj.{weight,bias}      [heads / tp, hidden]
    decoder.layers.j.self_attention.{A_log,dt_bias}               [heads / tp]
    decoder.layers.j.self_attention.{q,k,v}_conv1d.weight         [channels / tp, 1, kernel]
    decoder.layers.j.self_attention.o_norm.weight                 [head_dim]     replicated
    decoder.layers.j.self_attention.o_proj.weight                 [hidden, heads/tp * head_dim]
"""
from __future__ import annotations

import re

import torch

from megatron_tc.convert.errors import ConversionError
from megatron_tc.model.config import ArchConfig

Tensor = torch.Tensor
StateDict = dict[str, Tensor]

# How a tensor is cut over TP ranks.
ROWS, COLS, REPLICATED = "rows", "cols", "replicated"

# HybridLM name inside a layer -> (Megatron name inside a layer, split), for tensors that are
# a plain split. The fused ones (q/k/v of attention, gate/up of the MLP) are handled apart.
_COMMON = {
    "input_norm.weight": ("input_layernorm.weight", REPLICATED),
    "post_attn_norm.weight": ("post_attn_layernorm.weight", REPLICATED),
    "pre_mlp_norm.weight": ("pre_mlp_layernorm.weight", REPLICATED),
    "post_mlp_norm.weight": ("post_mlp_layernorm.weight", REPLICATED),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", COLS),
}
_ATTENTION = {
    "mixer.o_proj.weight": ("self_attention.linear_proj.weight", COLS),
    "mixer.q_norm.weight": ("self_attention.q_layernorm.weight", REPLICATED),
    "mixer.k_norm.weight": ("self_attention.k_layernorm.weight", REPLICATED),
}
_GDN = {
    **{f"mixer.{p}_proj.{w}": (f"self_attention.{p}_proj.{w}", ROWS) for p in "qkvabg" for w in ("weight", "bias")},
    **{f"mixer.{p}_conv1d.{w}": (f"self_attention.{p}_conv1d.{w}", ROWS) for p in "qkv" for w in ("weight", "bias")},
    "mixer.A_log": ("self_attention.A_log", ROWS),
    "mixer.dt_bias": ("self_attention.dt_bias", ROWS),
    "mixer.o_norm.weight": ("self_attention.o_norm.weight", REPLICATED),
    "mixer.o_proj.weight": ("self_attention.o_proj.weight", COLS),
}
_QKV_PARTS = ("q_proj", "k_proj", "v_proj")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_MEGATRON_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

EMBED, HEAD, FINAL_NORM = "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"


# ---- stages and TP checks ---------------------------------------------------------------------
def stage_ranges(arch: ArchConfig, pp: int) -> list[tuple[int, int]]:
    """Global [start, end) layer span of each pipeline stage.

    With '|' in `arch.layer_pattern` the marks decide (there must be pp - 1 of them); otherwise
    layers are split evenly, earlier stages taking one extra layer when pp does not divide them
    (the last stage also holds the LM head)."""
    if pp < 1:
        raise ConversionError(f"pp={pp}: the pipeline size must be >= 1")
    if pp == 1:
        return [(0, arch.num_layers)]
    if "|" in arch.layer_pattern:
        sizes = [len(part) for part in arch.layer_pattern.split("|")]
        if len(sizes) != pp:
            raise ConversionError(
                f"layer_pattern {arch.layer_pattern!r} marks {len(sizes)} pipeline stages but pp={pp}; "
                f"use pp={len(sizes)} or change the '|' marks"
            )
    else:
        if pp > arch.num_layers:
            raise ConversionError(f"pp={pp} is larger than the number of layers ({arch.num_layers})")
        base, extra = divmod(arch.num_layers, pp)
        sizes = [base + (1 if s < extra else 0) for s in range(pp)]
    if any(size == 0 for size in sizes):
        raise ConversionError(f"layer_pattern {arch.layer_pattern!r} leaves a pipeline stage without layers")
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [(start, start + size) for start, size in zip(starts, sizes)]


def check_tp(arch: ArchConfig, tp: int) -> None:
    """Raise ConversionError unless `tp` divides everything that is split by TP."""
    if tp < 1:
        raise ConversionError(f"tp={tp}: the tensor-parallel size must be >= 1")
    kinds = set(arch.layer_kinds)
    needs = [("intermediate_size", arch.intermediate_size)]
    if "A" in kinds:
        needs += [("num_heads", arch.num_heads), ("num_kv_heads (query groups)", arch.num_kv_heads)]
    if "G" in kinds:
        needs += [("num_heads (GDN heads)", arch.num_heads), ("GDN k/v heads", arch.gdn_kv_heads)]
    bad = [f"{name}={value}" for name, value in needs if value % tp]
    if bad:
        divisors = [d for d in range(1, arch.num_heads + 1) if all(v % d == 0 for _, v in needs)]
        raise ConversionError(
            f"tp={tp} does not divide {', '.join(bad)}; Megatron splits attention by query group, "
            f"so choose tp in {divisors}"
        )


# ---- one tensor ---------------------------------------------------------------------------------
def _split(tensor: Tensor, how: str, tp: int) -> list[Tensor]:
    if how == REPLICATED:
        return [tensor.clone() for _ in range(tp)]
    dim = 0 if how == ROWS else 1
    return [part.clone() for part in torch.chunk(tensor, tp, dim=dim)]


def _join(parts: list[Tensor], how: str, name: str) -> Tensor:
    if how == REPLICATED:
        for rank, part in enumerate(parts[1:], start=1):
            if not torch.equal(part, parts[0]):
                raise ConversionError(f"replicated tensor {name} differs between tp rank 0 and tp rank {rank}")
        return parts[0]
    return torch.cat(parts, dim=0 if how == ROWS else 1)


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, groups: int, tp: int) -> list[Tensor]:
    """Megatron's grouped QKV, per TP rank.

    q [heads * d, *rest], k and v [groups * d, *rest] -> tp tensors
    [groups/tp * (heads/groups + 2) * d, *rest]: for each group, its query heads' rows, then k, v."""
    rest = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], dim=1
    )  # [groups, (heads/groups + 2) * d, *rest]
    return [part.reshape(-1, *rest).clone() for part in torch.chunk(grouped, tp, dim=0)]


def unfuse_qkv(parts: list[Tensor], groups: int, heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv`: per-rank fused tensors -> (q, k, v) unsharded."""
    rest = parts[0].shape[1:]
    grouped = torch.cat(parts, dim=0).reshape(groups, -1, *rest)
    q_rows = heads // groups * head_dim
    q, k, v = torch.split(grouped, [q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# ---- one layer ----------------------------------------------------------------------------------
def _layer_table(kind: str) -> dict[str, tuple[str, str]]:
    return {**_COMMON, **(_ATTENTION if kind == "A" else _GDN)}


def shard_layer(layer: StateDict, kind: str, arch: ArchConfig, tp: int, where: str) -> list[StateDict]:
    """One layer's HybridLM tensors (names relative to `layers.{i}.`) -> per-rank Megatron tensors."""
    ranks: list[StateDict] = [{} for _ in range(tp)]
    todo = dict(layer)
    for suffix in ("weight", "bias"):
        names = [f"mixer.{p}.{suffix}" for p in _QKV_PARTS]
        if kind == "A" and all(n in todo for n in names):
            q, k, v = (todo.pop(n) for n in names)
            for rank, part in enumerate(fuse_qkv(q, k, v, arch.num_kv_heads, tp)):
                ranks[rank][f"self_attention.linear_qkv.{suffix}"] = part
    if "mlp.gate_proj.weight" in todo and "mlp.up_proj.weight" in todo:
        gates = torch.chunk(todo.pop("mlp.gate_proj.weight"), tp, dim=0)
        ups = torch.chunk(todo.pop("mlp.up_proj.weight"), tp, dim=0)
        for rank in range(tp):
            ranks[rank]["mlp.linear_fc1.weight"] = torch.cat([gates[rank], ups[rank]], dim=0)
    table = _layer_table(kind)
    for name, tensor in todo.items():
        if name not in table:
            raise ConversionError(f"no Megatron layout for tensor {where}.{name} of a {kind!r} layer")
        target, how = table[name]
        for rank, part in enumerate(_split(tensor, how, tp)):
            ranks[rank][target] = part
    return ranks


def unshard_layer(ranks: list[StateDict], kind: str, arch: ArchConfig, where: str) -> StateDict:
    """Inverse of `shard_layer`."""
    reverse = {target: (name, how) for name, (target, how) in _layer_table(kind).items()}
    out: StateDict = {}
    for rank, names in enumerate(ranks[1:], start=1):
        if set(names) != set(ranks[0]):
            raise ConversionError(f"{where}: tp rank {rank} holds {sorted(names)}, tp rank 0 holds {sorted(ranks[0])}")
    for target in ranks[0]:
        parts = [rank[target] for rank in ranks]
        if target.startswith("self_attention.linear_qkv.") and kind == "A":
            suffix = target.rsplit(".", 1)[1]
            qkv = unfuse_qkv(parts, arch.num_kv_heads, arch.num_heads, arch.head_dim)
            out.update({f"mixer.{p}.{suffix}": t for p, t in zip(_QKV_PARTS, qkv)})
        elif target == "mlp.linear_fc1.weight":
            halves = [torch.chunk(part, 2, dim=0) for part in parts]
            out["mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves], dim=0)
            out["mlp.up_proj.weight"] = torch.cat([h[1] for h in halves], dim=0)
        elif target in reverse:
            name, how = reverse[target]
            out[name] = _join(parts, how, f"{where}.{target}")
        else:
            raise ConversionError(f"unknown tensor {where}.{target} in a {kind!r} layer of the checkpoint")
    return out


# ---- whole model --------------------------------------------------------------------------------
def _group_layers(state: StateDict) -> tuple[dict[int, StateDict], StateDict]:
    layers: dict[int, StateDict] = {}
    rest: StateDict = {}
    for name, tensor in state.items():
        match = _LAYER_RE.match(name)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        else:
            rest[name] = tensor
    return layers, rest


def to_megatron_shards(state: StateDict, arch: ArchConfig, tp: int, pp: int) -> dict[tuple[int, int], StateDict]:
    """Unsharded HybridLM state dict -> {(tp_rank, pp_rank): Megatron-named tensors}.

    `state`'s embedding / LM head must have `arch.padded_vocab_size` rows, divisible by tp."""
    check_tp(arch, tp)
    if arch.padded_vocab_size % tp:
        raise ConversionError(f"padded_vocab_size={arch.padded_vocab_size} is not divisible by tp={tp}")
    stages = stage_ranges(arch, pp)
    layers, rest = _group_layers(state)
    missing = sorted(set(range(arch.num_layers)) - set(layers))
    if missing or len(layers) != arch.num_layers:
        raise ConversionError(f"state dict has layers {sorted(layers)}, architecture needs 0..{arch.num_layers - 1}")
    shards: dict[tuple[int, int], StateDict] = {(t, p): {} for t in range(tp) for p in range(pp)}
    kinds = arch.layer_kinds
    for p, (start, end) in enumerate(stages):
        for i in range(start, end):
            per_rank = shard_layer(layers[i], kinds[i], arch, tp, f"layers.{i}")
            for t in range(tp):
                shards[t, p].update({f"decoder.layers.{i - start}.{n}": x for n, x in per_rank[t].items()})
    top = dict(rest)
    for t, part in enumerate(_split(top.pop("embed_tokens.weight"), ROWS, tp)):
        shards[t, 0][EMBED] = part
    head = top.pop("lm_head.weight", None)
    if head is None and pp > 1:
        head = state["embed_tokens.weight"]  # tied: the last stage keeps a copy, as Megatron does
    if head is not None:
        for t, part in enumerate(_split(head, ROWS, tp)):
            shards[t, pp - 1][HEAD] = part
    for t, part in enumerate(_split(top.pop("norm.weight"), REPLICATED, tp)):
        shards[t, pp - 1][FINAL_NORM] = part
    if top:
        raise ConversionError(f"no Megatron layout for tensors {sorted(top)}")
    return shards


def from_megatron_shards(shards: dict[tuple[int, int], StateDict], arch: ArchConfig, tp: int, pp: int) -> StateDict:
    """Inverse of `to_megatron_shards` (bitwise)."""
    stages = stage_ranges(arch, pp)
    kinds = arch.layer_kinds
    state: StateDict = {}
    for p, (start, end) in enumerate(stages):
        per_layer: dict[int, list[StateDict]] = {}
        for t in range(tp):
            for name, tensor in shards[t, p].items():
                match = _MEGATRON_LAYER_RE.match(name)
                if match:
                    local = int(match.group(1))
                    per_layer.setdefault(local, [{} for _ in range(tp)])[t][match.group(2)] = tensor
                elif name not in (EMBED, HEAD, FINAL_NORM):
                    raise ConversionError(f"unknown tensor {name} in the shard of tp rank {t}, pp stage {p}")
        if sorted(per_layer) != list(range(end - start)):
            raise ConversionError(f"pipeline stage {p} holds layers {sorted(per_layer)}, expected 0..{end - start - 1}")
        for local, ranks in per_layer.items():
            i = start + local
            layer = unshard_layer(ranks, kinds[i], arch, f"decoder.layers.{local} (pp stage {p})")
            state.update({f"layers.{i}.{n}": x for n, x in layer.items()})
    state["embed_tokens.weight"] = _join([shards[t, 0][EMBED] for t in range(tp)], ROWS, EMBED)
    if not arch.tie_embeddings:
        state["lm_head.weight"] = _join([shards[t, pp - 1][HEAD] for t in range(tp)], ROWS, HEAD)
    state["norm.weight"] = _join([shards[t, pp - 1][FINAL_NORM] for t in range(tp)], REPLICATED, FINAL_NORM)
    return state


def rank_to_hybrid(shard: StateDict, local_arch: ArchConfig, start: int) -> StateDict:
    """One rank's Megatron tensors -> HybridLM names (global layer index = `start` + local), each
    still holding only the rank's part. `local_arch` has the rank's head and group counts."""
    top = {EMBED: "embed_tokens.weight", HEAD: "lm_head.weight", FINAL_NORM: "norm.weight"}
    per_layer: dict[int, StateDict] = {}
    out: StateDict = {}
    for name, tensor in shard.items():
        match = _MEGATRON_LAYER_RE.match(name)
        if match:
            per_layer.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        elif name in top:
            out[top[name]] = tensor
        else:
            raise ConversionError(f"unknown tensor {name} in a shard")
    for local, tensors in sorted(per_layer.items()):
        i = start + local
        layer = unshard_layer([tensors], local_arch.layer_kinds[i], local_arch, f"decoder.layers.{local}")
        out.update({f"layers.{i}.{n}": x for n, x in layer.items()})
    return out


def resize_vocab(state: StateDict, arch: ArchConfig, padded_vocab_size: int) -> tuple[StateDict, ArchConfig]:
    """Cut the embedding / LM head to `arch.vocab_size` rows, then zero-pad to `padded_vocab_size`.

    Rows past vocab_size never produce logits, so dropping them loses nothing."""
    import dataclasses

    out = dict(state)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in out:
            table = out[name][: arch.vocab_size]
            pad = table.new_zeros(padded_vocab_size - arch.vocab_size, table.shape[1])
            out[name] = torch.cat([table, pad], dim=0)
    return out, dataclasses.replace(arch, padded_vocab_size=padded_vocab_size)
