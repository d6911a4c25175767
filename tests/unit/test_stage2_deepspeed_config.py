"""The DeepSpeed config that stages 1 and 2 build from our config and the shipped JSON, and the
warning for ZeRO-3 over a single data-parallel rank (no sharding, all of ZeRO-3's gathers)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from megatron_tc.config.loader import load_config
from megatron_tc.distill.stage2_setup import stage2_deepspeed_config
from megatron_tc.parallel.state import ParallelContext

WARNING = "ZeRO-3 over one data-parallel rank shards nothing"
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def context(dp: int, rank: int = 0) -> ParallelContext:
    """Sizes and ranks only: the config builder reads no process group."""
    return ParallelContext(rank=rank, world_size=dp, tp_size=1, tp_rank=0, tp_group=None, pp_size=1, pp_rank=0,
                           pp_group=None, dp_size=dp, dp_rank=rank, dp_group=None, mp_group=None)


@pytest.fixture
def megatron_tc_logs(caplog):
    logging.getLogger("megatron_tc").addHandler(caplog.handler)  # its records do not reach the root logger
    yield caplog
    logging.getLogger("megatron_tc").removeHandler(caplog.handler)


@pytest.mark.parametrize("zero, dp, rank, warned", [(3, 1, 0, True), (3, 2, 0, False), (1, 1, 0, False),
                                                     (3, 1, 1, False)])
def test_zero3_on_one_data_parallel_rank_is_warned_about(zero, dp, rank, warned, megatron_tc_logs):
    cfg = load_config(TINY, [f"parallel.zero_stage={zero}", "data.global_batch_size=8",
                                            "data.micro_batch_size=2"])
    ds = stage2_deepspeed_config(cfg, context(dp, rank), torch.device("cpu"), None)
    assert ds["zero_optimization"]["stage"] == zero
    assert ds["gradient_accumulation_steps"] == 8 // (2 * dp) and ds["bf16"]["enabled"] is False
    # the shipped JSON leaves overlap_comm to DeepSpeed (on under ZeRO-3)
    assert "overlap_comm" not in ds["zero_optimization"]
    assert (WARNING in megatron_tc_logs.text) == warned, megatron_tc_logs.text


@pytest.mark.parametrize("trainable_numel, want", [(None, 50_000_000), (10, 1_000_000),
                                                   (135_000_000, 135_000_000), (1_100_000_000, 500_000_000)])
def test_zero_buckets_follow_the_trainable_size(trainable_numel, want):
    """'auto' buckets on GPUs: the trainable size, between 1e6 and the 5e8 measured best for the
    1.1B model; on CPU 4e6 elements at any size (a flattened bucket stays under glibc's mmap
    threshold, so its memory is reused from step to step)."""
    cfg = load_config(TINY, ["data.global_batch_size=8", "data.micro_batch_size=2"])
    model = None
    if trainable_numel is not None:
        model = torch.nn.Linear(1, 1)
        model.weight = torch.nn.Parameter(torch.empty(trainable_numel, device="meta"), requires_grad=True)
        model.bias.requires_grad_(False)
    for device, expected in (("cuda", want), ("cpu", 4_000_000)):
        zero = stage2_deepspeed_config(cfg, context(2), torch.device(device), None, model)["zero_optimization"]
        assert zero["reduce_bucket_size"] == zero["stage3_prefetch_bucket_size"] == expected, device


def test_concrete_bucket_sizes_in_the_users_json_win(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text('{"zero_optimization": {"reduce_bucket_size": 123456, "stage3_prefetch_bucket_size": "auto"}}')
    cfg = load_config(TINY, ["data.global_batch_size=8", "data.micro_batch_size=2",
                             f"parallel.deepspeed_config={user}"])
    for device, auto in (("cuda", 1_001_000), ("cpu", 4_000_000)):
        zero = stage2_deepspeed_config(cfg, context(2), torch.device(device), None,
                                       torch.nn.Linear(1000, 1000))["zero_optimization"]
        assert zero["reduce_bucket_size"] == 123456 and zero["stage3_prefetch_bucket_size"] == auto


@pytest.mark.parametrize("device, user_params, offload, fused", [
    ("cuda", {}, None, True), ("cpu", {}, None, True), ("cuda", {"foreach": True}, None, None),
    ("cuda", {"fused": False}, None, False), ("cuda", {}, "cpu", None)])
def test_pytorch_adamw_is_fused_unless_the_json_decides(device, user_params, offload, fused, tmp_path):
    """One fused AdamW pass over ZeRO's flat partition, on CUDA and on CPU; a JSON that names foreach
    or fused, and an optimizer offloaded to the CPU stay as they are."""
    import json

    from megatron_tc.config import deepspeed_template_path

    base = json.loads(deepspeed_template_path(1).read_text())
    base["optimizer"]["params"].update(user_params)
    if offload:
        base["zero_optimization"]["offload_optimizer"] = {"device": offload}
    (tmp_path / "ds.json").write_text(json.dumps(base))
    cfg = load_config(TINY, ["data.global_batch_size=8", "data.micro_batch_size=2",
                             f"parallel.deepspeed_config={tmp_path / 'ds.json'}"])
    ds = stage2_deepspeed_config(cfg, context(1), torch.device(device), None)
    assert ds["optimizer"]["params"].get("fused") == fused
