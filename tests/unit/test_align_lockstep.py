"""Layers aligned in lockstep (one AdamW over all of them, one step loop) end exactly where each
layer aligned alone ends, under every criterion; and the step loop never reads a value back."""
import copy
import os
import sys
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_tc.calibrate import align
from megatron_tc.calibrate.align import AlignJob, align_layer, align_together, collect_layer_io
from megatron_tc.calibrate.strategies import AlignSettings, get_strategy
from megatron_tc.calibrate.student import build_student
from tests.parallel._workers_stats import stats_of_rows, tiny_teacher_and_rows

LAYERS = (0, 2)
SETTINGS = {
    "heldout, 2 rows a step": AlignSettings(steps=7, eval_every=3, batch_rows=2, lr_gates=1e-2, lr_proj=1e-3),
    "train, before update, cosine": AlignSettings(steps=6, best_on="train", batch_rows=0, schedule="cosine",
                                                  lr_gates=1e-2, loss="absolute"),
    "the authors' (after update, bf16, all rows)": replace(get_strategy("taylor_calibrate").align, steps=5),
}


@pytest.fixture(scope="module")
def layers():
    teacher, ids, doc_ids = tiny_teacher_and_rows()
    batches = [{"input_ids": ids[r:r + 1], "doc_ids": doc_ids[r:r + 1]} for r in range(4)]
    student = build_student(teacher, "GAG", "taylor", stats_of_rows(range(4)), teacher_sha256="t")
    train = collect_layer_io(teacher, batches, list(LAYERS))
    # held-out rows: the training rows themselves, so that the best step is not the closed form
    return {l: student.layers[l].mixer for l in LAYERS}, train, train


@pytest.mark.parametrize("name", list(SETTINGS))
def test_lockstep_equals_one_layer_after_another(layers, name):
    mixers, train, held = layers
    settings = SETTINGS[name]
    alone, together = copy.deepcopy(mixers), copy.deepcopy(mixers)
    logs = {"alone": [], "together": []}
    want = [align_layer(alone[l], train[l], settings, held[l], seed=10 + l, tag=f"L{l}",
                        log=lambda *a: logs["alone"].append(a)) for l in LAYERS]
    jobs = [AlignJob(together[l], train[l], held[l], 10 + l, f"L{l}") for l in LAYERS]
    got = align_together(jobs, settings, log=lambda *a: logs["together"].append(a))
    assert got == want
    assert logs["together"] == logs["alone"] and len(logs["alone"]) >= 2 * settings.steps
    for l in LAYERS:
        moved = False
        for key, value in alone[l].state_dict().items():
            assert torch.equal(together[l].state_dict()[key], value), (name, l, key)
            moved |= not torch.equal(value, mixers[l].state_dict()[key])
        assert moved and together[l].q_proj.weight.dtype == torch.float32
    other = align_layer(copy.deepcopy(mixers[0]), train[0], settings, held[0], seed=99)
    assert settings.batch_rows == 0 or other != want[0]  # the seed draws the rows


class _HostReads(TorchFunctionMode):
    """Records tensor methods that hand a value to the host (each a device synchronization on a
    GPU). AdamW's reads of its step counters are left out: they live on the CPU by design."""

    READS = {"item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy", "nonzero"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS and not _inside_torch_optim():
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _inside_torch_optim() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if f"torch{os.sep}optim{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_step_loop_reads_nothing_back(layers, name, monkeypatch):
    mixers, train, held = layers
    seen = []
    original = align._lockstep

    def watched(*args, **kwargs):
        with _HostReads() as reads:
            original(*args, **kwargs)
        seen.append(reads.calls)

    monkeypatch.setattr(align, "_lockstep", watched)
    mixers = copy.deepcopy(mixers)
    jobs = [AlignJob(mixers[l], replace(train[l], doc_ids=None), replace(held[l], doc_ids=None), l) for l in LAYERS]
    align_together(jobs, SETTINGS[name])
    assert seen == [[]]
    with _HostReads() as reads:  # the watcher sees reads where there are some
        align.relative_mse(mixers[0], train[0])
    assert "__float__" in reads.calls


def test_lockstep_groups_fit_the_budget_and_any_grouping_gives_the_same_layers(layers):
    from megatron_tc.calibrate.align import align_layers, lockstep_groups

    mixers, train, held = layers
    state = 4 * sum(p.numel() * 4 for p in mixers[0].parameters())  # grads, 2 AdamW moments, best: fp32
    assert lockstep_groups(mixers, 2 * state) == [[0, 2]]
    assert lockstep_groups(mixers, 2 * state - 1) == lockstep_groups(mixers, 0) == [[0], [2]]
    assert lockstep_groups({}, 0) == []
    settings = SETTINGS["heldout, 2 rows a step"]
    results = {}
    for budget in (0, 2 * state):
        copies = copy.deepcopy(mixers)
        reports = align_layers(copies, train, settings, held, progress=False, seed=5, lockstep_budget=budget)
        results[budget] = (reports, {l: copies[l].state_dict() for l in LAYERS})
    (alone, alone_states), (together, together_states) = results.values()
    assert alone == together
    for l in LAYERS:
        for key, value in alone_states[l].items():
            assert torch.equal(together_states[l][key], value), (l, key)
