"""tools/paper/report.py on hand-made grid results: the zero-shot and tokens-to-target
tables, the goals checked cell by cell, and unfinished cells listed rather than guessed."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_tc.eval.paper_tokens import _goal_verdict
from tests._scripts import load_script


def _load():
    return load_script("tools/paper/report.py")


def _cell(root: Path, part: str, init: str, curve: list[tuple[int, float]], zero_shot: dict[str, float],
          teacher_ppl: float = 20.0) -> None:
    d = root / "grid" / part / "qwen2" / "uniform" / init
    (d / "eval").mkdir(parents=True)
    metrics = {"ppl": curve[-1][1], "kl": 0.5}
    (d / "cell.json").write_text(json.dumps({"status": "ok", "metrics": metrics}))
    (d / "run.json").write_text(json.dumps({"name": init, "init": init}))
    (d / "eval_log.jsonl").write_text("".join(json.dumps({"step": i, "tokens": t, "ppl": p, "kl": p / 100,
                                                          "teacher_ppl": teacher_ppl}) + "\n" for i, (t, p) in enumerate(curve)))
    rows = [{"model": "teacher", "ppl": 20.0, "kl": 0.0}] + [{"model": k, "ppl": v, "kl": v / 100} for k, v in zero_shot.items()]
    (d / "eval" / "results.json").write_text(json.dumps({"rows": rows}))


def _grid_cells(runs: Path) -> None:
    _cell(runs, "stage2", "naive", [(0, 4000.0), (1000, 100.0), (100000, 24.0)], {"naive zero-shot": 4000.0})
    _cell(runs, "stage2", "taylor_calibrate", [(0, 80.0), (1000, 30.0), (100000, 21.0)],
          {"naive zero-shot": 4000.0, "taylor_calibrate zero-shot": 80.0})
    # taylor_calibrate's curve after 0, with a dip at 500 tokens that it leaves again
    _cell(runs, "stage2", "taylor_fit", [(0, 60.0), (500, 24.0), (1000, 30.0), (100000, 21.0)],
          {"naive zero-shot": 4000.0, "taylor_fit zero-shot": 60.0})
    _cell(runs, "zero_shot", "zero_gate", [(0, 900.0)], {})


def test_tables_ratios_and_goals(tmp_path):
    runs = tmp_path / "runs"
    _grid_cells(runs)
    assert _load().main(["--runs", str(runs), "--out", str(tmp_path / "out"), "--variant", "taylor_fit"]) == 0
    md = (tmp_path / "out" / "README.md").read_text()
    assert "| qwen2 | uniform | 20 | 4000 / 40 | 900 / 0.5 (4.4x) | 80 / 0.8 (50.0x) | 60 / 0.6 (66.7x) |" in md
    assert "zero-shot qwen2/uniform" not in md  # fit has the best zero-shot perplexity: no miss
    line = next(l for l in md.splitlines() if l.startswith("| qwen2 | uniform | 1.10x"))
    assert line.endswith("| not reached | 54.8k | 54.8k | ≥ 1.82x | 1.00x |"), line  # naive never gets to 22
    assert (tmp_path / "out" / "qwen2_uniform" / "ppl_vs_tokens.png").is_file()
    for how in ("first reach", "reached and stayed"):
        # naive never reaches 22: only a lower bound, below the goal, is known
        assert (f"- not shown: tokens ({how}) qwen2/uniform 1.10x teacher: taylor_fit vs naive ≥ 1.82x (goal ≥ 10.0x); "
                "naive did not reach it in the budget") in md
        assert f"- missed: tokens ({how}) qwen2/uniform 1.10x teacher: taylor_fit vs taylor_calibrate 1.00x (goal ≥ 1.5x)\n" in md
    # 1.25x the teacher (25): first reached in the dip, before 500 tokens; stayed only after 1000
    first, stayed = (next(l for l in part.splitlines() if l.startswith("| qwen2 | uniform | 1.25x")).split(" | ")[5]
                     for part in md.split("Reached and stayed:")[:2])
    assert first.isdigit() and int(first) < 500, first
    assert stayed.endswith("k") and 1 < float(stayed[:-1]) < 100, stayed
    # supplementary KL table: the KL curves are the ppl curves / 100, so naive's final KL (0.24) is
    # reached where naive's final ppl is, by fit and taylor_calibrate at the same tokens
    kl_line = next(l for l in md.split("Supplementary")[1].splitlines() if l.startswith("| qwen2 | uniform |"))
    assert kl_line.startswith("| qwen2 | uniform | 0.2400 / 0.2100 / 0.2100 | 12.5% | 0.0% | 100k / "), kl_line
    assert kl_line.endswith("| 1.00x |"), kl_line
    assert "- smollm2/uniform/naive" in md and "- qwen2/uniform/naive" not in md.split("Cells not finished")[1]
    assert "No long naive run yet." in md
    assert "No cell run with another seed in these results." in md


def test_a_longer_naive_run_settles_a_goal_the_budget_left_not_shown(tmp_path):
    runs = tmp_path / "runs"
    _grid_cells(runs)
    # naive with 4.5x the budget reaches 1.10x the teacher (22) between 100k and 450k tokens
    # (its own evaluation of the teacher differs in the last bits: the grid's targets apply)
    _cell(runs, "naive_long", "naive", [(0, 4000.0), (100000, 100.0), (450000, 21.0)], {"naive zero-shot": 4000.0},
          teacher_ppl=20.0001)
    assert _load().main(["--runs", str(runs), "--out", str(tmp_path / "out"), "--variant", "taylor_fit"]) == 0
    md = (tmp_path / "out" / "README.md").read_text()
    long_tokens = math.exp(math.log(1e5) + (math.log(100 / 22) / math.log(100 / 21)) * math.log(4.5))
    fit_tokens = math.exp(math.log(1e3) + (math.log(30 / 22) / math.log(30 / 21)) * math.log(100))
    expected = f"{long_tokens / fit_tokens:.2f}x"
    assert expected == "7.85x"
    for how in ("first reach", "reached and stayed"):
        assert (f"- not shown: tokens ({how}) qwen2/uniform 1.10x teacher: taylor_fit vs naive ≥ 1.82x (goal ≥ 10.0x); "
                f"naive did not reach it in the budget; against naive given 4.5x the budget: {expected}, missed") in md
    table = md.split("## Supplementary: naive given a longer")[1]
    row = next(l for l in table.splitlines() if l.startswith("| qwen2 | uniform | reached and stayed | 1.10x"))
    assert row.endswith(f"| 430k | 54.8k | {expected} | missed |"), row
    assert "- qwen2 / uniform: naive ends at ppl 21 after 450k tokens (4.5x the budget); taylor_fit at 21 after 100k" in table


def test_a_second_seed_beside_the_grid_run(tmp_path):
    """stage2_seed cells (another run.seed) sit beside the grid's: per seed, taylor_calibrate / fit and
    taylor_fit's ratio; then how far each init moved between the seeds."""
    runs = tmp_path / "runs"
    _grid_cells(runs)
    # seed 1: taylor_calibrate reaches 1.15x the teacher (23) at 4,000 tokens, fit at 2,000, and both stay
    _cell(runs, "stage2_seed", "taylor_calibrate", [(0, 70.0), (1000, 27.5), (4000, 23.0), (100000, 21.0)], {})
    _cell(runs, "stage2_seed", "taylor_fit", [(0, 55.0), (2000, 23.0), (100000, 20.5)], {})
    for init in ("taylor_calibrate", "taylor_fit"):
        (runs / "grid" / "stage2_seed" / "qwen2" / "uniform" / init / "config.yaml").write_text("run:\n  seed: 1\n")
    assert _load().main(["--runs", str(runs), "--out", str(tmp_path / "out"), "--variant", "taylor_fit"]) == 0
    section = (tmp_path / "out" / "README.md").read_text().split("## Supplementary: other seeds")[1].split("##")[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| qwen2 |")]
    # the grid's cells have no config.yaml here: the grid runs with configs/paper/base.yaml's run.seed
    assert [r[2] for r in rows] == ["0", "1"]
    assert rows[1][3:6] == ["70 / 55", "21 / 20.5", "0.2100 / 0.2050"]
    assert rows[1][7] == "4k / 2k (2.00x)"
    # the grid's fit reaches 23 on its last segment (30 at 1k -> 21 at 100k; log-log interpolation)
    fit_grid = math.exp(math.log(1e3) + (math.log(30 / 23) / math.log(30 / 21)) * math.log(100))
    spread = next(line for line in section.splitlines() if line.startswith("- qwen2 / uniform: tokens"))
    assert spread.startswith("- qwen2 / uniform: tokens with seed 1 over seed 0 at 1.10x teacher / "
                             "1.15x teacher / 1.25x teacher: taylor_calibrate "), spread
    assert spread.split("; taylor_fit ")[1].split(" / ")[1] == f"{2000 / fit_grid:.2f}x", spread


def test_a_third_seed_is_set_against_the_first(tmp_path):
    """stage2_seed2 cells add a row each and a spread line against the grid's seed, like stage2_seed's."""
    runs = tmp_path / "runs"
    _grid_cells(runs)
    _cell(runs, "stage2_seed", "taylor_calibrate", [(0, 70.0), (1000, 27.5), (4000, 23.0), (100000, 21.0)], {})
    _cell(runs, "stage2_seed", "taylor_fit", [(0, 55.0), (2000, 23.0), (100000, 20.5)], {})
    _cell(runs, "stage2_seed2", "taylor_calibrate", [(0, 72.0), (8000, 23.0), (100000, 21.2)], {})
    _cell(runs, "stage2_seed2", "taylor_fit", [(0, 58.0), (4000, 23.0), (100000, 20.8)], {})
    for part, seed in (("stage2_seed", 1), ("stage2_seed2", 2)):
        for init in ("taylor_calibrate", "taylor_fit"):
            (runs / "grid" / part / "qwen2" / "uniform" / init / "config.yaml").write_text(f"run:\n  seed: {seed}\n")
    assert _load().main(["--runs", str(runs), "--out", str(tmp_path / "out"), "--variant", "taylor_fit"]) == 0
    section = (tmp_path / "out" / "README.md").read_text().split("## Supplementary: other seeds")[1].split("##")[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| qwen2 |")]
    assert [r[2] for r in rows] == ["0", "1", "2"]
    assert rows[2][3:6] == ["72 / 58", "21.2 / 20.8", "0.2120 / 0.2080"]
    assert rows[2][7] == "8k / 4k (2.00x)"
    spread = [line for line in section.splitlines() if line.startswith("- qwen2 / uniform: tokens")]
    assert [line.split(" at ")[0] for line in spread] == ["- qwen2 / uniform: tokens with seed 1 over seed 0",
                                                          "- qwen2 / uniform: tokens with seed 2 over seed 0"]
    # the mean over the three seeds: at 1.15x the teacher (23) both grid cells stay below it from the same
    # point of their last segment (30 at 1k -> 21 at 100k), then 4k / 2k and 8k / 4k
    grid = math.exp(math.log(1e3) + (math.log(30 / 23) / math.log(30 / 21)) * math.log(100))
    mean = next(line for line in section.splitlines() if line.startswith("- qwen2 / uniform, 3 seeds: "))
    at_115 = next(p for p in mean.split("; ") if "1.15x teacher" in p)
    base, run = (grid + 4000 + 8000) / 3, (grid + 2000 + 4000) / 3
    assert at_115.endswith(f"({base / run:.2f}x, per seed 1.00-2.00x)"), mean


def test_a_target_one_seed_never_reaches_has_no_mean(tmp_path):
    runs = tmp_path / "runs"
    _grid_cells(runs)
    _cell(runs, "stage2_seed", "taylor_calibrate", [(0, 70.0), (1000, 27.5), (4000, 23.0), (100000, 21.0)], {})
    _cell(runs, "stage2_seed", "taylor_fit", [(0, 55.0), (2000, 23.0), (100000, 22.5)], {})  # never at 22 (1.10x)
    assert _load().main(["--runs", str(runs), "--out", str(tmp_path / "out"), "--variant", "taylor_fit"]) == 0
    section = (tmp_path / "out" / "README.md").read_text().split("## Supplementary: other seeds")[1].split("##")[0]
    mean = next(line for line in section.splitlines() if line.startswith("- qwen2 / uniform, 2 seeds: ")).split("; ")
    assert mean[0].endswith("1.10x teacher no mean (a run did not reach it, or met it before training)"), mean
    assert mean[1].startswith("1.15x teacher ") and "x, per seed " in mean[1], mean


def test_grid_cells_kept_only_as_curves_count_in_every_section(tmp_path):
    """--grid-eval-logs: grid cells that survive as <teacher>_<policy>_<init>_eval_log.jsonl stand in
    for the grid's cells in the seed section and the tokens-to-target tables and goals, and are listed
    apart from the cells not finished; the zero-shot table takes their step-0 evaluation, marked."""
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    _cell(runs, "stage2_seed", "taylor_calibrate", [(0, 70.0), (1000, 27.5), (4000, 23.0), (100000, 21.0)], {})
    _cell(runs, "stage2_seed", "taylor_fit", [(0, 55.0), (2000, 23.0), (100000, 20.5)], {})
    logs.mkdir()
    for init, curve in (("taylor_calibrate", [(0, 80.0), (8000, 23.0), (100000, 21.0)]),
                        ("taylor_fit", [(0, 60.0), (4000, 23.0), (100000, 21.0)])):
        (logs / f"qwen2_uniform_{init}_eval_log.jsonl").write_text("".join(
            json.dumps({"step": i, "tokens": t, "ppl": p, "kl": p / 100, "teacher_ppl": 20.0}) + "\n"
            for i, (t, p) in enumerate(curve)))
    (logs / "notes_eval_log.jsonl").write_text("")  # not a cell's name: ignored
    args = ["--runs", str(runs), "--out", str(tmp_path / "out"), "--variant", "taylor_fit"]
    assert _load().main(args) == 0
    assert "No cell run with another seed" in (tmp_path / "out" / "README.md").read_text()
    assert _load().main(args + ["--grid-eval-logs", str(logs)]) == 0
    md = (tmp_path / "out" / "README.md").read_text()
    section = md.split("## Supplementary: other seeds")[1].split("##")[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| qwen2 |")]
    # no config.yaml here: the grid's run.seed is configs/paper/base.yaml's, another part is labelled by its name
    assert [r[2] for r in rows] == ["0", "stage2_seed"]
    assert rows[0][3:5] == ["80 / 60", "21 / 21"]
    assert rows[0][7] == "8k / 4k (2.00x)"
    not_finished, kept = md.split("## Cells not finished")[1].split("Kept only as stage-2 curves")
    assert "- qwen2/uniform/naive" in not_finished and "- qwen2/uniform/taylor_fit" not in not_finished
    assert kept.split("\n\n", 1)[1].strip().splitlines() == ["- qwen2/uniform/taylor_calibrate", "- qwen2/uniform/taylor_fit"]
    # the curves count in the tokens-to-target table (1.15x the teacher: 23, reached at 8k and 4k) ...
    line = next(l for l in md.split("Reached and stayed:")[1].splitlines() if l.startswith("| qwen2 | uniform | 1.15x"))
    assert line.endswith("| — | 8k | 4k | — | 2.00x |"), line
    # ... and in the zero-shot table with their step-0 evaluation (the curve's first point), marked;
    # a zero_gate cell in --runs fills its column from its own evaluation
    zero_shot = md.split("## Zero-shot perplexity")[1].split("##")[0]
    assert "| qwen2 | uniform | 20 | — | — | 80 / 0.8† | 60 / 0.6† |" in zero_shot, zero_shot
    assert "† a grid cell kept only as its stage-2 curve" in zero_shot
    assert "not finished: zero-shot qwen2/uniform: incomplete (['taylor_calibrate', 'taylor_fit'])" in md
    _cell(runs, "zero_shot", "zero_gate", [(0, 900.0)], {})
    (logs / "qwen2_uniform_naive_eval_log.jsonl").write_text("".join(
        json.dumps({"step": i, "tokens": t, "ppl": p, "kl": p / 100, "teacher_ppl": 20.0}) + "\n"
        for i, (t, p) in enumerate([(0, 4000.0), (100000, 24.0)])))
    assert _load().main(args + ["--grid-eval-logs", str(logs)]) == 0
    md = (tmp_path / "out" / "README.md").read_text()
    assert ("| qwen2 | uniform | 20 | 4000 / 40† | 900 / 0.5 (4.4x) | 80 / 0.8† (50.0x) | 60 / 0.6† (66.7x) |"
            in md.split("## Zero-shot perplexity")[1].split("##")[0])
    assert "zero-shot qwen2/uniform" not in md  # complete, fit the best: neither missed nor unfinished
    assert f"--grid-eval-logs {logs}" in md.splitlines()[2]
    with pytest.raises(SystemExit, match="no such directory"):
        _load().main(args + ["--grid-eval-logs", str(tmp_path / "none")])


@pytest.mark.parametrize("ratio, goal, verdict", [
    ({"value": None, "bound": "zero-shot"}, 10.0, None),
    ({"value": 12.0, "bound": "="}, 10.0, None),
    ({"value": 9.9, "bound": "="}, 10.0, "missed"),
    ({"value": 12.0, "bound": ">="}, 10.0, None),   # a lower bound above the goal already proves it
    ({"value": 2.3, "bound": ">="}, 10.0, "not shown"),
    ({"value": 0.5, "bound": "<="}, 1.5, "missed"),  # fit never reaches the target, the baseline does
    (None, 1.5, "missed"),                           # neither reaches it
])
def test_goal_verdict(ratio, goal, verdict):
    assert _goal_verdict(ratio, goal) == verdict


def test_several_roots_read_as_one_grid_and_a_scoped_report(tmp_path):
    """Grids run in parts keep their own results roots: a later root's cell replaces an earlier one's, and
    --teachers/--policies limit the report and its list of unfinished cells."""
    old, new = tmp_path / "old", tmp_path / "new"
    _grid_cells(old)
    # a later run redid taylor_fit: its zero-shot point (50) is what the report must show
    _cell(new, "stage2", "taylor_fit", [(0, 50.0), (100000, 21.0)], {"naive zero-shot": 4000.0, "taylor_fit zero-shot": 50.0})
    out = tmp_path / "out"
    assert _load().main(["--runs", str(old), "--runs", str(new), "--out", str(out), "--variant", "taylor_fit",
                         "--teachers", "qwen2", "--policies", "uniform"]) == 0
    md = (out / "README.md").read_text()
    assert f"--runs {old} --runs {new} --teachers qwen2 --policies uniform" in md
    assert "| qwen2 | uniform | 20 | 4000 / 40 | 900 / 0.5 (4.4x) | 80 / 0.8 (50.0x) | 50 / 0.5 (80.0x) |" in md
    assert md.split("## Cells not finished")[1].strip() == "- none"
    assert "No pretraining run in these results." in md
    # the same roots, unscoped: every other teacher's cells are listed as not finished
    assert _load().main(["--runs", str(old), "--runs", str(new), "--out", str(out), "--variant", "taylor_fit"]) == 0
    assert "- smollm2/stats/taylor_fit" in (out / "README.md").read_text().split("## Cells not finished")[1]


@pytest.mark.parametrize("flag, value", [("--teachers", "qwen2,llama"), ("--policies", "")])
def test_unknown_scope_names_are_refused(tmp_path, flag, value):
    _grid_cells(tmp_path / "runs")
    with pytest.raises(SystemExit, match=f"error: {flag} .*choose from"):
        _load().main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), flag, value])


