"""When the exported student captures a prefill (the policy of graphs_megatron_tc.PrefillGraphs), on
CPU with the CUDA capture replaced by a stand-in that runs the eager forward: the second prefill
of a shape over a reused cache is captured, later ones replay it, one-off shapes and fresh caches
never are, at most `keep` shapes are held, and replaced weights make a graph stale. Replayed
graphs on CUDA: tests/gpu/test_student_generate_cuda.py."""
from __future__ import annotations

import torch

from megatron_tc.convert.hf_student import MegatronTCCache, MegatronTCConfig, MegatronTCForCausalLM
from megatron_tc.export import graphs_megatron_tc as graphs
from megatron_tc.export.attention_megatron_tc import Batch
from tests.converters.helpers import tiny_arch


class EagerStandIn:
    """PrefillGraph's interface; `replay` runs the eager forward into the same cache."""

    built = 0

    def __init__(self, model, cache, input_ids, logits_to_keep, pool) -> None:
        type(self).built += 1
        self.model, self.cache, self.shape, self.keep = model, cache, input_ids.shape, logits_to_keep
        self.pointers, self.weights, self.pool = graphs.cache_pointers(cache), graphs.weight_pointers(model), None

    def fits(self, model, cache, input_ids) -> bool:
        return (cache is self.cache and input_ids.shape == self.shape and graphs.cache_pointers(cache) == self.pointers
                and graphs.weight_pointers(model) == self.weights)

    def replay(self, input_ids):
        t = input_ids.shape[1]
        positions = torch.arange(t).expand(input_ids.shape)
        return self.model.model(input_ids, positions, Batch(0, torch.arange(t), None, None, t), self.cache, self.keep)


def prefill(model, graph_set, cache, ids):
    """What the model's forward does for a prefill: the graph set, else the eager forward."""
    cache.reset()
    logits = graph_set.run(model, cache, ids, 1)
    if logits is None:
        t = ids.shape[1]
        logits = model.model(ids, torch.arange(t).expand(ids.shape), Batch(0, torch.arange(t), None, None, t), cache, 1)
    cache.seen = ids.shape[1]
    return logits


def test_second_prefill_of_a_shape_over_a_reused_cache_is_captured(monkeypatch):
    monkeypatch.setattr(graphs, "PrefillGraph", EagerStandIn)
    EagerStandIn.built = 0
    torch.manual_seed(0)
    model = MegatronTCForCausalLM(MegatronTCConfig.from_arch(tiny_arch("AGGG"))).eval()
    graph_set, cache = graphs.PrefillGraphs(keep=2), MegatronTCCache(model.config, static_len=32)
    ids = [torch.randint(3, 300, (2, 12)) for _ in range(3)]
    with torch.no_grad():
        reference = [prefill(model, graphs.PrefillGraphs(), MegatronTCCache(model.config, static_len=32), x)
                     for x in ids]
        out = [prefill(model, graph_set, cache, x) for x in ids]
        assert EagerStandIn.built == 1 and len(graph_set.graphs) == 1  # at the second, replayed at the third
        for got, want in zip(out, reference):
            assert torch.equal(got, want)
        fresh = MegatronTCCache(model.config, static_len=32)  # no buffers yet: never captured
        prefill(model, graph_set, fresh, ids[0])
        assert EagerStandIn.built == 1
        prefill(model, graph_set, cache, ids[0][:, :11])  # a length seen once: eager
        assert EagerStandIn.built == 1
        for t in (10, 9):  # two more shapes, each twice: the least recently used one is dropped
            prefill(model, graph_set, cache, ids[0][:, :t])
            prefill(model, graph_set, cache, ids[0][:, :t])
        assert EagerStandIn.built == 3
        assert [key[1] for key in graph_set.graphs] == [10, 9]
        prefill(model, graph_set, cache, ids[0][:, :9])
        assert EagerStandIn.built == 3  # replayed
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        assert torch.equal(prefill(model, graph_set, cache, ids[0]), reference[0])
        assert EagerStandIn.built == 4, "a graph over replaced weights was replayed"
