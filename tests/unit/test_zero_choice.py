"""The data-parallel engine choice: the memory estimate per rank and the ZeRO stage it picks."""
import pytest
import torch

from megatron_tc.bench.models import llama_1b, quarter_pattern, smollm2_135m
from megatron_tc.config import load_config
from megatron_tc.config.errors import ConfigError
from megatron_tc.model import HybridLM
from megatron_tc.parallel.memory import CPU_ZERO_STAGES, StepFootprint, choose_zero_stage, footprint_of

# 1e9-element student (all trainable) and teacher in bf16 over 4 ranks, no activations:
# weights 2e9, gradients 4e9, optimizer (8 + 4) e9 / 4, teacher 2e9 bytes
BILLION = StepFootprint(student_params=10**9, trainable_params=10**9, teacher_params=10**9, bf16=True)


def test_estimate_partitions_optimizer_then_gradients_then_weights():
    totals = {stage: BILLION.bytes_per_rank(stage, dp=4)["total"] for stage in (1, 2, 3)}
    assert totals == {1: 11 * 10**9, 2: 8 * 10**9, 3: 6_500_000_000}
    fp32 = StepFootprint(student_params=10**9, trainable_params=10**8, teacher_params=0, bf16=False)
    assert fp32.bytes_per_rank(1, dp=2) == {"student": 4 * 10**9, "gradients": 4 * 10**8, "optimizer": 4 * 10**8,
                                            "teacher": 0, "activations": 0, "logits": 0, "total": 48 * 10**8}


def test_activations_and_logits_follow_tokens_precision_and_checkpointing():
    shape = dict(student_params=0, trainable_params=0, tokens=1000, num_layers=10, hidden_size=100, vocab_size=500)
    bf16 = StepFootprint(**shape, bf16=True).bytes_per_rank(1, 1)
    assert (bf16["activations"], bf16["logits"]) == (1000 * 10 * 100 * 34, 1000 * 500 * 6)
    fp32 = StepFootprint(**shape, bf16=False).bytes_per_rank(1, 1)
    assert (fp32["activations"], fp32["logits"]) == (1000 * 10 * 100 * 68, 1000 * 500 * 12)
    ckpt = StepFootprint(**shape, bf16=True, activation_checkpointing=True).bytes_per_rank(1, 1)
    assert ckpt["activations"] == 1000 * 10 * 100 * 2


@pytest.mark.parametrize("device_gb, stage, fits", [(13.0, 1, True), (10.0, 2, True), (8.0, 3, True), (7.0, 3, False)])
def test_smallest_stage_that_fits_with_headroom(device_gb, stage, fits):
    choice = choose_zero_stage(BILLION, dp=4, device_bytes=int(device_gb * 1e9))
    assert (choice.stage, choice.fits) == (stage, fits)
    assert choice.estimate == BILLION.bytes_per_rank(stage, 4)
    assert f"ZeRO-{stage}" in choice.describe()


def test_one_rank_never_partitions_since_nothing_would_be_saved():
    choice = choose_zero_stage(BILLION, dp=1, device_bytes=10**9)
    assert (choice.stage, choice.fits) == (1, False)
    assert "does NOT fit" in choice.describe()
    with pytest.raises(ValueError, match="dp=0"):
        choose_zero_stage(BILLION, dp=0, device_bytes=10**9)


@pytest.mark.parametrize("arch", [smollm2_135m, llama_1b])
def test_benchmark_sizes_train_without_partitioning_on_one_h200(arch):
    """Student + teacher at 64k tokens per micro-batch (32 x 2048), bf16, on 139 GiB: ZeRO-1."""
    with torch.device("meta"):
        teacher = HybridLM(arch())
        student = HybridLM(arch().with_pattern(quarter_pattern(arch().num_layers)))
    footprint = footprint_of(student, teacher, tokens=32 * 2048, bf16=True)
    assert footprint.student_params == sum(p.numel() for p in student.parameters())
    assert footprint.num_layers == arch().num_layers and footprint.vocab_size == student.arch.padded_vocab_size
    choice = choose_zero_stage(footprint, dp=1, device_bytes=139 * 2**30)
    assert (choice.stage, choice.fits) == (1, True)


