"""A megatron_tc hybrid student as a transformers causal LM (torch and transformers only).

Softmax-attention layers ('A') and Gated DeltaNet layers ('G') follow `config.arch`; state-dict
names are megatron_tc's `HybridLM` names under `model.`. An exported student directory carries
this file (and the modules it imports) verbatim, so it loads with `trust_remote_code=True` where
megatron_tc is not installed, on transformers 5.17 to 5.24. `generate()` works in every mode
(greedy, sampling, beam search, assisted decoding, left-padded batches) through `MegatronTCCache`.
Padding is exact: a pad position is hidden from attention and leaves the GDN state and the
convolution inputs unchanged.

Decoding on CUDA with a static cache (`generate(..., cache_implementation="static")`, the
default there) captures one decoding step in a CUDA graph and replays it for every later token,
and captures a short prefill (up to PREFILL_GRAPH_TOKENS tokens) the second time a prompt of its
bucket (lengths rounded up to a multiple of 256, padded exactly) comes over the reused cache; every
later prompt of the bucket replays it. A short prefill no such graph serves runs layer by layer from
graphs of single decoder layers, one per layer form (graphs_megatron_tc.py).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache_megatron_tc import GDNLayerCache, MegatronTCCache
from .configuration_megatron_tc import MegatronTCConfig
from .attention_megatron_tc import Batch, Rotary
from .graphs_megatron_tc import DecodeGraph, PrefillGraphs, weight_pointers
from .layers_megatron_tc import GatedDeltaNet, HybridModel

# transformers 5.24 renamed `past_key_values` to `cache` (model kwargs and outputs)
CACHE_KEY = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# static caches on CUDA are sized in steps of this many tokens, so that generations of similar
# lengths share one cache and its captured decoding step
STATIC_ROUND = 256
# prefills of at most this many tokens (batch x prompt) into a reused static cache are captured
# when their bucket repeats: below it a forward is host-bound (launching kernels takes longer than
# the GPU's work), above it the graph's memory would buy little
PREFILL_GRAPH_TOKENS = 8192


class MegatronTCPreTrainedModel(PreTrainedModel):
    config_class = MegatronTCConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Weights come from the checkpoint; only the RoPE tables (non-persistent buffers, left
        empty by transformers' meta-device loading) are recomputed here."""
        if isinstance(module, Rotary):
            module.reset()


