"""HF <-> megatron_tc for every family: bitwise round trips over TP x PP, resharding, logits."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from megatron_tc.convert import checkpoint as ckpt
from megatron_tc.convert.errors import ConversionError
from megatron_tc.convert.export import export_to_hf
from megatron_tc.convert.hf_to_megatron import convert_hf_to_megatron, load_hybrid_lm
from tests.converters.families import FAMILIES, random_hf_model

GRID = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """One saved tiny model per family: {family: (directory, model)}."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in FAMILIES:
        model = random_hf_model(family)
        model.save_pretrained(root / family)
        out[family] = (root / family, model)
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_to_megatron_to_hf_is_bitwise_for_every_layout(family, hf_dirs, tmp_path):
    src, _ = hf_dirs[family]
    original = load_file(src / "model.safetensors")
    for tp, pp in GRID:
        ck = convert_hf_to_megatron(src, tmp_path / f"ck{tp}{pp}", tp, pp)
        info = ckpt.read_info(ck)
        assert info.arch.padded_vocab_size == 128 * tp * (3 if tp == 1 else 2)  # 300 -> 384 / 512
        assert info.source["family"] == family and len(info.source["sha256"]) == 64
        back = export_to_hf(ck, tmp_path / f"hf{tp}{pp}")
        assert_same_tensors(load_file(back / "model.safetensors"), original)
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == json.loads((src / "config.json").read_text())["model_type"]
    assert config["vocab_size"] == 300


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shards_reproduce_hf_logits_and_export_loads_in_transformers(family, hf_dirs, tmp_path):
    src, model = hf_dirs[family]
    ck = convert_hf_to_megatron(src, tmp_path / "ck", 2, 2)
    converted = load_hybrid_lm(ck)
    ids = torch.randint(0, 300, (2, 13))  # longer than the sliding windows
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert (converted(ids) - want).abs().max().item() <= 1e-4
        exported = tf.AutoModelForCausalLM.from_pretrained(export_to_hf(ck, tmp_path / "hf"), dtype=torch.float32)
        assert type(exported) is type(model)
        assert torch.equal(exported.eval()(input_ids=ids).logits, want)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_reshard_2x2_to_1x1_equals_direct_conversion(family, hf_dirs, tmp_path):
    src, _ = hf_dirs[family]
    convert_hf_to_megatron(src, tmp_path / "tp2pp2", 2, 2)
    convert_hf_to_megatron(src, tmp_path / "direct", 1, 1)
    ckpt.reshard(tmp_path / "tp2pp2", tmp_path / "resharded", 1, 1)
    name = ckpt.shard_filename(0, 0)
    assert_same_tensors(load_file(tmp_path / "direct" / name), load_file(tmp_path / "resharded" / name))


def test_sharded_safetensors_and_pytorch_bin_inputs(hf_dirs, tmp_path):
    src, model = hf_dirs["qwen2"]
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_bytes((src / "config.json").read_bytes())
    torch.save(load_file(src / "model.safetensors"), bin_dir / "pytorch_model.bin")
    direct = ckpt.load_checkpoint(convert_hf_to_megatron(src, tmp_path / "a", 2, 1))[1]
    for name, path in (("b", tmp_path / "sharded"), ("c", bin_dir)):
        assert_same_tensors(ckpt.load_checkpoint(convert_hf_to_megatron(path, tmp_path / name, 2, 1))[1], direct)


def test_tokenizer_files_travel_with_the_checkpoint(hf_dirs, tmp_path):
    src, _ = hf_dirs["llama"]
    (src / "tokenizer.json").write_text('{"fake": true}')
    try:
        ck = convert_hf_to_megatron(src, tmp_path / "ck", 1, 2)
        assert (ck / "tokenizer" / "tokenizer.json").read_text() == '{"fake": true}'
        assert (export_to_hf(ck, tmp_path / "hf") / "tokenizer.json").read_text() == '{"fake": true}'
    finally:
        (src / "tokenizer.json").unlink()


# ---- bad input ----------------------------------------------------------------------------------
def test_unsupported_architecture_lists_supported(tmp_path):
    tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConversionError, match=r"'gpt2' is not supported; supported model types: gemma3, .*llama.*qwen3"):
        convert_hf_to_megatron(tmp_path / "gpt2", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tp_not_dividing_kv_groups_fails_before_reading_weights(tmp_path):
    cfg = tf.LlamaConfig(vocab_size=100, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"not read")  # proves weights are never touched
    with pytest.raises(ConversionError, match=r"tp=2 does not divide .*num_kv_heads \(query groups\)=3"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "out", tp=2)
    with pytest.raises(ConversionError, match="pp=3 is larger than the number of layers"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "out", pp=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_of_a_corrupted_checkpoint_writes_nothing(hf_dirs, tmp_path):
    ck = convert_hf_to_megatron(hf_dirs["mistral"][0], tmp_path / "ck", 1, 2)
    shard = ck / ckpt.shard_filename(0, 1)
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ckpt.CheckpointError, match="model_tp00_pp01.safetensors has 1000 bytes"):
        export_to_hf(ck, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_without_recorded_hf_config_builds_an_equivalent_one(family, hf_dirs, tmp_path):
    src, model = hf_dirs[family]
    arch, state = ckpt.load_checkpoint(convert_hf_to_megatron(src, tmp_path / "ck", 1, 1))
    bare = ckpt.save_checkpoint(state, arch, tmp_path / "bare", 2, 1)  # e.g. a teacher we trained ourselves
    exported = tf.AutoModelForCausalLM.from_pretrained(export_to_hf(bare, tmp_path / "hf"), dtype=torch.float32)
    assert type(exported) is type(model)
    ids = torch.randint(0, 300, (1, 13))
    with torch.no_grad():
        assert (exported.eval()(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item() <= 1e-4


def test_dtype_cast_is_recorded_and_kept_on_export(hf_dirs, tmp_path):
    src, _ = hf_dirs["qwen3"]
    ck = convert_hf_to_megatron(src, tmp_path / "ck", 2, 1, dtype="bfloat16")
    assert ckpt.read_info(ck).dtype == "bfloat16"
    manifest = json.loads((ck / "manifest.json").read_text())
    assert {t["dtype"] for f in manifest["files"].values() for t in f.get("tensors", {}).values()} == {"bfloat16"}
    back = load_file(export_to_hf(ck, tmp_path / "hf") / "model.safetensors")
    original = load_file(src / "model.safetensors")
    assert all(torch.equal(back[k], original[k].to(torch.bfloat16)) for k in original)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