def test_gpu_results_of_smollm2_stats_give_their_tables(tmp_path):
    """Results returned by an H200 run (SmolLM2 / stats: the grid's three inits, zero_gate and naive
    with the long budget; tests/fixtures) give the numbers published for them, row by row."""
    fixture = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "paper_grid_smollm2_stats.json").read_text())
    runs = tmp_path / "runs"
    for rel, text in fixture["files"].items():
        (runs / rel).parent.mkdir(parents=True, exist_ok=True)
        (runs / rel).write_text(text)
    assert _load().main(["--runs", str(runs), "--out", str(tmp_path / "out"), "--teachers", "smollm2",
                         "--policies", "stats"]) == 0
    md = (tmp_path / "out" / "README.md").read_text()
    for row in (
        "| smollm2 | stats | 37.51 | 6.059e+04 / 7.55 | 7.751e+04 / 7.8 (0.8x) | 56.15 / 0.518 (1079.2x) | 53.97 / 0.477 (1122.7x) |",
        "| smollm2 | stats | 1.10x teacher (ppl ≤ 41.27) | not reached | 1.94M | 1.74M | ≥ 1.80x | 1.11x |",
        "| smollm2 | stats | naive final (ppl ≤ 48.27) | 3.15M | 280k | 193k | 16.34x | 1.46x |",
        "| smollm2 | stats | first reach | 1.25x teacher (ppl ≤ 46.9) | 2.43M | 283k | 8.60x | missed |",
    ):
        assert row in md, row
    assert md.split("## Cells not finished")[1].strip() == "- none"


