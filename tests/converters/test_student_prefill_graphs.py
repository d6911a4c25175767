"""Captured prefills of the exported student, on CPU: a prompt padded on the right to its bucket
gives the unpadded prefill's logits and cache (`padded_prefill`, what a captured graph runs), and
the capture policy of graphs_megatron_tc.PrefillGraphs with the CUDA capture replaced by a stand-in
that runs the same padded forward: the second prompt of a bucket over a reused cache is captured,
every later length of the bucket replays it, one-off buckets and fresh caches never are, at most
`keep` buckets are held, and replaced weights make a graph stale; a bucket's first prompt layer by
layer (`LayerGraphs`), one stand-in graph per layer form replayed with each layer's weights.
Replayed graphs on CUDA: tests/gpu/test_student_generate_cuda.py."""
from __future__ import annotations

import pytest
import torch

from megatron_tc.convert.hf_student import MegatronTCCache, MegatronTCConfig, MegatronTCForCausalLM
from megatron_tc.export import graphs_megatron_tc as graphs
from megatron_tc.export.attention_megatron_tc import Batch
from megatron_tc.export.cache_megatron_tc import GDNLayerCache
from tests.converters.helpers import tiny_arch


class EagerStandIn(graphs.PrefillGraph):
    """A PrefillGraph whose "capture" keeps the padded forward and whose replay runs it again."""

    built = 0

    def record(self, forward):
        type(self).built += 1
        logits = forward()

        class Replay:
            def replay(self) -> None:
                logits.copy_(forward())

        return Replay(), logits


class EagerLayerStandIn(graphs.LayerGraph):
    """A LayerGraph whose "capture" keeps the layer's forward and whose replay runs it again."""

    built = 0

    def record(self, forward, pool, stream):
        type(self).built += 1
        out = forward()

        class Replay:
            def replay(self) -> None:
                for buffer, new in zip(out, forward()):
                    buffer.copy_(new)

        return Replay(), out


def model_of(pattern: str = "AGGG", **overrides) -> MegatronTCForCausalLM:
    torch.manual_seed(0)
    model = MegatronTCForCausalLM(MegatronTCConfig.from_arch(tiny_arch(pattern, **overrides))).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mixer, "A_log"):
                layer.mixer.A_log.uniform_(0, 2.7)  # decays that matter over a few tokens
    return model


def eager_prefill(model, cache, ids, keep: int = 1) -> torch.Tensor:
    t = ids.shape[1]
    cache.reset()
    logits = model.model(ids, torch.arange(t).expand(ids.shape), Batch(0, torch.arange(t), None, None, t), cache, keep)
    cache.seen = t
    return logits


def prefill(model, graph_set, cache, ids):
    """What the model's forward does for a prefill: the graph set, else the eager forward."""
    cache.reset()
    logits = graph_set.run(model, cache, ids, 1)
    if logits is None:
        return eager_prefill(model, cache, ids)
    cache.seen = ids.shape[1]
    return logits


