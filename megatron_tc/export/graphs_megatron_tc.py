"""CUDA graphs of an exported student over a static cache (torch only): the decoding step, the
prefill of a bucket of prompt lengths that repeats, and the first prefill of a bucket layer by layer.

A forward of a small model over a few thousand tokens is host-bound: launching its kernels (fla's
Triton kernels above all) takes several times the GPU's work. A captured graph replays every
kernel with one launch. Both graphs read and write the cache's buffers in place, so they are
valid while the cache keeps its addresses (generate reuses a static cache of the same size).
"""
from __future__ import annotations

import copy
import itertools
import warnings
from collections import OrderedDict

import torch
from torch import nn

from .attention_megatron_tc import Attention, Batch, Packed
from .cache_megatron_tc import AttentionLayerCache, GDNLayerCache, MegatronTCCache
from .gated_delta_megatron_tc import graph_work


def cache_pointers(cache: MegatronTCCache) -> list[int]:
    return [x.data_ptr() for layer in cache.layers for x in layer.tensors().values()]


def weight_pointers(model) -> tuple[int, ...]:
    """Addresses of the model's parameters and buffers: a graph reads them where they were when it
    was captured, so one replaced (moved, cast, loaded with assign=True) makes it stale."""
    return tuple(x.data_ptr() for x in itertools.chain(model.parameters(), model.buffers()))


def capture(graph: torch.cuda.CUDAGraph, run, pool=None, stream: torch.cuda.Stream | None = None,
            warm_up: bool = True):
    """`run()` once on a side stream (kernels compiled and autotuned, buffers allocated outside the
    capture), then captured into `graph`; returns what the captured call returned (its buffers).
    capture_begin/end rather than torch.cuda.graph(), which empties PyTorch's CUDA memory cache
    first: the next prefill would then allocate all of its memory from the driver. stream: the side
    stream (default a new one); warm_up=False: the caller has just run the same kernels on the same
    shapes on that stream, so the capture needs no run of its own."""
    stream = torch.cuda.Stream() if stream is None else stream
    stream.wait_stream(torch.cuda.current_stream())
    if warm_up:
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            out = run()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return out


class DecodeGraph:
    """One decoding step (B rows, one token each) over a static cache, captured in a CUDA graph.

    Inputs are copied into fixed buffers (token, position, cache slot, key mask) before each
    replay; the attention layers attend over every slot of the static buffers, hidden by the mask
    where a slot is in the future or padding. What the layers share within a step (RoPE tables, the
    attention bias) is computed inside the graph, from those buffers, once per replay."""

    def __init__(self, model, cache: MegatronTCCache, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None) -> None:
        device, b = input_ids.device, input_ids.shape[0]
        self.cache, self.pointers, self.weights = cache, cache_pointers(cache), weight_pointers(model)
        self.ids = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.slots = torch.zeros(1, dtype=torch.long, device=device)
        self.key_valid = torch.zeros(b, cache.static_len, dtype=torch.bool, device=device)
        self.stage(input_ids, attention_mask, cache.seen)

        def step() -> torch.Tensor:  # a fresh Batch (its memo empty) for the warm-up and for the capture
            return model.model(self.ids, self.positions, Batch(cache.seen, self.slots, None, self.key_valid, None),
                               cache)

        states = [x for layer in cache.layers if isinstance(layer, GDNLayerCache) for x in layer.tensors().values()]
        saved = [x.clone() for x in states]
        try:
            self.graph = torch.cuda.CUDAGraph()
            self.logits = capture(self.graph, step)
        finally:  # the warm-up advanced the GDN states (a failed one maybe some): put them back
            torch.cuda.synchronize()
            for x, before in zip(states, saved):
                x.copy_(before)

    def fits(self, cache: MegatronTCCache, input_ids: torch.Tensor) -> bool:
        return (cache is self.cache and input_ids.shape[0] == self.ids.shape[0]
                and cache_pointers(cache) == self.pointers)

    def stage(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, seen: int) -> None:
        self.ids.copy_(input_ids)
        self.slots.fill_(seen)
        self.key_valid[:, seen + 1:] = False
        if attention_mask is None:
            self.key_valid[:, : seen + 1] = True
            self.positions.fill_(seen)
        else:
            self.key_valid[:, : seen + 1] = attention_mask.bool()
            self.positions.copy_(attention_mask.long().sum(-1, keepdim=True) - 1)

    def replay(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, seen: int) -> torch.Tensor:
        self.stage(input_ids, attention_mask, seen)
        self.graph.replay()
        return self.logits.clone()


