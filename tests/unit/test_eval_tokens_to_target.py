"""Tokens-to-target on synthetic logs with known answers; TensorBoard input; plot and report files."""
import json
import math
import os
import shutil

import pytest

from megatron_tc.eval.plots import plot_ppl_vs_tokens
from megatron_tc.eval.report import write_report
from megatron_tc.eval.tokens_to_target import (EvalLogError, Target, load_run, read_jsonl_log, tokens_to_reach,
                                               tokens_to_target)

# teacher ppl 10; with ks=(1.0, 2.0) the targets are 10 and 20; the naive run ends at 20 as well.
RUNS = {
    "naive": [(0, 400.0), (1000, 100.0), (100000, 20.0)],
    "taylor_calibrate": [(0, 80.0), (1000, 40.0), (100000, 10.0)],
    "taylor_fit": [(0, 30.0), (1000, 10.0)],
    "short": [(0, 50.0), (50000, 15.0)],
}


def _write_run(root, name, points, teacher_ppl=10.0, init=None):
    d = root / name
    d.mkdir()
    with open(d / "eval_log.jsonl", "w") as fh:
        for step, (t, p) in enumerate(points):
            fh.write(json.dumps({"step": step, "tokens": t, "ppl": p, "kl": math.log(p / teacher_ppl),
                                 "teacher_ppl": teacher_ppl}) + "\n")
    (d / "run.json").write_text(json.dumps({"name": name, "init": init or name, "policy": "uniform"}))
    return str(d)


@pytest.fixture
def run_dirs(tmp_path):
    return [_write_run(tmp_path, n, pts) for n, pts in RUNS.items()]


def test_known_crossings_interpolated_and_first(run_dirs):
    curves = {c.name: c for c in map(load_run, run_dirs)}
    tc, fit = curves["taylor_calibrate"], curves["taylor_fit"]
    # log-ppl linear in log-tokens: 20 = sqrt(40 * 10) lies half-way, at sqrt(1e3 * 1e5) = 1e4 tokens
    assert tokens_to_reach(tc, 20.0) == pytest.approx(1e4, rel=1e-12)
    assert tokens_to_reach(tc, 20.0, method="first") == 1e5
    assert tokens_to_reach(tc, 10.0) == pytest.approx(1e5, rel=1e-12)  # exactly on an eval point
    # from the zero-shot point (tokens 0) the interpolation is linear in tokens
    assert tokens_to_reach(fit, 20.0) == pytest.approx(1000 * math.log(1.5) / math.log(3), rel=1e-12)
    assert tokens_to_reach(fit, 40.0) == 0  # already there at zero-shot
    assert tokens_to_reach(curves["naive"], 19.9) is None


def test_stay_counts_from_the_last_rise_above_the_target(tmp_path):
    # a calibrated start that rises under the first steps, then falls (qwen2's taylor_fit on CPU, rounded)
    bump = load_run(_write_run(tmp_path, "bump", [(0, 88.0), (1000, 98.0), (4000, 99.5), (8000, 90.0),
                                                   (16000, 86.0), (32000, 87.0), (64000, 82.0)]))
    assert tokens_to_reach(bump, 98.6) == 0 and tokens_to_reach(bump, 98.6, stay=True) == pytest.approx(
        math.exp(math.log(4000) + (math.log(99.5) - math.log(98.6)) / (math.log(99.5) - math.log(90.0))
                 * (math.log(8000) - math.log(4000))), rel=1e-12)
    assert tokens_to_reach(bump, 98.6, method="first", stay=True) == 8000
    assert tokens_to_reach(bump, 86.5, method="first") == 16000  # first reach ...
    assert tokens_to_reach(bump, 86.5, method="first", stay=True) == 64000  # ... but back above at 32k
    assert tokens_to_reach(bump, 100.0, stay=True) == 0  # never above
    ends_above = load_run(_write_run(tmp_path, "ends_above", [(0, 80.0), (1000, 95.0)]))
    assert tokens_to_reach(ends_above, 90.0) == 0 and tokens_to_reach(ends_above, 90.0, stay=True) is None
    res = tokens_to_target([bump, ends_above], teacher_ppl=10.0, ks=(9.0,), stay=True)
    assert res["stay"] is True and {r["name"]: r["tokens"]["9.00x teacher"] for r in res["runs"]} == {
        "bump": 8000, "ends_above": None}  # 90 is met exactly at 8k, after the last point above it


