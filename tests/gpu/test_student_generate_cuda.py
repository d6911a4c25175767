"""Exported-student generation on CUDA: the captured decoding step over a static cache gives the
eager model's tokens and logits; fla's kernels agree with the PyTorch path."""
from __future__ import annotations

import warnings

import pytest
import torch

from megatron_tc.convert.hf_student import MegatronTCConfig, MegatronTCForCausalLM
from megatron_tc.model import ArchConfig

pytestmark = pytest.mark.gpu


def student(dtype: torch.dtype) -> MegatronTCForCausalLM:
    torch.manual_seed(0)
    arch = ArchConfig(family="llama", vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=32, intermediate_size=256, layer_pattern="AGGG", gdn_conv_size=4)
    with torch.device("cuda"):
        model = MegatronTCForCausalLM(MegatronTCConfig.from_arch(arch)).to(dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mixer, "A_log"):
                layer.mixer.A_log.uniform_(0, 2.7)
    return model


def test_captured_decoding_equals_eager_left_padded_fp32():
    model = student(torch.float32)
    ids = torch.randint(3, 512, (3, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7], mask[2, :13] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    graph = model.generate(ids, cache_implementation="static", **kw)
    assert model._graph is not None and model.decode_graphs, "the decoding step was not captured"
    _assert_equals_eager(model, ids, kw, graph)


def test_decoding_step_is_captured_in_bf16():
    """bf16 takes other SDPA kernels than fp32 (cuDNN's is excluded: its planning cannot be captured)."""
    model = student(torch.bfloat16)
    model.prefill_graph_tokens = 0  # both prefills eager: a replayed one equals it only to bf16 rounding
    ids = torch.randint(3, 512, (2, 40), device="cuda")
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0, cache_implementation="static")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns and decodes eagerly
        graph = model.generate(ids, **kw)
    assert model._graph is not None
    model.decode_graphs = False
    assert torch.equal(graph, model.generate(ids, **kw))


def test_reused_capture_equals_eager_fp32():
    """A second generate of the same size reuses the static cache and the captured step; both give
    the tokens and logits of PyTorch's GDN ops without capture."""
    model = student(torch.float32)
    ids = torch.randint(3, 512, (2, 100), device="cuda")  # > 64 tokens: the chunked kernel
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    first = model.generate(ids, cache_implementation="static", **kw)
    graph = model._graph
    second = model.generate(ids, cache_implementation="static", **kw)
    assert graph is not None and model._graph is graph, "the second generate captured its step again"
    assert torch.equal(first.sequences, second.sequences)
    _assert_equals_eager(model, ids, kw, first)


def _assert_equals_eager(model, ids, kw, captured) -> None:
    """`captured` (a generate output with logits) gives the tokens of PyTorch's GDN ops decoding
    eagerly, and logits within 1e-3 of theirs."""
    model.set_gdn_backend("chunk")
    model.decode_graphs = False
    eager = model.generate(ids, cache_implementation="dynamic", **kw)
    assert torch.equal(captured.sequences, eager.sequences)
    diff = (torch.stack(captured.logits) - torch.stack(eager.logits)).abs().max().item()
    assert diff <= 1e-3, f"captured decoding (fla) vs eager (PyTorch) logits differ by {diff}"


