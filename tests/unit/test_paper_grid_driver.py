"""tools/paper/grid.py (megatron_tc.eval.paper_grid): the stage-2 and zero-shot grids share each (teacher, policy)'s
converted teacher and layer selection, in both directions, and never overwrite a cell's own."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _driver():
    from megatron_tc.eval import paper_grid

    return paper_grid


def test_the_tool_writes_the_quick_teacher_configs_and_prints_the_quick_overrides(tmp_path, capsys):
    tool = load_script("tools/paper/grid.py")
    assert tool.main(["quick-configs", str(tmp_path)]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["teacher_mistral.json", "teacher_qwen2.json", "teacher_qwen3.json"]
    mistral = json.loads((tmp_path / "teacher_mistral.json").read_text())
    assert (mistral["num_hidden_layers"], mistral["num_attention_heads"], mistral["sliding_window"]) == (4, 2, 16)
    capsys.readouterr()
    assert tool.main(["quick-overrides"]) == 0
    assert capsys.readouterr().out.split() == _driver().QUICK


def _grid(tmp_path: Path, part: str, inits: list[str]):
    from megatron_tc.eval.grid import load_grid

    data = {"base": str(ROOT / "configs" / "tiny.yaml"), "out": part, "mode": "zero_shot",
            "axes": {"teacher": {"t": "teacher"}, "policy": ["uniform", "ar"], "init": inits}}
    path = tmp_path / f"{part}.yaml"
    path.write_text(json.dumps(data))
    return load_grid(path)


def _share_across(grids: dict, part: str) -> None:
    """Run part `part` of `grids` with the driver's donors (the other parts' cells), through a runner
    that does nothing: what each cell holds when its pipeline would start."""
    import dataclasses

    from megatron_tc.eval.grid import register_runner, run_grid

    register_runner("nothing", lambda cfg, grid, cell: {})
    run_grid(dataclasses.replace(grids[part], mode="nothing"), force=True, log=lambda msg: None,
             donors=_driver().donors_of(grids, part))


def _finish_shared_stages(run_dir: str, selection: str) -> None:
    root = Path(run_dir)
    (root / "teacher").mkdir(parents=True)
    (root / "teacher" / "manifest.json").write_text("{}")
    (root / "select").mkdir()
    (root / "select" / "selection.json").write_text(selection)
    stages = {s: {"status": "complete", "fingerprint": s} for s in ("convert", "select", "stats")}
    (root / "manifest.json").write_text(json.dumps({"stages": stages}))


def test_zero_shot_and_stage2_cells_take_each_others_selection(tmp_path):
    stage2, zero_shot = _grid(tmp_path, "stage2", ["naive", "taylor_fit"]), _grid(tmp_path, "zero_shot", ["zero_gate"])
    s2 = {c.key: c for c in stage2.cells()}
    zs = {c.key: c for c in zero_shot.cells()}
    _finish_shared_stages(s2["t/ar/naive"].run_dir, '{"keep": [1]}')  # stage 2 ran ar's selection
    _finish_shared_stages(zs["t/uniform/zero_gate"].run_dir, '{"keep": [0]}')  # zero-shot ran uniform's
    grids = {"stage2": stage2, "zero_shot": zero_shot}
    _share_across(grids, "zero_shot")
    _share_across(grids, "stage2")
    assert Path(zs["t/ar/zero_gate"].run_dir, "select", "selection.json").read_text() == '{"keep": [1]}'
    for init in ("naive", "taylor_fit"):
        assert Path(s2[f"t/uniform/{init}"].run_dir, "select", "selection.json").read_text() == '{"keep": [0]}'
    assert Path(s2["t/ar/taylor_fit"].run_dir, "select", "selection.json").read_text() == '{"keep": [1]}'
    stages = json.loads(Path(s2["t/uniform/taylor_fit"].run_dir, "manifest.json").read_text())["stages"]
    assert sorted(stages) == ["convert", "select"]  # stats depend on the init: not from another init's cell
    assert stages["select"]["reused_from"] == s2["t/uniform/naive"].run_dir  # which took zero_gate's
    assert json.loads(Path(s2["t/uniform/naive"].run_dir, "manifest.json").read_text()
                      )["stages"]["select"]["reused_from"] == zs["t/uniform/zero_gate"].run_dir
    # a cell with its own selection keeps it
    assert Path(zs["t/uniform/zero_gate"].run_dir, "select", "selection.json").read_text() == '{"keep": [0]}'


def test_the_long_naive_part_takes_the_selection_of_either_other_part(tmp_path):
    stage2, zero_shot = _grid(tmp_path, "stage2", ["naive", "taylor_fit"]), _grid(tmp_path, "zero_shot", ["zero_gate"])
    long = _grid(tmp_path, "naive_long", ["naive"])
    _finish_shared_stages({c.key: c for c in stage2.cells()}["t/ar/taylor_fit"].run_dir, '{"keep": [1]}')
    _finish_shared_stages({c.key: c for c in zero_shot.cells()}["t/uniform/zero_gate"].run_dir, '{"keep": [0]}')
    _share_across({"stage2": stage2, "zero_shot": zero_shot, "naive_long": long}, "naive_long")
    cells = {c.key: c for c in long.cells()}
    assert Path(cells["t/ar/naive"].run_dir, "select", "selection.json").read_text() == '{"keep": [1]}'
    assert Path(cells["t/uniform/naive"].run_dir, "select", "selection.json").read_text() == '{"keep": [0]}'


def test_parts_of_a_kind_and_the_long_budget():
    from megatron_tc.eval.grid import load_grid

    driver = _driver()
    assert sorted(driver.part_files("smollm2", ["naive_long"])) == ["faithful", "faithful_recipe", "faithful_seed1",
                                                                      "naive_long", "stage2", "stage2_gdn", "stage2_lr",
                                                                      "stage2_seed", "stage2_seed2", "stage2_variant",
                                                                      "stage2_warmup", "zero_shot"]
    with pytest.raises(SystemExit, match=r"--parts naive_long: no such grid for kind 'small'"):
        driver.part_files("small", ["stage2", "naive_long"])
    sets = {p: dict(o.split("=", 1) for o in load_grid(f).overrides if "=" in o)
            for p, f in driver.part_files("smollm2", []).items()}
    long, base = sets["naive_long"], sets["stage2"]
    assert int(long["distill.stage2.tokens"].split()[0]) == 9 * int(base["distill.stage2.tokens"].split()[0]) // 2
    # everything else that shapes training is the stage-2 grid's
    for key in ("data.micro_batch_size", "data.global_batch_size", "distill.stage2.lr", "distill.stage2.min_lr",
                "model.dtype", "run.stages"):
        assert long[key].split()[0] == base[key].split()[0], key
    assert load_grid(driver.part_files("smollm2", [])["naive_long"]).axes["init"] == ["naive"]


@pytest.mark.parametrize("part", ["stage2_seed", "stage2_seed2"])
def test_the_seed_parts_are_the_stage2_grid_with_other_seeds(part):
    """Only run.seed differs (init randomness and data order), so the parts' cells measure the
    run-to-run spread of one recipe; each part has a seed of its own."""
    from megatron_tc.eval.grid import load_grid

    driver = _driver()
    files = driver.part_files("smollm2", list(driver.PARTS))
    seed, base = load_grid(files[part]), load_grid(files["stage2"])
    sets = [dict(o.split("=", 1) for o in g.overrides) for g in (seed, base)]
    assert {k: v.split()[0] for k, v in sets[0].items() if k != "run.seed"} == \
        {k: v.split()[0] for k, v in sets[1].items()}
    seeds = {p: dict(o.split("=", 1) for o in load_grid(files[p]).overrides).get("run.seed", "0").split()[0]
             for p in ("stage2", "stage2_seed", "stage2_seed2")}
    assert len(set(seeds.values())) == 3, seeds
    assert seed.axes["init"] == ["taylor_calibrate", "taylor_fit"]  # the pair whose gap the spread is read against
    assert sorted(seed.axes["policy"]) == sorted(base.axes["policy"])
    assert Path(seed.out).name == part
    assert driver.TIMED_LIKE[part] == "stage2"


def test_the_variant_part_is_the_stage2_recipe_for_taylor_fit_alone(tmp_path):
    """A variant of taylor_fit (--variant NAME) trains with exactly the grid's recipe, so its cells compare
    with the grid's naive and taylor_calibrate cells."""
    from megatron_tc.eval.grid import load_grid

    driver = _driver()
    files = driver.part_files("smollm2", ["stage2_variant"])
    fit, base = load_grid(files["stage2_variant"]), load_grid(files["stage2"])
    assert [o.split("#")[0].split() for o in fit.overrides] == [o.split("#")[0].split() for o in base.overrides]
    assert fit.axes["init"] == ["taylor_fit"] and sorted(fit.axes["policy"]) == sorted(base.axes["policy"])
    narrowed = driver.narrowed(fit, {"smollm2": "/t"}, ["stats"], "taylor_fit-seqres", tmp_path / "stage2_variant", [])
    assert [c.key for c in narrowed.cells()] == ["smollm2/stats/taylor_fit-seqres"]
    assert narrowed.cells()[0].run_dir == str(tmp_path / "stage2_variant" / "smollm2" / "stats" / "taylor_fit-seqres")