def test_config_takes_auto_or_a_stage_and_rejects_anything_else():
    assert load_config(overrides=[]).parallel.zero_stage == "auto"
    assert load_config(overrides=["parallel.zero_stage=2"]).parallel.zero_stage == 2
    load_config(overrides=["parallel.pp=2", "parallel.zero_stage=auto", "data.global_batch_size=8"], world_size=2)
    with pytest.raises(ConfigError, match="parallel.zero_stage: expected one of 'auto', 0, 1, 2, 3"):
        load_config(overrides=["parallel.zero_stage=4"])


def test_cpu_ranks_share_the_machine_memory(monkeypatch):
    from megatron_tc.parallel.memory import device_memory_bytes

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    whole = device_memory_bytes(torch.device("cpu"))
    monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launcher
    assert device_memory_bytes(torch.device("cpu")) == whole // 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun, Slurm
    assert device_memory_bytes(torch.device("cpu")) == whole // 4


def test_cpu_ranks_try_zero0_first():
    """ZeRO-0 where it fits, then the partitioned stages as on GPUs; one rank: ZeRO-0 whatever."""
    assert BILLION.bytes_per_rank(0, dp=4)["total"] == 20 * 10**9  # nothing divided by the ranks
    assert choose_zero_stage(BILLION, dp=4, device_bytes=24 * 10**9, stages=CPU_ZERO_STAGES).stage == 0
    assert choose_zero_stage(BILLION, dp=4, device_bytes=23 * 10**9, stages=CPU_ZERO_STAGES).stage == 1
    assert choose_zero_stage(BILLION, dp=4, device_bytes=10 * 10**9, stages=CPU_ZERO_STAGES).stage == 2
    assert choose_zero_stage(BILLION, dp=4, device_bytes=7 * 10**9, stages=CPU_ZERO_STAGES).stage == 3
    assert choose_zero_stage(BILLION, dp=1, device_bytes=10**9, stages=CPU_ZERO_STAGES).stage == 0


def test_pipeline_resolves_auto_from_the_models_and_keeps_an_explicit_stage(monkeypatch):
    """The 1.1B student + teacher in fp32 on 2 ranks (about 19 GB per rank under ZeRO-1, 24 GB under
    ZeRO-0): ZeRO-0 on CPU ranks where it fits, ZeRO-1 on GPUs."""
    from types import SimpleNamespace

    import megatron_tc.parallel.memory as memory
    from megatron_tc.distill.stage2_setup import resolve_zero_stage

    with torch.device("meta"):
        teacher = HybridLM(llama_1b())
        student = HybridLM(llama_1b().with_pattern(quarter_pattern(16)))
    cpu = torch.device("cpu")
    ctx = lambda dp, pp=1: SimpleNamespace(dp_size=dp, pp_size=pp, rank=0)  # noqa: E731
    cfg = load_config(overrides=["data.micro_batch_size=1", "data.seq_len=64"])
    assert cfg.parallel.zero_stage == "auto"
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 64 * 2**30)
    assert resolve_zero_stage(cfg, ctx(2), cpu, student, teacher) == 0
    assert resolve_zero_stage(cfg, ctx(2), torch.device("cuda"), student, teacher) == 1
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 26 * 2**30)
    assert resolve_zero_stage(cfg, ctx(2), cpu, student, teacher) == 1  # ZeRO-0 is over 0.85 x 26 GiB
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 8 * 2**30)
    assert resolve_zero_stage(cfg, ctx(2), cpu, student, teacher) == 3  # does not fit at all: the most it can do
    assert resolve_zero_stage(cfg, ctx(2, pp=2), cpu, student, teacher) == 1  # the pipeline engine's limit
    assert (resolve_zero_stage(cfg, ctx(2), cpu, None), resolve_zero_stage(cfg, ctx(1), cpu, None)) == (3, 1)
    explicit = load_config(overrides=["parallel.zero_stage=2"])
    assert resolve_zero_stage(explicit, ctx(2), cpu, student, teacher) == 2