def test_table_and_ratios_with_bounds(run_dirs):
    res = tokens_to_target([load_run(d) for d in run_dirs], ks=(1.0, 2.0))
    assert res["teacher_ppl"] == 10.0
    assert [(t["label"], t["ppl"]) for t in res["targets"]] == [("1.00x teacher", 10.0), ("2.00x teacher", 20.0),
                                                               ("naive final", 20.0)]
    tokens = {r["name"]: r["tokens"] for r in res["runs"]}
    assert tokens["naive"] == {"1.00x teacher": None, "2.00x teacher": 1e5, "naive final": 1e5}
    assert tokens["short"]["1.00x teacher"] is None
    vs_naive, vs_tc = res["ratios"]["vs_naive"], res["ratios"]["vs_taylor_calibrate"]
    assert vs_naive["taylor_calibrate"]["naive final"] == {"value": pytest.approx(10.0), "bound": "="}
    # taylor_fit reaches 10 at 1e3 tokens, naive never does within its 1e5: at least 100x fewer
    assert vs_naive["taylor_fit"]["1.00x teacher"] == {"value": pytest.approx(100.0), "bound": ">="}
    assert vs_tc["taylor_fit"]["1.00x teacher"] == {"value": pytest.approx(100.0), "bound": "="}
    # short never reaches 10, taylor_calibrate does at 1e5: at most 1e5 / 5e4 = 2x
    assert vs_tc["short"]["1.00x teacher"] == {"value": pytest.approx(2.0), "bound": "<="}
    assert vs_naive["short"]["1.00x teacher"] is None
    assert "naive" not in vs_naive


def test_log_errors_and_truncated_last_line(tmp_path):
    p = tmp_path / "eval_log.jsonl"
    p.write_text('{"tokens": 0, "ppl": 50}\n{"tokens": 100, "ppl": 40}\n{"tokens": 200, "pp')
    assert read_jsonl_log(p).tokens == [0, 100]  # a line cut by a kill mid-write is ignored
    p.write_text('{"tokens": 0, "ppl": 50}\n{"tokens": 100, "ppl": 40}\n{"tokens": 100, "ppl": 30}\n')
    assert read_jsonl_log(p).ppl == [50, 30]  # repeated after a resume: the last wins
    p.write_text('{"tokens": 0, "loss": 5}\n')
    with pytest.raises(EvalLogError, match="needs 'tokens' and 'ppl'"):
        read_jsonl_log(p)
    with pytest.raises(EvalLogError, match="no such run"):
        load_run(tmp_path / "nope")
    with pytest.raises(EvalLogError, match="no targets"):
        tokens_to_target([read_jsonl_log(_ok(tmp_path))])


def test_report_puts_a_missing_run_or_bad_factors_in_one_error_line(tmp_path):
    from megatron_tc.eval.report import report_main

    with pytest.raises(SystemExit, match=r"^error: .*nope: no such run directory or log file"):
        report_main([str(tmp_path / "nope"), "--out", str(tmp_path / "rep")])
    with pytest.raises(SystemExit, match=r"^error: --ks '1.1,x': give comma-separated factors"):
        report_main([str(_ok(tmp_path)), "--out", str(tmp_path / "rep"), "--ks", "1.1,x"])
    assert not (tmp_path / "rep").exists()  # nothing written before the error


def _ok(tmp_path):
    p = tmp_path / "ok.jsonl"
    p.write_text('{"tokens": 0, "ppl": 50}\n')
    return p


