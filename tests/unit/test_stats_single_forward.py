"""The statistics pass runs the teacher once per batch: sweep 2 reads the layer inputs, outputs and
attention heads sweep 1 kept (consecutive batches merged into one call), and its sums equal those
of a second teacher forward batch by batch up to the fp64 summation order."""
import copy

import pytest
import torch

from megatron_tc.calibrate.stats import collect_stats, layer_io_bytes, readout_closed_forms
from megatron_tc.calibrate.strategies import get_strategy
from tests.parallel._workers_stats import READOUT, row_batches, tiny_teacher_and_rows

LAYERS = [0, 2]


def stats_and_forwards(io_cache_budget):
    model, ids, doc_ids = tiny_teacher_and_rows()
    batches = row_batches(ids, doc_ids, range(4))
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    stats = collect_stats(model, batches, LAYERS, {"teacher_sha256": "t", "seq_len": 24},
                          readout_strategies=[get_strategy(s) for s in READOUT],
                          student_arch=model.arch.with_pattern("GAG"), chunk_size=5, progress=False,
                          io_cache_budget=io_cache_budget)
    return stats, len(forwards), layer_io_bytes(model, batches, LAYERS)


def test_one_teacher_forward_per_batch_and_the_same_sums_as_two():
    cached, cached_forwards, needed = stats_and_forwards(None)
    assert needed == 3 * 4 * 24 * len(LAYERS) * 32 * 4  # x, out, heads: 4 rows x 24 tokens, hidden = H*D = 32, fp32
    twice, twice_forwards, _ = stats_and_forwards(0)  # no room for the cache: sweep 2 runs the teacher again
    assert (cached_forwards, twice_forwards) == (4, 8)
    assert any(key.startswith("readout.") for key in cached.sums)
    assert cached.sums.keys() == twice.sums.keys()
    for key, value in twice.sums.items():  # merged batches: fp64 sums in another order
        scale = value.abs().max().clamp_min(1e-300)
        assert float((cached.sums[key] - value).abs().max() / scale) <= 1e-13, key
    assert cached.meta == twice.meta


def test_the_budget_decides_exactly_at_the_cache_size():
    needed = 3 * 4 * 24 * len(LAYERS) * 32 * 4
    assert stats_and_forwards(needed)[1] == 4
    assert stats_and_forwards(needed - 1)[1] == 8


def test_readout_closed_forms_read_the_teacher_where_it_is():
    """Sweep 2 builds each layer's readout mixer from the teacher's weights on their device (a
    copy to the CPU would wait for the device's queue) and the statistics on the CPU: with the
    teacher on `meta`, any operation mixing the two fails. The mixers have the parameters (names,
    shapes, dtypes) and gate candidates of those built from a CPU teacher (values on `meta` cannot be
    read: the values are what the statistics-pass tests compare)."""
    from megatron_tc.calibrate.stats import collect_attention_stats, readout_mixer
    from megatron_tc.calibrate.strategies import REGISTRY

    model, ids, doc_ids = tiny_teacher_and_rows()
    stats = collect_attention_stats(model, row_batches(ids, doc_ids, range(2)), LAYERS,
                                    {"teacher_sha256": "t", "seq_len": 24}, chunk_size=5, progress=False)
    arch = model.arch.with_pattern("GAG")
    on_meta = model.to("meta")
    cpu_model = tiny_teacher_and_rows()[0]
    closed_forms = [name for name in REGISTRY if get_strategy(name).needs_readout
                    and get_strategy(name).readout_name == name]
    assert {"taylor", "taylor_fit", "taylor_fit-closed", "taylor_fit-bias"} <= set(closed_forms)
    for name in closed_forms:
        for index in LAYERS:
            mixer, candidates = readout_mixer(get_strategy(name), stats, on_meta, arch, index)
            want, want_candidates = readout_mixer(get_strategy(name), stats, cpu_model, arch, index)
            assert all(p.device.type == "meta" for p in mixer.parameters()), name
            assert [c is None or c.device.type == "meta" for c in candidates] == [True] * len(candidates)
            assert len(candidates) == len(want_candidates)
            got = mixer.state_dict()
            for key, value in want.state_dict().items():
                assert got[key].shape == value.shape and got[key].dtype == value.dtype == torch.float32, (name, key)


