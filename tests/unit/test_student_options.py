"""The student's GDN options in the run config (model.gdn_conv_size, gdn_expand_kv, gdn_b_bias,
gdn_chunk_size) shape the student the pipeline builds, and the stages that build GDN layers (select,
stats, init) depend on them; at their defaults they leave those stages' fingerprints as they were."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_tc.config import load_config
from megatron_tc.distill.runner import config_fingerprints
from megatron_tc.testing import run_distributed
from tests._scripts import distill_main
from tests.unit.test_select_stage import _tiny_teacher_and_text

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


def test_the_pipelines_student_takes_the_configs_gdn_options(tmp_path):
    from megatron_tc.convert.checkpoint import load_checkpoint

    run = tmp_path / "run"
    teacher_and_text = _tiny_teacher_and_text(tmp_path)
    argv = [teacher_and_text[0], *teacher_and_text[2:], f"run.run_dir={run}",
            "run.stages=[convert,select,stats,init]", "calibrate.init=taylor_calibrate", "calibrate.align_steps=1",
            "model.gdn_conv_size=3", "model.gdn_chunk_size=8", "model.gdn_b_bias=false"]
    run_distributed(distill_main, 1, argv, timeout=300)
    arch, state = load_checkpoint(run / "init" / "student")
    assert (arch.gdn_conv_size, arch.gdn_chunk_size, arch.gdn_b_bias) == (3, 8, False)
    converted = [i for i, kind in enumerate(arch.layer_kinds) if kind == "G"]
    assert converted
    for i in converted:
        convs = [name for name in state if name.startswith(f"layers.{i}.mixer.") and "conv" in name]
        assert len(convs) == 3 and all(state[name].shape[-1] == 3 for name in convs), convs
        assert f"layers.{i}.mixer.b_proj.bias" not in state


@pytest.mark.parametrize("key, value", [("gdn_conv_size", 4), ("gdn_expand_kv", False), ("gdn_b_bias", False),
                                        ("gdn_chunk_size", 32)])
def test_the_gdn_options_are_part_of_the_fingerprints_of_the_stages_that_build_gdn_layers(key, value):
    base = config_fingerprints(load_config(TINY, ["model.gdn_chunk_size=64"]))
    defaults = config_fingerprints(load_config(TINY, ["model.gdn_chunk_size=64", "model.gdn_conv_size=0",
                                                      "model.gdn_expand_kv=true", "model.gdn_b_bias=true"]))
    assert defaults == base
    changed = config_fingerprints(load_config(TINY, ["model.gdn_chunk_size=64", f"model.{key}={value}"]))
    assert changed["convert"] == base["convert"]
    assert all(changed[stage] != base[stage] for stage in ("select", "stats", "init", "stage2"))
