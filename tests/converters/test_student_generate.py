"""Every generate() mode of an exported student, against per-row unpadded runs (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import megatron_tc  # noqa: F401  (registers the Auto classes)
from megatron_tc.convert import checkpoint as ckpt
from megatron_tc.convert.export import export_to_hf
from megatron_tc.convert.hf_student import MegatronTCCache
from megatron_tc.model import HybridLM
from tests.converters.helpers import tiny_arch

PAD = 0
LENGTHS = (9, 5, 7)


@pytest.fixture(scope="module", params=["GAGG", "GGGG"], ids=["hybrid", "gdn_only"])
def model(request, tmp_path_factory):
    """An exported tiny student with short convolutions (layer 0 a GDN layer, as in converted students)."""
    torch.manual_seed(0)
    student = HybridLM(tiny_arch(request.param, tie_embeddings=True)).eval()
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    root = tmp_path_factory.mktemp("gen")
    ck = ckpt.save_checkpoint(student.state_dict(), student.arch, root / "ck", 1, 1,
                              source={"hf_config": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": PAD}})
    hf = tf.AutoModelForCausalLM.from_pretrained(export_to_hf(ck, root / "hf"), dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = PAD
    return hf


def prompts(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen) for n in LENGTHS]


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def new_tokens(out: torch.Tensor, prompt_width: int) -> list[list[int]]:
    return out[:, prompt_width:].tolist()


def test_padded_forward_equals_unpadded_rows(model):
    rows = prompts()
    ids, mask = left_padded(rows)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits
        for i, r in enumerate(rows):
            alone = model(input_ids=r[None]).logits[0]
            assert (batch[i, ids.shape[1] - len(r):] - alone).abs().max().item() <= 1e-5


def test_greedy_left_padded_batch_equals_each_row_alone(model):
    rows = prompts()
    ids, mask = left_padded(rows)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], max_new_tokens=10, min_new_tokens=10, do_sample=False, use_cache=False)
        assert new_tokens(out, ids.shape[1])[i] == new_tokens(alone, len(r))[0]


def test_static_cache_equals_dynamic(model):
    rows = prompts(1)
    ids, mask = left_padded(rows)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    static = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(static, model.generate(ids, **kw))


def test_sampling_scores_equal_unpadded_forward_of_each_row(model):
    """Sampled from a left-padded batch: the logits of every step equal a full forward of that row."""
    rows = prompts(2)
    ids, mask = left_padded(rows)
    torch.manual_seed(5)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=True, top_k=0,
                         temperature=1.0, output_logits=True, return_dict_in_generate=True)
    steps = torch.stack(out.logits, 1)  # [B, 6, V]
    width = ids.shape[1]
    for i, r in enumerate(rows):
        full = torch.cat([r, out.sequences[i, width:]])
        with torch.no_grad():
            ref = model(input_ids=full[None], use_cache=False).logits[0, len(r) - 1:-1]
        assert (steps[i] - ref).abs().max().item() <= 1e-4
    assert len({tuple(s) for s in new_tokens(out.sequences, width)}) == len(rows)


def test_beam_search_left_padded_batch_equals_each_row_alone(model):
    rows = prompts(3)
    ids, mask = left_padded(rows)
    kw = dict(max_new_tokens=7, min_new_tokens=7, num_beams=3, do_sample=False, early_stopping=True,
              return_dict_in_generate=True, output_scores=True)
    out = model.generate(ids, attention_mask=mask, **kw)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], use_cache=False, **kw)  # every step recomputed from the tokens
        assert new_tokens(out.sequences, ids.shape[1])[i] == new_tokens(alone.sequences, len(r))[0]
        assert out.sequences_scores[i].item() == pytest.approx(alone.sequences_scores[0].item(), abs=1e-4)


def test_prompt_lookup_decoding_equals_greedy_and_crops_the_recurrent_state(model, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    motif = torch.randint(3, 300, (4,), generator=gen)
    prompt = torch.cat([motif, torch.randint(3, 300, (3,), generator=gen), motif, motif[:2]])[None]
    removed = []
    crop = MegatronTCCache.crop
    monkeypatch.setattr(MegatronTCCache, "crop", lambda self, n: (removed.append(n), crop(self, n))[1])
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assisted = model.generate(prompt, prompt_lookup_num_tokens=3, **kw)
    assert any(n < 0 for n in removed), "no draft token was ever rejected: the crop path is untested"
    monkeypatch.setattr(MegatronTCCache, "crop", crop)
    assert torch.equal(assisted, model.generate(prompt, **kw))


def test_crop_restores_the_state_of_a_shorter_input(model):
    ids = prompts(6)[0][None]
    with torch.no_grad():
        cache = MegatronTCCache(model.config)
        _call(model, ids[:, :4], cache)
        cache.activate_past_recording()
        _call(model, ids[:, 4:], cache)
        cache.crop(-3)
        assert cache.get_seq_length() == ids.shape[1] - 3
        got = _call(model, ids[:, -3:], cache).logits
        ref = model(input_ids=ids, use_cache=False).logits[:, -3:]
    assert (got - ref).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="cannot crop 9 tokens"):
        cache.crop(-9)


def _cache_kwarg() -> str:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _call(model, ids, cache):
    return model(input_ids=ids, **{_cache_kwarg(): cache})


def test_bad_cache_and_mask_are_clear_errors(model):
    ids = prompts()[0][None]
    with pytest.raises(TypeError, match="MegatronTCCache"):
        _call(model, ids, tf.DynamicCache())
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, cached \+ new tokens\]"):
        model(input_ids=ids, attention_mask=torch.ones(1, 3, dtype=torch.long))
