"""parallel.shard_teacher resolved: 'auto' splits the teacher over TP ranks only when the fp32
teacher would take more than half of one device."""
import pytest
import torch

from megatron_tc.config import apply_overrides, config_from_dict
from megatron_tc.model import ArchConfig, HybridLM
from megatron_tc.parallel.sharded_teacher import resolve_shard_teacher, teacher_fp32_bytes

ARCH = ArchConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=48, padded_vocab_size=128)


def config(*overrides: str):
    return config_from_dict(apply_overrides({"model": {"teacher": "t"}}, overrides))


def test_teacher_bytes_count_every_parameter_in_fp32():
    assert teacher_fp32_bytes(ARCH) == 4 * sum(p.numel() for p in HybridLM(ARCH).parameters())


@pytest.mark.parametrize("device_bytes, tp, pp, setting, want", [
    (10**12, 2, 1, "auto", False),  # fits easily: the whole teacher serves every stage
    (10**3, 2, 1, "auto", True),    # more than half the device: split
    (10**3, 1, 1, "auto", False),   # no TP ranks to split over
    (10**3, 2, 2, "auto", False),   # pipeline stages hold their own teacher layers
    (10**12, 2, 1, "true", True),
    (10**3, 2, 1, "false", False),
])
def test_auto_splits_only_a_teacher_that_does_not_fit(monkeypatch, device_bytes, tp, pp, setting, want):
    from megatron_tc.parallel import memory

    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: device_bytes)
    cfg = config(f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.shard_teacher={setting}")
    assert resolve_shard_teacher(cfg, ARCH, torch.device("cpu")) is want
