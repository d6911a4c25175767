"""A rank whose error ends the job leaves its gloo groups while it lives (parallel.state.leave_after_error),
so the ranks waiting on it learn of it before a launcher stops them; see also
tests/reliability/test_rank_errors.py for the whole launch."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from megatron_tc.testing import free_port, run_distributed
from tests.parallel import _workers

pytest.importorskip("megatron.core")


def test_the_failing_rank_wakes_the_rank_waiting_on_it():
    run_distributed(_workers.leave_after_error_wakes_the_waiting_rank, 2, timeout=120)


def test_no_module_pins_the_default_group_when_init_distributed_made_it():
    """torch.distributed.nn.functional and DeepSpeed's comm read the default group into default
    arguments at import; imported after the group exists, they keep it alive past its destruction."""
    script = textwrap.dedent("""
        import gc, weakref
        import torch.distributed as dist
        from megatron_tc.parallel.state import init_distributed, init_parallel, shutdown_distributed
        init_distributed("gloo")
        init_parallel(tp=1, pp=1)
        import deepspeed.comm.torch, torch.distributed.nn.functional  # what the pipeline imports later
        group = weakref.ref(dist.distributed_c10d._get_default_group())
        shutdown_distributed()
        gc.collect()
        assert group() is None, "the default process group outlived shutdown_distributed"
        """)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
