"""In-process checks of the parallel package (no process group): config errors come before any
group exists, the DeepSpeed config builder, the pipeline's stage boundaries and transport."""
from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_tc.config import ConfigError, load_config
from megatron_tc.parallel import deepspeed_engine as dse
from megatron_tc.parallel import pipeline as pipe
from megatron_tc.parallel.losses import vocab_parallel_cross_entropy, vocab_parallel_kl
from megatron_tc.parallel.state import setup_parallel
from tests.parallel._workers_common import tiny_arch


@pytest.fixture
def no_process_group(monkeypatch):
    """Fail loudly if anything tries to create a process group, and check none exists after."""
    def refuse(*args, **kwargs):
        raise AssertionError("a process group was created before the config was checked")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    monkeypatch.setenv("WORLD_SIZE", "2")
    yield
    assert not dist.is_initialized()
    parallel_state = sys.modules.get("megatron.core.parallel_state")  # never imported: no groups either
    assert parallel_state is None or not parallel_state.model_parallel_is_initialized()


def _config(*overrides: str):
    return load_config("configs/tiny.yaml", list(overrides), check=False)


def test_pp_with_zero3_fails_at_load_and_before_any_process_group(no_process_group):
    with pytest.raises(ConfigError, match=r"parallel.pp=2 with parallel.zero_stage=3.*ZeRO stage 0 or 1"):
        load_config("configs/tiny.yaml", ["parallel.pp=2", "parallel.zero_stage=3"], world_size=2)
    with pytest.raises(ConfigError, match=r"parallel.pp=2 with parallel.zero_stage=3"):
        setup_parallel(_config("parallel.pp=2", "parallel.zero_stage=3"), tiny_arch("AGGA"))


def test_tp_not_dividing_heads_fails_before_any_process_group(no_process_group):
    arch = tiny_arch("AGGA")  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match=r"parallel.tp=4 does not divide the teacher's 2 KV heads"):
        setup_parallel(_config("parallel.tp=4", "parallel.dp=1"), arch, world_size=4)
    with pytest.raises(ConfigError, match=r"parallel.tp=3 does not divide"):
        setup_parallel(_config("parallel.tp=3", "parallel.dp=1"), arch, world_size=3)


def test_deepspeed_config_fills_autos_and_keeps_user_values(tmp_path):
    user = {"train_batch_size": "auto", "gradient_clipping": 0.3, "zero_optimization": {"stage": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": 1e-6}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    cfg = dse.build_deepspeed_config(zero_stage=3, micro_batch_size=2, global_batch_size=16, dp_size=4, lr=1e-4,
                                     grad_clip=1.0, base=path)
    assert cfg["train_batch_size"] == 16 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["gradient_clipping"] == 0.3, "a concrete user value must win"
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["optimizer"]["params"] == {"lr": 1e-4, "eps": 1e-6, "betas": [0.9, 0.95], "weight_decay": 0.0,
                                          "torch_adam": True}
    assert cfg["bf16"] == {"enabled": False}
    teacher = dse.teacher_deepspeed_config(cfg)
    assert "optimizer" not in teacher and teacher["zero_optimization"] == {"stage": 3}


def test_deepspeed_config_rejects_bad_batches_and_pipeline_zero3():
    with pytest.raises(ValueError, match="global_batch_size=10 is not a multiple of micro_batch_size x data-parallel"):
        dse.build_deepspeed_config(zero_stage=3, micro_batch_size=2, global_batch_size=10, dp_size=2)
    with pytest.raises(ValueError, match="pipeline engine supports ZeRO stage 0 or 1"):
        dse.build_deepspeed_config(zero_stage=3, micro_batch_size=1, global_batch_size=2, dp_size=1, pipeline=True)
    with pytest.raises(ValueError, match="asks for ZeRO stage 2"):
        dse.build_deepspeed_config(zero_stage=1, micro_batch_size=1, global_batch_size=2, dp_size=1, pipeline=True,
                                   base={"zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="train_batch_size=8 != micro batch 1 x accumulation 2 x data-parallel 2"):
        dse.build_deepspeed_config(zero_stage=3, micro_batch_size=1, global_batch_size=4, dp_size=2,
                                   base={"train_batch_size": 8})


def test_pipeline_stage_boundaries_follow_the_pattern():
    # 2 embedding layers + 6 pairs + norms + head = 10 pipeline layers
    assert pipe.pattern_parts("AG|GAGG", 6, 2) == [0, 4, 10]
    assert pipe.pattern_parts("A|GG|AGG", 6, 3) == [0, 3, 5, 10]
    with pytest.raises(ValueError, match="must have 2 non-empty"):
        pipe.pattern_parts("AGGAGG", 6, 2)
    with pytest.raises(ValueError, match="must have 2 non-empty"):
        pipe.pattern_parts("AGGAGG|", 6, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_teacher_activations_cross_stages_as_bits_exactly(dtype):
    x = torch.randn(2, 4, 3).to(dtype).transpose(1, 2)  # not contiguous, as a layer's output may be
    bits = pipe.pack(x)
    assert not bits.is_floating_point() and not bits.requires_grad
    # NCCL sends no int16 (H200: the bf16 pipeline failed on it): one of the types it sends
    assert bits.dtype in (torch.int8, torch.uint8, torch.int32, torch.int64)
    assert torch.equal(pipe.unpack(bits), x)
    with pytest.raises(TypeError, match="fp32 or bf16"):
        pipe.pack(x.half())


def test_single_device_losses_match_torch_and_pass_gradcheck():
    torch.manual_seed(0)
    s = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([3, -100, 9])
    kl = vocab_parallel_kl(s, t, 10, temperature=0.7)
    want = torch.nn.functional.kl_div(torch.log_softmax(s[:, :10] / 0.7, -1), torch.log_softmax(t[:, :10] / 0.7, -1),
                                      log_target=True, reduction="none").sum(-1)
    assert torch.allclose(kl, want, atol=1e-12)
    ce = vocab_parallel_cross_entropy(s, target, 10)
    want_ce = torch.nn.functional.cross_entropy(s[:, :10], target, reduction="none")
    assert torch.allclose(ce, want_ce, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: vocab_parallel_kl(a, b, 10, temperature=0.7), (s, t), fast_mode=True)
    assert torch.autograd.gradcheck(lambda a: vocab_parallel_cross_entropy(a, target, 10), (s,), fast_mode=True)
    with pytest.raises(ValueError, match=r"target ids must be in \[0, 10\)"):
        vocab_parallel_cross_entropy(s, torch.tensor([3, 10, 1]), 10)
