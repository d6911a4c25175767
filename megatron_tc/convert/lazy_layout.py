"""The Megatron TP x PP layout of `layout.py`, on lazy tensors.

`shard_lazy` cuts an unsharded HybridLM state of lazy tensors into per-rank lazy tensors and
`unshard_lazy` is its inverse, reading a checkpoint's shards; neither reads any tensor data.
Writing the result tensor by tensor (`safetensors_stream.py`) is what bounds conversion,
resharding and export by one tensor. The eager `layout.to_megatron_shards` /
`from_megatron_shards` define the layout; the converter tests check that both agree byte for byte.
"""
from __future__ import annotations

from megatron_tc.convert.errors import ConversionError
from megatron_tc.convert.layout import (
    _MEGATRON_LAYER_RE, _QKV_PARTS, EMBED, FINAL_NORM, HEAD, REPLICATED, ROWS, _group_layers, _layer_table, check_tp,
    stage_ranges,
)
from megatron_tc.convert.lazy import Cat, LazyTensor, Replicated, Zeros
from megatron_tc.model.config import ArchConfig

Lazies = dict[str, LazyTensor]


def _part(x: LazyTensor, how: str, tp: int, rank: int, name: str) -> LazyTensor:
    if how == REPLICATED:
        return x
    dim = 0 if how == ROWS else 1
    if x.shape[dim] % tp:
        raise ConversionError(f"{name}: dimension {dim} of size {x.shape[dim]} is not divisible by tp={tp}")
    size = x.shape[dim] // tp
    return x.narrow(dim, rank * size, size)


def _fused_qkv(q: LazyTensor, k: LazyTensor, v: LazyTensor, groups: int, tp: int, rank: int) -> LazyTensor:
    """Rank `rank`'s grouped QKV: per query group, its query heads' rows, then k, then v."""
    q_rows, kv_rows = q.shape[0] // groups, k.shape[0] // groups
    per_rank = groups // tp
    parts = []
    for g in range(rank * per_rank, (rank + 1) * per_rank):
        parts += [q.narrow(0, g * q_rows, q_rows), k.narrow(0, g * kv_rows, kv_rows), v.narrow(0, g * kv_rows, kv_rows)]
    return Cat(parts, 0)


def _shard_layer(layer: Lazies, kind: str, arch: ArchConfig, tp: int, rank: int, where: str) -> Lazies:
    out: Lazies = {}
    todo = dict(layer)
    for suffix in ("weight", "bias"):
        names = [f"mixer.{p}.{suffix}" for p in _QKV_PARTS]
        if kind == "A" and all(n in todo for n in names):
            q, k, v = (todo.pop(n) for n in names)
            out[f"self_attention.linear_qkv.{suffix}"] = _fused_qkv(q, k, v, arch.num_kv_heads, tp, rank)
    if "mlp.gate_proj.weight" in todo and "mlp.up_proj.weight" in todo:
        gate, up = todo.pop("mlp.gate_proj.weight"), todo.pop("mlp.up_proj.weight")
        out["mlp.linear_fc1.weight"] = Cat([_part(gate, ROWS, tp, rank, f"{where}.mlp.gate_proj.weight"),
                                            _part(up, ROWS, tp, rank, f"{where}.mlp.up_proj.weight")], 0)
    table = _layer_table(kind)
    for name, tensor in todo.items():
        if name not in table:
            raise ConversionError(f"no Megatron layout for tensor {where}.{name} of a {kind!r} layer")
        target, how = table[name]
        out[target] = _part(tensor, how, tp, rank, f"{where}.{name}")
    return out


def shard_lazy(state: Lazies, arch: ArchConfig, tp: int, pp: int) -> dict[tuple[int, int], Lazies]:
    """Unsharded HybridLM lazies -> {(tp_rank, pp_rank): Megatron-named lazies} (as
    `layout.to_megatron_shards`; embedding / head rows must already be `arch.padded_vocab_size`)."""
    check_tp(arch, tp)
    if arch.padded_vocab_size % tp:
        raise ConversionError(f"padded_vocab_size={arch.padded_vocab_size} is not divisible by tp={tp}")
    stages = stage_ranges(arch, pp)
    layers, top = _group_layers(state)
    if sorted(layers) != list(range(arch.num_layers)):
        raise ConversionError(f"state dict has layers {sorted(layers)}, architecture needs 0..{arch.num_layers - 1}")
    shards: dict[tuple[int, int], Lazies] = {(t, p): {} for t in range(tp) for p in range(pp)}
    for p, (start, end) in enumerate(stages):
        for i in range(start, end):
            for t in range(tp):
                ranked = _shard_layer(layers[i], arch.layer_kinds[i], arch, tp, t, f"layers.{i}")
                shards[t, p].update({f"decoder.layers.{i - start}.{n}": x for n, x in ranked.items()})
    embed = top.pop("embed_tokens.weight")
    head = top.pop("lm_head.weight", None)
    if head is None and pp > 1:
        head = embed  # tied: the last stage keeps a copy, as Megatron does
    norm = top.pop("norm.weight")
    if top:
        raise ConversionError(f"no Megatron layout for tensors {sorted(top)}")
    for t in range(tp):
        shards[t, 0][EMBED] = _part(embed, ROWS, tp, t, "embed_tokens.weight")
        if head is not None:
            shards[t, pp - 1][HEAD] = _part(head, ROWS, tp, t, "lm_head.weight")
        shards[t, pp - 1][FINAL_NORM] = norm
    return shards


