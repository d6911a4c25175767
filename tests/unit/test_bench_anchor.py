"""tools/bench/train_anchor.py: the pipeline's step and the plain loop start from the same loss and
both train; the step FLOPs follow the 6N / 2N convention."""
import json
import os
import subprocess
import sys

import torch

from megatron_tc.bench.anchor import SyntheticBatches, plain_kl, step_flops
from megatron_tc.bench.models import forward_flops, matmul_params, tiny
from megatron_tc.parallel.chunked_losses import chunked_kl
from tests._scripts import ROOT


def test_quick_run_compares_the_same_first_step_and_reports_spreads(tmp_path):
    """A process of its own: the tool starts torch.distributed and DeepSpeed for its one rank."""
    out = tmp_path / "anchor.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    subprocess.run([sys.executable, str(ROOT / "tools/bench/train_anchor.py"), "--quick", "--out", str(out),
                    "--runs", "3", "--steps", "1", "--profile"], env=env, check=True, timeout=300, capture_output=True)
    data = json.loads(out.read_text())
    assert not data["errors"], data["errors"]
    (check,) = data["checks"]
    assert check["rel_diff"] < 1e-5, check  # same weights, same batch, fp32 on CPU
    rows = {row["path"].split(" ")[0]: row for row in data["rows"]}
    assert set(rows) == {"pipeline", "plain"} and rows["pipeline"]["path"] == "pipeline (ZeRO-0)"  # what auto picks on a CPU rank
    for row in rows.values():
        assert row["step_ms_min"] <= row["step_ms_median"] <= row["step_ms_max"]
        assert row["tokens_per_step"] == 2 * 64 and row["mfu_median"] > 0
    assert rows["pipeline"]["vs_plain_min"] <= rows["pipeline"]["vs_plain_median"] <= rows["pipeline"]["vs_plain_max"]
    for path in ("pipeline", "plain"):  # --profile: one more step of each, all operators then the heaviest
        total, *ops = [r for r in data["profile"] if r["path"] == path]
        assert total["op"] == "(all)" and ops and all(0 < op["host_ms"] <= total["host_ms"] for op in ops)
        (regions,) = [r for r in data["regions"] if r["path"] == path]  # and three steps timed by region
        parts = [regions[f"{name}_ms"] for name in ("teacher", "student_forward", "loss", "backward", "optimizer")]
        assert all(part > 0 for part in parts) and regions["sum_ms"] >= sum(parts), regions


def test_plain_kl_is_the_pipeline_objective():
    torch.manual_seed(0)
    s, t = torch.randn(2, 7, 11), torch.randn(2, 7, 11)
    want = chunked_kl(s[:, :-1], t[:, :-1], 11, 1.0, None).mean()
    torch.testing.assert_close(plain_kl(s, t, 11), want, rtol=1e-6, atol=1e-7)
    padded = torch.cat([s, torch.full((2, 7, 5), 50.0)], -1), torch.cat([t, torch.zeros(2, 7, 5)], -1)
    torch.testing.assert_close(plain_kl(*padded, 11), want, rtol=1e-6, atol=1e-7)  # padding columns ignored


def test_step_flops_and_synthetic_batches():
    arch = tiny()
    flops = step_flops(arch, arch, tokens=128, seq=64)
    forward = forward_flops(arch, 128, 64)
    assert flops["student_flops"] == 3 * forward and flops["teacher_flops"] == forward
    assert forward_flops(arch, 128, 64) > 2 * matmul_params(arch) * 128  # attention on top of 2 N per token
    a, b = SyntheticBatches(256, 8, 2, 3, dp_rank=0, dp_size=2), SyntheticBatches(256, 8, 2, 3, dp_rank=1, dp_size=2)
    assert a.tokens_per_step == 8 * 2 * 3 * 2
    first, other = a.next_step(), b.next_step()
    assert len(first) == 3 and first[0]["input_ids"].shape == (2, 8)
    assert not torch.equal(first[0]["input_ids"], other[0]["input_ids"])  # ranks read different rows
    again = SyntheticBatches(256, 8, 2, 3, dp_rank=0, dp_size=2).next_step()
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(first, again))
    assert not torch.equal(a.next_step()[0]["input_ids"], first[0]["input_ids"])  # a new step, new rows


def test_result_rows_pair_the_rounds():
    from megatron_tc.bench.anchor import result_rows

    seconds = {"pipeline": [2.0, 4.0, 3.0], "plain": [1.0, 1.0, 3.0]}
    rows = result_rows(seconds, {"pipeline": "pipeline (ZeRO-1)", "plain": "plain torch"}, 100, 1e12, 1.0)
    pipe, plain = rows
    assert (pipe["step_ms_min"], pipe["step_ms_median"], pipe["step_ms_max"]) == (2000.0, 3000.0, 4000.0)
    assert (pipe["vs_plain_min"], pipe["vs_plain_median"], pipe["vs_plain_max"]) == (0.25, 0.5, 1.0)
    assert plain["tok_per_s_median"] == 100.0 and plain["mfu_max"] == 1.0 and "vs_plain_min" not in plain
