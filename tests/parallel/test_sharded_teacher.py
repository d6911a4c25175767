"""A teacher loaded split over TP=2 ranks from a checkpoint (parallel.sharded_teacher): each rank
holds exactly what apply_tensor_parallel cuts from the whole teacher; logits, statistics, the
zero-shot student and a stage-2 run equal the replicated teacher's; a TP size that does not divide
the heads, or a damaged shard that only one rank reads, is one clear error on every rank."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_tc.calibrate.statsfile import TaylorStats
from megatron_tc.calibrate.teacher_io import checkpoint_weights_sha256, weights_sha256
from megatron_tc.testing import run_distributed
from tests._scripts import distill_main
from tests.parallel import _workers_sharded_teacher as workers
from tests.parallel import _workers_stats
from tests.parallel._workers_common import assert_close, assert_same_weights


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The statistics tests' teacher saved with 2 TP shards (the sharded load re-slices any layout)."""
    return str(workers.save_tiny_teacher(tmp_path_factory.mktemp("sharded") / "teacher", tp=2))


@pytest.fixture(scope="module")
def bad_ckpt(tmp_path_factory):
    """A teacher with 3 attention heads and 1 KV head: TP=2 cannot split it."""
    from megatron_tc.convert.checkpoint import save_checkpoint
    from megatron_tc.model import HybridLM

    model, _, _ = _workers_stats.tiny_teacher_and_rows()
    arch = dataclasses.replace(model.arch, num_heads=3, num_kv_heads=1)
    return str(save_checkpoint(HybridLM(arch).state_dict(), arch, tmp_path_factory.mktemp("bad") / "teacher"))


@pytest.fixture(scope="module")
def damaged_ckpt(ckpt, tmp_path_factory):
    """A copy of `ckpt` with bytes of a shard changed (its size kept), as one node's staged copy of
    a teacher might be."""
    import shutil

    copy = tmp_path_factory.mktemp("damaged") / "teacher"
    shutil.copytree(ckpt, copy)
    shard = copy / "model_tp00_pp00.safetensors"
    data = bytearray(shard.read_bytes())
    data[-64:] = bytes(255 - b for b in data[-64:])
    shard.write_bytes(bytes(data))
    return str(copy)


@pytest.fixture(scope="module")
def loaded(ckpt, bad_ckpt, damaged_ckpt, tmp_path_factory):
    """Both ranks' records of `workers.load_and_forward` (one launch for the load and the error tests)."""
    out = str(tmp_path_factory.mktemp("load") / "load")
    run_distributed(workers.load_and_forward, 2, ckpt, out, bad_ckpt, damaged_ckpt, timeout=180)
    return out


def test_each_rank_reads_its_slice_and_the_logits_equal_the_whole_teacher(loaded):
    """Each rank holds exactly what apply_tensor_parallel cuts from the whole teacher in memory
    (vocabulary padded 128 -> 256 rows for TP=2), having read only its slice of the checkpoint: the
    two ranks together read every real weight once (padding rows never), the replicated norms once
    per rank and stored copy. Its gathered logits equal the whole teacher's, and the hash streamed
    from the checkpoint is the whole teacher's."""
    out = loaded
    model, ids, doc_ids = _workers_stats.tiny_teacher_and_rows()
    with torch.no_grad():
        want_logits = model(ids, doc_ids=doc_ids)[..., :model.arch.vocab_size]
    vocab, whole = model.arch.vocab_size, model.state_dict()
    real = sum(4 * (v[:vocab] if k in ("embed_tokens.weight", "lm_head.weight") else v).numel() for k, v in whole.items())
    norms = sum(4 * v.numel() for k, v in whole.items() if k.endswith("norm.weight"))
    loaded = [torch.load(f"{out}.{rank}") for rank in range(2)]
    assert sum(got["read_bytes"] for got in loaded) == real + (2 * 2 - 1) * norms  # 2 ranks x 2 stored copies
    for rank, got in enumerate(loaded):
        assert got["padded"] == 256 and got["sha256"] == weights_sha256(model)
        torch.testing.assert_close(got["logits"], want_logits, rtol=1e-5, atol=1e-5)
        assert sorted(got["state"]) == sorted(got["reference"])
        assert got["state"]["layers.0.mixer.q_proj.weight"].shape == (16, 32)  # 2 of 4 heads
        for name, value in got["reference"].items():
            assert torch.equal(got["state"][name], value), name


