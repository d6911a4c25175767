"""Retained-layer policies (docs/method.md section 6): which layers stay softmax attention.

Every policy returns a `Selection`: the kept layers (sorted) and one score per layer (higher =
more worth keeping as attention), plus how the scores were obtained. As the paper's authors define
them: `uniform` keeps layer 0 and every k-th; `ar` bypasses one layer's attention in the teacher and
ranks layers by the perplexity increase; `ga` ranks one-layer-kept students initialized with
taylor_calibrate (aligned) by perplexity. Perplexity is measured on calibration batches (the
authors measure on their evaluation text). `readout_gap` (taylor_fit's own) reads the statistics pass only.

`ar` and `ga` also take a teacher split over tensor-parallel ranks (`tp_group`; every rank of the
group calls them with the same batches): the teacher's perplexity comes from its vocabulary shards
without gathering the logits, a bypassed layer zeroes the row-parallel (already reduced) attention
output, and ga's probe students, whole on every rank, are built from `teacher_state` (the whole
weights read by name) and aligned on the split teacher's whole layer outputs.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from megatron_tc.model import HybridLM

from .readout import solve_joint_scales
from .statsfile import TaylorStats
from .strategies import get_strategy

POLICIES = ("uniform", "ar", "ga", "readout_gap")
# the run config's names (`model.policy`) of the policies whose function has another name
POLICY_ALIASES = {"stats": "readout_gap"}


def policy_name(name: str) -> str:
    """The policy `name` stands for (a config name such as `stats`, or a function's own name)."""
    return POLICY_ALIASES.get(name, name)


@dataclass
class Selection:
    policy: str
    keep: list[int]
    scores: dict[int, float]
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = asdict(self)
        out["scores"] = {str(k): v for k, v in self.scores.items()}
        return out


def uniform(num_layers: int, num_keep: int) -> Selection:
    """Layer 0 and every k-th after it, k = L // K (the authors' 28 layers, K = 7: 0, 4, ..., 24)."""
    if not 0 < num_keep <= num_layers:
        raise ValueError(f"num_keep={num_keep} must be in 1..{num_layers}")
    step = num_layers // num_keep
    keep = [i * step for i in range(num_keep)]
    return Selection("uniform", keep, {l: float(l in keep) for l in range(num_layers)}, {"every": step})


@torch.no_grad()
def perplexity(model: HybridLM, batches: Sequence[dict], tp_group=None) -> float:
    """Token-level perplexity of next-token prediction over the rows of `batches`. With `tp_group`
    the model is tensor-parallel and its logits are vocabulary shards ([B, T, V_pad / TP]): the
    cross-entropy is computed on them (a collective), the full logits are never gathered."""
    from megatron_tc.parallel.losses import vocab_parallel_cross_entropy

    nll, count = 0.0, 0
    device = next(model.parameters()).device
    for batch in batches:
        ids = batch["input_ids"].to(device)
        doc_ids = batch.get("doc_ids")
        logits = model(ids, doc_ids=None if doc_ids is None else doc_ids.to(device))
        ce = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], model.arch.vocab_size, tp_group=tp_group)
        nll += float(ce.double().sum())
        count += ids[:, 1:].numel()
    return math.exp(nll / max(count, 1))


def _build(teacher, keep, init, stats, sha, seed, teacher_state=None):
    from .student import build_student, pattern_from_keep

    return build_student(teacher, pattern_from_keep(teacher.arch.num_layers, keep), init, stats, seed, sha,
                         teacher_state)


class _BypassAttention:
    """Within the block, layer `index`'s attention outputs zeros (only the residual passes). On a
    tensor-parallel teacher the hook sees o_proj's row-parallel output after its all-reduce, the
    same on every rank: zeroing it bypasses the whole layer."""

    def __init__(self, model: HybridLM, index: int):
        self.mixer, self.handle = model.layers[index].mixer, None

    def __enter__(self):
        self.handle = self.mixer.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def attention_removal(
    teacher: HybridLM, num_keep: int, batches: Sequence[dict], init: str | None = None,
    stats: TaylorStats | None = None, teacher_sha256: str | None = None, seed: int = 0, progress=None,
    tp_group=None, teacher_state=None,
) -> Selection:
    """`ar`: score = perplexity increase over the teacher when one layer's attention is bypassed
    (whatever the init). With `init`, the layer is converted with that closed form instead (a
    whole student: from `teacher_state` when the teacher is split over `tp_group`)."""
    layers = list(range(teacher.arch.num_layers))
    base = perplexity(teacher, batches, tp_group)
    scores = {}
    for layer in (progress(layers) if progress else layers):
        if init is None:
            with _BypassAttention(teacher, layer):
                scores[layer] = perplexity(teacher, batches, tp_group) - base
        else:
            student = _build(teacher, [l for l in layers if l != layer], init, stats, teacher_sha256, seed,
                             teacher_state)
            scores[layer] = perplexity(student, batches) - base
    keep = sorted(sorted(layers, key=lambda l: -scores[l])[:num_keep])
    return Selection("ar", keep, scores, {"init": init or "bypass", "teacher_ppl": base})


