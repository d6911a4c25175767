"""Process groups for tensor (TP), pipeline (PP) and data (DP) parallelism, built once.

`init_parallel(tp, pp)` builds the groups through megatron-core's `parallel_state` (rank order
tp-dp-pp: TP ranks are adjacent, as Megatron-LM and DeepSpeed's pipeline topology both lay them
out) and returns a `ParallelContext` that the rest of the code receives explicitly. megatron-core's
parallel layers read the same global state, so both views always agree.

`DeepSpeedMPU(ctx)` is the `mpu=` object DeepSpeed's engine and ZeRO optimizers query.
"""
from __future__ import annotations

import gc
import os
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist


def _parallel_state():
    """megatron-core's parallel_state, imported without its TransformerEngine/Apex warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        from megatron.core import parallel_state
    return parallel_state


@dataclass(frozen=True)
class ParallelContext:
    """Ranks, sizes and groups of one process. Pass it explicitly; it never changes."""

    rank: int
    world_size: int
    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup
    pp_size: int
    pp_rank: int
    pp_group: dist.ProcessGroup
    dp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup  # TP x PP: the ranks that together hold one model replica

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size}, "
                f"pp {self.pp_rank}/{self.pp_size}, dp {self.dp_rank}/{self.dp_size}")


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> None:
    """Join the default process group from the launcher's environment (RANK, WORLD_SIZE, ...).

    A no-op when the group already exists (tests, or a launcher that initialized it). The backend
    defaults to nccl with CUDA and gloo otherwise.
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"cannot join the process group: environment variables {missing} are not set; start the "
            "job through launch/distill.sh (deepspeed or srun), or torchrun")
    # Imported before the group exists: their functions' `group=...WORLD` defaults are read at
    # import and would otherwise hold the default group for good (`leave_after_error` frees it).
    import deepspeed.comm.torch  # noqa: F401
    import torch.distributed.nn.functional  # noqa: F401

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def setup_parallel(cfg: Any, arch: Any = None, world_size: int | None = None) -> ParallelContext:
    """Check the run config, then join the process group and build the TP/PP/DP groups.

    cfg: megatron_tc.config.Config; arch: the teacher's ArchConfig (adds the checks that TP divides
    the heads and the MLP width, and that PP fits the layers). Every config error (e.g. pp > 1 with
    ZeRO-3) is raised as ConfigError *before* any process group exists. world_size defaults to the
    launcher's WORLD_SIZE (1 without a launcher).
    """
    from megatron_tc.config import validate_against_arch, validate_config

    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if arch is not None:
        validate_against_arch(cfg, arch, world_size)
    else:
        validate_config(cfg, world_size)
    init_distributed(None if cfg.parallel.backend == "auto" else cfg.parallel.backend)
    return init_parallel(cfg.parallel.tp, cfg.parallel.pp)


def init_parallel(tp: int = 1, pp: int = 1) -> ParallelContext:
    """Build the TP/PP/DP groups (once per process) and return this process's context.

    world_size must be a multiple of tp * pp; the remaining factor is the data-parallel size.
    Calling it again with the same sizes returns the existing groups; other sizes are an error
    (call `destroy_parallel()` first).
    """
    init_distributed()
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(
            f"world size {world} is not a multiple of tensor_parallel ({tp}) x pipeline_parallel ({pp}); "
            f"launch a multiple of {tp * pp} processes or change the parallel sizes")
    ps = _parallel_state()
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise RuntimeError(f"process groups already exist with (tp, pp) = {have}, asked for {(tp, pp)}; "
                               "call destroy_parallel() first")
    else:
        # create_gloo_process_groups: megatron's extra gloo copies of the DP groups are only for its
        # own distributed optimizer; with a gloo default backend they would merely double the groups.
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     create_gloo_process_groups=False)
        if torch.cuda.is_available():
            # megatron-core's parallel layers draw init noise from its CUDA RNG tracker; we always
            # load real weights, but the tracker must exist for the layers to be constructed.
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
            model_parallel_cuda_manual_seed(1234)
    return current_context()


def current_context() -> ParallelContext:
    """The context of groups made by `init_parallel` (error if there are none)."""
    ps = _parallel_state()
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("no parallel groups: call megatron_tc.parallel.state.init_parallel(tp, pp) first")
    return ParallelContext(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        tp_size=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_size=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_size=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
        dp_group=ps.get_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
    )


def destroy_parallel() -> None:
    """Forget the TP/PP/DP groups (tests build several layouts in one process)."""
    ps = _parallel_state()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def shutdown_distributed() -> None:
    """At the normal end of an entry point: drop the TP/PP/DP groups and leave the default group.
    (NCCL warns at exit about a group never destroyed; on an error path the process just exits,
    since destroying a communicator that other ranks still wait on can block.)"""
    destroy_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # groups held in reference cycles die now, not during interpreter finalization


STOPPING_KEY = "stopping_after_error/{rank}"
LEFT_KEY = "left_after_error/{rank}"  # a rank saw every mark and stops asking the store


