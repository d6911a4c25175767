"""Invalid configs fail with ConfigError and a message, never with an exception from deep inside
YAML parsing, DeepSpeed or torch.distributed; the runner checks the config before it creates any
process group, and the command line turns the error into a message and exit code 2."""
from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_tc.config import ConfigError, config_to_dict, load_config, validate_against_arch, validate_config
from megatron_tc.distill.runner import known_teacher_arch
from tests.reliability._rundir import DISTILL, ROOT, child_env, clone

TINY = ROOT / "configs" / "tiny.yaml"

# ---- property: any override set either loads or raises ConfigError --------------------------------

KEYS = [
    "parallel.tp", "parallel.pp", "parallel.dp", "parallel.zero_stage", "parallel.teacher_mode", "parallel.backend",
    "parallel.pipeline_partition", "data.seq_len", "data.micro_batch_size", "data.global_batch_size",
    "data.calib_tokens", "data.eval_tokens", "data.source.kind", "data.source.paths", "data.split.eval_fraction",
    "data.split.calibration_fraction", "data.split.eval_docs", "model.layer_pattern", "model.keep_layers",
    "model.keep_fraction", "model.keep_count", "model.policy", "calibrate.init", "calibrate.align_steps",
    "distill.stage2.lr", "distill.stage2.min_lr", "distill.stage2.tokens", "distill.stage2.temperature",
    "distill.nan_policy", "distill.max_skipped", "distill.keep_last", "distill.checkpoint_interval",
    "eval.tokens", "eval.seq_len", "eval.target_ppl_factors", "eval.probe_lengths", "run.stages", "run.precision",
    "run.device", "logging.log_interval", "export.formats",
    # not keys: a typo, a section given a value, a key below a value, an empty name
    "parallel.tpp", "data", "data.seq_len.x", "distill..lr", "nosuchsection.key",
]
VALUES = st.one_of(
    st.integers(-3, 9).map(str),
    st.sampled_from(["0.5", "1e-4", "-1e-9", "nan", ".inf", "-.inf", "1e400", "true", "no", "null", "~", "",
                     "[]", "[1, 2]", "[-1]", "[stage2, stats]", "[stage2, stage2]", "[[1]]", "{a: 1}", "[", "{",
                     "'x'", "AGAG", "AG|GA", "AXG", "skip", "abort", "bf16", "fp8", "cpu", "gloo", "3.5", "0x10",
                     "uniform", "taylor_calibrate", "tayler", "!!python/object:os.system x", "*alias", "a: b: c"]),
    st.text(alphabet="ab1.-_[]{}:, ", max_size=8),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides=st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=4),
       world_size=st.one_of(st.none(), st.integers(-1, 8)))
def test_any_overrides_load_or_raise_config_error(overrides, world_size):
    try:
        cfg = load_config(TINY, [f"{k}={v}" for k, v in overrides], world_size=world_size)
    except ConfigError as err:
        assert str(err).strip(), "ConfigError without a message"
    else:
        config_to_dict(cfg)  # a config that loads is plain data


# ---- the runner validates before any process group exists ----------------------------------------

class ProcessGroupCreated(Exception):
    """Raised by the patched init_process_group: the runner got as far as creating a process group."""


def run_pipeline_until_process_groups(cfg, world_size: int):
    """run_pipeline as rank 0 of `world_size` processes, stopped where the first process group
    would be created. Returns 'process group' or the ConfigError."""
    from megatron_tc.distill.runner import run_pipeline

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999"}
    with mock.patch.dict(os.environ, env), \
            mock.patch.object(dist, "init_process_group", side_effect=ProcessGroupCreated):
        try:
            run_pipeline(cfg)
        except ProcessGroupCreated:
            return "process group"
        except ConfigError as err:
            return err
    raise AssertionError("run_pipeline returned without creating a process group")


@pytest.fixture(scope="module")
def run_yaml(template, tmp_path_factory):
    return clone(template, tmp_path_factory.mktemp("cfg")) / "run.yaml"


@pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a default process group")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tp=st.integers(1, 4), pp=st.integers(1, 3), dp=st.integers(0, 3), zero=st.integers(0, 3),
       micro=st.integers(1, 3), gbs=st.integers(1, 12), world=st.integers(1, 8))
def test_runner_checks_the_config_before_creating_process_groups(run_yaml, tp, pp, dp, zero, micro, gbs, world):
    overrides = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.zero_stage={zero}",
                 f"data.micro_batch_size={micro}", f"data.global_batch_size={gbs}"]
    try:
        cfg = load_config(run_yaml, overrides)  # what the command line does first (no world size yet)
    except ConfigError:
        return  # refused even earlier
    try:
        validate_config(cfg, world_size=world)
        arch = known_teacher_arch(cfg)  # the runner also checks against the teacher when it is known
        if arch is not None:
            validate_against_arch(cfg, arch, world)
        valid = True
    except ConfigError:
        valid = False
    outcome = run_pipeline_until_process_groups(cfg, world)
    if valid:
        assert outcome == "process group"
    else:
        assert isinstance(outcome, ConfigError), f"invalid for world size {world}, but the runner reached {outcome!r}"


def test_runner_checks_tp_against_an_existing_teacher_before_creating_process_groups(run_yaml):
    cfg = load_config(run_yaml, ["parallel.tp=3"])
    outcome = run_pipeline_until_process_groups(cfg, 3)
    assert isinstance(outcome, ConfigError) and "does not divide" in str(outcome)


def test_runner_checks_tp_against_a_gguf_teacher_before_converting_it(tmp_path):
    """The quickstart's GGUF teacher (9 heads, 3 KV heads) is checked from its header at start-up,
    not after the convert stage has read its weights."""
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["parallel.tp=2", f"run.run_dir={tmp_path}"])
    outcome = run_pipeline_until_process_groups(cfg, 2)
    assert isinstance(outcome, ConfigError) and "does not divide the teacher's 9 attention" in str(outcome)
    assert not (tmp_path / "teacher").exists()


def test_command_line_reports_a_config_error_without_a_traceback(run_yaml):
    """tools/distill.py as one process with parallel.tp=2: a world-size error, exit code 2."""
    proc = subprocess.run([sys.executable, str(DISTILL), str(run_yaml), "parallel.tp=2"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config error: world size 1 is not divisible by parallel.tp * parallel.pp" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (run_yaml.parent / "run/manifest.json").exists()
