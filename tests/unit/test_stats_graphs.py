"""Per-layer replays of the statistics pass (`calibrate.graphs`): which calls capture, and that
sums computed from the static copies the replays read equal the eager pass's bit for bit.

CUDA graphs themselves need a GPU (tests/gpu/test_stats_graphs_cuda.py); here `_Captured.record`
and `replay` are replaced by a recording that runs the function on the static copies at replay
time, so everything else (signatures, copies of weights and inputs, the sweeps' use of the
outputs) runs as on a GPU."""
import pytest
import torch

from megatron_tc.calibrate import graphs
from megatron_tc.calibrate.stats import collect_stats
from megatron_tc.calibrate.strategies import get_strategy
from megatron_tc.model import ArchConfig, HybridLM
from megatron_tc.model.attention import Attention

CAPTURES = []


class Replayed(graphs._Captured):
    def record(self, fn, spec, pool):
        CAPTURES.append(spec)
        self.fn, self.spec = fn, spec

    def replay(self):
        with torch.no_grad():
            return self.fn(self.modules, self.inputs, self.spec)


@pytest.fixture
def fake_graphs(monkeypatch):
    CAPTURES.clear()
    monkeypatch.setenv(graphs.GRAPHS_ENV, "1")
    monkeypatch.setattr(graphs, "_capturable", lambda tensors: True)
    monkeypatch.setattr(graphs, "_Captured", Replayed)
    monkeypatch.setattr(graphs.torch.cuda, "graph_pool_handle", lambda: None)
    return CAPTURES


def teacher(sliding_window=None, num_layers=4):
    arch = ArchConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=num_layers, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=48, padded_vocab_size=128,
                      sliding_window=sliding_window)
    torch.manual_seed(3)
    return HybridLM(arch).double().eval()


def stats(model, rows, doc_ids=None):
    torch.manual_seed(5)
    ids = torch.randint(0, 97, (rows, 2, 20))
    batches = [{"input_ids": b} | ({} if doc_ids is None else {"doc_ids": doc_ids}) for b in ids]
    return collect_stats(model, batches, [0, 1, 3], {"teacher_sha256": "t", "seq_len": 20},
                         readout_strategies=[get_strategy(s) for s in ("taylor", "taylor_fit-closed")],
                         student_arch=model.arch.with_pattern("GGAG"), chunk_size=6, progress=False)


@pytest.mark.parametrize("kept", [True, False])
def test_replayed_sums_equal_eager_ones_bit_for_bit(fake_graphs, monkeypatch, kept):
    """Three batches, three layers: the first call of each sweep runs eagerly, the second captures,
    the other layers and batches replay with their own weights and inputs copied in (fp64 teacher)."""
    model = teacher()
    if not kept:
        monkeypatch.setattr("megatron_tc.calibrate.stats.default_io_cache_budget", lambda device: 0)
    replayed = stats(model, 3)
    # one signature per sweep: every layer shares it; reading the kept layers, sweep 2 is one call
    # (the batches merged, the layers stacked): seen once, never captured
    assert len(fake_graphs) == (1 if kept else 2)
    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    fake_graphs.clear()
    eager = stats(model, 3)
    assert fake_graphs == []
    assert replayed.sums.keys() == eager.sums.keys() and any(k.startswith("readout.") for k in eager.sums)
    for key, value in eager.sums.items():
        assert torch.equal(replayed.sums[key], value), key


def test_documents_run_eagerly(fake_graphs):
    stats(teacher(), 3, doc_ids=torch.tensor([[0] * 8 + [1] * 12] * 2))
    assert fake_graphs == []


def test_a_signature_is_captured_on_its_second_call_and_layers_share_it(fake_graphs):
    calls = []

    def fn(modules, tensors, spec):
        calls.append(spec)
        return {"s": modules[0].q_proj.weight.sum() * tensors[0].sum()}

    arch = teacher().arch
    layers = [Attention(arch, i).double() for i in range(3)]
    run = graphs.LayerGraphs(fn, enabled=True)
    x = torch.ones(2, 3, dtype=torch.float64)
    for i, layer in enumerate(layers):
        want = (layer.q_proj.weight.sum() * x.sum()).item()
        assert run([layer], [x * (i + 1)], "a")["s"].item() == pytest.approx(want * (i + 1))
    assert calls == ["a"] * 3 and fake_graphs == ["a"]  # eager, capture, then a replay
    run([layers[0]], [torch.ones(5, 3, dtype=torch.float64)], "a")  # a new shape: eager first
    run([layers[0]], [x], "b")  # a new spec too
    assert fake_graphs == ["a"]
    sliding = Attention(teacher(sliding_window=4).arch, 0).double()
    run([sliding], [x], "a")  # another configuration: its own signature
    assert fake_graphs == ["a"]


def test_the_switch(monkeypatch):
    monkeypatch.delenv(graphs.GRAPHS_ENV, raising=False)
    assert not graphs.LayerGraphs(lambda m, t, s: {}).enabled  # eager unless asked
    monkeypatch.setenv(graphs.GRAPHS_ENV, "2")
    with pytest.raises(ValueError, match="MEGATRON_TC_STATS_GRAPHS"):
        graphs.LayerGraphs(lambda m, t, s: {})
    monkeypatch.setenv(graphs.GRAPHS_ENV, "1")
    assert graphs.LayerGraphs(lambda m, t, s: {}).enabled


@pytest.mark.parametrize("per_call", [1, 2])
def test_readout_layers_in_calls_of_any_size_give_the_same_sums(monkeypatch, per_call):
    """Sweep 2 over kept layers: three layers in one stacked call (the default here), in calls of
    two and one (the readout mixers of one call reused by the next): the same sums up to the fp64
    summation order."""
    from megatron_tc.calibrate import stats as stats_module, sweep_readout

    model = teacher()
    together = stats(model, 3)
    sizes = []
    real = sweep_readout.layers_readout_sums
    monkeypatch.setattr(sweep_readout, "layers_readout_sums", lambda mixers, *a: sizes.append(len(mixers)) or real(mixers, *a))
    monkeypatch.setattr(stats_module, "readout_stacked_layers", lambda tokens, per_token: per_call)
    apart = stats(model, 3)
    assert sizes == {1: [1] * 6, 2: [2, 2, 1, 1]}[per_call]  # two closed forms per call
    assert apart.sums.keys() == together.sums.keys()
    for key, value in together.sums.items():
        scale = value.abs().max().clamp_min(1e-300)
        assert float((apart.sums[key] - value).abs().max() / scale) <= 1e-12, key


def test_readout_layers_per_call_fit_the_temporaries():
    from megatron_tc.calibrate.stats import READOUT_GROUP_BYTES, readout_stacked_layers

    per_token = 4096
    tokens = READOUT_GROUP_BYTES // (3 * per_token)  # three layers' temporaries fit
    assert readout_stacked_layers(tokens, per_token) == 3
    assert readout_stacked_layers(tokens + 1, per_token) == 2
    assert readout_stacked_layers(10 * tokens, per_token) == 1  # never none
