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
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .capture import LayerIO, capture_layers
from .strategies import AlignSettings

GATE_PARAMS = ("a_proj", "b_proj", "A_log", "dt_bias", "g_proj")


@dataclass
class LayerData:
    """Data of one layer: x, y [N, T, hidden] (mixer input / target: the teacher's attention output
    after o_proj), doc_ids [N, T] or None; resid [N, T, hidden] the residual stream entering the
    layer, when collected (student-forced alignment, sequential.py)."""

    x: torch.Tensor
    y: torch.Tensor
    doc_ids: torch.Tensor | None
    resid: torch.Tensor | None = None

    def rows(self, index: torch.Tensor) -> "LayerData":
        return LayerData(self.x[index], self.y[index], None if self.doc_ids is None else self.doc_ids[index])


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
    err = ref = 0.0
    dtype = next(mixer.parameters()).dtype
    with torch.no_grad():
        for start in range(0, data.x.shape[0], rows):
            part = data.rows(torch.arange(start, min(start + rows, data.x.shape[0]), device=data.x.device))
            out = mixer(part.x.to(dtype), doc_ids=part.doc_ids).float()
            err += float((out - part.y).double().pow(2).sum())
            ref += float(part.y.double().pow(2).sum())
    return err / max(ref, 1e-30)


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


def _train_rows(n: int, settings: AlignSettings, generator) -> torch.Tensor:
    """This step's rows: all of them (batch_rows 0), else batch_rows drawn at random."""
    if settings.batch_rows <= 0:
        return torch.arange(n)
    return torch.randint(0, n, (min(settings.batch_rows, n),), generator=generator, device="cpu")


def _check(settings: AlignSettings, heldout) -> None:
    choices = {"best_on": ("heldout", "train"), "schedule": ("constant", "cosine"), "loss": ("relative", "absolute"),
               "dtype": ("float32", "bfloat16"), "best_state": ("before_update", "after_update")}
    for key, allowed in choices.items():
        if getattr(settings, key) not in allowed:
            raise ValueError(f"align {key} must be one of {allowed}, got {getattr(settings, key)!r}")
    if settings.best_on == "heldout" and heldout is None:
        raise ValueError("best_on='heldout' needs held-out calibration data")


def _minibatch_loss(mixer: nn.Module, train: LayerData, settings: AlignSettings, generator) -> float:
    """Training loss of the current parameters on one training minibatch (no update)."""
    rows = _train_rows(train.x.shape[0], settings, generator)
    with torch.no_grad():
        part = train.rows(rows.to(train.x.device))
        return float(_loss(mixer(part.x, doc_ids=part.doc_ids), part.y, settings))


def _in_dtype(data: LayerData, dtype: torch.dtype) -> LayerData:
    """Inputs in `dtype`; targets rounded to it (as a bf16 teacher computes them), kept fp32."""
    if dtype == torch.float32:
        return data
    return LayerData(data.x.to(dtype), data.y.to(dtype).float(), data.doc_ids, data.resid)


def align_layer(
    mixer: nn.Module, train: LayerData, settings: AlignSettings, heldout: LayerData | None = None,
    seed: int = 0, log=None, tag: str = "",
) -> dict:
    """Align one GDN mixer in place; returns {initial, best, best_step, final, curve}. `log(tag,
    value, step)` receives the training loss every step and the held-out loss every eval."""
    _check(settings, heldout)
    dtype = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32
    home = next(mixer.parameters()).dtype
    mixer.to(dtype)
    train = _in_dtype(train, dtype)
    frozen = {name: p.requires_grad for name, p in mixer.named_parameters()}
    try:
        report = _align_steps(mixer, train, settings, heldout, seed, log, tag)
    finally:
        for name, param in mixer.named_parameters():
            param.requires_grad_(frozen[name])
        mixer.to(home)
    return report