def decode(model, cache, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Eager decoding steps after a prefill: logits of each token of tokens [B, N]."""
    out = []
    for i in range(tokens.shape[1]):
        seen = cache.seen
        slot = torch.tensor([seen])
        batch = Batch(seen, slot, None, None, seen + 1)
        out.append(model.model(tokens[:, i:i + 1], slot.expand(tokens.shape[0], 1), batch, cache, 1))
        cache.seen += 1
    return out


@pytest.mark.parametrize("pattern,overrides", [("AGGG", {}), ("AGAG", {"sliding_window": 5})])
def test_a_prompt_padded_on_the_right_prefills_exactly(pattern, overrides):
    """Logits of the last tokens, GDN states, convolution tails and the prompt's keys and values
    equal the unpadded prefill's; decoding on from either cache gives the same logits (the padding's
    keys and values are overwritten before a query can see them)."""
    model = model_of(pattern, **overrides)
    ids = torch.randint(3, 300, (2, 13))
    padded = torch.cat([ids, torch.randint(3, 300, (2, 11))], 1)  # any tokens as padding
    end = torch.tensor([13])
    with torch.no_grad():
        for keep in (1, 3):
            want_cache, got_cache = (MegatronTCCache(model.config, static_len=32) for _ in range(2))
            want = eager_prefill(model, want_cache, ids, keep)
            got = graphs.padded_prefill(model, padded, end, got_cache, keep)
            got_cache.seen = 13
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_cache.layers, want_cache.layers):
            if isinstance(a, GDNLayerCache):
                torch.testing.assert_close(a.state, b.state, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(a.conv["qkv"], b.conv["qkv"], rtol=1e-5, atol=1e-6)
            else:  # (projections of more rows may take another GEMM: equal to fp32 rounding)
                torch.testing.assert_close(a.keys[:, :, :13], b.keys[:, :, :13], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(a.values[:, :, :13], b.values[:, :, :13], rtol=1e-5, atol=1e-6)
        steps = torch.randint(3, 300, (2, 5))
        for g, w in zip(decode(model, got_cache, steps), decode(model, want_cache, steps)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_prefill_bucket():
    assert graphs.prefill_bucket(1, 1024) == 256 and graphs.prefill_bucket(256, 1024) == 256
    assert graphs.prefill_bucket(257, 1024) == 512
    assert graphs.prefill_bucket(300, 400) == 300, "a bucket past the cache's slots: the prompt's own length"


def test_the_second_prompt_of_a_bucket_is_captured_and_serves_every_length(monkeypatch):
    monkeypatch.setattr(graphs, "PrefillGraph", EagerStandIn)
    monkeypatch.setattr(graphs, "LayerGraph", EagerLayerStandIn)
    monkeypatch.setattr(graphs, "PREFILL_BUCKET", 8)
    EagerStandIn.built = 0
    model = model_of()
    graph_set, cache = graphs.PrefillGraphs(keep=2), MegatronTCCache(model.config, static_len=32)
    ids = [torch.randint(3, 300, (2, 12)) for _ in range(3)]

    def reference(x):
        return eager_prefill(model, MegatronTCCache(model.config, static_len=32), x)

    with torch.no_grad():
        out = [prefill(model, graph_set, cache, x) for x in ids]
        assert EagerStandIn.built == 1 and len(graph_set.graphs) == 1  # at the second, replayed at the third
        for got, x in zip(out, ids):
            torch.testing.assert_close(got, reference(x), rtol=1e-5, atol=1e-5)
        fresh = MegatronTCCache(model.config, static_len=32)  # no buffers yet: never captured
        prefill(model, graph_set, fresh, ids[0])
        assert EagerStandIn.built == 1
        longer = torch.cat([ids[0], ids[1]], 1)
        for t in (11, 9, 16):  # lengths never seen, in the captured bucket (9..16): replayed
            got = prefill(model, graph_set, cache, longer[:, :t])
            assert EagerStandIn.built == 1
            torch.testing.assert_close(got, reference(longer[:, :t]), rtol=1e-5, atol=1e-5)
        prefill(model, graph_set, cache, ids[0][:, :5])  # a bucket seen once: eager
        assert EagerStandIn.built == 1
        prefill(model, graph_set, cache, ids[0][:, :3])  # its second prompt: captured
        assert EagerStandIn.built == 2
        for t in (20, 24):  # a third bucket: the least recently used one is dropped
            prefill(model, graph_set, cache, longer[:, :t])
        assert EagerStandIn.built == 3
        assert [key[1] for key in graph_set.graphs] == [8, 24]
        prefill(model, graph_set, cache, ids[0][:, :7])
        assert EagerStandIn.built == 3  # replayed
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        torch.testing.assert_close(prefill(model, graph_set, cache, ids[0]), reference(ids[0]), rtol=1e-5, atol=1e-5)
        assert EagerStandIn.built == 4, "a graph over replaced weights was replayed"


def assert_same_cache(got: MegatronTCCache, want: MegatronTCCache, t: int) -> None:
    for a, b in zip(got.layers, want.layers):
        if isinstance(a, GDNLayerCache):
            torch.testing.assert_close(a.state, b.state, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a.conv["qkv"], b.conv["qkv"], rtol=1e-5, atol=1e-6)
        else:  # (projections of more rows may take another GEMM: equal to fp32 rounding)
            torch.testing.assert_close(a.keys[:, :, :t], b.keys[:, :, :t], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values[:, :, :t], b.values[:, :, :t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern,overrides,shared,single", [
    ("AGGG", {}, 1, 1),
    ("AGAGA", {"sliding_window": 5, "attn_layer_types": ["sliding", "full", "full", "full", "sliding"]}, 2, 1),
])
def test_a_first_prompt_runs_layer_by_layer_from_one_graph_per_form(monkeypatch, pattern, overrides, shared, single):
    """Logits and cache of a prompt no whole-model graph serves (at a prompt shape new to the graphs,
    the first layer of each form eager, the others from their form's graph, each layer's weights
    copied in) equal the eager prefill's, decoding on from it too. A graph is made once per prompt
    shape and form: for the `shared` forms of two or more layers at the shape's first prompt, for
    the `single` forms of one layer at its second; the last `keep` shapes kept; weights edited in
    place are read at the next replay, replaced weights drop the graphs."""
    monkeypatch.setattr(graphs, "PREFILL_BUCKET", 8)
    monkeypatch.setattr(graphs, "LayerGraph", EagerLayerStandIn)
    EagerLayerStandIn.built = 0
    model = model_of(pattern, **overrides)
    graph_set = graphs.PrefillGraphs()

    def check(t: int) -> None:
        ids = torch.randint(3, 300, (2, t))
        got_cache, want_cache = (MegatronTCCache(model.config, static_len=32) for _ in range(2))
        got = prefill(model, graph_set, got_cache, ids)
        torch.testing.assert_close(got, eager_prefill(model, want_cache, ids), rtol=1e-5, atol=1e-5)
        assert_same_cache(got_cache, want_cache, t)
        steps = torch.randint(3, 300, (2, 4))
        for g, w in zip(decode(model, got_cache, steps), decode(model, want_cache, steps)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        for t in (12, 9, 12):  # fresh caches: never a whole-model capture
            check(t)
        assert EagerLayerStandIn.built == 2 * shared + single and not graph_set.graphs
        shapes = graph_set.layers.shapes.items()
        captured = {key[1]: sum(graph is not None for graph in forms.values()) for key, forms in shapes}
        assert captured == {9: shared, 12: shared + single}
        model.model.layers[-1].mlp.up_proj.weight.mul_(3.0)  # edited in place: same addresses
        check(12)
        assert EagerLayerStandIn.built == 2 * shared + single
        check(16)  # a third shape: the least recently used one (9) is dropped
        assert [key[1] for key in graph_set.layers.shapes] == [12, 16]
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        check(16)
        assert EagerLayerStandIn.built == 4 * shared + single, "graphs of replaced weights were kept"


def test_one_layer_template_per_form_serves_every_prompt_shape(monkeypatch):
    """The graphs of a form at every prompt shape capture one template: a copy of a layer of that
    form with parameters of its own (not the model's, which each replay copies in) and no packed
    weights of the layer's; a clear keeps it, replaced weights or a release drop it."""
    monkeypatch.setattr(graphs, "PREFILL_BUCKET", 8)
    monkeypatch.setattr(graphs, "LayerGraph", EagerLayerStandIn)
    model, graph_set = model_of(), graphs.PrefillGraphs()
    layers = graph_set.layers

    def first_prompt(t: int) -> None:
        prefill(model, graph_set, MegatronTCCache(model.config, static_len=32), torch.randint(3, 300, (2, t)))

    with torch.no_grad():
        for t in (12, 9):
            first_prompt(t)
        (form, template), = layers.templates.items()  # the GDN layers' (one attention layer: eager)
        assert [forms[form].layer for forms in layers.shapes.values()] == [template, template]
        gdn = model.model.layers[1]
        assert [p.shape for p in template.parameters()] == [p.shape for p in gdn.parameters()]
        assert not {p.data_ptr() for p in template.parameters()} & {p.data_ptr() for p in model.parameters()}
        assert gdn.mixer.packed_proj.value is not None  # the eager layers' concatenated projections
        assert graphs.layer_template(gdn).mixer.packed_proj.value is None, "a template copied packed weights"
        graph_set.clear()
        first_prompt(12)
        assert layers.templates[form] is template
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        first_prompt(12)
        assert layers.templates[form] is not template, "a template of replaced weights (and buffers) was kept"
        graph_set.release()
        assert layers.templates == {}


def test_a_failed_layer_capture_warns_once_and_prefills_eagerly(monkeypatch):
    class Failing(graphs.LayerGraph):
        def record(self, forward, pool, stream):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "PREFILL_BUCKET", 8)
    monkeypatch.setattr(graphs, "LayerGraph", Failing)
    model, graph_set = model_of(), graphs.PrefillGraphs()
    ids = torch.randint(3, 300, (2, 12))
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="capturing a prefill layer failed"):
        got = prefill(model, graph_set, MegatronTCCache(model.config, static_len=32), ids)
    assert not graph_set.layers.enabled
    with torch.no_grad():
        torch.testing.assert_close(got, eager_prefill(model, MegatronTCCache(model.config, static_len=32), ids))
        assert graph_set.run(model, MegatronTCCache(model.config, static_len=32), ids, 1) is None