def _unfuse_qkv(parts: list[LazyTensor], arch: ArchConfig, tp: int) -> tuple[LazyTensor, ...]:
    per_rank = arch.num_kv_heads // tp
    q_rows, d = arch.num_heads // arch.num_kv_heads * arch.head_dim, arch.head_dim
    block = q_rows + 2 * d
    q, k, v = [], [], []
    for part in parts:
        if part.shape[0] != per_rank * block:
            raise ConversionError(f"fused QKV has {part.shape[0]} rows per rank, expected {per_rank * block}")
        for g in range(per_rank):
            q.append(part.narrow(0, g * block, q_rows))
            k.append(part.narrow(0, g * block + q_rows, d))
            v.append(part.narrow(0, g * block + q_rows + d, d))
    return Cat(q, 0), Cat(k, 0), Cat(v, 0)


def _unshard_layer(ranks: list[Lazies], kind: str, arch: ArchConfig, where: str) -> Lazies:
    reverse = {target: (name, how) for name, (target, how) in _layer_table(kind).items()}
    for rank, names in enumerate(ranks[1:], start=1):
        if set(names) != set(ranks[0]):
            raise ConversionError(f"{where}: tp rank {rank} holds {sorted(names)}, tp rank 0 holds {sorted(ranks[0])}")
    out: Lazies = {}
    for target in ranks[0]:
        parts = [rank[target] for rank in ranks]
        if target.startswith("self_attention.linear_qkv.") and kind == "A":
            suffix = target.rsplit(".", 1)[1]
            qkv = _unfuse_qkv(parts, arch, len(ranks))
            out.update({f"mixer.{p}.{suffix}": x for p, x in zip(_QKV_PARTS, qkv)})
        elif target == "mlp.linear_fc1.weight":
            half = parts[0].shape[0] // 2
            out["mlp.gate_proj.weight"] = Cat([x.narrow(0, 0, half) for x in parts], 0)
            out["mlp.up_proj.weight"] = Cat([x.narrow(0, half, half) for x in parts], 0)
        elif target in reverse:
            name, how = reverse[target]
            out[name] = _join(parts, how, f"{where}.{target}")
        else:
            raise ConversionError(f"unknown tensor {where}.{target} in a {kind!r} layer of the checkpoint")
    return out


def _join(parts: list[LazyTensor], how: str, name: str) -> LazyTensor:
    if how == REPLICATED:
        return Replicated(parts, name) if len(parts) > 1 else parts[0]
    return Cat(parts, 0 if how == ROWS else 1)


def unshard_lazy(shards: dict[tuple[int, int], Lazies], arch: ArchConfig, tp: int, pp: int) -> Lazies:
    """Inverse of `shard_lazy`: a checkpoint's per-rank lazies -> unsharded HybridLM lazies."""
    state: Lazies = {}
    for p, (start, end) in enumerate(stage_ranges(arch, pp)):
        per_layer: dict[int, list[Lazies]] = {}
        for t in range(tp):
            for name, tensor in shards[t, p].items():
                match = _MEGATRON_LAYER_RE.match(name)
                if match:
                    per_layer.setdefault(int(match.group(1)), [{} for _ in range(tp)])[t][match.group(2)] = tensor
                elif name not in (EMBED, HEAD, FINAL_NORM):
                    raise ConversionError(f"unknown tensor {name} in the shard of tp rank {t}, pp stage {p}")
        if sorted(per_layer) != list(range(end - start)):
            raise ConversionError(f"pipeline stage {p} holds layers {sorted(per_layer)}, expected 0..{end - start - 1}")
        for local, ranks in sorted(per_layer.items()):
            layer = _unshard_layer(ranks, arch.layer_kinds[start + local], arch, f"decoder.layers.{local} (pp stage {p})")
            state.update({f"layers.{start + local}.{n}": x for n, x in layer.items()})
    state["embed_tokens.weight"] = Cat([shards[t, 0][EMBED] for t in range(tp)], 0)
    if not arch.tie_embeddings:
        state["lm_head.weight"] = Cat([shards[t, pp - 1][HEAD] for t in range(tp)], 0)
    state["norm.weight"] = _join([shards[t, pp - 1][FINAL_NORM] for t in range(tp)], REPLICATED, FINAL_NORM)
    return state


def resize_vocab_lazy(state: Lazies, vocab_size: int, padded_vocab_size: int) -> Lazies:
    """Embedding / LM head cut to `vocab_size` rows, then zero rows up to `padded_vocab_size`
    (as `layout.resize_vocab`: rows past vocab_size never produce logits)."""
    out = dict(state)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in out:
            table = out[name].narrow(0, 0, vocab_size)
            pad = Zeros((padded_vocab_size - vocab_size, table.shape[1]), table.dtype)
            out[name] = Cat([table, pad], 0)
    return out
