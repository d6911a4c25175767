"""CUDA graphs for the lockstep alignment (align.py): after a few eager steps, one whole step of
every layer (forwards, backwards, gradient clipping, one AdamW step, the best-state bookkeeping)
is recorded once and replayed for the remaining steps.

Why: the step is a few thousand small kernels (22 layers of SmolLM2: ~14 ms of host time per layer
and step, far more than the GPU needs); a replay launches them all at the cost of one call.

What a replay needs, and align.py provides: the same tensors every step (the calibration rows are
fixed; drawn rows are gathered on the device by a step counter there), state updated in place,
AdamW with `capturable=True` (its step counters on the device), a constant learning rate, and no
host reads inside the step. Packed documents qualify as `PackedRows` (model/ops/gated_delta_rule/
segments.py): fla's segment offsets and chunk indices of the rows, computed once before the first
step, gathered on the device for each step's rows with shapes that do not depend on them. Where
these do not hold the steps run eagerly, as on the CPU, and the log says why.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable

import torch

from megatron_tc.model.fused import eager_formulas

log = logging.getLogger(__name__)

GRAPH_ENV = "MEGATRON_TC_ALIGN_GRAPHS"  # "0": eager steps on CUDA too
WARMUP_STEPS = 3  # eager steps first: Triton autotuning, TileLang builds, library handles, AdamW state


def graph_plan(device: torch.device, settings, raw_doc_ids: bool, graphs: bool | None) -> tuple[bool, str]:
    """(replay the steps from a CUDA graph?, why not). `graphs` None follows $MEGATRON_TC_ALIGN_GRAPHS.
    raw_doc_ids: packed documents given as plain doc_ids, not as PackedRows (whose layout is precomputed)."""
    if device.type != "cuda":
        return False, "not on CUDA"
    if graphs is None:
        graphs = os.environ.get(GRAPH_ENV, "1") != "0"
    if not graphs:
        return False, f"turned off ({GRAPH_ENV}=0)"
    if settings.schedule != "constant":
        return False, f"the {settings.schedule!r} schedule changes the learning rate every step"
    if raw_doc_ids:
        return False, ("packed documents as plain doc_ids: their segment offsets for fla's variable-length "
                       "kernels would be read on the host in every step (PackedRows precompute them)")
    if settings.steps <= WARMUP_STEPS:
        return False, f"{settings.steps} steps: all of them are warm-up"
    return True, ""


@contextlib.contextmanager
def replay_stream(device: torch.device, use: bool):
    """With `use`: a side stream (yielded) that the warm-up, the capture and the replays run on, as
    CUDA graphs ask, ordered after the caller's stream and before it again on exit; the blocks as
    their eager formulas. Without: None, nothing changed."""
    if not use:
        yield None
        return
    caller = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream), eager_formulas():
            yield stream
    finally:
        caller.wait_stream(stream)


def capture_step(body: Callable[[], None], stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """Record `body` (one lockstep step) on `stream` without running it; returns the graph.
    The gradients must be None on entry: the backward allocates them in the graph's memory."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: another host thread's CUDA calls neither break nor join this capture
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        body()
    return graph


def try_capture(body: Callable[[], None], stream: torch.cuda.Stream, layers: int, first: int, last: int):
    """`capture_step`, or None (logged) when the capture fails: the caller then goes on eagerly
    (a failed capture ran nothing, so no state moved)."""
    try:
        graph = capture_step(body, stream)
    except Exception as exc:  # an op that syncs, a kernel off the capture stream, ...
        log.warning("alignment of %d layers: CUDA graph capture failed (%s: %s); steps %d-%d run eagerly",
                    layers, type(exc).__name__, str(exc)[:300], first, last)
        return None
    log.info("alignment of %d layers: steps 1-%d eager, %d-%d replayed from one CUDA graph",
             layers, first - 1, first, last)
    return graph
