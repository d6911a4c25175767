"""configs/gpu_smoke.yaml and tools/bench/prepare_smoke.py: what the multi-GPU smoke run relies on."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpu_smoke_config_is_valid_on_one_two_and_four_gpus(world):
    from megatron_tc.config import load_config

    cfg = load_config(ROOT / "configs" / "gpu_smoke.yaml", world_size=world)
    assert cfg.run.precision == "bf16" and cfg.parallel.zero_stage == 3
    assert cfg.data.source.cache_dir == ".gpudata/corpora" and cfg.model.teacher == ".gpudata/teacher"


def test_smoke_teacher_shares_the_gdn_head_shape_of_the_scaling_preset():
    # fla compiles per (heads, head_dim): the smoke run reuses the scaling bench's compiled kernels
    from megatron_tc.bench.models import llama_1b
    from prepare_smoke import TEACHER

    arch = llama_1b()
    assert (TEACHER["num_attention_heads"], TEACHER["head_dim"]) == (arch.num_heads, arch.head_dim)