def test_tensorboard_logs_read_like_jsonl(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    d = tmp_path / "tb_run"
    writer = SummaryWriter(str(d / "tb"))
    for step, (t, p) in enumerate(RUNS["taylor_calibrate"]):
        writer.add_scalar("eval/ppl", p, step * 10)
        writer.add_scalar("eval/tokens", t, step * 10)
        writer.add_scalar("eval/teacher_ppl", 10.0, step * 10)
        writer.add_scalar("train/loss", 1.0, step * 10)
    writer.close()
    curve = load_run(d)
    assert curve.name == "tb_run"
    assert curve.tokens == [0, 1000, 100000]
    assert curve.ppl == pytest.approx([80, 40, 10])
    assert curve.teacher_ppl == 10.0
    assert tokens_to_reach(curve, 20.0) == pytest.approx(1e4, rel=1e-5)


def _assert_png(path):
    import matplotlib.image

    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_plot_is_a_valid_png(run_dirs, tmp_path):
    curves = [load_run(d) for d in run_dirs]
    path = plot_ppl_vs_tokens(curves, [Target("1.10x teacher", 11.0)], tmp_path / "p.png", teacher_ppl=10.0)
    _assert_png(path)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_report_has_tables_and_figure(run_dirs, tmp_path):
    out = tmp_path / "report"
    meta = json.loads(open(os.path.join(run_dirs[0], "run.json")).read())
    with open(os.path.join(run_dirs[0], "run.json"), "w") as fh:  # a run that recorded its BOS convention
        json.dump(meta | {"bos": True}, fh)
    path = write_report(run_dirs, str(out), ks=(1.0, 2.0))
    text = open(path).read()
    assert f"| {meta['name']} | {meta['init']} | uniform | — | yes |" in text
    assert "| BOS |" in text and text.count("| uniform | — | — |") == len(run_dirs) - 1
    assert "| taylor_fit |" in text and "not reached" in text and "≥ 100.00x" in text and "10.00x" in text
    assert "![eval perplexity vs training tokens](ppl_vs_tokens.png)" in text
    _assert_png(out / "ppl_vs_tokens.png")
    assert json.load(open(out / "tokens_to_target.json"))["teacher_ppl"] == 10.0


def test_tensorboard_stage2_layout_and_eval_token_count_refused(tmp_path):
    """stage 2 logs ppl against tokens as the global step; an eval-token count in 'tokens' is refused."""
    from torch.utils.tensorboard import SummaryWriter

    d = tmp_path / "stage2"
    writer = SummaryWriter(str(d / "tensorboard"))
    for step, (t, p) in enumerate(RUNS["naive"]):
        writer.add_scalar("stage2_eval/ppl", p, step)
        writer.add_scalar("stage2_eval/teacher_ppl", 10.0, step)
        writer.add_scalar("stage2_eval_vs_tokens/ppl", p, t)
    writer.close()
    curve = load_run(d)
    assert curve.tokens == [0, 1000, 100000] and curve.ppl == pytest.approx([400, 100, 20])
    assert curve.teacher_ppl == 10.0
    p = tmp_path / "eval_log.jsonl"
    p.write_text('{"step": 0, "tokens": 512, "ppl": 50}\n{"step": 10, "tokens": 512, "ppl": 40}\n')
    with pytest.raises(EvalLogError, match="eval token count"):
        read_jsonl_log(p)
    p.write_text('{"step": 0, "tokens": 512, "train_tokens": 0, "ppl": 50}\n'
                 '{"step": 10, "tokens": 512, "train_tokens": 4096, "ppl": 40}\n')
    assert read_jsonl_log(p).tokens == [0, 4096]


def test_report_names_logs_copied_side_by_side(run_dirs, tmp_path):
    """eval_log.jsonl files kept in one folder get their names from NAME=PATH; without names they
    would all be named after that folder, which is refused."""
    flat = tmp_path / "flat"
    flat.mkdir()
    specs = []
    for d in run_dirs[:2]:
        name = os.path.basename(d)
        shutil.copy(os.path.join(d, "eval_log.jsonl"), flat / f"{name}_eval_log.jsonl")
        specs.append(f"{name}={flat / f'{name}_eval_log.jsonl'}")
    path = write_report(specs, str(tmp_path / "named"), ks=(1.0, 2.0), naive="taylor_calibrate",
                        baselines=["taylor_calibrate"])
    text = open(path).read()
    # naive reaches 2x the teacher (20) at 100k tokens, taylor_calibrate at 1e4 (see above)
    assert "Times fewer tokens than `taylor_calibrate`" in text and "Times fewer tokens than `naive`" not in text
    assert "| naive | ≤ 1.00x | 0.10x | ≤ 1.00x |" in text
    with pytest.raises(EvalLogError, match=r"baselines \['taylor_fit'\] name no run"):
        write_report(specs, str(tmp_path / "named"), baselines=["taylor_fit"])
    with pytest.raises(EvalLogError, match=r"several runs are named \['flat'\].*NAME=PATH"):
        write_report([s.split("=", 1)[1] for s in specs], str(tmp_path / "unnamed"))



def test_a_run_folder_whose_name_holds_an_equals_sign_is_a_path(run_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(run_dirs[0], tmp_path / "lr=3e-4")
    path = write_report(["lr=3e-4", run_dirs[1]], str(tmp_path / "out"), ks=(1.0, 2.0))
    assert "| naive |" in open(path).read()  # named by its run.json, not split at the '='
