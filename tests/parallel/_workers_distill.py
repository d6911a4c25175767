"""Workers for the stage-2 distillation tests (spawned gloo processes must import them).

A tiny random teacher (every layer attention) and a student converted from it (half the layers
Gated DeltaNet, matching tensors copied), random packed documents, ZeRO-3 over 2 ranks with
every parameter partitioned (persistence threshold 0), the project's configs/tiny.yaml.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from megatron_tc.model.config import ArchConfig
from megatron_tc.model.transformer import HybridLM

VOCAB, SEQ = 96, 16


def tiny_arch(pattern: str = "AAAA") -> ArchConfig:
    return ArchConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=64, layer_pattern=pattern, tie_embeddings=True,
                      gdn_chunk_size=8)


def teacher_and_student(seed: int = 0) -> tuple[HybridLM, HybridLM]:
    torch.manual_seed(seed)
    teacher = HybridLM(tiny_arch(), init_std=0.1)  # peaked enough to give a KL worth lowering
    student = HybridLM(tiny_arch("AGAG"))
    own = student.state_dict()
    copied = {k: v for k, v in teacher.state_dict().items() if k in own and own[k].shape == v.shape}
    student.load_state_dict(copied, strict=False)
    return teacher, student


def zipf_tokens(rng: np.random.Generator, size) -> np.ndarray:
    """Token ids 1..VOCAB-1 with Zipf-like frequencies (learnable in a few steps, unlike uniform)."""
    p = 1.0 / np.arange(1, VOCAB) ** 1.2
    return rng.choice(np.arange(1, VOCAB), size=size, p=p / p.sum())


def packed(num_docs: int, seed: int):
    from megatron_tc.data.packing import PackedSequences, TokenStream

    rng = np.random.default_rng(seed)
    docs = [zipf_tokens(rng, int(rng.integers(5, 40))).tolist() + [0] for _ in range(num_docs)]
    return PackedSequences(TokenStream.from_token_lists(docs), SEQ, pad_id=0, fingerprint=f"random{seed}")


def tiny_config(out: Path, steps: int, pp: int = 1, tp: int = 1, **extra: str):
    from megatron_tc.config.loader import load_config

    ds_json = out / "ds_zero3.json"
    if int(os.environ.get("RANK", "0")) == 0 and pp == 1:
        template = json.loads((Path(__file__).resolve().parents[2] / "configs/deepspeed/zero3.json").read_text())
        template["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition everything
        ds_json.parent.mkdir(parents=True, exist_ok=True)
        ds_json.write_text(json.dumps(template))
    torch.distributed.barrier()
    overrides = [f"distill.stage2.steps={steps}", "distill.stage2.lr=3.0e-3", "distill.stage2.warmup_steps=1",
                 "distill.eval_interval=2", "distill.checkpoint_interval=2", "data.global_batch_size=4",
                 "data.micro_batch_size=1", f"data.seq_len={SEQ}", "logging.progress_bar=false"]
    # Only stage 2 runs here; with pp > 1 the config may not list stage 1 (it runs with pp = 1).
    overrides += ([f"parallel.deepspeed_config={ds_json}"] if pp == 1
                  else [f"parallel.pp={pp}", "parallel.zero_stage=1", "run.stages=[stage2]"])
    overrides += [f"parallel.tp={tp}"]
    overrides += [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]
    return load_config(Path(__file__).resolve().parents[2] / "configs/tiny.yaml", overrides)


def build_tiny_stage2(out: Path, steps: int, pp: int = 1, tp: int = 1, seed: int = 0, eval_windows: int = 6,
                      **extra: str):
    """(ctx, trainer, tb): stage 2 of the tiny teacher and student built from scratch in `out`, as a
    new job builds it: packed synthetic training text, `eval_windows` zipf evaluation windows."""
    from megatron_tc.data.loader import DistributedBatchLoader
    from megatron_tc.distill.evaluation import window_rows
    from megatron_tc.distill.stage2 import build_stage2
    from megatron_tc.monitor import TBWriter
    from megatron_tc.parallel.state import init_parallel

    ctx = init_parallel(tp, pp)
    cfg = tiny_config(out, steps, pp, tp, **extra)
    teacher, student = teacher_and_student(seed)
    loader = DistributedBatchLoader(packed(60, seed=1), cfg.data.global_batch_size, cfg.data.micro_batch_size,
                                    ctx.dp_rank, ctx.dp_size, seed=7)
    eval_ids = torch.from_numpy(zipf_tokens(np.random.default_rng(2), (eval_windows, SEQ)))
    tb = TBWriter(out / "tb")
    trainer = build_stage2(cfg, ctx, student, teacher, loader, window_rows([eval_ids]), out, tb, torch.device("cpu"))
    return ctx, trainer, tb


def run_once(out: Path, steps: int, stop_after: int | None = None, seed: int = 0, pp: int = 1, tp: int = 1,
             **extra: str):
    """Build everything from scratch (as a new job would) and run stage 2 in `out`."""
    _, trainer, tb = build_tiny_stage2(out, steps, pp, tp, seed, **extra)
    with trainer:  # releases the engine, so runs in one process do not pile up
        result = trainer.run(stop_after=stop_after)
    tb.close()
    return result


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_resume_matches_uninterrupted(rank: int, world_size: int, root: str) -> None:
    root = Path(root)
    steps = 6
    full = run_once(root / "full", steps)
    # the same run, stopped after 3 steps (checkpoint), then resumed by a fresh engine
    first = run_once(root / "split", steps, stop_after=3)
    assert first.stopped_early and first.steps == 3 and first.student_state is None
    second = run_once(root / "split", steps)
    assert second.steps == steps and not second.stopped_early
    if rank == 0:
        a, b = _records(root / "full/train_log.jsonl"), _records(root / "split/train_log.jsonl")
        assert [r["step"] for r in b] == list(range(1, steps + 1)), [r["step"] for r in b]
        assert [r["loss"] for r in a] == [r["loss"] for r in b], ([r["loss"] for r in a], [r["loss"] for r in b])
        assert [r["lr"] for r in a] == [r["lr"] for r in b]
        assert full.student_state.keys() == second.student_state.keys()
        for name, value in full.student_state.items():
            assert torch.equal(value, second.student_state[name]), name
        evals = _records(root / "full/eval_log.jsonl")
        assert [e["step"] for e in evals] == [0, 2, 4, 6] and evals[-1]["tokens"] == steps * 4 * SEQ
        assert evals[-1]["kl"] < 0.7 * evals[0]["kl"], evals  # distillation lowers the KL
        assert _records(root / "split/eval_log.jsonl") == evals
        kept = sorted(p.name for p in (root / "full/checkpoints").iterdir())
        assert kept == ["latest", "step_00000004", "step_00000006"], kept  # keep_last=2


def gdn_only_leaves_the_rest_of_the_student_as_it_was(rank: int, world_size: int, root: str) -> None:
    result = run_once(Path(root) / "gdn", 2, distill__stage2__trainable="gdn")
    if rank == 0:
        before = teacher_and_student()[1].state_dict()
        after = result.student_state
        assert after.keys() == before.keys()
        gdn = {n for n in before if n.startswith(("layers.1.mixer.", "layers.3.mixer."))}  # pattern AGAG
        assert gdn and all(not torch.equal(after[n], before[n]) for n in gdn), \
            [n for n in gdn if torch.equal(after[n], before[n])]
        frozen = [n for n in before if n not in gdn and not torch.equal(after[n], before[n])]
        assert not frozen, f"trainable=gdn changed {frozen}"


def nan_policies(rank: int, world_size: int, root: str) -> None:
    from megatron_tc.distill.numerics import NonFiniteError
    from tests.parallel._workers_common import assert_no_live_engines

    root = Path(root)
    os.environ["MEGATRON_TC_FAULTS"] = "nan_loss@1,nan_grad@3"
    result = run_once(root / "skip", 4)
    assert result.skipped_steps == 2 and result.steps == 4
    if rank == 0:
        log = _records(root / "skip/train_log.jsonl")
        assert [r["applied"] for r in log] == [1.0, 0.0, 1.0, 0.0]
        assert [r["skipped_steps"] for r in log] == [0, 1, 1, 2]
        assert all(np.isfinite(v) for v in result.student_state["layers.1.mixer.A_log"].tolist())
    os.environ["MEGATRON_TC_FAULTS"] = "nan_loss@2"
    try:
        run_once(root / "abort", 4, distill__nan_policy="abort")
    except NonFiniteError as err:
        assert "step 2" in str(err) and "nan_policy" in str(err)
    else:
        raise AssertionError("nan_policy=abort did not stop the run")
    finally:
        del os.environ["MEGATRON_TC_FAULTS"]
    # the abort left the checkpoint of step 2 (interval 2) and nothing later
    if rank == 0:
        assert (root / "abort/checkpoints/latest").read_text().strip() == "step_00000002"
    # both runs, the aborted one included, released their engines (close() on leaving `with trainer`)
    assert_no_live_engines()


def pipeline_resume_matches_uninterrupted(rank: int, world_size: int, root: str) -> None:
    """PP=2 (DeepSpeed pipeline engine, ZeRO-1): 4 steps straight vs 2 + resume; the gathered
    student equals, and its tensors match the single-device student's names."""
    root = Path(root)
    full = run_once(root / "full", 4, pp=2)
    first = run_once(root / "split", 4, stop_after=2, pp=2)
    assert first.stopped_early and first.steps == 2
    second = run_once(root / "split", 4, pp=2)
    if rank == 0:
        a, b = _records(root / "full/train_log.jsonl"), _records(root / "split/train_log.jsonl")
        assert [r["step"] for r in b] == [1, 2, 3, 4]
        assert [r["loss"] for r in a] == [r["loss"] for r in b], ([r["loss"] for r in a], [r["loss"] for r in b])
        assert a[-1]["loss"] < a[0]["loss"], a
        _, student = teacher_and_student()
        assert set(full.student_state) == set(student.state_dict())
        for name, value in full.student_state.items():
            assert torch.equal(value, second.student_state[name]), name
        changed = [n for n, v in full.student_state.items() if not torch.equal(v, student.state_dict()[n])]
        assert "layers.3.mixer.A_log" in changed and "embed_tokens.weight" in changed  # both stages trained
    else:
        assert full.student_state is None


