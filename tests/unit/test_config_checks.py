"""Cross-field checks: every rule raises ConfigError with a message that says how to fix it."""
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tc.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    derive_dp,
    register_init_strategy,
    resolve_config,
    validate_against_arch,
    validate_config,
)
from megatron_tc.config.names import init_strategy_names
from megatron_tc.model.config import ArchConfig

SMOLLM = dict(family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
              head_dim=64, intermediate_size=1536)


def make(*overrides: str) -> Config:
    return config_from_dict(apply_overrides({"model": {"teacher": "t"}}, overrides))


def arch(**kw) -> ArchConfig:
    return ArchConfig(**{**SMOLLM, **kw})


def raises(match: str):
    return pytest.raises(ConfigError, match=match)


def test_defaults_and_shipped_settings_pass():
    validate_config(make(), world_size=1)
    validate_against_arch(make(), arch(), world_size=1)
    validate_against_arch(make("parallel.tp=3", "data.global_batch_size=6"), arch(), world_size=6)


def test_world_size_must_equal_tp_pp_dp():
    with raises(r"world size 8 != parallel.tp \* parallel.pp \* parallel.dp = 2 \* 1 \* 2 = 4: set parallel.dp=0"):
        validate_config(make("parallel.tp=2", "parallel.dp=2"), world_size=8)
    with raises(r"world size 6 is not divisible by parallel.tp \* parallel.pp = 2 \* 2 = 4: launch a multiple of 4"):
        validate_config(make("parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1"), world_size=6)
    with raises("world size 0 must be >= 1"):
        validate_config(make(), world_size=0)


def test_dp_is_derived_from_world_size():
    cfg = make("parallel.tp=2", "data.global_batch_size=8")
    assert derive_dp(cfg.parallel, 8) == 4
    resolved = resolve_config(cfg, 8)
    assert resolved.parallel.dp == 4 and cfg.parallel.dp == 0  # a copy; the input is unchanged
    validate_config(resolved, world_size=8)


def test_tp_must_divide_heads_kv_heads_and_mlp():
    with raises(r"parallel.tp=2 does not divide the teacher's 9 attention and GDN heads.*3 KV heads.*choose parallel.tp from \[1, 3\]"):
        validate_against_arch(make("parallel.tp=2"), arch(), world_size=2)
    with raises(r"parallel.tp=4 does not divide the teacher's 2 KV heads \(num_kv_heads\).*from \[1, 2\]"):
        validate_against_arch(make("parallel.tp=4"), arch(num_heads=8, num_kv_heads=2, intermediate_size=64))
    with raises(r"parallel.tp=2 does not divide the teacher's 9 attention and GDN heads \(num_heads\)"):
        validate_against_arch(make("parallel.tp=2"), arch(num_kv_heads=1, intermediate_size=64))
    validate_against_arch(make("parallel.tp=2"), arch(num_heads=6, num_kv_heads=6, intermediate_size=64))
    with raises(r"does not divide the teacher's 30 MLP width"):
        validate_against_arch(make("parallel.tp=4"), arch(num_heads=8, num_kv_heads=4, intermediate_size=30))


@pytest.mark.parametrize("zero", [2, 3])
def test_pipeline_parallel_rejects_zero_2_and_3(zero):
    with raises(rf"parallel.pp=2 with parallel.zero_stage={zero}: DeepSpeed's pipeline engine supports only ZeRO "
                r"stage 0 or 1; set parallel.zero_stage=1"):
        validate_config(make("parallel.pp=2", f"parallel.zero_stage={zero}"))
    validate_config(make("parallel.pp=2", "parallel.zero_stage=1"), world_size=2)


def test_layer_pattern_must_match_teacher():
    with raises(r"model.layer_pattern has 4 layers but the teacher has 30: give one letter per layer"):
        validate_against_arch(make("model.layer_pattern=AGGG"), arch())
    validate_against_arch(make("model.layer_pattern=" + "AGG|" * 9 + "AGG"), arch())  # '|' is not a layer
    with raises(r"model.layer_pattern='AXG' contains \['X'\]: use only 'A'"):
        validate_config(make("model.layer_pattern=AXG"))
    with raises("model.layer_pattern and model.keep_layers are both set"):
        validate_config(make("model.layer_pattern=AG", "model.keep_layers=[0]"))
    with raises(r"model.keep_layers \[30, 31\] are out of range: the teacher has layers 0..29"):
        validate_against_arch(make("model.keep_layers=[0, 30, 31]"), arch())
    with raises("must be distinct layer indices"):
        validate_config(make("model.keep_layers=[1, 1]"))
    with raises("model.keep_count=31 exceeds the teacher's 30 layers"):
        validate_against_arch(make("model.keep_count=31"), arch())


def test_pipeline_stages_and_partition():
    with raises("parallel.pp=4 exceeds the teacher's 3 layers"):
        validate_against_arch(make("parallel.pp=4", "parallel.zero_stage=1"), arch(num_layers=3))
    with raises(r"pipeline_partition='pattern' with parallel.pp=2 needs model.layer_pattern with 2 non-empty stages"):
        validate_config(make("parallel.pp=2", "parallel.zero_stage=1", "parallel.pipeline_partition=pattern",
                             "model.layer_pattern=AGGG"))
    validate_config(make("parallel.pp=2", "parallel.zero_stage=1", "parallel.pipeline_partition=pattern",
                         "model.layer_pattern=AG|GG"))


