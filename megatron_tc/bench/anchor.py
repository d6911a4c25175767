"""The pipeline's stage-2 step beside a plain PyTorch distillation loop, in one process.

`pipeline_trainer` builds the trainer stage 2 runs (`distill.stage2.build_stage2`: the DeepSpeed
engine at the ZeRO stage `parallel.zero_stage=auto` picks, the frozen teacher, our losses); one
timed step is `Stage2Trainer.train_step`, everything a pipeline step does. `PlainLoop` is what
a user would write without us: the same student (a copy of the same weights) and teacher,
torch.compile of the student and of the teacher's forward on CUDA, fused AdamW, bf16 autocast, a
full-vocabulary KL, and torch DDP when there are several ranks; no DeepSpeed. Each path has its own
copy of the teacher (stage 2 compiles its teacher's layers in place). Both see the same
micro-batches (`SyntheticBatches`), so their first losses agree (the tests check it), and
`interleaved_runs` alternates them run by run so that the drift of a shared machine hits both alike.
"""
from __future__ import annotations

import copy
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_tc.bench.common import spread
from megatron_tc.bench.models import forward_flops


class SyntheticBatches:
    """Random token rows, the loader interface stage 2 reads (`next_step`, `tokens_per_step`,
    `state_dict`). Each call of `next_step` returns this rank's `micro` micro-batches [mbs, T]; the
    rows depend only on the seed, the step and the data-parallel rank."""

    def __init__(self, vocab: int, seq: int, micro_batch: int, micro_steps: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, device: torch.device | str = "cpu"):
        self.vocab, self.seq, self.mbs, self.micro, self.device = vocab, seq, micro_batch, micro_steps, device
        self.dp_rank, self.seed, self.step = dp_rank, seed, 0
        self.tokens_per_step = seq * micro_batch * micro_steps * dp_size

    def batch(self, step: int, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(hash((self.seed, step, self.dp_rank, index)) % 2**62)
        ids = torch.randint(0, self.vocab, (self.mbs, self.seq), generator=gen)
        return {"input_ids": ids.to(self.device)}

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        out = [self.batch(self.step, i) for i in range(self.micro)]
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def step_flops(student_arch, teacher_arch, tokens: int, seq: int) -> dict[str, float]:
    """Model FLOPs of one distillation step over `tokens` tokens (models.py's convention): student
    6 x matmul parameters x tokens + attention (forward + backward), teacher 2 x ... (forward)."""
    student = 3 * forward_flops(student_arch, tokens, seq)
    teacher = forward_flops(teacher_arch, tokens, seq)
    return {"student_flops": student, "teacher_flops": teacher, "flops": student + teacher}


def plain_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Mean over positions with a next token of KL(teacher || student) in fp32, full vocabulary.
    logits [B, T, V_padded] (columns past `vocab` ignored) -> scalar."""
    s = student_logits[:, :-1, :vocab].float().log_softmax(-1)
    t = teacher_logits[:, :-1, :vocab].float().log_softmax(-1)
    return (t.exp() * (t - s)).sum(-1).mean()


REGIONS = ("data", "teacher", "student_forward", "loss", "backward", "optimizer", "rest")


class RegionClock:
    """Seconds per region of a step: `mark(name)` drains the device and books the time since the
    previous mark to `name`. With the device drained at every mark, a region's time is its own
    device time or its host time, whichever is longer (the overlap of host and device across
    regions is lost: the regions add up to more than a free-running step)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, dict.fromkeys(REGIONS, 0.0)
        self._last = 0.0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[name] += now - self._last
        self._last = now


class PlainLoop:
    """The plain PyTorch step (module doc). `student` is copied; `teacher` (frozen) is compiled whole
    on CUDA, as `torch.compile(teacher)`, not in place."""

    def __init__(self, student: nn.Module, teacher: nn.Module, device: torch.device, lr: float, ctx: Any = None):
        self.device = device
        self.vocab = student.arch.vocab_size
        self.model = copy.deepcopy(student).to(device).train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        cuda = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
        self.ddp = None
        if ctx is not None and ctx.dp_size > 1:
            self.ddp = nn.parallel.DistributedDataParallel(self.model, process_group=ctx.dp_group)
        forward = self.ddp or self.model
        self.forward = torch.compile(forward) if cuda else forward
        self.teacher = torch.compile(teacher) if cuda else teacher
        self.loss = torch.compile(plain_kl) if cuda else plain_kl
        self.amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()

    def train_step(self, micro: list[dict[str, torch.Tensor]], clock: RegionClock | None = None) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; the mean loss (a tensor: no host sync).
        clock: marks the end of each region (and drains the device there: diagnosis only)."""
        mark = clock.mark if clock is not None else lambda name: None
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro):
            ids = batch["input_ids"].to(self.device, non_blocking=True)
            mark("data")  # the step's batches are read before it starts
            with torch.no_grad():
                t_logits = self.teacher(ids)
            mark("teacher")
            last = i == len(micro) - 1
            with self.amp, (self.ddp.no_sync() if self.ddp is not None and not last else nullcontext()):
                logits = self.forward(ids)
                mark("student_forward")
                loss = self.loss(logits, t_logits, self.vocab) / len(micro)
                mark("loss")
                loss.backward()
                mark("backward")
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mark("optimizer")
        return total


def clock_pipeline(trainer: Any, clock: RegionClock) -> Callable[[], None]:
    """Mark the regions of `Stage2Trainer.train_step` on `clock` from outside: hooks on the teacher
    and the student module, wrappers around the engine's backward and step. Returns the function
    that removes them."""
    engine = trainer.engine
    teacher = getattr(trainer.teacher, "module", trainer.teacher)
    handles = [teacher.register_forward_pre_hook(lambda *_: clock.mark("data")),
               teacher.register_forward_hook(lambda *_: clock.mark("teacher")),
               engine.module.register_forward_hook(lambda *_: clock.mark("student_forward"))]
    backward, step = engine.backward, engine.step

    def timed_backward(*args, **kwargs):
        clock.mark("loss")
        out = backward(*args, **kwargs)
        clock.mark("backward")
        return out

    def timed_step(*args, **kwargs):
        out = step(*args, **kwargs)
        clock.mark("optimizer")
        return out

    engine.backward, engine.step = timed_backward, timed_step

    def remove() -> None:
        for handle in handles:
            handle.remove()
        del engine.backward, engine.step

    return remove


def region_ms(step: Callable[[RegionClock], Any], device: torch.device, steps: int = 3) -> dict[str, float]:
    """{region: median milliseconds} over `steps` calls of step(clock); "rest" is what follows the
    last mark (the step's scalars to the host)."""
    runs = []
    for _ in range(steps):
        clock = RegionClock(device)
        clock.start()
        step(clock)
        clock.mark("rest")
        runs.append(clock.seconds)
    return {name: statistics.median(run[name] for run in runs) * 1e3 for name in REGIONS}


def pipeline_config(overrides: list[str]) -> Any:
    """The quickstart config with `overrides`, no evaluation, no checkpoints, no progress bar."""
    from megatron_tc.config import load_config

    return load_config(overrides=["distill.eval_interval=0", "distill.checkpoint_interval=0",
                                  "logging.progress_bar=false", *overrides])


class _NoBoard:
    def scalars(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flush(self) -> None:
        pass


def pipeline_trainer(cfg: Any, ctx: Any, student: nn.Module, teacher: nn.Module, loader: SyntheticBatches,
                     device: torch.device, out_dir: Path):
    """(trainer, its state, its non-finite guard): stage 2 exactly as the pipeline builds it, on
    copies of `student` and `teacher`, with its run files (none while only `train_step` runs) under `out_dir`."""
    from megatron_tc.distill.checkpointing import TrainState
    from megatron_tc.distill.numerics import NonFiniteGuard
    from megatron_tc.distill.stage2 import build_stage2

    trainer = build_stage2(cfg, ctx, copy.deepcopy(student), copy.deepcopy(teacher), loader, [], out_dir, _NoBoard(), device)
    return trainer, TrainState(), NonFiniteGuard("skip", 10**9)


def time_step(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call, the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _max_over_ranks(seconds: float) -> float:
    """The slowest rank's time: a data-parallel step is done when every rank is."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return seconds
    from megatron_tc.parallel.comm import all_reduce_

    return float(all_reduce_(torch.tensor([seconds], dtype=torch.float64), dist.ReduceOp.MAX))


def interleaved_runs(steps: dict[str, Callable[[], Any]], device: torch.device, runs: int, per_run: int,
                     warmup: int) -> dict[str, list[float]]:
    """{name: [median step seconds of each run]}: `warmup` untimed steps of each, then `runs`
    rounds, each timing `per_run` steps of every entry in turn."""
    for fn in steps.values():
        for _ in range(warmup):
            time_step(fn, device)
    out: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(runs):
        for name, fn in steps.items():
            times = [_max_over_ranks(time_step(fn, device)) for _ in range(per_run)]
            out[name].append(statistics.median(times))
    return out


def result_rows(seconds: dict[str, list[float]], labels: dict[str, str], tokens: int, flops: float,
                peak_tflops: float) -> list[dict[str, Any]]:
    """One row per path of `interleaved_runs`' {path: [seconds per round]}: step ms, tokens/s and MFU
    (min / median / max over the rounds), and for the pipeline its tokens/s over the plain loop's,
    round by round."""
    rows = []
    for path, times in seconds.items():
        row = {"path": labels[path], "tokens_per_step": tokens}
        for key, values in (("step_ms", [s * 1e3 for s in times]), ("tok_per_s", [tokens / s for s in times]),
                            ("mfu", [flops / s / (peak_tflops * 1e12) for s in times])):
            row.update({f"{key}_{k}": v for k, v in spread(values).items()})
        if path == "pipeline":
            ratios = [plain / mine for plain, mine in zip(seconds["plain"], times)]
            row.update({f"vs_plain_{k}": v for k, v in spread(ratios).items()})
        rows.append(row)
    return rows