def pipeline_student(rank: int, world_size: int, root: str, tp: int = 1) -> None:
    """PP=2 (x TP=`tp`) stage 2, 4 steps; the gathered student goes to <root>/student.pt."""
    result = run_once(Path(root), 4, pp=2, tp=tp)
    if rank == 0:
        torch.save(result.student_state, Path(root) / "student.pt")


def tp2_pp2_resume_matches_uninterrupted(rank: int, world_size: int, root: str) -> None:
    """TP=2 x PP=2 on 4 ranks: 4 steps straight (student saved as in `pipeline_student`) vs 2 +
    resume by a fresh engine: the same losses and gathered student, bit for bit."""
    root = Path(root)
    pipeline_student(rank, world_size, str(root / "full"), tp=2)
    first = run_once(root / "split", 4, stop_after=2, pp=2, tp=2)
    assert first.stopped_early and first.steps == 2
    second = run_once(root / "split", 4, pp=2, tp=2)
    if rank == 0:
        a, b = _records(root / "full/train_log.jsonl"), _records(root / "split/train_log.jsonl")
        assert [r["step"] for r in b] == [1, 2, 3, 4]
        assert [r["loss"] for r in a] == [r["loss"] for r in b], ([r["loss"] for r in a], [r["loss"] for r in b])
        full = torch.load(root / "full/student.pt")
        assert full.keys() == second.student_state.keys()
        for name, value in full.items():
            assert torch.equal(value, second.student_state[name]), name
    else:
        assert second.student_state is None


