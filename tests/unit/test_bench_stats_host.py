"""tools/bench/stats_host.py runs with --quick on CPU: one row per piece of sweep 2's host work and
for a whole pass beside its forward, with the operators counted where they reach the kernels."""
import json

import torch

from megatron_tc.bench.stats_host import count_ops
from tests._scripts import load_script


def test_quick_run_reports_default_builds_and_sums(capsys):
    assert load_script("tools/bench/stats_host.py").main(["--quick"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["work"], r["per"]) for r in rows] == [("default", "layer"), ("build", "layer"),
                                                       ("build, 8 layers together", "layer"),
                                                       ("sums", "layer and batch"),
                                                       ("sums, 8 layers stacked", "layer and batch"),
                                                       ("forward, narrow layers", "pass"),
                                                       ("pass, narrow layers", "pass")]
    assert rows[2]["ops"] < rows[1]["ops"]  # a group's closed forms share their operators
    assert rows[4]["ops"] < rows[3]["ops"] / 2  # the stacked call issues most operators once for all layers
    forward, whole = rows[5], rows[6]
    assert whole["ops"] > forward["ops"] and whole["tokens"] == forward["tokens"] == 16
    assert whole["x_forward"] == round(whole["cpu_ms"]["median"] / forward["cpu_ms"]["median"], 2)
    for row in rows:
        assert row["ops"] > 0 and 0 <= row["cpu_ms"]["min"] <= row["cpu_ms"]["median"] <= row["cpu_ms"]["max"]


def test_operators_are_counted_below_autograd():
    x = torch.ones(3, requires_grad=True)
    assert count_ops(lambda: (x * 2).sum()) == 2  # mul, sum
