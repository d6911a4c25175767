"""configs/gpu_smoke.yaml and tools/gpu_multi.sh: what the multi-GPU run relies on, checked here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpu_smoke_config_is_valid_on_one_two_and_four_gpus(world):
    from megatron_tc.config import load_config

    cfg = load_config(ROOT / "configs" / "gpu_smoke.yaml", world_size=world)
    assert cfg.run.precision == "bf16" and cfg.parallel.zero_stage == 3
    assert cfg.data.source.cache_dir == ".gpudata/corpora" and cfg.model.teacher == ".gpudata/teacher"


def test_smoke_teacher_shares_the_gdn_head_shape_of_the_scaling_preset():
    # fla compiles per (heads, head_dim): the smoke run reuses the scaling bench's compiled kernels
    from megatron_tc.bench.models import llama_1b
    from prepare_gpu_smoke import TEACHER

    arch = llama_1b()
    assert (TEACHER["num_attention_heads"], TEACHER["head_dim"]) == (arch.num_heads, arch.head_dim)


def test_gpu_multi_script_parses_and_keeps_multicast_off():
    script = ROOT / "tools" / "gpu_multi.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for var in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1"):
        assert var in text