def _align_steps(mixer, train: LayerData, settings: AlignSettings, heldout, seed: int, log, tag: str) -> dict:
    generator = torch.Generator(device="cpu").manual_seed(seed)  # the same rows on every device
    optimizer = torch.optim.AdamW(_param_groups(mixer, settings), betas=tuple(settings.betas))
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    scheduler = None
    if settings.schedule == "cosine":
        total = max(settings.steps, 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    n, device = train.x.shape[0], train.x.device
    score = (lambda: relative_mse(mixer, heldout)) if settings.best_on == "heldout" else None
    after_update = score is None and settings.best_state == "after_update"
    if score:
        initial = score()
    else:
        first = train.rows(torch.arange(n if settings.batch_rows <= 0 else min(n, settings.batch_rows), device=device))
        with torch.no_grad():
            initial = float(_loss(mixer(first.x, doc_ids=first.doc_ids), first.y, settings))
    best, best_step, best_state = initial, 0, copy.deepcopy(mixer.state_dict())
    if after_update:  # the authors' loop never keeps the closed form itself
        best, best_state = math.inf, None
    curve = [(0, initial)]
    mixer.train()
    for step in range(1, settings.steps + 1):
        part = train.rows(_train_rows(n, settings, generator).to(device))
        loss = _loss(mixer(part.x, doc_ids=part.doc_ids), part.y, settings)
        improved = score is None and float(loss.detach()) < best
        if improved and not after_update:
            # the loss was measured on the parameters *before* this step: those are kept (step - 1 updates)
            best, best_step, best_state = float(loss.detach()), step - 1, copy.deepcopy(mixer.state_dict())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        # torch < 2.13 creates Adam's step counters on the default device (a caller's
        # `torch.device(...)` context included); newer torch puts them on the CPU: do so everywhere
        with torch.device("cpu"):
            optimizer.step()
        if improved and after_update:
            best, best_step, best_state = float(loss.detach()), step, copy.deepcopy(mixer.state_dict())
        if scheduler is not None:
            scheduler.step()
        if log is not None:
            log(f"align/{tag}/train", float(loss.detach()), step)
        value = None
        if score is None:
            if step == settings.steps and not after_update:  # the last update is scored on one more minibatch
                value = _minibatch_loss(mixer, train, settings, generator)
        elif step % settings.eval_every == 0 or step == settings.steps:
            mixer.eval()
            value = score()
            mixer.train()
            curve.append((step, value))
            if log is not None:
                log(f"align/{tag}/heldout", value, step)
        if value is not None and value < best:
            best, best_step, best_state = value, step, copy.deepcopy(mixer.state_dict())
    if best_state is not None:
        mixer.load_state_dict(best_state)
    mixer.eval()
    return {"initial": initial, "best": best, "best_step": best_step, "steps": settings.steps, "curve": curve,
            "loss": settings.loss}


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
        from tqdm.auto import tqdm

        return tqdm(layers, desc=desc, unit="layer", dynamic_ncols=True)

    def align(self, layer: int, mixer: nn.Module, train: LayerData, settings: AlignSettings,
              heldout: LayerData | None, seed: int) -> None:
        report = self.reports[layer] = align_layer(mixer, train, settings, heldout, seed + layer, self.log, f"L{layer:02d}")
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


def align_layers(
    mixers: dict[int, nn.Module],
    data: dict[int, LayerData],
    settings: AlignSettings,
    heldout: dict[int, LayerData] | None = None,
    group: dist.ProcessGroup | None = None,
    writer=None,
    progress: bool = True,
    seed: int = 0,
) -> dict[int, dict]:
    """Align every layer of `mixers`; with a process group, rank r aligns layers r, r+W, ... (in
    sorted order) and the aligned parameters are broadcast from their owner, so every rank ends
    with all layers aligned. Returns per-layer reports (on every rank)."""
    work = LayerWork(group, writer, progress)
    layers = sorted(mixers)
    mine = [l for i, l in enumerate(layers) if _owner(i, work.world) == work.rank]
    for layer in work.bar(mine, "align layers"):
        work.align(layer, mixers[layer], data[layer], settings, heldout.get(layer) if heldout else None, seed)
    if work.world > 1:
        for position, layer in enumerate(layers):
            work.broadcast(mixers[layer], position)
    return work.gathered_reports()