def test_kept_heads_equal_the_recomputed_attention():
    """Sweep 2 reads the per-head output the forward fed o_proj instead of recomputing the
    attention, sweep 1 the forward's q/k/v: bit for bit the recomputation's, with and without
    packed documents, fp32 and bf16."""
    from megatron_tc.calibrate.capture import capture_layers
    from megatron_tc.calibrate.stats import teacher_heads

    for dtype in (torch.float32, torch.bfloat16):
        model, ids, doc_ids = tiny_teacher_and_rows()
        model.to(dtype)
        for docs in (doc_ids, None):
            kept = {}
            capture_layers(model, ids, docs, LAYERS, lambda index, io: kept.setdefault(index, io), inner=True)
            for index, io in kept.items():
                assert io.heads is not None and io.heads.dtype == dtype
                got = teacher_heads(io.mixer, io.x, io.position_ids, io.doc_ids, io.heads)
                with torch.no_grad():
                    want = teacher_heads(io.mixer, io.x, io.position_ids, io.doc_ids)
                assert got.shape == want.shape == (4, 4, 24, 8)
                assert torch.equal(got, want), (dtype, docs is None, index)
                with torch.no_grad():  # sweep 1 reads the forward's q/k/v: those of projecting again
                    again = io.mixer.project_qkv(io.x, io.position_ids)
                assert all(torch.equal(a, b) for a, b in zip(io.qkv, again, strict=True))
        assert all("project_qkv" not in vars(layer.mixer) for layer in model.layers)  # the hooks are gone
        plain = {}
        capture_layers(model, ids, None, LAYERS, lambda index, io: plain.setdefault(index, io))
        assert all(io.heads is None and io.qkv is None for io in plain.values())  # not asked: not recorded


def test_the_default_init_of_each_layer_is_made_once_for_every_closed_form(monkeypatch):
    from megatron_tc.calibrate import stats as stats_module, sweep_readout

    made, sweep_2 = [], []
    real = sweep_readout.default_gdn_state
    monkeypatch.setattr(sweep_readout, "default_gdn_state", lambda *a, **k: made.append(a[1]) or real(*a, **k))
    real_readout = stats_module.collect_readout_stats
    monkeypatch.setattr(stats_module, "collect_readout_stats",
                        lambda *a, **k: sweep_2.append(list(made)) or real_readout(*a, **k))
    stats_and_forwards(None)
    assert sweep_2 == [[]] and made == LAYERS  # in sweep 2, once a layer whatever the closed forms


def test_sweep_2_reads_the_document_layout_once_and_every_layer_gets_it(monkeypatch):
    """Packed rows: fla's segment layout (a host read) is made once per group of merged rows, not
    per layer, and the recurrence of every closed form runs on it once for both layers (their
    heads stacked)."""
    from megatron_tc.calibrate import readout
    from megatron_tc.model.ops.gated_delta_rule import PackedRows

    made, read = [], []
    real_of, real_rule = PackedRows.of, readout.gated_delta_rule
    monkeypatch.setattr(PackedRows, "of", classmethod(lambda cls, d: made.append(d.shape) or real_of(d)))
    monkeypatch.setattr(readout, "gated_delta_rule",
                        lambda q, *a, **k: read.append((q.shape[2], k["doc_ids"])) or real_rule(q, *a, **k))
    stats_and_forwards(None)
    assert made == [(4, 24)]  # the four one-row batches merged into one group
    closed_forms = len(readout_closed_forms([get_strategy(name) for name in READOUT]))
    assert len(read) == closed_forms and all(heads == len(LAYERS) * 4 for heads, _ in read)
    assert all(isinstance(docs, PackedRows) and docs is read[0][1] for _, docs in read)