def activation_checkpointing_equals_plain(rank: int, world_size: int, root: str) -> None:
    """parallel.activation_checkpointing=true on the ZeRO-3 path (pp = 1), with a frozen embedding
    (trainable=mixers): every student layer goes through the checkpoint, and the losses and final
    weights equal the plain run's."""
    from megatron_tc.model import transformer

    root = Path(root)
    plain = run_once(root / "plain", 3, distill__stage2__trainable="mixers")
    calls = []
    real = transformer.checkpoint
    transformer.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        ckpt = run_once(root / "ckpt", 3, distill__stage2__trainable="mixers", parallel__activation_checkpointing="true")
    finally:
        transformer.checkpoint = real
    assert len(calls) >= 3 * 2 * 4, f"{len(calls)} checkpointed layer calls"  # steps x micro-batches x layers
    if rank == 0:
        a, b = _records(root / "plain/train_log.jsonl"), _records(root / "ckpt/train_log.jsonl")
        for x, y in zip(a, b):
            assert abs(x["loss"] - y["loss"]) <= 1e-6 * abs(x["loss"]), (x["loss"], y["loss"])
        for name, value in plain.student_state.items():
            torch.testing.assert_close(ckpt.student_state[name], value, rtol=1e-5, atol=1e-6, msg=name)
