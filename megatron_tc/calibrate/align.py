"""Per-layer alignment (docs/method.md section 5): each converted GDN layer, alone and
teacher-forced, learns to reproduce the teacher's attention output after o_proj.

    data = collect_layer_io(teacher, batches, layers)            # one teacher forward
    reports = align_layers(mixers, data, settings, heldout=...)  # layers spread over ranks

The loss is the MSE  mean|GDN(x) - Y|^2  (absolute, the authors') or relative to mean|Y|^2 on
the teacher's mixer input x and attention output Y after o_proj. AdamW groups (`AlignSettings.groups`):
'taylor_fit' = gates/timescales (a_proj, b_proj, A_log, dt_bias, g_proj) and projections (q/k/v/o_proj,
o_norm, convolutions); 'paper' = q/k/v weights and everything else but o_proj and o_norm, which
stay frozen. The best parameters by the chosen criterion (held-out calibration tokens, or the
training loss as the authors) are kept; with 'before_update' step 0 (the closed-form init) is a
candidate, so alignment never returns something worse by that criterion.

A rank aligns its layers in lockstep (`align_together`): every step runs each layer's forward and
backward, then one AdamW step over all of them. The layers are independent (own loss, clipping,
row draws, best state), so the results are those of one layer after another, bit for bit; the
losses and the best state stay on the device, so the host queues steps without waiting. On CUDA
the steps after the first three replay one captured step of all the layers (align_graph.py): the
step then costs its GPU time, not the host's thousands of launches. Rows of packed documents take
part as PackedRows (their layout for fla's variable-length kernels computed once, `_packed`).
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from megatron_tc.model.ops.gated_delta_rule import PackedRows

from .align_graph import WARMUP_STEPS, graph_plan, replay_stream, try_capture
from .capture import LayerIO, capture_layers
from .strategies import AlignSettings

logger = logging.getLogger(__name__)

GATE_PARAMS = ("a_proj", "b_proj", "A_log", "dt_bias", "g_proj")


@dataclass
class LayerData:
    """Data of one layer: x, y [N, T, hidden] (mixer input / target: the teacher's attention output
    after o_proj), doc_ids [N, T] (or their PackedRows) or None; resid [N, T, hidden] the residual stream entering the
    layer, when collected (student-forced alignment, sequential.py)."""

    x: torch.Tensor
    y: torch.Tensor
    doc_ids: torch.Tensor | PackedRows | None
    resid: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> "LayerData":
        return LayerData(self.x[index], self.y[index], None if self.doc_ids is None else self.doc_ids[index])

    def slice(self, start: int, stop: int) -> "LayerData":
        """Rows start..stop-1 as views (no copy)."""
        docs = None if self.doc_ids is None else self.doc_ids[start:stop]
        return LayerData(self.x[start:stop], self.y[start:stop], docs)


@torch.no_grad()
def collect_layer_io(model: nn.Module, batches, layers: list[int], keep_resid: bool = False) -> dict[int, LayerData]:
    """Teacher forward over `batches` (dicts with input_ids, optional doc_ids); keeps, for each
    layer, the mixer inputs and outputs of every row (fp32, N*T*hidden*8 bytes per layer), and with
    keep_resid the residual stream entering the layer too."""
    xs: dict[int, list] = {l: [] for l in layers}
    ys: dict[int, list] = {l: [] for l in layers}
    rs: dict[int, list] = {l: [] for l in layers}
    docs = []

    def on_layer(index: int, io: LayerIO) -> None:
        xs[index].append(io.x.float().clone())
        ys[index].append(io.out.float().clone())
        if keep_resid:
            rs[index].append(io.resid.float().clone())

    device = next(model.parameters()).device  # doc_ids must sit beside the captured activations
    for batch in batches:
        capture_layers(model, batch["input_ids"], batch.get("doc_ids"), layers, on_layer)
        docs.append(None if batch.get("doc_ids") is None else batch["doc_ids"].to(device))
    doc_ids = None if any(d is None for d in docs) else torch.cat(docs)
    return {l: LayerData(torch.cat(xs[l]), torch.cat(ys[l]), doc_ids, torch.cat(rs[l]) if keep_resid else None)
            for l in layers}


def relative_mse(mixer: nn.Module, data: LayerData, rows: int = 4) -> float:
    """mean|mixer(x) - y|^2 / mean|y|^2 over all rows of `data`, in row batches."""
    return float(_relative_mse(mixer, data, rows))


def _relative_mse(mixer: nn.Module, data: LayerData, rows: int = 4) -> torch.Tensor:
    """`relative_mse` as an fp64 scalar on the data's device (summed in the same order)."""
    dtype = next(mixer.parameters()).dtype
    err = ref = torch.zeros((), dtype=torch.float64, device=data.x.device)
    with torch.no_grad():
        for start in range(0, data.x.shape[0], rows):
            part = data.slice(start, start + rows)
            out = mixer(part.x.to(dtype), doc_ids=part.doc_ids).float()
            err = err + (out - part.y).double().pow(2).sum()
            ref = ref + part.y.double().pow(2).sum()
    return err / ref.clamp_min(1e-30)