def test_readout_groups_are_as_few_as_fit_and_of_equal_size():
    from megatron_tc.calibrate.stats import readout_windows

    layers = list(range(22))
    assert readout_windows(layers, 18) == [layers[:11], layers[11:]]
    assert readout_windows(layers, 22) == [layers] and readout_windows(layers, 100) == [layers]
    assert [len(w) for w in readout_windows(layers, 8)] == [8, 8, 6]
    assert [len(w) for w in readout_windows(layers, 7)] == [6, 6, 6, 4]
    assert readout_windows(layers, 1) == [[i] for i in layers]
    assert readout_windows([3, 5, 9], 2) == [[3, 5], [9]] and readout_windows([], 4) == []
    for per_call in range(1, 30):
        windows = readout_windows(layers, per_call)
        assert sum(windows, []) == layers and max(map(len, windows)) <= per_call
        assert len(windows) == -(-22 // per_call) and len({len(w) for w in windows[:-1]}) <= 1


def test_kept_batches_merge_in_order_up_to_the_token_cap_and_only_when_alike():
    from megatron_tc.calibrate.capture import LayerIO, merge_layer_io

    def io(rows, tokens=6, docs=True, dtype=torch.float32):
        x = torch.randn(rows, tokens, 4, dtype=dtype)
        return LayerIO(x, x, x + 1, torch.arange(tokens)[None], torch.zeros(rows, tokens, dtype=torch.long) if docs
                       else None, MIXER, x * 2)

    MIXER = torch.nn.Linear(1, 1)
    ios = [io(1), io(2), io(1), io(1, docs=False), io(1, docs=False), io(1, tokens=5, docs=False), io(3)]
    merged = merge_layer_io(ios, max_tokens=4 * 6)
    assert [m.x.shape[0] for m in merged] == [4, 2, 1, 3]  # 1+2+1 rows, then the doc-less pair, 5 tokens, 3 rows
    first = merged[0]
    assert torch.equal(first.x, torch.cat([ios[i].x for i in range(3)]))
    assert torch.equal(first.out, torch.cat([ios[i].out for i in range(3)]))
    assert torch.equal(first.heads, torch.cat([ios[i].heads for i in range(3)]))
    assert first.doc_ids.shape == first.position_ids.shape == (4, 6) and first.resid is None
    assert merged[1].doc_ids is None and merged[2] is ios[5] and merged[3] is ios[6]
    assert [m.x.shape[0] for m in merge_layer_io(ios[:3], max_tokens=5)] == [1, 2, 1]  # over the cap: alone
    assert [m.x.shape[0] for m in merge_layer_io([io(1), io(1, dtype=torch.bfloat16)], 100)] == [1, 1]


def test_packed_copies_give_back_every_tensor_and_a_reused_mixer_equals_a_new_one(monkeypatch):
    from megatron_tc.calibrate import readout_mixers
    from megatron_tc.calibrate.readout_mixers import shell_like
    from megatron_tc.calibrate.stats import collect_attention_stats, pack_to, readout_mixer

    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.randn(2, 1, 3), "d": torch.randn(()),
               "e": torch.randn(4, 2).t()}  # e: not contiguous
    moved = pack_to(tensors, torch.device("cpu"), non_blocking=False)
    assert moved.keys() == tensors.keys()
    for key, value in tensors.items():
        assert moved[key].shape == value.shape and moved[key].dtype == value.dtype and torch.equal(moved[key], value)
    assert moved["a"].untyped_storage().data_ptr() == moved["c"].untyped_storage().data_ptr()  # one fp32 buffer

    model, ids, doc_ids = tiny_teacher_and_rows()
    stats = collect_attention_stats(model, row_batches(ids, doc_ids, range(2)), LAYERS,
                                    {"teacher_sha256": "t", "seq_len": 24}, chunk_size=5, progress=False)
    arch = model.arch.with_pattern("GAG")
    packed = lambda tensors, device: pack_to(tensors, device, non_blocking=False)  # noqa: E731 (the GPU's packing, on the CPU)
    for name in ("taylor", "taylor_fit-closed"):
        fresh, want = readout_mixer(get_strategy(name), stats, model, arch, LAYERS[1])
        monkeypatch.setattr(readout_mixers, "to_device_all", packed)
        shell, _ = readout_mixer(get_strategy(name), stats, model, arch, LAYERS[0])
        before = {k: v.clone() for k, v in shell.state_dict().items() if not v.is_meta}
        copied, got_copied = readout_mixer(get_strategy(name), stats, model, arch, LAYERS[1], into=shell_like(shell))
        assert all(torch.equal(shell.state_dict()[k], v) for k, v in before.items())  # the template is untouched
        reused, got = readout_mixer(get_strategy(name), stats, model, arch, LAYERS[1], into=shell)
        monkeypatch.undo()
        assert copied is not shell and all(a is not b for a, b in zip(copied.modules(), shell.modules()))
        for key, value in copied.state_dict().items():
            assert value.is_meta or torch.equal(value, reused.state_dict()[key]), (name, key)
        assert [c is None or torch.equal(c, w) for c, w in zip(got_copied, got)] == [True] * len(got)
        assert reused is shell and reused.layer_idx == fresh.layer_idx == LAYERS[1]
        assert reused.state_dict().keys() == fresh.state_dict().keys()
        for key, value in fresh.state_dict().items():
            if value.is_meta:  # the output gate the closed form leaves to finish: a placeholder in both
                assert key == "g_proj.weight" and reused.state_dict()[key].is_meta, (name, key)
            else:
                assert torch.equal(reused.state_dict()[key], value), (name, key)
        assert [c is None or torch.equal(c, w) for c, w in zip(got, want)] == [True] * len(want)


