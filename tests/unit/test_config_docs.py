"""docs/configuration.md documents every key and is exactly what the schema generates; the shipped
DeepSpeed templates are accepted by DeepSpeed; our data section matches the data pipeline's."""
import dataclasses
import json
from pathlib import Path

import pytest

from megatron_tc.config import Config, deepspeed_template_path, load_config
from megatron_tc.config.docs import DOC_PATH, render_markdown
from megatron_tc.config.typecheck import section_types

REPO = Path(__file__).resolve().parents[2]


def _all_fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        yield key, f
        tp = section_types(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _all_fields(tp, key + ".")


def test_every_field_has_a_doc_and_appears_in_the_reference():
    text = (REPO / DOC_PATH).read_text()
    undocumented = [key for key, f in _all_fields(Config) if len(f.metadata.get("doc", "")) < 10]
    assert not undocumented, f"add a doc string to opt(...) for: {undocumented}"
    missing = [key for key, _ in _all_fields(Config) if f"`{key}`" not in text]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_the_reference_is_generated_from_the_schema():
    assert (REPO / DOC_PATH).read_text() == render_markdown(), (
        "docs/configuration.md is stale: run `python -m megatron_tc.config --write-docs`"
    )


@pytest.mark.parametrize("pp, zero", [(1, 3), (1, 2), (2, 1)])
def test_deepspeed_templates_filled_from_config_are_accepted_by_deepspeed(pp, zero):
    from deepspeed.runtime.config import DeepSpeedConfig

    from megatron_tc.parallel import deepspeed_engine as engine  # no process group: DeepSpeed assumes dp = 1

    cfg = load_config(overrides=[f"parallel.pp={pp}", f"parallel.zero_stage={zero}", "data.global_batch_size=8",
                                 "data.micro_batch_size=2", "distill.stage2.lr=2e-4", "distill.stage2.grad_clip=0.5"])
    template = deepspeed_template_path(cfg.parallel.pp, cfg.parallel.deepspeed_config)
    assert template.name == ("zero1_pipeline.json" if pp > 1 else "zero3.json")
    raw = json.loads(template.read_text())
    assert raw["optimizer"]["params"]["torch_adam"] is True and raw["train_batch_size"] == "auto"
    ds = engine.build_deepspeed_config(
        zero_stage=cfg.parallel.zero_stage, micro_batch_size=cfg.data.micro_batch_size,
        global_batch_size=cfg.data.global_batch_size, dp_size=1, lr=cfg.distill.stage2.lr,
        weight_decay=cfg.distill.stage2.weight_decay, grad_clip=cfg.distill.stage2.grad_clip,
        pipeline=pp > 1, base=template,
    )
    parsed = DeepSpeedConfig(ds)
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (8, 2, 4)
    assert parsed.zero_optimization_stage == zero and parsed.gradient_clipping == 0.5
    assert ds["optimizer"]["params"]["lr"] == 2e-4 and ds["optimizer"]["params"]["torch_adam"] is True
    assert '"auto"' not in json.dumps(ds), "every 'auto' in the template must be filled from our config"


def test_data_section_matches_the_data_pipeline_config():
    """The keys the data pipeline reads have its names and types, so `cfg.data` can feed it."""
    from megatron_tc.data import pipeline
    shipped = load_config().data
    shared = {f.name for f in dataclasses.fields(pipeline.DataConfig)}
    shipped_dict = dataclasses.asdict(shipped)
    assert shared <= set(shipped_dict), f"config data section lacks {sorted(shared - set(shipped_dict))}"
    built = pipeline.DataConfig.from_dict({k: shipped_dict[k] for k in shared})
    assert dataclasses.asdict(built) == {k: shipped_dict[k] for k in shared}
