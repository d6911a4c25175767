"""Student-forced alignment: converted layers aligned one after another, bottom to top, each on the
inputs the partly converted student itself produces.

Teacher-forced alignment (align.py) fits every GDN mixer to the teacher's attention on the teacher's
inputs; once all of them are swapped in, each layer sees inputs already bent by the approximations
below it, and the errors add up over the depth. Here layer l trains on what the student feeds it, with
the layers under l already aligned:

    x_l = input_norm(h_l)                      h_l: the student's residual stream entering layer l
    target 'student':   y_l                    the teacher's attention output (after o_proj)
    target 'residual':  y_l + (h*_l - h_l)     h*_l: the teacher's residual stream entering layer l

'residual' asks the mixer to also undo the drift of the residual stream, so that after layer l the
student's stream is the teacher's again (as far as one mixer can). The held-out rows are forced the
same way, so best-step selection scores what the layer will see.

    reports = align_student_forced(student, teacher, converted, settings, calib, heldout)

Every rank holds every calibration row (distill/stages.py); layer l is aligned on the rank that owns
its position (as in align.py) and broadcast before the stream moves past it, so all ranks build the
same student.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .align import LayerData, LayerWork, _owner, collect_layer_io

FORCINGS = ("teacher", "student", "residual")


class ResidualStream:
    """The student's residual stream over fixed batches, moved up one layer at a time.

    batches: dicts with input_ids [B, T] and optional doc_ids [B, T]; h[i] is [B, T, hidden] (fp32
    when the student is) entering layer `at` for batch i."""

    def __init__(self, student: nn.Module, batches) -> None:
        self.student = student
        device = next(student.parameters()).device
        self.ids = [b["input_ids"].to(device) for b in batches]
        self.docs = [None if b.get("doc_ids") is None else b["doc_ids"].to(device) for b in batches]
        self.positions = [student.resolve_positions(i, doc_ids=d) for i, d in zip(self.ids, self.docs)]
        with torch.no_grad():
            self.h = [student.embed(i) for i in self.ids]
        self.at = 0

    @torch.no_grad()
    def advance_to(self, layer: int) -> None:
        """Run layers [at, layer) on every batch."""
        if layer < self.at:
            raise ValueError(f"the stream is at layer {self.at}; it cannot go back to {layer}")
        for index in range(self.at, layer):
            block = self.student.layers[index]
            self.h = [block(h, p, d) for h, p, d in zip(self.h, self.positions, self.docs)]
        self.at = layer

    @torch.no_grad()
    def layer_data(self, teacher: LayerData, target: str) -> LayerData:
        """This layer's mixer inputs from the student, targets from the teacher's `y` (and `resid`)."""
        norm = self.student.layers[self.at].input_norm
        x = torch.cat([norm(h).float() for h in self.h])
        y = teacher.y
        if target == "residual":
            y = y + (teacher.resid - torch.cat([h.float() for h in self.h]))
        doc_ids = None if any(d is None for d in self.docs) else torch.cat(self.docs)
        return LayerData(x, y, doc_ids)


def align_student_forced(
    student: nn.Module,
    teacher: nn.Module,
    layers: list[int],
    settings,
    calib_batches,
    heldout_batches=None,
    group: dist.ProcessGroup | None = None,
    writer=None,
    progress: bool = True,
    seed: int = 0,
) -> dict[int, dict]:
    """Align the GDN mixers of `student` at `layers` in place, bottom to top, on student-forced
    inputs (settings.forcing 'student' or 'residual'). Returns per-layer reports as align_layers."""
    if settings.forcing not in FORCINGS[1:]:
        raise ValueError(f"student-forced alignment needs forcing 'student' or 'residual', got {settings.forcing!r}")
    if settings.forcing == "residual" and getattr(student.arch, "sandwich_norm", False):
        raise ValueError("forcing='residual' targets the residual stream, which a sandwich-normed mixer output "
                         "(post_attn_norm) cannot match exactly; use forcing='student' for this teacher")
    layers = sorted(layers)
    keep_resid = settings.forcing == "residual"
    targets = collect_layer_io(teacher, calib_batches, layers, keep_resid=keep_resid)
    held_targets = collect_layer_io(teacher, heldout_batches, layers, keep_resid=keep_resid) if heldout_batches else None
    stream = ResidualStream(student, calib_batches)
    held_stream = ResidualStream(student, heldout_batches) if heldout_batches else None
    work = LayerWork(group, writer, progress)
    for position, layer in enumerate(work.bar(layers, "align layers (student-forced)")):
        stream.advance_to(layer)
        train = stream.layer_data(targets.pop(layer), settings.forcing)
        held = None
        if held_stream is not None:
            held_stream.advance_to(layer)
            held = held_stream.layer_data(held_targets.pop(layer), settings.forcing)
        mixer = student.layers[layer].mixer
        if _owner(position, work.world) == work.rank:
            work.align(layer, mixer, train, settings, held, seed)
        del train, held
        if work.world > 1:  # the next layer's inputs go through this one: every rank needs it now
            work.broadcast(mixer, position)
    return work.gathered_reports()
