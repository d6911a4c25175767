"""CUDA graphs of an exported student (torch only): the decoding step over a static cache, and
prefills of any prompt length as pieces of power-of-two lengths.

A forward of a small model over a few thousand tokens is host-bound: launching its kernels (fla's
Triton kernels above all) takes several times the GPU's work. A captured graph replays every
kernel with one launch. The decoding graph reads and writes the cache's buffers in place, so it is
valid while the cache keeps its addresses (generate reuses a static cache of the same size); the
prefill pieces work in a scratch cache of their own and copy the prompt's entries out.
"""
from __future__ import annotations

import itertools
import warnings
from collections import OrderedDict

import torch

from .attention_megatron_tc import Batch
from .cache_megatron_tc import GDNLayerCache, MegatronTCCache
from .gated_delta_megatron_tc import graph_work


def cache_pointers(cache: MegatronTCCache) -> list[int]:
    return [x.data_ptr() for layer in cache.layers for x in layer.tensors().values()]


def weight_pointers(model) -> tuple[int, ...]:
    """Addresses of the model's parameters and buffers: a graph reads them where they were when it
    was captured, so one replaced (moved, cast, loaded with assign=True) makes it stale."""
    return tuple(x.data_ptr() for x in itertools.chain(model.parameters(), model.buffers()))


def capture(graph: torch.cuda.CUDAGraph, run, pool=None):
    """`run()` once on a side stream (kernels compiled and autotuned, buffers allocated outside the
    capture), then captured into `graph`, both within `graph_work` (fla's fused small kernels);
    returns what the captured call returned (its buffers). capture_begin/end rather than
    torch.cuda.graph(), which empties PyTorch's CUDA memory cache first: the next prefill would
    then allocate all of its memory from the driver."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with graph_work():
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


# tokens per row of the largest prefill piece (a power of two): a prompt is cut into powers of two,
# largest first, so prompts of every length replay the same dozen graphs
LARGEST_PIECE = 2048


def piece_lengths(tokens: int, largest: int) -> list[int]:
    """`tokens` as a sum of powers of two of at most `largest` (a power of two), largest first:
    4090 -> [2048, 1024, 512, 256, 128, 64, 32, 16, 8, 2]."""
    pieces, rest = [largest] * (tokens // largest), tokens % largest
    while rest:
        pieces.append(1 << (rest.bit_length() - 1))
        rest -= pieces[-1]
    return pieces


class PrefillPiece:
    """`length` tokens of each of B rows at any position of the prompt (staged into fixed buffers),
    continuing the scratch cache's GDN states and attending to its earlier slots, captured in a
    CUDA graph (run eagerly where `graph` is False: the same computation, for CPU tests)."""

    def __init__(self, model, scratch: MegatronTCCache, rows: int, length: int, pool, graph: bool = True) -> None:
        device = next(model.parameters()).device
        self.ids = torch.zeros(rows, length, dtype=torch.long, device=device)
        self.steps = torch.arange(length, device=device)
        self.slots = torch.zeros(length, dtype=torch.long, device=device)
        positions = self.slots.expand(rows, length)

        def forward() -> torch.Tensor:
            # offset 1 means "earlier tokens are cached": GDN layers read their state and convolution
            # inputs from the scratch cache, attention masks its slots by position (all of them)
            return model.model(self.ids, positions, Batch(1, self.slots, None, None, None), scratch, 1)

        self.forward, self.graph = forward, None
        if graph:
            self.graph = torch.cuda.CUDAGraph()
            self.logits = capture(self.graph, forward, pool)

    def run(self, input_ids: torch.Tensor, start: int) -> torch.Tensor:
        """The last token's logits [B, 1, vocab] of input_ids [B, length] at positions start..."""
        self.ids.copy_(input_ids)
        torch.add(self.steps, start, out=self.slots)
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.logits


