"""What every pipeline stage needs: the config, the run paths, process groups, the device, the
TensorBoard writer, and (loaded once, on first use) the teacher and the prepared data."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_tc.distill.rundir import STUDENT_KEYS, RunPaths
from megatron_tc.parallel.state import shared_outcome
from megatron_tc.monitor import get_logger

log = get_logger(__name__)


def ensure_process_group_env() -> None:
    """A plain `python tools/distill.py` (no launcher) runs as a world of one process."""
    if "WORLD_SIZE" in os.environ:
        return
    from megatron_tc.testing import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def pick_device(cfg: Any) -> torch.device:
    want = cfg.run.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def student_options(cfg: Any) -> dict[str, Any]:
    """The ArchConfig fields of the student's GDN layers the config sets (model.gdn_*)."""
    return {key.split(".", 1)[1]: getattr(cfg.model, key.split(".", 1)[1]) for key in STUDENT_KEYS}


@dataclass
class RunContext:
    cfg: Any
    paths: RunPaths
    par: Any  # megatron_tc.parallel.state.ParallelContext
    device: torch.device
    tb: Any  # megatron_tc.monitor.TBWriter
    _teacher: Any = field(default=None, repr=False)
    _data: Any = field(default=None, repr=False)
    _shard_teacher: bool | None = field(default=None, repr=False)
    _eval_memo: Any = field(default=None, repr=False)

    @property
    def rank0(self) -> bool:
        return self.par.rank == 0

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def rank0_first(self, fn):
        """Run `fn()` on rank 0, then on the others (they find its cached files); return its value.
        An error on rank 0 (bad data, an unreadable file) is raised on every rank."""
        result = shared_outcome(fn if self.rank0 else None)
        if not self.rank0:
            result = fn()
        return result

    def on_rank0(self, fn):
        """`fn()` on rank 0 only (what one rank writes); its error, if any, raised on every rank."""
        return shared_outcome(fn if self.rank0 else None)

    # ---- the teacher (megatron_tc checkpoint written by the convert stage) ------------------------
    def teacher(self, whole: bool = False):
        """calibrate.teacher_io.Teacher: model (fp32, eval, on `self.device`), sha256, tokenizer,
        files. The select / stats / init / eval stages run it where it is: the rank's GPU under
        CUDA, so their sums live there and NCCL can reduce them.

        With parallel.shard_teacher resolved on (`parallel.sharded_teacher.resolve_shard_teacher`)
        the model is split over the tensor-parallel ranks (`Teacher.tp_group` set), each reading
        only its slice; every stage that runs the teacher (select's ar / ga, stats, init,
        stage 1, stage 2, eval) works on it split. `whole=True` asks for a single-device HybridLM
        on every rank whatever the setting. One teacher is kept at a time: asking for the other
        kind loads it afresh."""
        if not self.paths.teacher.is_dir():
            raise FileNotFoundError(f"{self.paths.teacher} does not exist: run the convert stage first "
                                    "(add 'convert' to run.stages)")
        sharded = not whole and self.shard_teacher()
        if self._teacher is not None and self._teacher.sharded != sharded:
            self._teacher = None
        if self._teacher is None:
            from megatron_tc.calibrate.teacher_io import load_sharded_teacher, load_teacher

            if sharded:  # read onto the device tensor by tensor: the host never holds the slice
                teacher = load_sharded_teacher(self.paths.teacher, self.par, self.device)
            else:
                teacher = load_teacher(self.paths.teacher)  # hashed on the CPU, then moved
            teacher.model.to(self.device)
            # the student's GDN options (model.gdn_*) on the teacher's architecture: every student
            # made from it (`arch.with_pattern`) takes them; its attention layers read none of them
            teacher.model.arch = dataclasses.replace(teacher.model.arch, **student_options(self.cfg))
            self._teacher = teacher
        return self._teacher

    def teacher_meta(self):
        """The loaded teacher of either kind, for its hash, tokenizer, files and architecture only
        (never switches kinds); loads one as `teacher()` when none is."""
        return self._teacher if self._teacher is not None else self.teacher()

    def shard_teacher(self) -> bool:
        """parallel.shard_teacher resolved against the converted teacher's size and this device."""
        if self._shard_teacher is None:
            from megatron_tc.convert.checkpoint import read_info
            from megatron_tc.parallel.sharded_teacher import resolve_shard_teacher

            arch = read_info(self.paths.teacher).arch
            self._shard_teacher = resolve_shard_teacher(self.cfg, arch, self.device)
            if self._shard_teacher:
                log.info("the teacher is split over %d tensor-parallel ranks (parallel.shard_teacher=%s)",
                         self.par.tp_size, str(self.cfg.parallel.shard_teacher).lower())
        return self._shard_teacher

    def release_teacher(self) -> None:
        """Forget the loaded teacher (a training stage may have cast or wrapped it in place); the
        next `teacher()` loads it again, fp32, from the run directory."""
        self._teacher = None

    def eval_memo(self):
        """distill.eval_memo.EvalMemo: stage 2's evaluations, which the eval stage reuses."""
        if self._eval_memo is None:
            from megatron_tc.distill.eval_memo import EvalMemo

            self._eval_memo = EvalMemo()
        return self._eval_memo

    # ---- data ----------------------------------------------------------------------------------------
    def data(self):
        """megatron_tc.data.PreparedData over the run directory (manifest, cached token streams)."""
        if self._data is None:
            from megatron_tc.data import DataConfig, prepare_data

            d = self.cfg.data
            dcfg = DataConfig.from_config(d)  # the pipeline's keys of the run config's data section
            teacher = self.teacher_meta()
            tokenizer = teacher.tokenizer
            if d.tokenizer:  # another tokenizer for the data must map text exactly as the teacher's
                from megatron_tc.data.tokenizer import check_same_tokenizer, load_tokenizer

                tokenizer = load_tokenizer(d.tokenizer)
                check_same_tokenizer(teacher.tokenizer, tokenizer, "teacher", f"data (data.tokenizer={d.tokenizer})")
            vocab = teacher.model.arch.vocab_size

            def prepare():
                data = prepare_data(dcfg, self.paths.root, tokenizer=tokenizer, model_vocab_size=vocab)
                for split in ("calibration", "eval", "train"):
                    data.token_stream(split)  # tokenize (cached in the run dir) before the others read it
                return data

            self._data = self.rank0_first(prepare)
        return self._data

    def calibration_batches(self, num_tokens: int, skip_tokens: int = 0,
                            every_rank: bool = False) -> list[dict[str, torch.Tensor]]:
        """This DP rank's share of the calibration sequences (data.calib_order; rows dealt
        round-robin), one row per batch, on `self.device`. Sums over all ranks' rows equal a single
        process's over all rows. `every_rank`: all rows on every rank (per-layer alignment)."""
        rows = self.calibration_rows(num_tokens, skip_tokens)
        start, step = (0, 1) if every_rank else (self.par.dp_rank, self.par.dp_size)
        picked = range(start, rows["input_ids"].shape[0], step)
        return [{k: v[i:i + 1].to(self.device) for k, v in rows.items() if k in ("input_ids", "doc_ids")}
                for i in picked]

    def calibration_rows(self, num_tokens: int, skip_tokens: int = 0) -> dict[str, torch.Tensor]:
        """The calibration sequences after the first `skip_tokens` worth, in data.calib_order
        (CPU tensors [B, T]): statistics, alignment and ar/ga scoring all draw from here."""
        return self.data().sampled_sequences("calibration", num_tokens, self.cfg.data.seq_len, skip_tokens,
                                             order=self.cfg.data.calib_order)

    def eval_windows(self) -> list[torch.Tensor]:
        """The held-out evaluation text as windows [n, T] (eval.perplexity's convention; each starts
        with BOS when data.bos resolves to one)."""
        from megatron_tc.eval.perplexity import make_windows

        tokens = self.cfg.eval.tokens or self.cfg.data.eval_tokens
        seq = self.cfg.eval.seq_len or self.cfg.data.seq_len
        data = self.data()
        return make_windows(data.token_ids("eval", tokens), seq, data.bos_id)

    def bos_record(self) -> dict[str, Any] | None:
        """The BOS convention of the run's data (megatron_tc.data.bos.bos_record), or None while
        no stage has prepared the data."""
        return None if self._data is None else self._data.bos_record()


def rank0_save_student(ctx: RunContext, model_or_state: Any, arch: Any, out: Path, source: dict) -> None:
    """Write a single-device student as a megatron_tc checkpoint (rank 0), with the teacher's tokenizer."""
    tokenizer_files = ctx.teacher_meta().tokenizer_files  # every rank: loading a split teacher is collective
    if ctx.rank0:
        from megatron_tc.convert.checkpoint import save_checkpoint

        state = model_or_state.state_dict() if hasattr(model_or_state, "state_dict") else model_or_state
        state = {k: v.detach().cpu() for k, v in state.items()}  # a student on the GPU is written from the host
        save_checkpoint(state, arch, out, source=source, tokenizer_files=tokenizer_files, overwrite=True)
    ctx.barrier()