def test_a_prefill_of_more_activations_than_the_layer_graph_limit_runs_eagerly(monkeypatch):
    monkeypatch.setattr(graphs, "PREFILL_BUCKET", 8)
    monkeypatch.setattr(graphs, "LayerGraph", EagerLayerStandIn)
    EagerLayerStandIn.built = 0
    model, graph_set = model_of(), graphs.PrefillGraphs()
    hidden = model.config.hidden_size
    monkeypatch.setattr(graphs, "LAYER_GRAPH_ELEMENTS", 2 * 12 * hidden - 1)
    with torch.no_grad():
        ids = torch.randint(3, 300, (2, 12))
        assert graph_set.run(model, MegatronTCCache(model.config, static_len=32), ids, 1) is None
        assert EagerLayerStandIn.built == 0
        ids = torch.randint(3, 300, (2, 11))  # within the limit
        got = graph_set.run(model, MegatronTCCache(model.config, static_len=32), ids, 1)
        torch.testing.assert_close(got, eager_prefill(model, MegatronTCCache(model.config, static_len=32), ids),
                                   rtol=1e-5, atol=1e-5)
        assert EagerLayerStandIn.built == 1  # the GDN layers' form: the one attention layer runs eagerly


def test_a_model_with_accelerate_hooks_on_its_layers_prefills_eagerly(monkeypatch):
    """Layers placed by accelerate (device_map) move their inputs in hooks a layer graph would skip."""
    monkeypatch.setattr(graphs, "LayerGraph", EagerLayerStandIn)
    EagerLayerStandIn.built = 0
    model, graph_set = model_of(), graphs.PrefillGraphs()
    model.model.layers[2].mixer._hf_hook = object()
    ids = torch.randint(3, 300, (2, 12))
    with torch.no_grad():
        assert graph_set.run(model, MegatronTCCache(model.config, static_len=32), ids, 1) is None
    assert EagerLayerStandIn.built == 0
