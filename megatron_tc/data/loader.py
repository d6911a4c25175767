"""Deterministic, DP-sharded, resumable batches over packed sequences.

The global order is a pure function of (seed, epoch): epoch e visits the sequences in
`permutation(default_rng([seed, e]))`, global batch s of the epoch is the slice
[s*G, (s+1)*G) of that order (G = global batch size), and the last N % G sequences of each epoch
are skipped (a different tail every epoch, since each epoch is reshuffled). Data-parallel rank r
of d takes the contiguous slice [r*G/d, (r+1)*G/d) of every global batch and cuts it into
micro-batches, so concatenating the ranks' micro-batches gives the single-process global batch in
the same order, and a run can resume with another DP size as long as G is unchanged.

The position is the global step alone; `state_dict()` records it with what it depends on.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from .documents import DataError
from .packing import PackedSequences


class DistributedBatchLoader:
    """Yields, per optimizer step, this rank's list of micro-batches (dicts of tensors [mbs, T])."""

    def __init__(self, dataset: PackedSequences, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle: bool = True) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if micro_batch_size < 1 or global_batch_size % (micro_batch_size * dp_size):
            raise DataError(
                f"global_batch_size {global_batch_size} must be a positive multiple of "
                f"micro_batch_size {micro_batch_size} x data-parallel size {dp_size}"
            )
        if len(dataset) < global_batch_size:
            raise DataError(
                f"the data holds {len(dataset)} sequences of {dataset.seq_len} tokens, fewer than one "
                f"global batch ({global_batch_size}); add data, or lower seq_len or the batch size"
            )
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.grad_accum_steps = global_batch_size // (micro_batch_size * dp_size)
        self.steps_per_epoch = len(dataset) // global_batch_size
        self.step = 0  # global steps consumed
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.dataset.seq_len

    def epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.dataset)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def global_batch_indices(self, step: int) -> np.ndarray:
        """Sequence indices [G] of global batch `step` (all ranks)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        G = self.global_batch_size
        return self.epoch_order(epoch)[within * G : (within + 1) * G]

    def rank_indices(self, step: int) -> np.ndarray:
        """This rank's sequence indices [G / dp] of global batch `step`."""
        per_rank = self.global_batch_size // self.dp_size
        return self.global_batch_indices(step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        idx = self.rank_indices(step)
        m = self.micro_batch_size
        return [self.dataset.batch(idx[i : i + m]) for i in range(0, len(idx), m)]

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches for the next optimizer step; advances the position."""
        batches = self.micro_batches(self.step)
        self.step += 1
        return batches

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        while True:
            yield self.next_step()

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "offset": (self.step % self.steps_per_epoch) * self.global_batch_size,  # sequences into the epoch
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_size": self.global_batch_size,
            "num_sequences": len(self.dataset),
            "dataset": self.dataset.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state["step"]`; refuses a position recorded over other data or another order."""
        mine = self.state_dict()
        for k in ("seed", "shuffle", "global_batch_size", "num_sequences", "dataset"):
            if state.get(k) != mine[k]:
                raise DataError(
                    f"cannot resume the data position: {k} was {state.get(k)!r} when it was saved, "
                    f"now {mine[k]!r}. Resuming needs the same data, seq_len, seed and global batch size."
                )
        self.step = int(state["step"])
