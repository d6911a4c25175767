"""When the lockstep alignment replays a captured CUDA graph, and why not otherwise (align_graph.py).
The replay itself is compared with eager steps in tests/gpu/test_align_graph_cuda.py."""
import contextlib
import copy
from dataclasses import replace

import pytest
import torch

from megatron_tc.calibrate import align
from megatron_tc.calibrate.align import AlignJob, align_together
from megatron_tc.calibrate.align_graph import GRAPH_ENV, WARMUP_STEPS, graph_plan
from megatron_tc.calibrate.strategies import get_strategy
from tests.unit.test_align_lockstep import LAYERS, SETTINGS, layers  # noqa: F401 (a fixture)

PAPER = get_strategy("taylor_calibrate").align
CUDA = torch.device("cuda", 0)


def test_the_authors_alignment_replays_on_cuda(monkeypatch):
    monkeypatch.delenv(GRAPH_ENV, raising=False)
    assert graph_plan(CUDA, PAPER, raw_doc_ids=False, graphs=None) == (True, "")
    assert graph_plan(CUDA, replace(PAPER, batch_rows=4, best_on="heldout"), False, True) == (True, "")


@pytest.mark.parametrize("device, settings, docs, graphs, why", [
    (torch.device("cpu"), PAPER, False, True, "not on CUDA"),
    (CUDA, PAPER, False, False, "turned off"),
    (CUDA, replace(PAPER, schedule="cosine"), False, None, "changes the learning rate"),
    (CUDA, PAPER, True, None, "plain doc_ids"),
    (CUDA, replace(PAPER, steps=WARMUP_STEPS), False, None, "warm-up"),
])
def test_eager_steps_say_why(device, settings, docs, graphs, why, monkeypatch):
    monkeypatch.delenv(GRAPH_ENV, raising=False)
    use, reason = graph_plan(device, settings, docs, graphs)
    assert not use and why in reason


def test_the_environment_turns_graphs_off_unless_asked(monkeypatch):
    monkeypatch.setenv(GRAPH_ENV, "0")
    assert graph_plan(CUDA, PAPER, False, None)[0] is False
    assert graph_plan(CUDA, PAPER, False, True)[0] is True


class _Rerun:
    """A stand-in for the captured graph on the CPU: a replay runs the recorded step again, with
    the gradients fresh (as the captured backward writes them)."""

    def __init__(self, body, mixers):
        self.body, self.mixers, self.replays = body, mixers, 0

    def replay(self):
        self.replays += 1
        for mixer in self.mixers:
            for param in mixer.parameters():
                param.grad = None
        self.body()


@pytest.mark.parametrize("name", list(SETTINGS))
def test_steps_after_the_warm_up_go_to_the_replay(layers, name, monkeypatch):
    """The loop around the graph (warm-up, capture after step WARMUP_STEPS, replays, held-out
    evals and the last minibatch between them, the step counter on the device) ends where the
    eager loop ends, bit for bit, when a replay does what was recorded."""
    mixers, train, held = layers
    settings = replace(SETTINGS[name], schedule="constant")
    results, graphs = [], []
    for replayed in (False, True):
        copies = copy.deepcopy(mixers)
        if replayed:
            monkeypatch.setattr(align, "graph_plan", lambda *args: (True, ""))
            monkeypatch.setattr(align, "replay_stream", lambda device, use: contextlib.nullcontext())
            make = align._optimizer  # capturable AdamW runs on accelerators only
            monkeypatch.setattr(align, "_optimizer", lambda runs, s, capturable: make(runs, s, False))
            monkeypatch.setattr(align, "try_capture", lambda body, *a: graphs.append(_Rerun(body, copies.values()))
                                or graphs[-1])
        logs = []
        jobs = [AlignJob(copies[l], train[l], held[l], 10 + l, f"L{l}") for l in LAYERS]
        reports = align_together(jobs, settings, log=lambda *a: logs.append(a))
        results.append((reports, logs, {l: copies[l].state_dict() for l in LAYERS}))
    (want, want_logs, want_states), (got, got_logs, got_states) = results
    assert [g.replays for g in graphs] == [settings.steps - WARMUP_STEPS]
    assert got == want and got_logs == want_logs
    for l in LAYERS:
        for key, value in want_states[l].items():
            assert torch.equal(got_states[l][key], value), (l, key)


def test_packed_documents_reach_the_steps_precomputed(layers, monkeypatch):
    """Rows with doc_ids go to the steps as one PackedRows per doc_ids tensor (their fla layout
    computed once), which graph_plan accepts; on the CPU the results equal those with plain doc_ids."""
    mixers, train, held = layers
    assert all(train[l].doc_ids is not None for l in LAYERS)
    settings = replace(SETTINGS["heldout, 2 rows a step"], steps=4)
    plans, seen = [], []
    monkeypatch.setattr(align, "graph_plan", lambda device, s, raw, graphs: plans.append(raw) or (False, "cpu"))
    forward = align._LayerRun.forward_backward
    monkeypatch.setattr(align._LayerRun, "forward_backward", lambda run, clock: seen.append(run.train.doc_ids)
                        or forward(run, clock))
    results = []
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(align, "_packed", lambda data, layouts: data)
        copies = copy.deepcopy(mixers)
        jobs = [AlignJob(copies[l], train[l], held[l], 10 + l, f"L{l}") for l in LAYERS]
        results.append((align_together(jobs, settings), {l: copies[l].state_dict() for l in LAYERS}))
    assert plans == [False, True]  # plain doc_ids would keep the steps eager
    half = len(seen) // 2  # each step's drawn rows: gathered from the layout, or plain doc_ids
    assert all(isinstance(d, align.PackedRows) for d in seen[:half])
    assert all(isinstance(d, torch.Tensor) for d in seen[half:])
    (got, got_states), (want, want_states) = results
    assert got == want
    for l in LAYERS:
        for key, value in want_states[l].items():
            assert torch.equal(got_states[l][key], value), (l, key)