def _settings(grid) -> dict[str, str]:
    return {k: v.split("#")[0].strip() for k, v in (o.split("=", 1) for o in grid.overrides)}


def test_the_recipe_parts_change_one_thing_each_for_every_init():
    """stage2_warmup is the stage-2 grid with a 2-step warmup; stage2_gdn is that with only the GDN
    mixers trained; stage2_lr is the grid at half the peak (and final) learning rate. Same inits,
    policies, budget and data order, so each is read against the others."""
    from megatron_tc.eval.grid import load_grid

    files = _driver().part_files("smollm2", ["stage2_warmup", "stage2_gdn", "stage2_lr"])
    base, warmup, gdn, lr = (load_grid(files[p]) for p in ("stage2", "stage2_warmup", "stage2_gdn", "stage2_lr"))
    assert _settings(warmup) == {**_settings(base), "distill.stage2.warmup_steps": "2"}
    assert _settings(gdn) == {**_settings(warmup), "distill.stage2.trainable": "gdn"}
    assert _settings(lr) == {**_settings(base), "distill.stage2.lr": "1.5e-4", "distill.stage2.min_lr": "1.5e-5"}
    assert _driver().TIMED_LIKE["stage2_lr"] == "stage2"
    for part in (warmup, gdn, lr):
        assert part.axes["init"] == base.axes["init"] and sorted(part.axes["policy"]) == sorted(base.axes["policy"])
    assert (Path(warmup.out).name, Path(gdn.out).name) == ("stage2_warmup", "stage2_gdn")