def _probe(teacher, keep, init, stats, sha, seed, calib_batches, heldout_batches, tp_group=None, teacher_state=None):
    """A student keeping `keep` as attention: the init's closed form, aligned when it aligns (ga's
    taylor_calibrate with the authors' probe learning rate). In a world of several processes
    every rank calls this with the same rows and gets the same whole layer outputs (a split
    teacher's too): the layers are aligned dealt over the world."""
    from .strategies import PAPER_GA_ALIGN
    from .student import calibrate_student

    strategy = get_strategy(init)
    if strategy.align is None:
        return _build(teacher, keep, init, stats, sha, seed, teacher_state)
    align = PAPER_GA_ALIGN if strategy.name == "taylor_calibrate" else True
    student, _ = calibrate_student(teacher, keep, strategy, calib_batches=calib_batches, heldout_batches=heldout_batches,
                                   stats=stats, teacher_sha256=sha, align=align, tp_group=tp_group,
                                   teacher_state=teacher_state, align_group=None, progress=False, seed=seed)
    return student


def greedy_addition(
    teacher: HybridLM, num_keep: int, batches: Sequence[dict], init: str = "taylor_calibrate",
    stats: TaylorStats | None = None, teacher_sha256: str | None = None, rounds: int = 1, seed: int = 0,
    progress=None, calib_batches: Sequence[dict] | None = None, heldout_batches: Sequence[dict] | None = None,
    tp_group=None, teacher_state=None,
) -> Selection:
    """`ga`: from all layers converted, add the attention layer that lowers perplexity most.
    rounds=1 (the authors'): one ranking of one-layer-kept students (L of them, each initialized
    with `init` and aligned on `calib_batches`, default `batches`); rounds=num_keep: forward greedy
    selection (about K*L students). Score = -perplexity of the student with the layer added in the
    round that chose it (or of the single ranking)."""
    layers = list(range(teacher.arch.num_layers))
    calib = calib_batches if calib_batches is not None else batches
    keep: list[int] = []
    scores: dict[int, float] = {}
    history = []
    for round_index in range(max(1, min(rounds, num_keep))):
        candidates = [l for l in layers if l not in keep]
        ppl = {}
        for layer in (progress(candidates) if progress else candidates):
            student = _probe(teacher, keep + [layer], init, stats, teacher_sha256, seed, calib, heldout_batches,
                             tp_group, teacher_state)
            ppl[layer] = perplexity(student, batches)
        order = sorted(candidates, key=lambda l: ppl[l])
        history.append({str(l): ppl[l] for l in order})
        if rounds <= 1:
            scores = {l: -ppl[l] for l in candidates}
            keep = order[:num_keep]
            break
        keep.append(order[0])
        scores[order[0]] = -ppl[order[0]]
    for layer in layers:
        scores.setdefault(layer, -math.inf)
    return Selection("ga", sorted(keep), scores, {"init": init, "rounds": rounds, "history": history})


def readout_gap(stats: TaylorStats, num_keep: int, strategy: str = "taylor_fit-closed") -> Selection:
    """The attention output energy the initialized recurrence cannot explain, relative to
    the residual stream: (|Y|^2 - r^T a) / |h|^2 with a the joint least-squares scales. `strategy`:
    a fitted-gate strategy (its readout sums hold the sums after o_proj G, r, YY)."""
    chosen = get_strategy(strategy)
    if not chosen.readout_products:
        raise ValueError(f"readout_gap reads the sums after o_proj (G, r, YY) of a fitted-gate strategy such as "
                         f"taylor_fit-closed; the statistics pass does not make them for {strategy!r}")
    stats.check_readout_products(chosen.readout_name, strategy, "readout_gap")
    scores = {}
    for layer in stats.layers:
        readout = stats.readout(chosen.readout_name, layer)
        explained = readout["uy"].pow(2) / readout["uu"].clamp_min(1e-30)
        h = readout["uy"].shape[1]
        index = explained.argmax(dim=0) * h + torch.arange(h)
        scales = solve_joint_scales(readout["G"][index][:, index], readout["r"][index])
        residual = float(readout["YY"] - readout["r"][index] @ scales)
        scores[layer] = residual / float(stats.layer(layer)["resid_energy"].clamp_min(1e-30))
    keep = sorted(sorted(scores, key=lambda l: -scores[l])[:num_keep])
    return Selection("readout_gap", keep, scores, {"strategy": strategy})


def log_selection(scores: dict, keep: Sequence[int], writer) -> None:
    """A selection's per-layer scores (finite ones) and which layers it keeps, as TensorBoard
    scalars `select/score` and `select/kept` over the layer index."""
    kept = set(keep)
    for layer, score in sorted((int(l), float(s)) for l, s in scores.items()):
        if math.isfinite(score):
            writer.scalar("select/score", score, layer)
        writer.scalar("select/kept", float(layer in kept), layer)


def select_layers(policy: str, num_keep: int, *, teacher: HybridLM | None = None, stats: TaylorStats | None = None,
                  batches: Sequence[dict] | None = None, **kwargs) -> Selection:
    """Dispatch by name; `uniform` needs only the teacher's depth."""
    if policy == "uniform":
        return uniform(teacher.arch.num_layers if teacher is not None else stats.meta["num_layers"], num_keep)
    if policy == "readout_gap":
        if stats is None:
            raise ValueError("policy readout_gap needs a stats file with taylor_fit-closed readout sums over all layers")
        return readout_gap(stats, num_keep, kwargs.get("strategy", "taylor_fit-closed"))
    if policy in ("ar", "ga"):
        if teacher is None or not batches:
            raise ValueError(f"policy {policy} needs the teacher and calibration batches")
        fn: Callable = attention_removal if policy == "ar" else greedy_addition
        return fn(teacher, num_keep, batches, stats=stats, **kwargs)
    raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