def test_finished_sums_come_to_the_cpu_exactly_in_one_buffer_per_dtype(tmp_path):
    from megatron_tc.calibrate.stats import _to_cpu
    from megatron_tc.calibrate.statsfile import TaylorStats

    g = torch.Generator().manual_seed(0)
    sums = {"layers.0.count": torch.tensor(7.0, dtype=torch.float64), "layers.0.k_sq": torch.randn(2, 3, 3, generator=g,
            dtype=torch.float64), "layers.1.y_sum": torch.randn(4, 5, generator=g, dtype=torch.float64),
            "readout.x.idx": torch.arange(6, dtype=torch.int64).view(2, 3), "readout.x.w": torch.randn(3, generator=g)}
    expected = {k: v.clone() for k, v in sums.items()}
    out = _to_cpu(TaylorStats({}, dict(sums))).sums
    assert list(out) == list(expected)
    for key, value in expected.items():
        assert out[key].dtype == value.dtype and out[key].shape == value.shape and out[key].device.type == "cpu"
        assert torch.equal(out[key], value), key
        assert out[key].untyped_storage().data_ptr() != sums[key].untyped_storage().data_ptr(), key  # a copy
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in out.values()}
    assert len(storages) == 3 and sum(storages.values()) == sum(v.numel() * v.element_size() for v in out.values())
    out["layers.0.k_sq"].zero_()  # a sum changed in place leaves its neighbours in the buffer alone
    assert torch.equal(out["layers.1.y_sum"], expected["layers.1.y_sum"])
    TaylorStats({"layers": [0, 1]}, out).save(tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)["sums"]
    assert all(torch.equal(loaded[k], out[k]) for k in out)


@pytest.mark.parametrize("io_cache_budget", [None, 0])
def test_nothing_of_the_pass_outlives_it_without_a_garbage_collection(io_cache_budget):
    """The kept layer I/O (up to a quarter of a GPU), the sweeps and their readout mixers are freed
    when the pass returns, by reference counting alone: no reference cycle keeps them until Python's
    next full collection (the stage after the pass would run with them still on the device)."""
    import gc

    from megatron_tc.calibrate.capture import LayerIO
    from megatron_tc.calibrate.sweep_attention import AttentionSweep
    from megatron_tc.calibrate.sweep_readout import ReadoutSweep

    def alive() -> list[str]:  # by exact type: isinstance would read __class__ of every object there is
        return [type(o).__name__ for o in gc.get_objects() if type(o) in (LayerIO, AttentionSweep, ReadoutSweep)]

    gc.collect()
    assert alive() == []
    gc.disable()
    try:
        stats_and_forwards(io_cache_budget)
        left = alive()
    finally:
        gc.enable()
    assert left == []