def test_a_prefill_bucket_is_captured_and_serves_new_lengths_fp32():
    """The second generate of a prompt bucket captures its prefill; later prompts of the bucket
    replay it, lengths never seen included (padded on the right); tokens and logits equal an eager
    prefill's."""
    model = student(torch.float32)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True, cache_implementation="static")
    prompts = [torch.randint(3, 512, (2, 100), device="cuda") for _ in range(3)]
    prompts += [torch.randint(3, 512, (2, 77), device="cuda"), torch.randint(3, 512, (2, 200), device="cuda")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns and prefills eagerly
        outs = [model.generate(p, **kw) for p in prompts]
    assert len(model._prefills.graphs) == 1, "the repeated bucket was not captured, or a new length captured again"
    model.prefill_graph_tokens = 0
    for prompt, captured in zip(prompts, outs):
        eager = model.generate(prompt, **kw)
        assert torch.equal(captured.sequences, eager.sequences)
        diff = (torch.stack(captured.logits) - torch.stack(eager.logits)).abs().max().item()
        assert diff <= 1e-4, f"replayed vs eager prefill logits differ by {diff}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_first_prompt_from_layer_graphs_equals_the_eager_prefill(dtype):
    """The first prompt of each bucket runs layer by layer (`LayerGraphs`): the first layer of each
    form eagerly, the others from one captured graph per form (here the GDN layers'; the one
    attention layer stays eager), with the eager forward's kernels: the same tokens and logits as
    an eager prefill, bit for bit."""
    model = student(dtype)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True, cache_implementation="static")
    prompts = [torch.randint(3, 512, (2, n), device="cuda") for n in (100, 300, 530)]  # three buckets
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns and prefills eagerly
        outs = [model.generate(p, **kw) for p in prompts]
    layers = model._prefills.layers
    assert layers.enabled and not model._prefills.graphs
    # a generate with a longer static cache drops the graphs of the shorter one (the last prompt's stay)
    captured = [[graph is not None for graph in forms.values()] for forms in layers.shapes.values()]
    assert captured == [[False, True]], "a graph for the GDN layers' form, none for the single attention layer's"
    model.prefill_graph_tokens = 0
    for prompt, first in zip(prompts, outs):
        eager = model.generate(prompt, **kw)
        assert torch.equal(first.sequences, eager.sequences)
        diff = (torch.stack(first.logits) - torch.stack(eager.logits)).abs().max().item()
        assert diff == 0, f"layer-graph vs eager prefill logits differ by {diff:.3g}"


def test_graphs_captured_again_after_a_clear_take_their_pools_memory():
    """Dropping the prefill graphs keeps their memory pools and capture streams: a bucket's first
    prompt (layer graphs) and its second (the whole-model capture) after a clear allocate nothing
    from the driver, and give the logits they gave before; `release_graphs` returns that memory."""
    model = student(torch.float32)
    kw = dict(max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True, cache_implementation="static")
    prompt = torch.randint(3, 512, (2, 300), device="cuda")

    def first_and_second():
        first = model.generate(prompt, **kw)
        assert any(g is not None for forms in model._prefills.layers.shapes.values() for g in forms.values())
        second = model.generate(prompt, **kw)
        assert model._prefills.graphs, "the bucket's second prompt captures the whole model"
        return [torch.stack(out.logits) for out in (first, second)]

    before = first_and_second()
    model._prefills.clear()
    model._prefills.counts.clear()  # the bucket as if never seen: layer graphs again, then a whole-model capture
    segments = torch.cuda.memory_stats()["segment.all.allocated"]  # cudaMalloc calls so far
    after = first_and_second()
    assert torch.cuda.memory_stats()["segment.all.allocated"] == segments
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    model.release_graphs()  # the graphs and their pools go: their memory back to the driver
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() < reserved
    again = model.generate(prompt, **kw)
    assert torch.equal(torch.stack(again.logits), before[0])


def test_replayed_prefill_in_bf16_gives_the_eager_logits():
    """bf16: the replayed bucket (fla's fused small kernels inside the graph, PyTorch's eagerly)
    gives the eager prefill's last-token logits within bf16 rounding."""
    model = student(torch.bfloat16)
    # two new tokens: a decoding step is captured, and with it the static cache is reused
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation="static", output_logits=True,
              return_dict_in_generate=True)
    prompts = [torch.randint(3, 512, (1, n), device="cuda") for n in (300, 301, 317, 400)]  # one cache size
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        outs = [model.generate(p, **kw).logits[0] for p in prompts]
    assert len(model._prefills.graphs) == 1
    model.prefill_graph_tokens = 0
    for prompt, captured in zip(prompts, outs):
        eager = model.generate(prompt, **kw).logits[0]
        diff = (captured - eager).abs().max().item() / eager.abs().max().item()
        assert diff <= 3e-2, f"replayed vs eager bf16 prefill logits differ by {diff:.3g} of their largest"


