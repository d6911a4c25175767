"""A rank whose error ends the job leaves its gloo groups while it lives (parallel.state.leave_after_error),
so the ranks waiting on it learn of it before a launcher stops them; before any group exists, the
ranks that refuse the same input wait for each other in a store of their own. See also
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


def test_work_of_one_rank_that_fails_raises_its_error_on_every_rank():
    run_distributed(_workers.shared_outcome_reaches_every_rank, 2, timeout=120)


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


@pytest.mark.parametrize("late_rank", [0, 1])
def test_before_any_group_a_rank_leaves_only_once_every_rank_has_reported(late_rank):
    """Each rank "reports" (its timestamp) then calls leave_after_error; the late one reports 2 s
    after the other. Neither may return before the late rank has reported: a launcher stops every
    rank when the first one exits, which would cut the late rank off before its line."""
    script = textwrap.dedent(f"""
        import os, time
        from megatron_tc.parallel.state import leave_after_error
        if os.environ["RANK"] == "{late_rank}":
            time.sleep(2.0)
        print("reported", time.monotonic(), flush=True)
        leave_after_error(timeout_s=30.0)
        print("left", time.monotonic(), flush=True)
        """)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port))
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    times = [dict(line.split() for line in out.splitlines()) for out, _ in outs]
    late_report = float(times[late_rank]["reported"])
    for rank, t in enumerate(times):
        assert late_report <= float(t["left"]) < late_report + 20, (rank, times)


def test_the_store_host_leaves_only_after_every_other_rank_stopped_asking():
    """Rank 0's process serves the store the ranks meet in: it returns only once the others have
    seen every mark and said so, so no rank queries the store after its host exited (torch would
    print its connection warnings under that rank's error line)."""
    import threading
    import time

    import torch.distributed as dist

    from megatron_tc.parallel.state import LEFT_KEY, STOPPING_KEY, _wait_for_marks

    store = dist.HashStore()
    for rank in range(2):
        store.set(STOPPING_KEY.format(rank=rank), "1")
    seen = []
    host = threading.Thread(target=lambda: seen.append(_wait_for_marks(store, 2, 0, 10.0)
                                                       or store.check([LEFT_KEY.format(rank=1)])))
    host.start()
    time.sleep(0.5)
    assert host.is_alive()  # every mark is there, but rank 1 has not said it saw them
    _wait_for_marks(store, 2, 1, 10.0)
    host.join(10.0)
    assert seen == [True]