def test_ar_ga_and_eval_scores_of_the_sharded_teacher_equal_the_replicated_teachers(loaded):
    """On the split teacher (both ranks): `ar` (one layer's row-parallel attention output zeroed,
    perplexity from vocabulary shards), `ga` (probe students built from the checkpoint, aligned
    over both ranks) and the eval stage's teacher perplexity, KL and top-1 agreement of a whole
    student (also from the teacher cache) equal one process's with the whole teacher."""
    model, _, _ = _workers_stats.tiny_teacher_and_rows()
    want = workers.select_and_score(model)
    assert want["eval"][0]["kl"] > 1e-3 and want["eval"][0]["top1_agree"] < 1
    ppl = want["ar"]["details"]["teacher_ppl"]
    for rank in range(2):
        got = torch.load(f"{loaded}.{rank}")
        for policy in ("ar", "ga"):
            assert got[policy]["keep"] == want[policy]["keep"], (rank, policy)
        assert got["ar"]["details"]["teacher_ppl"] == pytest.approx(ppl, rel=1e-6)
        # ar's scores are differences of perplexities: fp32 rounding of each, relative to the perplexity
        assert got["ar"]["scores"] == pytest.approx(want["ar"]["scores"], abs=1e-6 * ppl), rank
        assert got["ga"]["scores"] == pytest.approx(want["ga"]["scores"], rel=1e-5), rank
        for scores in got["eval"]:  # the first call fills the teacher cache, the second reads it
            for key in ("teacher_ppl", "ppl", "kl", "top1_agree", "tokens"):
                assert scores[key] == pytest.approx(want["eval"][0][key], rel=1e-5, abs=1e-7), (rank, key)