# a captured prefill serves every prompt length up to a multiple of this many tokens: a prompt is
# padded on the right to its bucket (exactly: see `padded_prefill`)
PREFILL_BUCKET = 256


def prefill_bucket(length: int, static_len: int) -> int:
    """The padded length a prompt of `length` tokens is prefilled at: the next multiple of
    PREFILL_BUCKET, within the cache's `static_len` slots (past it: the prompt's own length)."""
    bucket = -(-length // PREFILL_BUCKET) * PREFILL_BUCKET
    return bucket if bucket <= static_len else length


def padded_prefill(model, ids: torch.Tensor, end: torch.Tensor, cache: MegatronTCCache,
                   logits_to_keep: int) -> torch.Tensor:
    """The prefill of ids [B, T'] into an empty cache where only the first `end` ([1] long on the
    device) tokens are the prompt and the rest is padding: logits of the last `logits_to_keep`
    prompt tokens. Exact: the padding comes after the prompt, so causal attention and the causal
    convolutions of the prompt never see it; it passes the GDN states unchanged (decay 1, no
    write); the cache keeps the convolution inputs before `end`; the keys and values it writes past
    `end` lie in slots a decoding step overwrites before any query can see them."""
    b, t = ids.shape
    slots = torch.arange(t, device=ids.device)
    valid = (slots < end).expand(b, t)
    return model.model(ids, slots.expand(b, t), Batch(0, slots, valid, None, t, end=end), cache, logits_to_keep)


class PrefillGraph:
    """The prefill of B unpadded prompts of up to T' tokens (a bucket) into an empty static cache,
    captured: each prompt is copied into a fixed buffer of T' tokens and its length into another, the
    graph writes the cache (keys and values, the GDN states and convolution tails) and the last
    `logits_to_keep` logits of the prompt (`padded_prefill`). A prefill starts from an empty cache and
    overwrites what it stores, so the warm-up changes nothing."""

    def __init__(self, model, cache: MegatronTCCache, batch: int, bucket: int, logits_to_keep: int, memory,
                 device: torch.device) -> None:
        self.cache, self.bucket = cache, bucket
        self.ids = torch.zeros(batch, bucket, dtype=torch.long, device=device)
        self.end = torch.full((1,), bucket, dtype=torch.long, device=device)

        def forward() -> torch.Tensor:
            return padded_prefill(model, self.ids, self.end, cache, logits_to_keep)

        self.memory = memory  # memory() gives the MemoryPool shared with the other prefills
        self.graph, self.logits = self.record(forward)
        self.pointers, self.weights = cache_pointers(cache), weight_pointers(model)

    def record(self, forward) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(graph, the logits buffer it writes): `forward` warmed up and captured on the stream
        and in the memory pool shared with the other prefills."""
        memory, graph = self.memory(), torch.cuda.CUDAGraph()
        with graph_work():
            return graph, capture(graph, forward, memory.id, memory.stream)

    def fits(self, model, cache: MegatronTCCache, input_ids: torch.Tensor) -> bool:
        return (cache is self.cache and input_ids.shape[0] == self.ids.shape[0] and input_ids.shape[1] <= self.bucket
                and cache_pointers(cache) == self.pointers and weight_pointers(model) == self.weights)

    def replay(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        self.ids[:, :t].copy_(input_ids)
        self.ids[:, t:].zero_()
        self.end.fill_(t)
        self.graph.replay()
        return self.logits.clone()


def layer_form(layer) -> tuple:
    """What a captured decoder layer depends on besides its weights' values: the mixer's kind,
    backend, window and RoPE, and every parameter's shape and dtype. Layers of one form replay
    one graph."""
    mixer, rope = layer.mixer, getattr(layer.mixer, "rope", None)
    return (type(mixer).__name__, getattr(mixer, "backend", None), getattr(mixer, "window", None),
            None if rope is None else (rope.theta, repr(rope.scaling)),
            tuple((tuple(p.shape), p.dtype) for p in layer.parameters()))


def renew_packed(module) -> None:
    """Forget every packed weight under `module`, so the next forward concatenates them anew
    (inside a capture: on every replay, from the weights copied in)."""
    for m in module.modules():
        for name, value in list(vars(m).items()):
            if isinstance(value, Packed):
                setattr(m, name, Packed())


def layer_template(layer):
    """A copy of `layer` whose parameters are new, uninitialised tensors of the same shapes: the
    module a `LayerGraph` captures. Its graphs copy a layer's weights into it before every replay,
    so copying the values here would be a wasted pass over them (about 100 MB a layer at 1.1B)."""
    memo = {id(p): nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad) for p in layer.parameters()}
    memo |= {id(value): Packed() for m in layer.modules() for value in vars(m).values() if isinstance(value, Packed)}
    return copy.deepcopy(layer, memo)


# prefills of at most this many activations (batch x prompt x hidden size) run layer by layer from
# graphs. Measured on one H200 against the teacher's eager prefill (tools/bench/generate.py
# --eager-rounds): a SmolLM2-shaped student's 4k prefill (2.4M) 1.24x as fast with them, 0.70x
# eagerly; the 1.1B's (8.4M) 0.90x with them, 1.13x eagerly (--layer-graph-elements; 0.71x and
# 0.80x on another machine): there the captures and the weight copies cost more than the launches
# they save
LAYER_GRAPH_ELEMENTS = 1 << 22


class LayerGraph:
    """One decoder layer over B unpadded prompts of T tokens, captured over `template` (a
    `layer_template` of its form) and replayed for every layer of that form: before a replay, one
    multi-tensor copy brings that layer's weights and inputs into the buffers the graph reads; after
    it, the keys and values (or the GDN state and convolution tail) the graph wrote go into that
    layer's cache. Graphs of one template at other prompt shapes read the same parameters: each
    replay copies its layer's weights in first.

    The graph runs the eager forward's kernels (not `graph_work`'s fused ones: their Python wrappers
    would make the capture cost more host time than it saves), so its output equals the eager
    layer's. The packed weights (one matmul for several projections) are concatenated inside the
    graph from the copied weights: a second pass over them for the device, small next to the
    layer's matmuls over T tokens. The capture runs on `stream` with no warm-up: a layer of this
    form has just run there on these shapes (`LayerGraphs`)."""

    def __init__(self, template, x: torch.Tensor, pool, stream: torch.cuda.Stream) -> None:
        b, t = x.shape[:2]
        self.layer = template
        self.x, self.pending = torch.zeros_like(x), torch.zeros_like(x)
        self.targets = [*self.layer.parameters(), self.x, self.pending]
        self.slots = torch.arange(t, device=x.device)
        self.cache = AttentionLayerCache(t) if isinstance(self.layer.mixer, Attention) else GDNLayerCache(static=True)

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            renew_packed(self.layer)
            batch = Batch(0, self.slots, None, None, t)
            return self.layer(self.x, self.pending, self.slots.expand(b, t), batch, self.cache)

        self.graph, self.out = self.record(forward, pool, stream)  # pool() gives the memory pool to capture in

    def record(self, forward, pool, stream: torch.cuda.Stream):
        """(graph, the outputs it writes): `forward` captured on `stream` in the memory pool `pool()`."""
        graph = torch.cuda.CUDAGraph()
        return graph, capture(graph, forward, pool(), stream, warm_up=False)

    def __call__(self, weights: list[torch.Tensor], x: torch.Tensor, pending: torch.Tensor,
                 cache: AttentionLayerCache | GDNLayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer of `weights` (its parameters, in order) over x and pending [B, T, hidden]:
        (x, its MLP branch), buffers the next replay of a graph of the same pool may overwrite."""
        torch._foreach_copy_(self.targets, [*weights, x, pending])
        self.graph.replay()
        if isinstance(self.cache, GDNLayerCache):
            cache.store(self.cache.state, self.cache.conv)
        else:
            cache.update(self.cache.keys, self.cache.values, 0, self.slots, None)
        return self.out


def on_stream(stream: torch.cuda.Stream | None, run):
    """run() on `stream` (None: where the caller is), ordered after the current stream's work
    and before its later work."""
    if stream is None:
        return run()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = run()
    torch.cuda.current_stream().wait_stream(stream)
    return out


class MemoryPool:
    """A CUDA graph memory pool and the side stream its graphs are captured on, both outliving those
    graphs. PyTorch frees a pool with the last graph captured in it, so a capture after a `clear`
    would allocate every buffer from the driver again (nine cudaMalloc calls, 1.5-2.3 ms of a 4k
    first prompt's 25 ms on an H200), and a new side stream would not reuse the blocks cached for
    the last one's warm-up. An anchor graph of one small kernel, captured in the pool and kept with
    it, holds the pool (in the device's allocator and the pinned host allocator alike, which
    `torch.cuda.MemPool` does not): the memory of dropped graphs goes back to it for the next."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.id = device, torch.cuda.graph_pool_handle()
        self.stream, self.anchor = torch.cuda.Stream(device), torch.cuda.CUDAGraph()
        capture(self.anchor, lambda: torch.zeros(1, device=device), self.id, self.stream, warm_up=False)

    @staticmethod
    def on(memory: "MemoryPool | None", device: torch.device) -> "MemoryPool":
        """`memory` if it is on `device`, else a new pool there."""
        return memory if memory is not None and memory.device == device else MemoryPool(device)


class LayerGraphs:
    """A prefill no whole-model graph serves (the first prompt of a bucket, or one over a fresh
    cache), layer by layer: at a prompt shape new to it, the first layer of each form runs eagerly
    (on the capture stream, which then needs no warm-up run of its own: one eager layer a form, not
    two), the second is captured as that form's `LayerGraph`, and it and the rest replay it, so the
    host launches a few operations per layer instead of a few dozen (a form of one layer is
    captured at the shape's next prompt). A hybrid student has two or three forms; prefills of more
    than LAYER_GRAPH_ELEMENTS activations run eagerly. The graphs of the last `keep` prompt shapes are
    kept, in one memory pool (safe: every graph's outputs are read before another graph replays, and
    its inputs and packed weights are written anew before each of its replays); weights moved or
    replaced drop them all. Each form's `layer_template` is made once and serves its graphs at every
    prompt shape, so a new shape's captures need no copy of a layer."""

    def __init__(self, keep: int = 2) -> None:
        self.keep, self.enabled, self.memory = keep, True, None
        # (B, T, dtype) -> {form: its LayerGraph, or None once a layer of it ran eagerly at that shape}
        self.shapes: OrderedDict = OrderedDict()
        self.weights, self.sources, self.forms, self.usable = None, [], [], False
        self.templates: dict = {}  # form -> its layer_template

    def clear(self) -> None:
        """Drop every graph. Their memory pool (`MemoryPool`) and the layer templates outlive them:
        the next captures take the memory the graphs held instead of asking the driver for it."""
        self.shapes.clear()

    def release(self) -> None:
        """Drop every graph and template and return their memory pool's memory to the driver."""
        self.clear()
        self.memory, self.templates, self.weights = None, {}, None

    def template(self, form: tuple, layer):
        """The `layer_template` of `form`, made from `layer` (a layer of that form) when missing."""
        if form not in self.templates:
            self.templates[form] = layer_template(layer)
        return self.templates[form]

    def shared_pool(self):
        """The id of the memory pool every layer graph is captured in (`capture_stream` made it)."""
        return self.memory.id

    def capture_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream every layer graph of `device` is captured on (None off CUDA)."""
        if device.type != "cuda":
            return None
        self.memory = MemoryPool.on(self.memory, device)
        return self.memory.stream

    def run(self, model, cache: MegatronTCCache, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        """Logits of the prefill of input_ids [B, T] into the empty `cache`, or None (a capture
        failed: the caller runs it eagerly, from the start)."""
        b, t = input_ids.shape
        if not self.enabled or b * t * model.model.embed_tokens.weight.shape[1] > LAYER_GRAPH_ELEMENTS:
            return None
        pointers = weight_pointers(model)
        if pointers != self.weights:  # moved or replaced: the templates' buffers (RoPE tables) too
            self.clear()
            self.weights, self.templates = pointers, {}
            self.sources = [list(layer.parameters()) for layer in model.model.layers]
            self.forms = [layer_form(layer) for layer in model.model.layers]
            # a model spread over devices (or moved layer by layer by accelerate's hooks) runs eagerly
            self.usable = (all(p.device == input_ids.device for p in model.parameters())
                           and not any(hasattr(m, "_hf_hook") for m in model.model.layers.modules()))
        if not self.usable:
            return None
        key = (b, t, model.model.embed_tokens.weight.dtype)
        if key not in self.shapes:
            while len(self.shapes) >= self.keep:
                self.shapes.popitem(last=False)
            self.shapes[key] = {}
        self.shapes.move_to_end(key)
        graphs = self.shapes[key]

        slots = torch.arange(t, device=input_ids.device)
        positions, batch = slots.expand(b, t), Batch(0, slots, None, None, t)
        stream = self.capture_stream(input_ids.device)

        def run_layer(i: int, layer, x: torch.Tensor, pending: torch.Tensor | None, layer_cache):
            form = self.forms[i]
            if form not in graphs:  # compiles, autotunes and allocates on the capture stream, for real
                graphs[form] = None
                return on_stream(stream, lambda: layer(x, pending, positions, batch, layer_cache))
            if graphs[form] is None:
                graphs[form] = LayerGraph(self.template(form, layer), x, self.shared_pool, stream)
            return graphs[form](self.sources[i], x, torch.zeros_like(x) if pending is None else pending, layer_cache)

        try:
            return model.model(input_ids, positions, batch, cache, logits_to_keep, run_layer=run_layer)
        except Exception as exc:  # noqa: BLE001 - the prefill stays correct (eager, from the start), only slower
            warnings.warn(f"capturing a prefill layer failed ({type(exc).__name__}: {str(exc)[:200]}); "
                          "prefilling eagerly", RuntimeWarning, stacklevel=3)
            self.enabled = False
            self.release()
            return None


class PrefillGraphs:
    """Captured prefills per (batch, bucket of prompt lengths, cache length, logits kept), at most
    `keep` of them (least recently used dropped), sharing one memory pool (one prefill runs at a time).

    A bucket is captured the second time a prompt of it comes, over a cache that already holds
    buffers of its batch size (a static cache generate reuses); from then on every prompt length of
    the bucket replays it, lengths never seen before included. A bucket's first prompt (or one over
    a fresh cache) runs layer by layer from `LayerGraphs` and never pays for capturing the whole
    model (a warm-up forward plus the capture: about 3x an eager prefill of 4k tokens)."""

    def __init__(self, keep: int = 8) -> None:
        self.keep, self.graphs, self.counts, self.memory = keep, OrderedDict(), {}, None
        self.layers = LayerGraphs()

    def clear(self) -> None:
        """Drop every graph; their memory pools outlive them (`MemoryPool`)."""
        self.graphs.clear()
        self.layers.clear()

    def release(self) -> None:
        """Drop every graph and return their memory pools' memory to the driver."""
        self.clear()
        self.layers.release()
        self.memory = None

    def shared_memory(self, device: torch.device) -> MemoryPool:
        """The memory pool and capture stream of every whole-model prefill graph on `device`."""
        self.memory = MemoryPool.on(self.memory, device)
        return self.memory

    def run(self, model, cache: MegatronTCCache, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        """Logits of the prefill from a captured graph, or None: the caller runs it eagerly."""
        b, t = input_ids.shape
        bucket = prefill_bucket(t, cache.static_len)
        if t < logits_to_keep:  # the kept logits would reach into the padding
            return None
        key = (b, bucket, cache.static_len, logits_to_keep)
        graph = self.graphs.get(key)
        if graph is not None and graph.fits(model, cache, input_ids):
            self.graphs.move_to_end(key)
            return graph.replay(input_ids)
        if len(self.counts) > 256:  # buckets seen once each, many of them: forget them
            self.counts.clear()
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.counts[key] < 2 or cache.batch_size != b:
            return self.layers.run(model, cache, input_ids, logits_to_keep)
        self.graphs.pop(key, None)
        while len(self.graphs) >= self.keep:
            self.graphs.popitem(last=False)
        try:
            device = input_ids.device
            graph = self.graphs[key] = PrefillGraph(model, cache, b, bucket, logits_to_keep,
                                                    lambda: self.shared_memory(device), device)
        except Exception as exc:  # noqa: BLE001 - the prefill stays correct, only slower
            warnings.warn(f"capturing the prefill failed ({type(exc).__name__}: {str(exc)[:200]}); "
                          "prefilling eagerly", RuntimeWarning, stacklevel=3)
            model.prefill_graph_tokens = 0
            self.clear()
            return None
        return graph.replay(input_ids)
