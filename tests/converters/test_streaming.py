"""Streaming conversion: shards written tensor by tensor are byte-identical to shards serialized
from memory, and no read or materialized tensor is larger than one rank's largest tensor."""
from __future__ import annotations

import functools
import hashlib
import io
import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from megatron_tc.convert import checkpoint as ckpt
from megatron_tc.convert import export as export_module
from megatron_tc.convert import layout
from megatron_tc.convert.export import export_to_hf
from megatron_tc.convert.hf_mapping import hf_to_tc_state_dict, tc_to_hf_state_dict
from megatron_tc.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_tc.convert.lazy import Cat, lazy_state, track_reads
from megatron_tc.convert.safetensors_stream import write_safetensors
from megatron_tc.model.config import pad_vocab
from tests.converters.families import random_hf_model
from tests.converters.helpers import synthetic_state, tiny_arch

GRID = [(1, 1), (2, 1), (1, 2), (2, 2)]


def in_memory_shard_bytes(state, arch, tp, pp, cast=None):
    """The shards as `safetensors.torch.save` serializes them from an eager layout."""
    if cast is not None:
        state = {k: v.to(cast) for k, v in state.items()}
    state, arch = layout.resize_vocab(state, arch, pad_vocab(arch.vocab_size, tp, ckpt.VOCAB_MULTIPLE))
    shards = layout.to_megatron_shards(state, arch, tp, pp)
    return {ckpt.shard_filename(t, p): save({k: v.contiguous() for k, v in ts.items()}, metadata={"format": "pt"})
            for (t, p), ts in shards.items()}


def assert_shards_equal_bytes(directory, expected):
    manifest = json.loads((directory / ckpt.MANIFEST).read_text())["files"]
    for name, data in expected.items():
        assert (directory / name).read_bytes() == data, name
        assert manifest[name]["sha256"] == hashlib.sha256(data).hexdigest()


def largest_rank_tensor(directory) -> int:
    files = json.loads((directory / ckpt.MANIFEST).read_text())["files"]
    return max(v.numel() * v.element_size() for name in files if name.endswith(".safetensors")
               for v in load_file(directory / name).values())


def test_writer_matches_safetensors_for_mixed_dtypes_and_odd_shapes(tmp_path):
    tensors = {"b": torch.randn(3, 5).to(torch.bfloat16), "a": torch.randn(7), "i": torch.arange(6).reshape(2, 3),
               "e": torch.zeros(0, 4), "h": torch.randn(2, 2).half(), "z": torch.tensor(1.5, dtype=torch.float64)}
    sha = write_safetensors(tmp_path / "x.safetensors", lazy_state(tensors), metadata={"format": "pt"})
    data = save(tensors, metadata={"format": "pt"})
    assert (tmp_path / "x.safetensors").read_bytes() == data and sha == hashlib.sha256(data).hexdigest()
    write_safetensors(tmp_path / "c.safetensors", lazy_state(tensors), cast=torch.bfloat16)
    cast = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
    assert (tmp_path / "c.safetensors").read_bytes() == save(cast)