def test_statistics_of_the_sharded_teacher_equal_the_replicated_teachers(ckpt, tmp_path):
    """Both sweeps, with the layers' inputs and outputs kept from sweep 1 and with a second forward
    (budget 0): every sum equals the single-process pass within the statistics tests' tolerance."""
    ref = _workers_stats.stats_of_rows(range(4))
    assert any(k.startswith("readout.taylor_fit.") for k in ref.sums)
    path = str(tmp_path / "stats")
    run_distributed(workers.stats, 2, ckpt, path, timeout=240)
    for name in ("kept", "forward"):
        got = TaylorStats.load(f"{path}.{name}")
        assert sorted(got.sums) == sorted(ref.sums)
        assert got.meta["num_heads"] == 4 and got.sums["layers.0.count"].shape == ref.sums["layers.0.count"].shape
        for key, want in ref.sums.items():
            torch.testing.assert_close(got.sums[key], want, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


def test_zero_shot_student_and_alignment_targets_from_the_sharded_teacher_equal_the_replicated_ones(ckpt, tmp_path):
    """The closed-form student (statistics, readout fit, the weights copied from the checkpoint)
    and the per-layer alignment targets (mixer inputs, outputs, residual stream) that both ranks
    get from the sharded teacher equal one process's from the whole teacher."""
    out = str(tmp_path / "init")
    run_distributed(workers.init_student, 2, ckpt, out, timeout=240)
    model, _, _ = _workers_stats.tiny_teacher_and_rows()
    want = workers.closed_form_student(model)[0].state_dict()
    want_targets = workers.alignment_targets(model)
    vocab = model.arch.vocab_size
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        state = got["state"]
        assert state["embed_tokens.weight"].shape[0] == 256 and not state["embed_tokens.weight"][vocab:].any()
        for name in ("embed_tokens.weight", "lm_head.weight"):  # the sharded teacher's padding: 256 rows
            if name in state:
                state[name], want[name] = state[name][:vocab], want[name][:vocab]
        assert_same_weights(state, want, f"rank {rank} student")
        for layer, tensors in want_targets.items():
            for key, value in tensors.items():
                assert_close(got["targets"][layer][key], value, f"rank {rank} layer {layer} {key}")


def test_training_stages_with_the_sharded_teacher_equal_one_process(tmp_path):
    """Stage 2 (KL, CE and hidden-state terms on vocabulary shards) and stage 1 against the split
    teacher: the same losses, gradient norms and gathered student as one process with the whole one."""
    run_distributed(workers.stage2_reference, 1, str(tmp_path), timeout=180)
    run_distributed(workers.stage2, 2, str(tmp_path), timeout=240)
    for one, two, keys, steps in (("tp1", "tp2_sharded", ("loss", "kl", "ce", "hidden", "grad_norm"), [1, 2]),
                                  ("s1_tp1", "s1_tp2_sharded", ("loss", "mse/L01", "mse/L03", "grad_norm"), [1, 2, 3])):
        records = [[json.loads(line) for line in (tmp_path / d / "train_log.jsonl").read_text().splitlines() if line]
                   for d in (one, two)]
        assert [r["step"] for r in records[1]] == steps
        for key in keys:
            series = [torch.tensor([r[key] for r in rs], dtype=torch.float64) for rs in records]
            assert_close(series[1], series[0], f"{two} {key}")
        assert_same_weights(torch.load(tmp_path / two / "student.pt"), torch.load(tmp_path / one / "student.pt"),
                            f"{two} student")


def test_heads_not_divisible_by_tp_is_one_error_line_on_every_rank(loaded):
    messages = [open(f"{loaded}.error.{rank}").read() for rank in range(2)]
    assert messages[0] == messages[1]
    assert messages[0] == ("ValueError: parallel.tp=2 does not divide the teacher's 3 attention heads, 1 KV heads, which "
                           "a sharded teacher splits over the tensor-parallel ranks: choose parallel.tp from [1]")


def test_a_damaged_shard_read_by_one_rank_stops_every_rank_with_its_error(loaded):
    """Rank 1 reads a damaged copy of the teacher, rank 0 the intact one (its own load succeeds):
    the teacher's load stops both ranks with rank 1's error."""
    own = [json.loads(open(f"{loaded}.damaged.{rank}").read()) for rank in range(2)]
    assert own[0]["alone"] == "loaded"
    assert own[1]["alone"].startswith("CheckpointError: ") and "model_tp00_pp00.safetensors is corrupted" in own[1]["alone"]
    assert own[0]["shared"] == own[1]["shared"] == own[1]["alone"]


ROOT = Path(__file__).resolve().parents[2]


def _args(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    """tools/distill.py's arguments: configs/tiny.yaml on `assets` with parallel.tp=2."""
    return [str(ROOT / "configs" / "tiny.yaml"), f"model.teacher={assets / 'teacher'}",
            f"data.source.paths=[{assets / 'text'}]", "data.source.split_by=file", f"run.run_dir={run_dir}",
            "parallel.tp=2", *extra]


def _launch(assets: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """launch/distill.sh with 2 gloo ranks on `_args`."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_JOB_ID")}
    env.update(NPROC="2", OMP_NUM_THREADS="1", PYTHON=sys.executable)
    cmd = ["bash", str(ROOT / "launch" / "distill.sh"), *_args(assets, run_dir, *extra)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def test_pipeline_with_a_sharded_teacher(tmp_path):
    """The launcher with parallel.shard_teacher=true runs every stage on the split teacher
    (select with policy ar, stats, init, stage 1, stage 2, eval); its selection, statistics, the
    starting point of every aligned layer and the eval rows of the teacher and the zero-shot
    students equal the replicated teacher's run (the same pipeline on 2 gloo ranks of the test
    harness: the launcher itself is what the sharded run tests)."""
    from megatron_tc.testing import write_tiny_teacher

    assets = write_tiny_teacher(tmp_path / "assets", n_docs=40, words_per_doc=(50, 300))
    sharded = _launch(assets, tmp_path / "sharded", "parallel.shard_teacher=true", "model.policy=ar",
                      "run.stages=[convert,select,stats,init,stage1,stage2,eval]", "distill.stage2.steps=2")
    assert sharded.returncode == 0, sharded.stdout[-3000:] + sharded.stderr[-5000:]
    assert "the teacher is split over 2 tensor-parallel ranks" in sharded.stdout + sharded.stderr
    run_distributed(distill_main, 2, _args(assets, tmp_path / "replicated", "parallel.shard_teacher=false",
                                           "model.policy=ar", "run.stages=[convert,select,stats,init,eval]"),
                    timeout=400)
    chosen, want_chosen = (json.loads((tmp_path / run / "select/selection.json").read_text())
                           for run in ("sharded", "replicated"))
    assert chosen["policy"] == "ar" and chosen["keep"] == want_chosen["keep"]
    assert chosen["scores"] == pytest.approx(want_chosen["scores"], abs=1e-6 * want_chosen["details"]["teacher_ppl"])
    got, want = (TaylorStats.load(tmp_path / run / "stats/stats.pt") for run in ("sharded", "replicated"))
    assert got.meta["teacher_sha256"] == want.meta["teacher_sha256"] and sorted(got.sums) == sorted(want.sums)
    for key, value in want.sums.items():
        torch.testing.assert_close(got.sums[key], value, rtol=1e-5, atol=1e-6, msg=key)
    # alignment: the layers dealt over both TP ranks start from the same closed form on the same targets
    aligned, want_aligned = (json.loads((tmp_path / run / "init/report.json").read_text())["align"]
                             for run in ("sharded", "replicated"))
    assert sorted(aligned) == sorted(want_aligned) and len(aligned) >= 2
    for layer, report in want_aligned.items():
        assert abs(aligned[layer]["initial"] - report["initial"]) <= 1e-5 * report["initial"], layer
    results, want_results = (json.loads((tmp_path / run / "eval/results.json").read_text())["rows"]
                             for run in ("sharded", "replicated"))
    assert [r["model"] for r in results][-1] == "after distillation"
    assert [r["model"] for r in results[:3]] == [r["model"] for r in want_results] == \
        ["teacher", "naive zero-shot", "taylor_calibrate zero-shot"]
    for row, want_row in zip(results, want_results):  # the zero-shot students differ only by alignment rounding
        for key in ("ppl", "kl", "top1_agree"):
            assert row[key] == pytest.approx(want_row[key], rel=1e-4, abs=1e-6), (row["model"], key)


@pytest.mark.parametrize("rows_per_read", [7, 4096])
def test_streamed_checkpoint_hash_equals_the_loaded_teachers(ckpt, rows_per_read):
    from megatron_tc.convert.hf_to_megatron import load_hybrid_lm

    assert checkpoint_weights_sha256(ckpt, rows_per_read) == weights_sha256(load_hybrid_lm(ckpt))