def test_strategy_and_policy_names():
    with raises(r"calibrate.init='taylor_calib' is not a known strategy\. Did you mean: taylor_calibrate"):
        validate_config(make("calibrate.init=taylor_calib"))
    with raises(r"model.policy='unifrom' is not a known policy\. Did you mean: uniform\? Known: uniform, ar, ga"):
        validate_config(make("model.policy=unifrom"))
    validate_config(make("calibrate.init=mine"), init_strategies=["naive", "mine"])  # names passed in
    with raises("Known: naive, mine"):
        validate_config(make("calibrate.init=taylor"), init_strategies=["naive", "mine"])
    name = "test_registered_strategy"
    with raises("not a known strategy"):
        validate_config(make(f"calibrate.init={name}"))
    register_init_strategy(name)  # the hook a registry calls
    assert name in init_strategy_names()
    validate_config(make(f"calibrate.init={name}"))


def test_batch_sizes():
    with raises(r"data.global_batch_size=6 is not a multiple of data.micro_batch_size \* dp = 2 \* 2 = 4: use a "
                r"global batch of 4"):
        validate_config(make("data.global_batch_size=6", "data.micro_batch_size=2"), world_size=2)
    validate_config(make("data.global_batch_size=8", "data.micro_batch_size=2"), world_size=2)
    with raises("distill.stage2.tokens=100 is less than one step"):
        validate_config(make("distill.stage2.tokens=100"))


def test_stages():
    with raises(r"unknown stage\(s\) \['stage3'\]\. Did you mean: stage2, stage1"):
        validate_config(make("run.stages=[stage3]"))
    with raises(r"out of order: stages run in pipeline order, write \['init', 'eval'\]"):
        validate_config(make("run.stages=[eval, init]"))
    with raises("lists a stage twice"):
        validate_config(make("run.stages=[eval, eval]"))
    with raises("run.stages is empty"):
        validate_config(make("run.stages=[]"))
    with raises(r"stage1 with parallel.pp=2: stage 1 runs with pp=1"):
        validate_config(make("run.stages=[stage1]", "parallel.pp=2", "parallel.zero_stage=1"))
    validate_config(make("run.stages=[stage2]", "parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1"),
                    world_size=4)
    validate_config(make("run.stages=[stage2]", "parallel.pp=2", "parallel.zero_stage=1"))
    validate_config(make("run.stages=[stage1, stage2]", "parallel.tp=2"))


def test_data_checks():
    with raises(r"data.source.kind='text' needs data.source.paths"):
        validate_config(make("data.source.kind=text"))
    with raises("no calibration text"):
        validate_config(make("data.split.calibration_fraction=0"))
    validate_config(make("data.split.calibration_fraction=0", "data.split.calibration_docs=[a]"))
    with raises("no evaluation text"):
        validate_config(make("data.split.eval_fraction=0"))
    validate_config(make("data.split.eval_fraction=0", "run.stages=[stats, init]"))  # no stage needs eval text
    with raises("must be < 1 to leave training text"):
        validate_config(make("data.split.calibration_fraction=0.5", "data.split.eval_fraction=0.5"))
    with raises("pinned to both calibration and evaluation"):
        validate_config(make("data.split.calibration_docs=[a]", "data.split.eval_docs=[a]"))
    with raises(r"eval.tokens=99 exceeds the data.eval_tokens=10"):
        validate_config(make("eval.tokens=99", "data.eval_tokens=10"))


def test_ranges_and_schedule():
    with raises(r"parallel.tp=0 must be >= 1"):
        validate_config(make("parallel.tp=0"), world_size=2)  # reported, not a ZeroDivisionError
    with raises(r"model.keep_fraction=0.0 must be in \(0, 1\]"):
        validate_config(make("model.keep_fraction=0"))
    with raises(r"distill.stage2.lr=0.0 must be > 0"):
        validate_config(make("distill.stage2.lr=0", "distill.stage2.min_lr=0"))
    with raises("distill.stage2.min_lr=0.01 exceeds distill.stage2.lr=0.001"):
        validate_config(make("distill.stage2.lr=1e-3", "distill.stage2.min_lr=1e-2"))


def test_all_problems_reported_together():
    with raises(r"(?s)config has 2 problems:.*zero_stage.*calibrate.init"):
        validate_config(make("parallel.pp=2", "parallel.zero_stage=3", "calibrate.init=nope"))


def test_programmatic_configs_are_type_checked():
    cfg = make()
    cfg.parallel.zero_stage = 5
    with raises(r"parallel.zero_stage: expected one of 'auto', 0, 1, 2, 3, got 5"):
        validate_config(cfg)
    cfg = dataclasses.replace(make(), model=dataclasses.replace(make().model, keep_fraction="half"))
    with raises("model.keep_fraction: expected float"):
        validate_config(cfg)