class ChunkedPrefill:
    """Prefills of B unpadded rows of up to `capacity` tokens, of any length, as pieces of
    power-of-two lengths (`piece_lengths`), each replaying its captured graph over a scratch cache
    of its own; the prompt's keys and values, GDN states and convolution inputs are then copied
    into the caller's cache. One set of graphs serves every prompt length and every cache, so a
    prompt length seen once replays too. graph=False runs the pieces eagerly (CPU tests)."""

    def __init__(self, model, rows: int, capacity: int, pool=None, graph: bool = True) -> None:
        device = next(model.parameters()).device
        self.rows, self.capacity, self.weights = rows, capacity, weight_pointers(model)
        self.scratch = MegatronTCCache(model.config, static_len=capacity)
        ids = torch.zeros(rows, 2, dtype=torch.long, device=device)
        slots = torch.arange(2, device=device)
        model.model(ids, slots.expand(rows, 2), Batch(0, slots, None, None, 2), self.scratch, 1)  # its buffers
        self.states = [x for layer in self.scratch.layers if isinstance(layer, GDNLayerCache)
                       for x in layer.tensors().values()]
        self.slots = torch.arange(capacity, device=device)
        # a piece at offset 1 must fit the scratch cache's bound check: at most capacity - 1 tokens
        self.largest = min(LARGEST_PIECE, 1 << ((capacity - 1).bit_length() - 1))
        self.pool = pool if pool is not None or not graph else torch.cuda.graph_pool_handle()
        lengths = [1 << i for i in reversed(range(self.largest.bit_length()))]
        self.pieces = {n: PrefillPiece(model, self.scratch, rows, n, self.pool, graph) for n in lengths}

    def fits(self, model, input_ids: torch.Tensor) -> bool:
        return (input_ids.shape[0] == self.rows and input_ids.shape[1] <= self.capacity
                and weight_pointers(model) == self.weights)

    def run(self, input_ids: torch.Tensor, cache: MegatronTCCache) -> torch.Tensor:
        """The last token's logits [B, 1, vocab] of the prompt input_ids [B, T]; `cache` (empty,
        static) then holds the prompt as an eager prefill would have stored it."""
        t = input_ids.shape[1]
        torch._foreach_zero_(self.states)  # a prompt starts from zero states and convolution inputs
        start = 0
        for length in piece_lengths(t, self.largest):
            logits = self.pieces[length].run(input_ids[:, start:start + length], start)
            start += length
        for src, dst in zip(self.scratch.layers, cache.layers):
            if isinstance(src, GDNLayerCache):
                dst.store(src.state, src.conv)
            else:
                dst.update(src.keys[:, :, :t], src.values[:, :, :t], 0, self.slots[:t], None)
        return logits.clone()


class ChunkedPrefills:
    """The model's chunked prefills, one per batch size (at most `keep`, least recently used
    dropped), sharing one memory pool (one prefill runs at a time). A batch size's graphs are
    captured the second time a prefill of that batch size comes: a single prefill never pays for
    the captures (about a dozen warm-up forwards and captures)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep, self.sets, self.counts, self.pool = keep, OrderedDict(), {}, None

    def clear(self) -> None:
        """Drop every graph (and with the last of them, their memory pool)."""
        self.sets.clear()
        self.pool = None

    def run(self, model, cache: MegatronTCCache, input_ids: torch.Tensor, tokens: int) -> torch.Tensor | None:
        """Logits of the prefill from captured pieces, or None: the caller runs it eagerly. tokens:
        the largest prefill (batch x prompt) served; a batch size's scratch cache holds tokens / B."""
        rows = input_ids.shape[0]
        prefill = self.sets.get(rows)
        if prefill is not None and prefill.fits(model, input_ids):
            self.sets.move_to_end(rows)
            return prefill.run(input_ids, cache)
        self.counts[rows] = self.counts.get(rows, 0) + 1
        if self.counts[rows] < 2 or tokens // rows < max(2, input_ids.shape[1]):
            return None
        self.sets.pop(rows, None)
        while len(self.sets) >= self.keep:
            self.sets.popitem(last=False)
        try:
            prefill = self.sets[rows] = ChunkedPrefill(model, rows, tokens // rows, self.pool)
            self.pool = prefill.pool
        except Exception as exc:  # noqa: BLE001 - the prefill stays correct, only slower
            warnings.warn(f"capturing the prefill failed ({type(exc).__name__}: {str(exc)[:200]}); "
                          "prefilling eagerly", RuntimeWarning, stacklevel=3)
            model.prefill_graph_tokens = 0
            self.clear()
            return None
        return prefill.run(input_ids, cache)