PAPER_PROJ_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
PAPER_FROZEN = ("o_proj", "o_norm")


def _param_groups(mixer: nn.Module, settings: AlignSettings) -> list[dict]:
    """AdamW groups of `settings.groups`; with 'paper' the frozen o_proj / o_norm lose requires_grad."""
    if settings.groups not in ("taylor_fit", "paper"):
        raise ValueError(f"groups must be 'taylor_fit' or 'paper', got {settings.groups!r}")
    gates, proj = [], []
    for name, param in mixer.named_parameters():
        if settings.groups == "taylor_fit":
            (gates if name.split(".")[0] in GATE_PARAMS else proj).append(param)
        elif name.split(".")[0] in PAPER_FROZEN:
            param.requires_grad_(False)
        else:  # the authors' "new" group holds every parameter that is not a q/k/v weight (biases too)
            (proj if name in PAPER_PROJ_WEIGHTS else gates).append(param)
    gate_decay = 0.0 if settings.groups == "taylor_fit" else settings.weight_decay
    return [
        {"params": gates, "lr": settings.lr_gates, "weight_decay": gate_decay},
        {"params": proj, "lr": settings.lr_proj, "weight_decay": settings.weight_decay},
    ]


def _loss(out: torch.Tensor, y: torch.Tensor, settings: AlignSettings) -> torch.Tensor:
    err = (out.float() - y).pow(2).mean()
    return err if settings.loss == "absolute" else err / y.pow(2).mean().clamp_min(1e-30)


def _row_draws(n: int, settings: AlignSettings, seed: int, device: torch.device) -> torch.Tensor | None:
    """[steps + 1, rows] the rows of every step (and of the last score with best_on 'train'), drawn
    up front from a CPU generator seeded by `seed` (the same rows on every device) and sent to the
    device at once; None when every step takes all rows (batch_rows 0)."""
    if settings.batch_rows <= 0:
        return None
    generator = torch.Generator(device="cpu").manual_seed(seed)
    size = (min(settings.batch_rows, n),)
    draws = [torch.randint(0, n, size, generator=generator, device="cpu") for _ in range(settings.steps + 1)]
    return torch.stack(draws).to(device)


def _check(settings: AlignSettings, heldout) -> None:
    choices = {"best_on": ("heldout", "train"), "schedule": ("constant", "cosine"), "loss": ("relative", "absolute"),
               "dtype": ("float32", "bfloat16"), "best_state": ("before_update", "after_update")}
    for key, allowed in choices.items():
        if getattr(settings, key) not in allowed:
            raise ValueError(f"align {key} must be one of {allowed}, got {getattr(settings, key)!r}")
    if settings.best_on == "heldout" and heldout is None:
        raise ValueError("best_on='heldout' needs held-out calibration data")