class MegatronTCForCausalLM(MegatronTCPreTrainedModel, GenerationMixin):
    """forward(input_ids [B, T], attention_mask [B, cached + T]) -> logits [B, T, vocab]."""

    def __init__(self, config: MegatronTCConfig) -> None:
        super().__init__(config)
        self.model = HybridModel(config)
        self.decode_graphs = True  # capture the decoding step on CUDA with a static cache
        self.prefill_graph_tokens = PREFILL_GRAPH_TOKENS  # 0: never capture a prefill (whole or per layer)
        self._graph: DecodeGraph | None = None
        self._prefills = PrefillGraphs()
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module | None:
        return self.model.lm_head  # None when tied: the embedding is reused

    def release_graphs(self) -> None:
        """Drop every captured CUDA graph (decoding step, prefills) and the prefill's layer templates,
        and return the memory their pools keep for later captures to the driver; the next generate
        captures anew."""
        self._graph = None
        self._prefills.release()

    def set_gdn_backend(self, backend: str) -> None:
        """'auto', 'fla', 'chunk' or 'recurrent' for every Gated DeltaNet layer."""
        for layer in self.model.layers:
            if isinstance(layer.mixer, GatedDeltaNet):
                layer.mixer.backend = backend

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Any = None, cache: Any = None,
                use_cache: bool | None = None, labels: torch.LongTensor | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int = 0, **kwargs: Any):
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("MegatronTCForCausalLM takes input_ids [B, T], not inputs_embeds")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is not None and not isinstance(cache, MegatronTCCache):
            raise TypeError(f"the cache must be a MegatronTCCache (KV + recurrent state), got {type(cache).__name__}; "
                            "let generate() create it, or pass MegatronTCCache(model.config)")
        cache = (cache if cache is not None else MegatronTCCache(self.config)) if use_cache else None
        offset, (b, t) = (cache.seen if cache is not None else 0), input_ids.shape
        if attention_mask is not None and tuple(attention_mask.shape) != (b, offset + t):
            raise ValueError(f"attention_mask must be [B, cached + new tokens] = {[b, offset + t]}, got "
                             f"{list(attention_mask.shape)} (a 2D mask of ones and zeros; zeros mark padding)")
        logits, padded = None, None
        if self._can_replay(cache, input_ids, position_ids, labels):
            logits = self._graph_step(input_ids, attention_mask, cache)
        else:  # one look at the mask (a wait for the device) serves both paths below
            padded = attention_mask is not None and not bool(attention_mask.all())
            if self._can_capture_prefill(cache, input_ids, padded, position_ids, labels, logits_to_keep):
                logits = self._prefills.run(self, cache, input_ids, logits_to_keep)
        if logits is None:
            logits = self._eager(input_ids, attention_mask, position_ids, cache, offset, logits_to_keep, padded)
        if cache is not None:
            cache.seen += t
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_KEY: cache})

    def _eager(self, input_ids, attention_mask, position_ids, cache, offset, logits_to_keep, padded=None):
        t, device = input_ids.shape[1], input_ids.device
        if padded is None:
            padded = attention_mask is not None and not bool(attention_mask.all())
        if position_ids is None:
            if padded:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
            else:
                position_ids = torch.arange(offset, offset + t, device=device).expand(input_ids.shape)
        valid = attention_mask[:, -t:].bool() if padded else None
        batch = Batch(offset, torch.arange(offset, offset + t, device=device), valid,
                      attention_mask.bool() if padded else None, offset + t)
        return self.model(input_ids, position_ids, batch, cache, logits_to_keep)

    # ---- captured decoding step -------------------------------------------------------------
    def _can_replay(self, cache, input_ids, position_ids, labels) -> bool:
        return (self.decode_graphs and cache is not None and cache.is_static and input_ids.is_cuda
                and input_ids.shape[1] == 1 and cache.seen > 0 and position_ids is None and labels is None
                and not torch.is_grad_enabled() and not cache.is_recording_past()
                and not torch.cuda.is_current_stream_capturing())

    def _can_capture_prefill(self, cache, input_ids, padded, position_ids, labels, logits_to_keep) -> bool:
        """A prefill (empty static cache, unpadded prompts) small enough to be host-bound, keeping the
        last token's logits (generate's; all of them would make the graph hold [B, T, vocab])."""
        return (0 < input_ids.numel() <= self.prefill_graph_tokens and input_ids.shape[1] > 1
                and isinstance(logits_to_keep, int) and logits_to_keep == 1 and cache is not None and cache.is_static
                and cache.seen == 0 and input_ids.is_cuda and position_ids is None and labels is None
                and not torch.is_grad_enabled() and not cache.is_recording_past()
                and not torch.cuda.is_current_stream_capturing()
                and not padded)

    def _graph_step(self, input_ids, attention_mask, cache) -> torch.Tensor:
        if cache.seen + 1 > cache.static_len:
            raise ValueError(f"the static cache holds {cache.static_len} tokens; "
                             "pass a larger MegatronTCCache(config, static_len=N)")
        graph = self._graph
        if graph is None or not graph.fits(cache, input_ids):
            self._graph = None
            try:
                graph = self._graph = DecodeGraph(self, cache, input_ids, attention_mask)
            except Exception as exc:  # noqa: BLE001 - decoding stays correct, only slower
                warnings.warn(f"capturing the decoding step failed ({type(exc).__name__}: {str(exc)[:200]}); "
                              "decoding eagerly", RuntimeWarning, stacklevel=3)
                self.decode_graphs = False
                return self._eager(input_ids, attention_mask, None, cache, cache.seen, 0)
        return graph.replay(input_ids, attention_mask, cache.seen)

    # ---- generate ---------------------------------------------------------------------------
    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args: Any, **kwargs: Any) -> None:
        """Our cache for generate: static (fixed addresses, captured decoding) on CUDA or when
        cache_implementation="static", else dynamic; max length from generate's arguments."""
        given = model_kwargs.get(CACHE_KEY)
        if given is not None:
            if not isinstance(given, MegatronTCCache):
                raise TypeError(f"the cache must be a MegatronTCCache, got {type(given).__name__}")
            return
        if generation_config.use_cache is False:
            return
        impl = generation_config.cache_implementation
        if impl not in (None, "dynamic", "static"):
            raise ValueError(f"cache_implementation={impl!r} is not supported by this model; use 'static' or 'dynamic'")
        max_len = args[2] if len(args) >= 3 else kwargs.get("max_cache_length")
        static = impl == "static" or (impl is None and self.device.type == "cuda")
        assistant = getattr(generation_config, "is_assistant", False)
        if static and max_len and not assistant and self.device.type == "cuda":
            cache = self._static_cache_for(-(-(int(max_len) + 1) // STATIC_ROUND) * STATIC_ROUND)
        else:
            cache = MegatronTCCache(self.config, static_len=int(max_len) + 1 if static and max_len else None)
        if assistant:
            cache.activate_past_recording()
        model_kwargs[CACHE_KEY] = cache

    def _static_cache_for(self, length: int) -> MegatronTCCache:
        """The static cache of the last generation when it has `length` slots, emptied in place (its
        buffers keep their addresses, so the captured decoding step is replayed, not captured
        again), else a new one. As with transformers' own static cache, a later generate() reuses
        (and empties) the cache an earlier one returned."""
        previous = self._graph.cache if self._graph is not None else None
        if (previous is not None and previous.static_len == length and not previous.is_recording_past()
                and self._graph.weights == weight_pointers(self)):
            previous.reset()
            return previous
        self._graph = None  # frees the graph and the buffers it was captured over
        self._prefills.clear()
        return MegatronTCCache(self.config, static_len=length)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                                      inputs_embeds: torch.Tensor | None = None, **kwargs: Any) -> dict[str, Any]:
        """The tokens the cache has not seen yet, the whole 2D attention mask and the cache."""
        cache = kwargs.get(CACHE_KEY, kwargs.get("past_key_values"))
        seen = cache.seen if cache is not None else 0
        if seen >= input_ids.shape[1]:
            raise ValueError(f"the cache already holds {seen} tokens of this {input_ids.shape[1]}-token input")
        inputs = {"input_ids": input_ids[:, seen:].contiguous(), "attention_mask": attention_mask, CACHE_KEY: cache,
                  "use_cache": kwargs.get("use_cache", True)}
        if kwargs.get("logits_to_keep") is not None:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs
