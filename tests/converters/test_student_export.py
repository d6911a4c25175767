"""Hybrid students: megatron_tc -> HF -> megatron_tc bitwise, HF logits and generate() equal the in-package model's."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

import megatron_tc  # noqa: F401  (registers the Auto classes)
from megatron_tc.convert import checkpoint as ckpt
from megatron_tc.convert.export import export_to_hf
from megatron_tc.convert.hf_student import MegatronTCForCausalLM
from megatron_tc.convert.hf_to_megatron import convert_hf_to_megatron, load_hybrid_lm
from megatron_tc.model import HybridLM, generate
from tests.converters.helpers import tiny_arch


def random_student(pattern: str, tied: bool, seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    model = HybridLM(tiny_arch(pattern, tie_embeddings=tied))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.fixture(scope="module", params=[("AG|GA", False), ("GAGG", True)], ids=["untied_marked", "tied"])
def student(request, tmp_path_factory):
    pattern, tied = request.param
    root = tmp_path_factory.mktemp("student")
    model = random_student(pattern, tied)
    ck = ckpt.save_checkpoint(model.state_dict(), model.arch, root / "ck", 2, 2,
                              source={"hf_config": {"bos_token_id": 1, "eos_token_id": 2}})
    return ck, export_to_hf(ck, root / "hf")


def test_round_trip_megatron_hf_megatron_is_bitwise(student, tmp_path):
    ck, hf = student
    again = convert_hf_to_megatron(hf, tmp_path / "again", 2, 2)
    for t in range(2):
        for p in range(2):
            name = ckpt.shard_filename(t, p)
            a, b = load_file(ck / name), load_file(again / name)
            assert sorted(a) == sorted(b)
            assert all(torch.equal(a[k], b[k]) for k in a), name
    assert ckpt.read_info(again).arch == ckpt.read_info(ck).arch


def test_exported_model_loads_with_auto_classes_and_matches_our_logits(student):
    ck, hf = student
    converted = load_hybrid_lm(ck)
    model = tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert isinstance(model, MegatronTCForCausalLM)
    assert model.config.vocab_size == 300 and model.config.bos_token_id == 1
    assert model.model.embed_tokens.weight.shape[0] == 300  # vocabulary padding removed on export
    ids = torch.randint(0, 300, (2, 70))  # longer than one GDN chunk (64)
    with torch.no_grad():
        assert (model(input_ids=ids).logits - converted(ids)).abs().max().item() <= 1e-5  # conv summation order


def test_generate_equals_our_greedy(student):
    ck, hf = student
    model = tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.randint(3, 300, (1, 9))
    out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(out, generate(load_hybrid_lm(ck), ids, 12))


def test_all_attention_checkpoint_exports_as_its_family_or_as_student(tmp_path):
    arch = tiny_arch("AAAA", family="qwen3", attention_bias=False, gdn_conv_size=0)
    torch.manual_seed(1)
    model = HybridLM(arch).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ck = ckpt.save_checkpoint(model.state_dict(), arch, tmp_path / "ck", 2, 1)  # no source HF config
    ids = torch.randint(0, 300, (1, 11))
    for as_student, cls in ((False, tf.Qwen3ForCausalLM), (True, MegatronTCForCausalLM)):
        hf = export_to_hf(ck, tmp_path / f"hf{as_student}", as_student=as_student)
        loaded = tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        assert type(loaded) is cls
        with torch.no_grad():
            assert (loaded(input_ids=ids).logits - model(ids)).abs().max().item() <= 1e-4
