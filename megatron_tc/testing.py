"""Run a function in N gloo processes and turn any rank's failure into a test failure.

Every parallel test goes through `run_distributed`. Each child gets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT in its environment, one intra-op thread, and an initialized gloo
process group; the function's exception (with its traceback) comes back to the parent, which
raises one AssertionError naming every failed rank. A child that dies without a Python exception
(a segfault, os._exit) or hangs past `timeout` fails the test as well.
"""
from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 300.0) -> None:
    """Run ``fn(rank, world_size, *args)`` in `world_size` spawned gloo processes.

    `fn` and `args` must be picklable (a module-level function). Raises AssertionError if any rank
    raised, exited non-zero or did not finish within `timeout` seconds.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, errors)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    reports = []
    while not errors.empty():
        rank, tb = errors.get()
        reports.append(f"--- rank {rank} raised:\n{tb}")
    reported = {int(line.split()[2]) for line in reports}
    for r, p in enumerate(procs):
        if r in hung:
            reports.append(f"--- rank {r} did not finish within {timeout:.0f} s (killed)")
        elif p.exitcode != 0 and r not in reported:
            reports.append(f"--- rank {r} exited with code {p.exitcode} without a Python exception")
    if reports:
        raise AssertionError(f"{len(reports)} of {world_size} ranks failed:\n" + "\n".join(reports))