@pytest.mark.parametrize("tp,pp", GRID)
@pytest.mark.parametrize("tied", [False, True])
def test_save_checkpoint_shards_are_byte_identical_to_in_memory_serialization(tmp_path, tp, pp, tied):
    arch = tiny_arch("AGAG", tie_embeddings=tied)
    state = synthetic_state(arch)
    out = ckpt.save_checkpoint(state, arch, tmp_path / "ck", tp, pp)
    assert_shards_equal_bytes(out, in_memory_shard_bytes(state, arch, tp, pp))
    bf16 = ckpt.save_checkpoint(state, arch, tmp_path / "bf16", tp, pp, dtype="bf16")
    assert_shards_equal_bytes(bf16, in_memory_shard_bytes(state, arch, tp, pp, torch.bfloat16))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen2 (untied head, q/k/v biases) split over several safetensors files, as large
    checkpoints are published."""
    path = tmp_path_factory.mktemp("hf") / "qwen2"
    model = random_hf_model("qwen2")
    model.save_pretrained(path, max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 1)])
def test_hf_conversion_streams_one_rank_slice_at_a_time(hf_dir, tmp_path, tp, pp):
    from megatron_tc.convert.hf_to_megatron import arch_of_hf_config
    from megatron_tc.convert.hf_io import read_hf_config

    hf_state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        hf_state.update(load_file(file))
    arch = arch_of_hf_config(read_hf_config(hf_dir)[0])
    expected = in_memory_shard_bytes(hf_to_tc_state_dict(hf_state, arch), arch, tp, pp)
    with track_reads() as stats:
        out = convert_hf_to_megatron(hf_dir, tmp_path / "ck", tp, pp)
    assert_shards_equal_bytes(out, expected)
    largest = largest_rank_tensor(out)
    # one rank's largest tensor is the most that is ever read or held; the model is much larger
    assert stats.max_materialized_bytes == largest
    assert stats.max_read_bytes <= largest
    assert sum(v.numel() * v.element_size() for v in hf_state.values()) > 5 * largest


def test_reshard_reads_slices_and_equals_direct_save(tmp_path):
    arch = tiny_arch("AGAG")
    state = synthetic_state(arch)
    ckpt.save_checkpoint(state, arch, tmp_path / "src", 2, 2)
    with track_reads() as stats:
        out = ckpt.reshard(tmp_path / "src", tmp_path / "dst", 1, 2)
    assert_shards_equal_bytes(out, in_memory_shard_bytes(state, arch, 1, 2))
    assert stats.max_materialized_bytes == largest_rank_tensor(out)
    # tp 2 -> 1: the embedding is made of two source slices, each read on its own
    embed_rows = pad_vocab(arch.vocab_size, 2, ckpt.VOCAB_MULTIPLE) // 2
    assert stats.max_read_bytes <= embed_rows * arch.hidden_size * 4


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_load_rank_reads_only_its_slice_and_equals_the_resharded_shard(tmp_path, tp, pp):
    arch = tiny_arch("AGAG")
    ckpt.save_checkpoint(synthetic_state(arch), arch, tmp_path / "src", 1, 1)
    ckpt.reshard(tmp_path / "src", tmp_path / "dst", tp, pp)
    for t in range(tp):
        for p in range(pp):
            with track_reads() as stats:
                mine = ckpt.load_rank(tmp_path / "src", tp, pp, t, p)
            want = ckpt.load_shard(tmp_path / "dst", t, p)
            assert sorted(mine) == sorted(want)
            assert all(torch.equal(mine[k], want[k]) for k in want)
            assert stats.max_read_bytes <= max(v.numel() * v.element_size() for v in want.values())


def test_load_rank_verifies_the_files_it_reads(tmp_path):
    arch = tiny_arch("AGAG")
    ckpt.save_checkpoint(synthetic_state(arch), arch, tmp_path / "ck", 1, 2)
    shard = tmp_path / "ck" / ckpt.shard_filename(0, 1)
    shard.write_bytes(shard.read_bytes()[:-8] + b"\xff" * 8)
    ckpt.load_rank(tmp_path / "ck", 2, 2, 1, 0)  # stage 0 does not read the damaged file
    with pytest.raises(ckpt.CheckpointError, match="is corrupted"):
        ckpt.load_rank(tmp_path / "ck", 2, 2, 1, 1)


def test_export_is_byte_identical_to_in_memory_serialization(tmp_path, hf_dir):
    ck = convert_hf_to_megatron(hf_dir, tmp_path / "ck", 2, 2)
    arch, state = ckpt.load_checkpoint(ck)
    state = {k: v[: arch.vocab_size] if k in ("embed_tokens.weight", "lm_head.weight") else v for k, v in state.items()}
    weights = {k: v.contiguous().clone() for k, v in tc_to_hf_state_dict(state, arch).items()}
    save_file(weights, tmp_path / "want.safetensors", metadata={"format": "pt"})
    with track_reads() as stats:
        out = export_to_hf(ck, tmp_path / "hf")
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "want.safetensors").read_bytes()
    assert stats.max_materialized_bytes == max(v.numel() * v.element_size() for v in weights.values())


def test_cat_narrow_reads_only_the_parts_it_covers():
    a, b = torch.randn(4, 3), torch.randn(6, 3)
    lazies = lazy_state({"a": a, "b": b})
    joined = Cat([lazies["a"], lazies["b"]], 0)
    with track_reads() as stats:
        assert torch.equal(joined.narrow(0, 5, 3).materialize(), torch.cat([a, b])[5:8])
    assert stats.reads == 1 and stats.max_read_bytes == 3 * 3 * 4
    assert torch.equal(joined.narrow(1, 1, 2).materialize(), torch.cat([a, b])[:, 1:3])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("write", ["checkpoint", "export"])
def test_progress_counts_every_weight_byte_as_it_is_written(tmp_path, monkeypatch, write):
    """The bars of a conversion and an export advance tensor by tensor (a shard of a large teacher
    takes minutes) and end at the bytes of the weights written, over every file."""
    import megatron_tc.monitor as monitor

    monkeypatch.setattr(sys, "stderr", _Terminal())
    bars, steps, shown = [], [], []
    make = monitor.progress

    def recording(*args, **kwargs):
        made = make(*args, **kwargs)
        shown.append(not made.disable)  # closing a bar disables it
        update = made.update
        made.update = lambda n=1: (steps.append(n), update(n))[1]
        bars.append(made)
        return made

    arch = tiny_arch("AGAG")
    if write == "checkpoint":
        monkeypatch.setattr(ckpt, "bar", recording)
        out = ckpt.save_checkpoint(synthetic_state(arch), arch, tmp_path / "ck", 2, 1, progress=True)
        files = sorted(out.glob("model_*.safetensors"))
    else:
        source = ckpt.save_checkpoint(synthetic_state(arch), arch, tmp_path / "ck", 1, 1)
        monkeypatch.setattr(monitor, "progress", recording)
        small_files = functools.partial(export_module.save_weights, max_shard_bytes=4096)
        monkeypatch.setattr(export_module, "save_weights", small_files)  # several files
        out = export_to_hf(source, tmp_path / "hf", progress=True)
        files = sorted(out.glob("model*.safetensors"))
    weights = sum(f.stat().st_size - 8 - int.from_bytes(f.read_bytes()[:8], "little") for f in files)
    assert len(files) >= 2 and len(bars) == 1 and shown == [True]
    assert bars[0].n == bars[0].total == weights == sum(steps)
    assert len(steps) > len(files)  # a step per tensor
