import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: it reads this once

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_tc.testing import fork_gloo_ranks_from  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (`pytest -n N tests/gpu` on a GPU machine) worker gwK runs on GPU
# K modulo the visible GPUs ("cuda" means the current device): fla compiles about a minute per kernel
# shape, mostly on the host, so N workers finish the GPU tests in about 1/N of the time.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and torch.cuda.is_available() and torch.cuda.device_count() > 1:
    torch.cuda.set_device(int(_worker[2:]) % torch.cuda.device_count())

# The gloo ranks of tests/parallel and friends fork from one process that imported these once,
# instead of importing them in every rank of every launch (see megatron_tc/testing.py).
fork_gloo_ranks_from("torch", "torch.distributed", "numpy", "deepspeed", "megatron.core.parallel_state",
                     "megatron.core.tensor_parallel", "transformers", "torch.utils.tensorboard",
                     "megatron_tc.distill.stage2", "megatron_tc.parallel.deepspeed_engine",
                     "megatron_tc.convert.hf_to_megatron", "megatron_tc.calibrate.strategies",
                     "megatron_tc.distill.runner")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA and fla (see docs/development.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