def _in_dtype(data: LayerData, dtype: torch.dtype) -> LayerData:
    """Inputs in `dtype`; targets rounded to it (as a bf16 teacher computes them), kept fp32."""
    if dtype == torch.float32:
        return data
    return LayerData(data.x.to(dtype), data.y.to(dtype).float(), data.doc_ids, data.resid)


def _packed(data: LayerData, layouts: dict[int, PackedRows]) -> LayerData:
    """`data` with its doc_ids as PackedRows: the variable-length layout of the rows computed here,
    once per doc_ids tensor, so that no step reads it on the host (align_graph.py's condition)."""
    if data.doc_ids is None or isinstance(data.doc_ids, PackedRows):
        return data
    key = id(data.doc_ids)
    if key not in layouts:
        layouts[key] = PackedRows.of(data.doc_ids)
    return LayerData(data.x, data.y, layouts[key], data.resid)


@dataclass
class AlignJob:
    """One layer to align: its mixer (changed in place), training rows, held-out rows (best_on
    'heldout'), the seed of its row draws and its TensorBoard tag."""

    mixer: nn.Module
    train: LayerData
    heldout: LayerData | None = None
    seed: int = 0
    tag: str = ""


def align_layer(
    mixer: nn.Module, train: LayerData, settings: AlignSettings, heldout: LayerData | None = None,
    seed: int = 0, log=None, tag: str = "",
) -> dict:
    """Align one GDN mixer in place; returns {initial, best, best_step, steps, curve, loss}.
    `log(tag, value, step)` receives the training loss of every step and the held-out loss of
    every eval (after the last step)."""
    return align_together([AlignJob(mixer, train, heldout, seed, tag)], settings, log)[0]


def align_together(jobs: list[AlignJob], settings: AlignSettings, log=None, progress: bool = False,
                   graphs: bool | None = None) -> list[dict]:
    """Align every job's mixer in place, in lockstep: each step runs every layer's forward and
    backward, then one AdamW step over all layers' (disjoint) parameters. Each layer keeps its own
    loss, gradient clipping, row draws (seeded by its job) and best state, so every result equals
    that of aligning the layers one after another, to the bit. Losses, best-state choices and the
    kept parameters stay on the device until the end: the host never waits inside the loop.
    On CUDA the steps after the first few replay one captured step (align_graph.py; `graphs` False,
    or $MEGATRON_TC_ALIGN_GRAPHS=0, keeps them eager). Returns one report per job (as `align_layer`)."""
    for job in jobs:
        _check(settings, job.heldout)
    dtype = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32
    layouts: dict[int, PackedRows] = {}  # one per doc_ids tensor: the layers share their rows
    homes = [(next(job.mixer.parameters()).dtype, {n: p.requires_grad for n, p in job.mixer.named_parameters()})
             for job in jobs]
    try:
        for job in jobs:
            job.mixer.to(dtype)
        runs = [_LayerRun(replace(job, heldout=None if job.heldout is None else _packed(job.heldout, layouts)),
                          _packed(_in_dtype(job.train, dtype), layouts), settings) for job in jobs]
        _lockstep(runs, settings, progress, graphs)
        return [run.finish(log) for run in runs]
    finally:
        for job, (home, grads) in zip(jobs, homes):
            for name, param in job.mixer.named_parameters():
                param.requires_grad_(grads[name])
            job.mixer.to(home)


def _optimizer(runs: list["_LayerRun"], settings: AlignSettings, capturable: bool):
    """One AdamW over all layers (the same two parameter groups in each: per-element updates do not
    depend on which tensors share an optimizer) and the cosine schedule's scheduler, or None.
    capturable: AdamW's step counters live on the device and its update reads no host value."""
    groups = [_param_groups(run.mixer, settings) for run in runs]
    merged = [dict(group, params=[p for layer in groups for p in layer[i]["params"]])
              for i, group in enumerate(groups[0])]
    extra = {"capturable": True, "foreach": True} if capturable else {}
    optimizer = torch.optim.AdamW(merged, betas=tuple(settings.betas), **extra)
    for run, layer in zip(runs, groups):
        run.start([p for group in layer for p in group["params"]])
    if settings.schedule != "cosine":
        return optimizer, None
    total = max(settings.steps, 1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))


