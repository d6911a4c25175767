"""The megatron_tc checkpoint: Megatron layouts, exact round trips, resharding, integrity checks."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_tc.convert import checkpoint as ckpt
from megatron_tc.convert import layout
from megatron_tc.convert.errors import CheckpointError, ConversionError
from tests.converters.helpers import synthetic_state, tiny_arch

GRID = [(1, 1), (2, 1), (1, 2), (2, 2)]


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("tp,pp", GRID)
@pytest.mark.parametrize("tied", [False, True])
def test_layout_round_trip_is_exact(tp, pp, tied):
    arch = tiny_arch("AGGA", tie_embeddings=tied, padded_vocab_size=512)
    state = synthetic_state(arch)
    shards = layout.to_megatron_shards(state, arch, tp, pp)
    assert sorted(shards) == [(t, p) for t in range(tp) for p in range(pp)]
    assert all("embedding.word_embeddings.weight" in shards[t, 0] for t in range(tp))
    assert (layout.HEAD in shards[0, pp - 1]) == (not tied or pp > 1)
    assert_same(layout.from_megatron_shards(shards, arch, tp, pp), state)


def test_qkv_is_grouped_per_query_group_as_megatron():
    arch = tiny_arch("AA", num_heads=4, num_kv_heads=2, head_dim=16)
    state = synthetic_state(arch)
    shards = layout.to_megatron_shards(state, arch, tp=2, pp=1)
    q, k, v = (state[f"layers.1.mixer.{p}_proj.weight"] for p in "qkv")
    d = arch.head_dim
    for rank in range(2):  # one query group per rank: [q heads 2g, 2g+1; k_g; v_g]
        g = rank
        expected = torch.cat([q[2 * g * d:(2 * g + 2) * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]])
        assert torch.equal(shards[rank, 0]["decoder.layers.1.self_attention.linear_qkv.weight"], expected)
        bias = state["layers.1.mixer.q_proj.bias"][2 * g * d:(2 * g + 2) * d]
        assert torch.equal(shards[rank, 0]["decoder.layers.1.self_attention.linear_qkv.bias"][: 2 * d], bias)


def test_mlp_gate_up_fused_per_rank_and_rows_cols_split():
    arch = tiny_arch("AG")
    state = synthetic_state(arch)
    shards = layout.to_megatron_shards(state, arch, tp=2, pp=1)
    gate, up, down = (state[f"layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up", "down"))
    n = arch.intermediate_size // 2
    fc1 = shards[1, 0]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[n:], up[n:]]))
    assert torch.equal(shards[1, 0]["decoder.layers.0.mlp.linear_fc2.weight"], down[:, n:])
    a_log = shards[1, 0]["decoder.layers.1.self_attention.A_log"]  # GDN: by head
    assert torch.equal(a_log, state["layers.1.mixer.A_log"][2:])
    conv = shards[0, 0]["decoder.layers.1.self_attention.q_conv1d.weight"]
    assert torch.equal(conv, state["layers.1.mixer.q_conv1d.weight"][: 2 * arch.head_dim])


def test_pipeline_stages_even_or_marked():
    assert layout.stage_ranges(tiny_arch("AGAGA"), 2) == [(0, 3), (3, 5)]
    assert layout.stage_ranges(tiny_arch("A|GAGA"), 2) == [(0, 1), (1, 5)]
    with pytest.raises(ConversionError, match="marks 2 pipeline stages but pp=3"):
        layout.stage_ranges(tiny_arch("A|GAGA"), 3)


@pytest.mark.parametrize("tp,pp", GRID)
def test_save_load_pads_vocab_and_round_trips(tmp_path, tp, pp):
    arch = tiny_arch("AGAG")
    state = synthetic_state(arch)
    out = ckpt.save_checkpoint(state, arch, tmp_path / "ck", tp, pp, source={"family": "qwen3"})
    info = ckpt.read_info(out)
    assert (info.tp, info.pp, info.arch.padded_vocab_size) == (tp, pp, 128 * tp * 3 if tp == 1 else 512)
    loaded_arch, loaded = ckpt.load_checkpoint(out)
    assert loaded_arch.padded_vocab_size == info.arch.padded_vocab_size
    for name in ("embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(loaded[name][:300], state[name]) and not loaded[name][300:].any()
        loaded[name] = loaded[name][:300]
    assert_same(loaded, state)
    manifest = json.loads((out / "manifest.json").read_text())
    files = manifest["files"]
    assert {ckpt.shard_filename(t, p) for t in range(tp) for p in range(pp)} | {"config.json"} == set(files)
    first = files[ckpt.shard_filename(0, 0)]["tensors"]["embedding.word_embeddings.weight"]
    assert first == {"shape": [info.arch.padded_vocab_size // tp, 64], "dtype": "float32"}
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    mask = os.umask(0)
    os.umask(mask)
    assert (out / ckpt.shard_filename(0, 0)).stat().st_mode & 0o777 == 0o666 & ~mask  # not safetensors' 0600


def test_reshard_equals_direct_conversion(tmp_path):
    arch = tiny_arch("AGGA")
    state = synthetic_state(arch)
    ckpt.save_checkpoint(state, arch, tmp_path / "tp2pp2", 2, 2, tokenizer_files={"tokenizer.json": b"{}"})
    ckpt.save_checkpoint(state, arch, tmp_path / "direct", 1, 1)
    ckpt.reshard(tmp_path / "tp2pp2", tmp_path / "resharded", 1, 1)
    a = load_file(tmp_path / "direct" / ckpt.shard_filename(0, 0))
    b = load_file(tmp_path / "resharded" / ckpt.shard_filename(0, 0))
    assert_same(a, b)
    assert (tmp_path / "resharded" / "tokenizer" / "tokenizer.json").read_bytes() == b"{}"
    assert ckpt.read_info(tmp_path / "resharded").source["resharded_from"]["tp"] == 2


def test_load_shard_hybrid_gives_each_rank_its_part(tmp_path):
    arch = tiny_arch("AG|GA")
    state = synthetic_state(arch)
    ckpt.save_checkpoint(state, arch, tmp_path / "ck", 2, 2)
    part = ckpt.load_shard_hybrid(tmp_path / "ck", tp_rank=1, pp_rank=1)
    assert {n.split(".")[1] for n in part if n.startswith("layers.")} == {"2", "3"}
    d = arch.head_dim
    assert torch.equal(part["layers.3.mixer.q_proj.weight"], state["layers.3.mixer.q_proj.weight"][2 * d:])
    assert torch.equal(part["layers.3.mixer.k_proj.weight"], state["layers.3.mixer.k_proj.weight"][d:])
    assert torch.equal(part["layers.2.mixer.A_log"], state["layers.2.mixer.A_log"][2:])
    assert torch.equal(part["lm_head.weight"], torch.cat([state["lm_head.weight"], torch.zeros(212, 64)])[256:])
    assert "embed_tokens.weight" not in part


# ---- errors: clear, and nothing partial ---------------------------------------------------------
def test_tp_not_dividing_groups_is_refused_before_writing(tmp_path):
    arch = tiny_arch("AG", num_heads=6, num_kv_heads=3, head_dim=16)
    with pytest.raises(ConversionError, match=r"tp=2 does not divide .*num_kv_heads \(query groups\)=3.*tp in \[1, 3\]"):
        ckpt.save_checkpoint(synthetic_state(arch), arch, tmp_path / "ck", tp=2)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    arch = tiny_arch("AG")
    state = synthetic_state(arch)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists; pass overwrite=True"):
        ckpt.save_checkpoint(state, arch, tmp_path / "ck")
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["keep.txt"]
    ckpt.save_checkpoint(state, arch, tmp_path / "ck", overwrite=True)
    assert not (tmp_path / "ck" / "keep.txt").exists() and ckpt.is_checkpoint(tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    arch = tiny_arch("AG")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(synthetic_state(arch), arch, tmp_path / "ck")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture()
def saved(tmp_path):
    arch = tiny_arch("AG")
    return ckpt.save_checkpoint(synthetic_state(arch), arch, tmp_path / "ck", 2, 1)


def test_missing_shard_is_named(saved):
    os.remove(saved / ckpt.shard_filename(1, 0))
    with pytest.raises(CheckpointError, match=r"model_tp01_pp00.safetensors is missing"):
        ckpt.load_checkpoint(saved)
    ckpt.load_shard(saved, 0, 0)  # the other rank still loads alone


def test_truncated_shard_is_named(saved):
    path = saved / ckpt.shard_filename(0, 0)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model_tp00_pp00.safetensors has \d+ bytes.*truncated"):
        ckpt.load_checkpoint(saved)
    with pytest.raises(CheckpointError, match="model_tp00_pp00"):
        ckpt.load_shard(saved, 0, 0)


def test_corrupted_shard_fails_sha256_and_names_file(saved):
    path = saved / ckpt.shard_filename(1, 0)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # same size, one byte of tensor data flipped
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model_tp01_pp00.safetensors is corrupted: sha256"):
        ckpt.load_checkpoint(saved)


def test_missing_manifest_is_refused(saved):
    os.remove(saved / "manifest.json")
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        ckpt.load_checkpoint(saved)