def test_a_bf16_teachers_copied_projections_stay_bf16_and_sum_as_in_fp32():
    """The q/k/v weights a closed form copies from a bf16 teacher keep that dtype in the readout
    mixer (exact there; on CUDA they multiply as bf16 with fp32 output), the rest is fp32; on the
    CPU the sums are bit for bit those of the mixer with every weight in fp32."""
    from megatron_tc.calibrate.readout import WideLinear, layers_readout_sums, wide_linear
    from megatron_tc.calibrate.stats import collect_attention_stats, readout_mixer

    model, ids, doc_ids = tiny_teacher_and_rows()
    model.to(torch.bfloat16)
    keep = []
    stats = collect_attention_stats(model, row_batches(ids, doc_ids, range(2)), LAYERS,
                                    {"teacher_sha256": "t", "seq_len": 24}, chunk_size=5, progress=False, keep_io=keep)
    arch = model.arch.with_pattern("GAG")
    for name in ("taylor", "taylor_fit-closed"):
        mixer, candidates = readout_mixer(get_strategy(name), stats, model, arch, LAYERS[0])
        narrow = {key for key, value in mixer.state_dict().items() if value.dtype == torch.bfloat16}
        assert narrow == {"q_proj.weight", "k_proj.weight", "v_proj.weight"}, name
        assert all(isinstance(getattr(mixer, p), WideLinear) for p in ("q_proj", "k_proj", "v_proj"))
        wide = copy.deepcopy(mixer)  # the same values, every weight in fp32
        for p in ("q_proj", "k_proj", "v_proj"):
            getattr(wide, p).weight.data = getattr(wide, p).weight.data.float()
        io = keep[0][LAYERS[0]]
        y = io.heads.view(*io.x.shape[:2], -1, arch.head_dim).transpose(1, 2)
        o_weight = io.mixer.o_proj.weight
        got, want = (layers_readout_sums([m], [candidates], [io.x], [y], [io.out], [o_weight], io.doc_ids)[0]
                     for m in (mixer, wide))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[key], want[key]) for key in want), name
    x, w = torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(4, 5, dtype=torch.bfloat16)
    assert wide_linear(x, w).dtype == torch.float32
    assert torch.equal(wide_linear(x, w, torch.ones(4)), x.float() @ w.float().t() + 1)


def test_assigned_parameters_are_those_load_state_dict_assigns_and_bad_names_are_errors():
    from megatron_tc.calibrate.readout_mixers import assign_parameters
    from megatron_tc.model.gdn import GatedDeltaNet

    arch = tiny_teacher_and_rows()[0].arch.with_pattern("GAG")
    source = GatedDeltaNet(arch, 1)
    tensors = {k: v.detach().clone() for k, v in source.state_dict().items()}
    got, want = GatedDeltaNet(arch, 1, init=False), GatedDeltaNet(arch, 1, init=False)
    want.load_state_dict(tensors, assign=True)
    assign_parameters(got, tensors, {"q_proj.weight": torch.bfloat16})
    assert got.state_dict().keys() == want.state_dict().keys()
    for key, value in want.state_dict().items():
        if key == "q_proj.weight":
            assert got.q_proj.weight.dtype == torch.bfloat16 and torch.equal(got.q_proj.weight, value.bfloat16())
        else:
            mine = got.state_dict()[key]
            assert torch.equal(mine, value) and mine.data_ptr() == tensors[key].data_ptr(), key  # no copy
    assert isinstance(got.q_proj.weight, torch.nn.Parameter)
    assign_parameters(got, tensors)  # again, into the same module (the pass reuses one per closed form)
    assert got.q_proj.weight.dtype == torch.float32
    with pytest.raises(KeyError, match=r"missing \['A_log'\]"):
        assign_parameters(got, {k: v for k, v in tensors.items() if k != "A_log"})
    with pytest.raises(KeyError, match=r"unexpected \['extra'\]"):
        assign_parameters(got, tensors | {"extra": torch.zeros(1)})