def test_another_stage2_recipe_beside_the_grid_recipe_of_the_same_init(tmp_path):
    """stage2_warmup cells sit beside the grid's cell of their init: tokens to each target with the
    speed-up over the grid's recipe, and fit against taylor_calibrate within the recipe."""
    runs = tmp_path / "runs"
    _grid_cells(runs)
    # teacher 20: targets 22 / 23 / 25. taylor_calibrate reaches 25 at 2,000 tokens, fit at 500, and they stay
    _cell(runs, "stage2_warmup", "taylor_calibrate", [(0, 80.0), (2000, 25.0), (8000, 23.0), (16000, 22.0), (100000, 21.0)], {})
    _cell(runs, "stage2_warmup", "taylor_fit", [(0, 60.0), (500, 25.0), (4000, 23.0), (8000, 22.0), (100000, 20.5)], {})
    assert _load().main(["--runs", str(runs), "--out", str(tmp_path / "out"), "--variant", "taylor_fit"]) == 0
    section = (tmp_path / "out" / "README.md").read_text().split("## Supplementary: other stage-2 recipes")[1].split("##")[0]
    rows = {r[3]: r for r in (line.split(" | ") for line in section.splitlines() if line.startswith("| qwen2 |"))}
    assert sorted(rows) == ["taylor_calibrate", "taylor_fit"] and rows["taylor_fit"][2] == "2-step warmup"
    assert rows["taylor_fit"][5:7] == ["20.5", "0.2050"]
    # 1.10x (22): 8,000 tokens here; the grid's fit gets there on its last segment (30 at 1k -> 21 at 100k)
    grid_22 = math.exp(math.log(1e3) + (math.log(30 / 22) / math.log(30 / 21)) * math.log(100))
    assert rows["taylor_fit"][7] == f"8k ({grid_22 / 8000:.2f}x)", rows["taylor_fit"][7]
    assert rows["taylor_fit"][9].startswith("500 (") and rows["taylor_calibrate"][9].startswith("2k (")
    within = next(line for line in section.splitlines() if line.startswith("- qwen2 / uniform, 2-step warmup"))
    assert within.endswith(": 2.00x / 2.00x / 4.00x"), within