def test_causal_prefill_takes_the_flash_kernel_not_cudnn():
    """cuDNN plans every new sequence length (tens of milliseconds): a prompt's causal attention must
    not reach it. Logits equal the math kernel's within bf16 rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    model = student(torch.bfloat16)
    ids = torch.randint(3, 512, (1, 300), device="cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = model(ids).logits
    ops = {e.key for e in prof.key_averages()}
    assert not any("cudnn_attention" in op for op in ops), sorted(op for op in ops if "attention" in op)
    assert any("flash_attention" in op for op in ops), sorted(op for op in ops if "attention" in op)
    import megatron_tc.export.attention_megatron_tc as attention

    saved = attention.CAUSAL_SDPA_BACKENDS
    attention.CAUSAL_SDPA_BACKENDS = [SDPBackend.MATH]
    try:
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            reference = model(ids).logits
    finally:
        attention.CAUSAL_SDPA_BACKENDS = saved
    torch.testing.assert_close(logits.float(), reference.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunk_forward_without_the_autograd_function_equals_fla_chunk(dtype):
    """An inference prefill calls fla's chunk forward without its autograd Function: output and
    final state equal fla's public `chunk_gated_delta_rule` (the same kernels, so exactly), from an
    initial state, with q / k / v as the layer gives them."""
    import warnings

    import megatron_tc.export.gated_delta_megatron_tc as gated_delta

    kernels = gated_delta.fla_kernels()
    assert "l2norm" in kernels and "chunk_forward" in kernels
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, t, h, d = 2, 300, 3, 64
    q, k, v = (torch.randn(3, b, t, h, d, device="cuda", generator=gen).to(dtype)).unbind(0)
    a, beta = torch.randn(b, t, h, device="cuda", generator=gen).to(dtype), torch.rand(b, t, h, device="cuda")
    a_log, dt_bias = torch.rand(h, device="cuda") * 2.7, -2 - 2 * torch.rand(h, device="cuda")
    state = torch.randn(b, h, d, d, device="cuda", generator=gen) * 0.1
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # the forward-only path must not fall back
        o, final = gated_delta.chunk_forward_only(kernels, q, k, v, a, beta, a_log, dt_bias, d**-0.5, state)
        o_ref, final_ref = kernels["chunk"](q=q, k=k, v=v, g=a, beta=beta, scale=d**-0.5, initial_state=state,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
    assert o.dtype == o_ref.dtype == dtype and final.dtype == final_ref.dtype
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(final, final_ref, rtol=0, atol=0)


@pytest.mark.parametrize("length", [40, 300])  # fla's fused recurrent kernel, then its chunked one
def test_eager_prefill_with_the_gates_in_fla_kernels_fp32(monkeypatch, length):
    """An eager prefill hands fla the raw a_proj / b_proj outputs (the decay computed inside its
    kernel): the logits and the cache's states equal those of the gates computed in PyTorch, within
    the 1e-3 of the other fla-against-PyTorch tests (fla's chunked kernel multiplies in TF32, whose
    roundings a change of the decay's last bits moves)."""
    import megatron_tc.export.gated_delta_megatron_tc as gated_delta
    from megatron_tc.export.cache_megatron_tc import MegatronTCCache

    model = student(torch.float32)
    ids = torch.randint(3, 512, (2, length), device="cuda")
    called = []
    real = gated_delta.fused_chunk_rule
    monkeypatch.setattr("megatron_tc.export.layers_megatron_tc.fused_chunk_rule",
                        lambda *a: called.append(1) or real(*a))
    out = {}
    for fused in (True, False):
        monkeypatch.setitem(gated_delta._FUSED, "ok", fused)
        cache = MegatronTCCache(model.config)
        with torch.no_grad():
            logits = model(ids, cache=cache, use_cache=True).logits
        out[fused] = logits, [layer.state for layer in cache.layers if hasattr(layer, "state")]
    assert len(called) == 6  # three GDN layers, twice (the second time the unfused path takes over)
    assert (out[True][0] - out[False][0]).abs().max().item() <= 1e-3
    for fused_state, state in zip(out[True][1], out[False][1]):
        assert (fused_state - state).abs().max().item() <= 1e-3