# ---- property: invalid parallel layouts always give ConfigError, valid ones pass ---------------
def _is_valid(tp, pp, dp, zero, world, heads, kv, inter, layers, micro, gbs) -> bool:
    if tp < 1 or pp < 1 or dp < 0 or zero not in (0, 1, 2, 3) or world < 1:
        return False
    if pp > 1 and zero >= 2:
        return False
    if dp == 0:
        if world % (tp * pp):
            return False
        dp = world // (tp * pp)
    elif tp * pp * dp != world:
        return False
    return heads % tp == 0 and kv % tp == 0 and inter % tp == 0 and pp <= layers and gbs % (micro * dp) == 0


@settings(max_examples=400, deadline=None)
@given(
    tp=st.integers(-1, 8), pp=st.integers(-1, 5), dp=st.integers(-1, 6), zero=st.integers(-1, 4),
    world=st.integers(-1, 48), kv=st.integers(1, 8), group=st.integers(1, 4), inter=st.integers(1, 64),
    layers=st.integers(1, 6), micro=st.integers(1, 4), gbs=st.integers(1, 32),
)
def test_parallel_layouts_property(tp, pp, dp, zero, world, kv, group, inter, layers, micro, gbs):
    heads = kv * group
    cfg = make("run.stages=[convert, stats, init, eval]")  # layouts only; trainer limits: test_stages
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero_stage = tp, pp, dp, zero
    cfg.data.micro_batch_size, cfg.data.global_batch_size = micro, gbs
    teacher = arch(num_layers=layers, num_heads=heads, num_kv_heads=kv, intermediate_size=inter, head_dim=8)
    if _is_valid(tp, pp, dp, zero, world, heads, kv, inter, layers, micro, gbs):
        validate_against_arch(cfg, teacher, world_size=world)
    else:
        with pytest.raises(ConfigError):
            validate_against_arch(cfg, teacher, world_size=world)


@settings(max_examples=200, deadline=None)
@given(
    tp=st.integers(1, 4), pp=st.integers(1, 4), dp=st.integers(1, 4), zero=st.integers(0, 3), give_dp=st.booleans(),
    kv_per_tp=st.integers(1, 3), group=st.integers(1, 3), inter_per_tp=st.integers(1, 16), extra_layers=st.integers(0, 4),
    micro=st.integers(1, 4), accum=st.integers(1, 4),
)
def test_valid_parallel_layouts_pass_property(tp, pp, dp, zero, give_dp, kv_per_tp, group, inter_per_tp,
                                              extra_layers, micro, accum):
    zero = min(zero, 1) if pp > 1 else zero
    kv = kv_per_tp * tp
    cfg = make("run.stages=[convert, stats, init, eval]")  # layouts only; trainer limits: test_stages
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero_stage = tp, pp, dp if give_dp else 0, zero
    cfg.data.micro_batch_size, cfg.data.global_batch_size = micro, micro * dp * accum
    teacher = arch(num_layers=pp + extra_layers, num_heads=kv * group, num_kv_heads=kv,
                   intermediate_size=inter_per_tp * tp, head_dim=8)
    validate_against_arch(cfg, teacher, world_size=tp * pp * dp)
    assert derive_dp(cfg.parallel, tp * pp * dp) == dp


def test_pretrain_stage_needs_a_model_config_a_tokenizer_and_eval_text():
    with raises(r"pretrain.hf_config is not set(.|\n)*data.tokenizer is not set"):
        validate_config(make("run.stages=[pretrain]"), world_size=1)
    ok = ("run.stages=[pretrain]", "pretrain.hf_config=c.json", "data.tokenizer=tok")
    validate_config(make(*ok), world_size=1)
    with raises("no evaluation text"):
        validate_config(make(*ok, "data.split.eval_fraction=0"), world_size=1)
    with raises(r"pretrain with parallel.pp=2: the pretrain stage runs with data and tensor parallelism"):
        validate_config(make(*ok, "parallel.pp=2", "parallel.zero_stage=1", "data.global_batch_size=2"), world_size=2)
    validate_config(make(*ok, "parallel.tp=2", "data.global_batch_size=2"), world_size=2)
    with raises(r"pretrain.min_lr=0.1 exceeds pretrain.lr=0.01"):
        validate_config(make(*ok, "pretrain.lr=0.01", "pretrain.min_lr=0.1"), world_size=1)


def test_shard_teacher_true_needs_tensor_parallelism_without_pipeline():
    validate_config(make("parallel.tp=2", "parallel.shard_teacher=true"), world_size=2)
    with raises(r"parallel.shard_teacher=true .* needs parallel.tp > 1 and parallel.pp = 1 \(got tp=1, pp=1\)"):
        validate_config(make("parallel.shard_teacher=true"), world_size=1)
    with raises(r"\(got tp=2, pp=2\)"):
        validate_config(make("parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1", "parallel.shard_teacher=true"),
                        world_size=4)
    with raises("parallel.shard_teacher: expected one of 'auto', true, false"):
        make("parallel.shard_teacher=yes")