def _lockstep(runs: list["_LayerRun"], settings: AlignSettings, progress: bool, graphs: bool | None = None) -> None:
    """The steps of every run together, one AdamW step over all layers. On CUDA the steps after the
    first few replay one captured step (align_graph.py); elsewhere they run eagerly."""
    device = runs[0].device
    raw = any(run.train.doc_ids is not None and not isinstance(run.train.doc_ids, PackedRows) for run in runs)
    use_graph, why = graph_plan(device, settings, raw, graphs)
    if not use_graph and device.type == "cuda":
        logger.info("alignment of %d layers: eager steps (%s)", len(runs), why)
    optimizer, scheduler = _optimizer(runs, settings, capturable=use_graph)
    clock = torch.ones((), dtype=torch.int64, device=device)  # the step under way (1-based), on the device

    def step_body() -> None:
        for run in runs:
            run.forward_backward(clock)
        # torch < 2.13 creates Adam's step counters on the default device (a caller's `torch.device(...)`
        # context included); newer torch puts them on the CPU: do so everywhere (capturable: on theirs)
        with contextlib.nullcontext() if use_graph else torch.device("cpu"):
            optimizer.step()
        for run in runs:
            run.after_update(clock)
        clock.add_(1)

    steps = range(1, settings.steps + 1)
    if progress:
        from megatron_tc.monitor import progress as bar

        steps = bar(steps, desc=f"align {len(runs)} layers", unit="step")
    graph = None
    with replay_stream(device, use_graph) as stream:
        for step in steps:
            if graph is not None:
                graph.replay()
            else:
                optimizer.zero_grad(set_to_none=True)
                step_body()
                if scheduler is not None:
                    scheduler.step()
            for run in runs:
                run.between_steps(step)
            if use_graph and graph is None and step == WARMUP_STEPS:
                optimizer.zero_grad(set_to_none=True)
                graph = try_capture(step_body, stream, len(runs), step + 1, settings.steps)
    optimizer.zero_grad(set_to_none=True)  # the gradients are not part of the result