def leave_after_error(timeout_s: float = 10.0) -> None:
    """On a rank whose error ends the job: let the other ranks say why they stop before it exits.

    Launchers (DeepSpeed's, torchrun, srun) stop every rank as soon as one exits, which can cut
    off a rank before it prints its line. With gloo, leaving the process groups closes this rank's
    connections while it lives, so the ranks waiting in a collective fail it at once, say so and
    mark it in the store (`mark_stopping`); this marks itself too (several ranks may fail at once)
    and waits for every rank's mark, at most `timeout_s` (a rank busy outside any collective is
    left to the launcher). Before any process group exists (bad input every rank refuses alike),
    the ranks meet in a store of their own at MASTER_ADDR:MASTER_PORT instead. NCCL groups are not
    touched: destroying a communicator that peers still wait on can block, and there the
    launcher's stop is the peers' only news."""
    if not dist.is_initialized():
        _wait_for_peers_without_groups(timeout_s)
        return
    if dist.get_world_size() == 1 or dist.get_backend() != "gloo":
        return
    store = dist.distributed_c10d._get_default_store()  # outlives the groups; rank 0's process serves it
    world, rank = dist.get_world_size(), dist.get_rank()
    mark_stopping(waits=True)
    shutdown_distributed()
    _wait_for_marks(store, world, rank, timeout_s)


def _wait_for_marks(store: Any, world: int, rank: int, timeout_s: float) -> None:
    """Wait for every rank's stopping mark. Then the others tell the store they saw them
    (LEFT_KEY) and return, and rank 0, whose process serves the store, waits for those before it
    returns: a rank that asked the store after its host exited would print torch's connection
    warnings under its error line."""
    deadline = time.monotonic() + timeout_s
    if not _wait_for_keys(store, [STOPPING_KEY.format(rank=r) for r in range(world)], deadline):
        return
    if rank == 0:
        _wait_for_keys(store, [LEFT_KEY.format(rank=r) for r in range(1, world)], deadline)
        return
    try:
        store.set(LEFT_KEY.format(rank=rank), "1")
    except RuntimeError:  # the host has exited (its deadline passed first)
        pass


def _wait_for_keys(store: Any, keys: list[str], deadline: float) -> bool:
    """Whether all `keys` were set in `store` before `deadline` (time.monotonic)."""
    while time.monotonic() < deadline:
        try:
            if store.check(keys):
                return True
        except RuntimeError:  # the store's host (rank 0) has exited
            return False
        time.sleep(0.02)
    return False


def _wait_for_peers_without_groups(timeout_s: float) -> None:
    """`leave_after_error` for an error raised before the default group exists, in a launch of
    several ranks: rank 0 serves a store at MASTER_ADDR:MASTER_PORT (the one the group would have
    used), every rank marks itself there and waits for the others' marks. A peer that does not
    fail the same way (it joins the group's rendezvous instead) costs at most `timeout_s`."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    if world == 1 or not all(k in env for k in ("RANK", "MASTER_ADDR", "MASTER_PORT")):
        return
    rank = int(env["RANK"])
    try:
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=rank == 0,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        store.set(STOPPING_KEY.format(rank=rank), "1")
    except (RuntimeError, OSError, ValueError):  # port taken, or rank 0 never served it: nobody to wait for
        return
    _wait_for_marks(store, world, rank, timeout_s)


def mark_stopping(waits: bool = False) -> None:
    """Tell the store this rank is stopping after an error, its own or a peer's (`leave_after_error`).
    waits: it waits for the other ranks' marks next; else it asks the store nothing more (LEFT_KEY
    too, so the store's host need not wait for it)."""
    try:
        store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
        store.set(STOPPING_KEY.format(rank=rank), "1")
        if not waits:
            store.set(LEFT_KEY.format(rank=rank), "1")
    except (RuntimeError, ValueError):  # no group, or the store's host has exited: nobody waits
        pass


class DeepSpeedMPU:
    """The `mpu` DeepSpeed queries (engine, ZeRO 1-3, gradient clipping, checkpoint names).

    DeepSpeed's "model parallel" group is the group whose ranks hold *different* parts of one
    replica: gradient norms are summed over it, and parameters not marked `tensor_model_parallel`
    are counted only on its rank 0. ZeRO-3 runs without PP, so that group is the TP group.
    """

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx

    # model parallel = TP x PP (equal to TP whenever DeepSpeed is given this object)
    def get_model_parallel_group(self): return self.ctx.mp_group
    def get_model_parallel_world_size(self) -> int: return self.ctx.tp_size * self.ctx.pp_size
    def get_model_parallel_rank(self) -> int: return dist.get_rank(self.ctx.mp_group)

    def get_tensor_model_parallel_group(self): return self.ctx.tp_group
    def get_tensor_model_parallel_world_size(self) -> int: return self.ctx.tp_size
    def get_tensor_model_parallel_rank(self) -> int: return self.ctx.tp_rank
    def get_tensor_model_parallel_src_rank(self) -> int:
        return _parallel_state().get_tensor_model_parallel_src_rank()

    def get_pipeline_model_parallel_group(self): return self.ctx.pp_group
    def get_pipeline_model_parallel_world_size(self) -> int: return self.ctx.pp_size
    def get_pipeline_model_parallel_rank(self) -> int: return self.ctx.pp_rank
    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank

    def get_data_parallel_group(self): return self.ctx.dp_group
    def get_data_parallel_world_size(self) -> int: return self.ctx.dp_size
    def get_data_parallel_rank(self) -> int: return self.ctx.dp_rank
    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.ctx.dp_group)


def shared_outcome(fn: Callable[[], Any] | None) -> Any:
    """Run `fn()` on the ranks that get one (None: this rank has nothing to run), then agree: when
    any of them raised, every rank raises the first error, so none is left waiting at the next
    collective and each says the same line. Collective over the world. Returns this rank's value."""
    result, error = None, None
    if fn is not None:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001  (handed to every rank below)
            error = err
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, _portable(error))
        first = next((e for e in errors if e is not None), None)
        if error is None and first is not None:
            error = first
    if error is not None:
        raise error
    return result


def _portable(error: BaseException | None) -> BaseException | None:
    """`error` if it pickles, else a RuntimeError with its type and message."""
    if error is None:
        return None
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")
