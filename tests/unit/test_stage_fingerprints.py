"""Which config keys invalidate which pipeline stage (distill/rundir.py STAGE_KEYS)."""
from __future__ import annotations

import pytest

from megatron_tc.config.loader import config_to_dict, load_config
from megatron_tc.distill.rundir import STAGE_KEYS, stage_fingerprints
from megatron_tc.distill.runner import STAGES

PIPELINE = [s for s in STAGES if s != "pretrain"]


def _fingerprints(*overrides: str) -> dict[str, str]:
    return stage_fingerprints(config_to_dict(load_config(None, overrides, check=False)), PIPELINE)


def _changed(*overrides: str) -> list[str]:
    base, other = _fingerprints(), _fingerprints(*overrides)
    return [stage for stage in PIPELINE if base[stage] != other[stage]]


@pytest.mark.parametrize("stage", sorted(STAGE_KEYS))
def test_every_stage_key_names_a_config_field(stage):
    tree = config_to_dict(load_config(None, check=False))
    for key in STAGE_KEYS[stage]:
        node = tree
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"STAGE_KEYS[{stage!r}] names {key!r}, not in the config"
            node = node[part]


@pytest.mark.parametrize("override, first_changed", [
    # the calibration rows' order decides ar / ga / readout_gap scores and the statistics
    ("data.calib_order=stream", "select"),
    ("run.seed=7", "select"),
    ("data.calib_tokens=4096", "select"),
    ("data.bos=false", "select"),  # calibration rows, training sequences and eval windows change
    ("data.token_store=corpus/store", "select"),  # every split's documents come from the store
    ("calibrate.init=naive", "stats"),
    ("distill.stage2.lr=1e-3", "stage2"),
    ("eval.batch_size=4", "eval"),
])
def test_a_change_invalidates_its_stage_and_every_later_one(override, first_changed):
    start = PIPELINE.index(first_changed)
    assert _changed(override) == PIPELINE[start:]


def test_an_unset_token_store_leaves_the_fingerprints_of_run_directories_written_before_it():
    tree = config_to_dict(load_config(None, check=False))
    assert tree["data"]["token_store"] is None
    del tree["data"]["token_store"]  # the config as it was before the key existed
    before = {stage: tuple(k for k in keys if k != "data.token_store") for stage, keys in STAGE_KEYS.items()}
    import megatron_tc.distill.rundir as rundir
    saved = dict(rundir.STAGE_KEYS)
    try:
        rundir.STAGE_KEYS.update(before)
        old = stage_fingerprints(tree, PIPELINE)
    finally:
        rundir.STAGE_KEYS.update(saved)
    assert _fingerprints() == old