class _LayerRun:
    """One layer's alignment state: its rows, the loss of every step, the best score, its step
    and the parameters it was scored on (flat, trained parameters only), all on the device and
    updated in place (a captured step writes the same tensors on every replay).

    Candidates, as the criterion says: best_on 'heldout' scores the parameters after every
    eval_every-th update (and the last) on the held-out rows; 'train' with 'before_update' the
    parameters each step's minibatch loss was measured on (step - 1 updates; the closed form is
    step 0), and after the last update one more minibatch; 'after_update' (the authors' loop)
    pairs each step's loss with the parameters after that step's update."""

    def __init__(self, job: AlignJob, train: LayerData, settings: AlignSettings):
        self.mixer, self.train, self.heldout, self.tag, self.settings = job.mixer, train, job.heldout, job.tag, settings
        self.device = train.x.device
        self.rows = _row_draws(train.x.shape[0], settings, job.seed, self.device)
        self.on_heldout = settings.best_on == "heldout"
        self.after = not self.on_heldout and settings.best_state == "after_update"
        self.losses = torch.zeros(settings.steps, dtype=torch.float32, device=self.device)
        self.curve: list[tuple[int, torch.Tensor]] = []

    def _batch(self, draw: int | torch.Tensor) -> LayerData:
        """The rows of draw `draw` (an int, or a 0-d device tensor: gathered there, no host read)."""
        if self.rows is None:
            return self.train
        if isinstance(draw, torch.Tensor):
            return self.train.rows(self.rows.index_select(0, draw.view(1))[0])
        return self.train.rows(self.rows[draw])

    def _flat(self) -> torch.Tensor:
        if not self.trained:
            return torch.zeros(0, device=self.device)
        return torch.cat([p.detach().reshape(-1) for p in self.trained])

    def _offer(self, value: torch.Tensor, step: int | torch.Tensor) -> None:
        """Keep the current parameters when `value` (fp64 scalar) is below the best so far."""
        better = value < self.best
        self.best.copy_(torch.where(better, value, self.best))
        self.best_step.copy_(torch.where(better, step, self.best_step))
        self.best_flat.copy_(torch.where(better, self._flat(), self.best_flat))

    def start(self, trained: list[torch.Tensor]) -> None:
        self.trained = trained
        if self.on_heldout:
            self.initial = _relative_mse(self.mixer, self.heldout)
        else:
            n = self.train.x.shape[0]
            first = self.train.slice(0, n if self.settings.batch_rows <= 0 else min(n, self.settings.batch_rows))
            with torch.no_grad():
                self.initial = _loss(self.mixer(first.x, doc_ids=first.doc_ids), first.y, self.settings).double()
        self.best = torch.full_like(self.initial, math.inf) if self.after else self.initial.clone()
        self.best_step = torch.zeros((), dtype=torch.int64, device=self.device)
        self.best_flat = self._flat()
        self.curve.append((0, self.initial))
        self.mixer.train()

    def forward_backward(self, clock: torch.Tensor) -> None:
        """Step `clock` (0-d device tensor): loss on its rows, gradients, clipping."""
        draw = clock - 1
        part = self._batch(draw)
        loss = _loss(self.mixer(part.x, doc_ids=part.doc_ids), part.y, self.settings)
        self.losses.index_copy_(0, draw.view(1), loss.detach().view(1))
        self.loss = loss.detach().double()
        if not self.on_heldout and not self.after:
            self._offer(self.loss, draw)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trained, 1.0)

    def after_update(self, clock: torch.Tensor) -> None:
        """Inside the step, after AdamW's update: the 'after_update' candidate."""
        if self.after:
            self._offer(self.loss, clock)

    def between_steps(self, step: int) -> None:
        """After step `step`, never captured: held-out evals and the last extra minibatch."""
        settings = self.settings
        if self.on_heldout:
            if step % settings.eval_every == 0 or step == settings.steps:
                self.mixer.eval()
                value = _relative_mse(self.mixer, self.heldout)
                self.mixer.train()
                self.curve.append((step, value))
                self._offer(value, step)
        elif not self.after and step == settings.steps:  # the last update is scored on one more minibatch
            part = self._batch(step)
            with torch.no_grad():
                self._offer(_loss(self.mixer(part.x, doc_ids=part.doc_ids), part.y, self.settings).double(), step)

    def finish(self, log) -> dict:
        """Load the best parameters (none when no step was finite with 'after_update'), log the
        curve, and return the report."""
        best = float(self.best)
        if math.isfinite(best) or not self.after:
            with torch.no_grad():
                offset = 0
                for param in self.trained:
                    param.copy_(self.best_flat[offset:offset + param.numel()].view_as(param))
                    offset += param.numel()
        self.mixer.eval()
        curve = [(step, float(value)) for step, value in self.curve]
        if log is not None:
            scored = dict(curve[1:])
            for step, loss in enumerate(self.losses.tolist(), start=1):
                log(f"align/{self.tag}/train", loss, step)
                if self.on_heldout and step in scored:
                    log(f"align/{self.tag}/heldout", scored[step], step)
        return {"initial": curve[0][1], "best": best, "best_step": int(self.best_step), "steps": self.settings.steps,
                "curve": curve, "loss": self.settings.loss}


def _owner(position: int, world: int) -> int:
    return position % world


class LayerWork:
    """What both alignment orders share: rank and world of `group`, the TensorBoard sink, a progress
    bar on rank 0, aligning one layer with its per-layer scalars, the owner's broadcast, and gathering
    every rank's reports."""

    def __init__(self, group: dist.ProcessGroup | None, writer, progress: bool):
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.log = None if writer is None else (writer.scalar if hasattr(writer, "scalar") else writer.add_scalar)
        self.progress = progress and self.rank == 0
        self.reports: dict[int, dict] = {}

    def bar(self, layers: list[int], desc: str):
        if not self.progress:
            return layers
        from megatron_tc.monitor import progress

        return progress(layers, desc=desc, unit="layer")

    def align(self, layer: int, mixer: nn.Module, train: LayerData, settings: AlignSettings,
              heldout: LayerData | None, seed: int) -> None:
        self.align_many({layer: mixer}, {layer: train}, settings, {layer: heldout}, seed)

    def align_many(self, mixers: dict[int, nn.Module], data: dict[int, LayerData], settings: AlignSettings,
                   heldout: dict[int, LayerData | None], seed: int, progress: bool = False) -> None:
        """Align `mixers` in lockstep (`align_together`); layer l draws its rows with seed + l."""
        layers = sorted(mixers)
        jobs = [AlignJob(mixers[l], data[l], heldout.get(l), seed + l, f"L{l:02d}") for l in layers]
        for layer, report in zip(layers, align_together(jobs, settings, self.log, progress and self.progress)):
            self.reports[layer] = report
            if self.log is not None:
                self.log("align/best_relative_mse", report["best"], layer)
                self.log("align/initial_relative_mse", report["initial"], layer)

    def broadcast(self, mixer: nn.Module, position: int) -> None:
        """The mixer's parameters from the rank owning `position`, to every rank."""
        src = _owner(position, self.world)
        src = dist.get_global_rank(self.group, src) if self.group is not None else src
        for tensor in mixer.state_dict().values():
            dist.broadcast(tensor, src=src, group=self.group)

    def gathered_reports(self) -> dict[int, dict]:
        if self.world == 1:
            return self.reports
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, self.reports, group=self.group)
        return {k: v for part in gathered for k, v in part.items()}


def lockstep_groups(mixers: dict[int, nn.Module], budget: int) -> list[list[int]]:
    """The layers of `mixers` (sorted) in consecutive groups to align together, each group's
    alignment state (gradients, AdamW's two moments and the best parameters: four copies of its
    parameters) within `budget` bytes; a layer larger than the budget alone."""
    groups: list[list[int]] = [[]]
    size = 0
    for layer in sorted(mixers):
        need = 4 * sum(p.numel() * p.element_size() for p in mixers[layer].parameters())
        if groups[-1] and size + need > budget:
            groups.append([])
            size = 0
        groups[-1].append(layer)
        size += need
    return groups if groups[0] else []


def align_layers(
    mixers: dict[int, nn.Module],
    data: dict[int, LayerData],
    settings: AlignSettings,
    heldout: dict[int, LayerData] | None = None,
    group: dist.ProcessGroup | None = None,
    writer=None,
    progress: bool = True,
    seed: int = 0,
    lockstep_budget: int | None = None,
) -> dict[int, dict]:
    """Align every layer of `mixers`; with a process group, rank r aligns layers r, r+W, ... (in
    sorted order) and the aligned parameters are broadcast from their owner, so every rank ends
    with all layers aligned. A rank aligns its layers in lockstep (`align_together`: the same
    results as one after another), in groups whose alignment state fits `lockstep_budget` bytes
    (default: a quarter of the GPU, a tenth of the RAM). Returns per-layer reports (on every rank)."""
    from .stats import default_io_cache_budget

    work = LayerWork(group, writer, progress)
    layers = sorted(mixers)
    mine = {l: mixers[l] for i, l in enumerate(layers) if _owner(i, work.world) == work.rank}
    if mine:
        device = next(next(iter(mine.values())).parameters()).device
        budget = default_io_cache_budget(device) if lockstep_budget is None else lockstep_budget
        for part in lockstep_groups(mine, budget):
            work.align_many({l: mine[l] for l in part}, {l: data[l] for l in part}, settings,
                            {l: heldout.get(l) for l in part} if heldout else {}, seed, progress=True)
    if work.world > 1:
        for position, layer in enumerate(layers):
            work.broadcast(mixers[layer], position)
    return work.gathered_reports()
