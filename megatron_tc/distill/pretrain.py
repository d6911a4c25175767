"""The `pretrain` stage: a teacher trained from scratch with the plain next-token objective.

    run:      {stages: [pretrain, convert, select, ...]}
    model:    {teacher: runs/t/hf}                 # where the pretrained model is exported
    data:     {tokenizer: <HF dir or .gguf>, ...}  # there is no teacher to take it from
    pretrain: {hf_config: configs/paper/teacher_qwen2.json, tokens: 20000000, lr: 2e-3}

It is stage 2 without a teacher: the same trainer (`Stage2Trainer`: DeepSpeed engine, data loader
and its resumable order, warmup + cosine schedule, NaN guard, checkpoints every
distill.checkpoint_interval steps, TensorBoard, held-out evaluation every distill.eval_interval
steps and at distill.eval_steps), with the loss replaced by the mean next-token cross-entropy over positions that have a
next token in the same document, and evaluation by held-out perplexity alone.

Files: <run_dir>/pretrain/{checkpoints/, train_log.jsonl, eval_log.jsonl, model/} (model: a
megatron_tc checkpoint with the tokenizer), and the HF export of the model's family at
model.teacher (plain transformers loads it), so the later stages convert it like any teacher.
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from megatron_tc.distill.checkpointing import latest_zero_stage
from megatron_tc.distill.context import RunContext
from megatron_tc.distill.losses import IGNORE, next_token_labels
from megatron_tc.distill.stage2 import Stage2Trainer, evaluates_while_training
from megatron_tc.distill.stage2_setup import stage2_deepspeed_config
from megatron_tc.monitor import get_logger

log = get_logger(__name__)

MARKER = "pretrained_by_megatron_tc.json"  # in the HF export: this stage may overwrite the directory


class _RenamedTB:
    """The trainer logs under 'stage2*' tags; a pretrain run's scalars read 'pretrain*' (no KL)."""

    def __init__(self, tb: Any):
        self.tb = tb

    def scalars(self, values: dict[str, Any], step: int, prefix: str = "") -> None:
        values = {k: v for k, v in values.items() if k != "kl"}
        self.tb.scalars(values, step, prefix=prefix.replace("stage2", "pretrain", 1))

    def __getattr__(self, name: str):  # scalar, flush, close, ...
        return getattr(self.tb, name)


class PretrainTrainer(Stage2Trainer):
    """Stage2Trainer with teacher=None: next-token cross-entropy, perplexity-only evaluation."""

    def _forward_loss(self, batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """batch: the packer's tensors [mbs, T]; loss = mean CE over positions with a next token."""
        from megatron_tc.parallel.losses import vocab_parallel_cross_entropy

        on = {k: v.to(self.device) for k, v in batch.items()}
        ids = on["input_ids"]
        kwargs = {k: on[k] for k in ("doc_ids", "position_ids") if k in on}
        logits = self.engine(ids, **kwargs)
        labels = on["labels"] if "labels" in on else next_token_labels(ids, kwargs.get("doc_ids"))
        count = (labels != IGNORE).sum().clamp(min=1).to(torch.float32)
        ce = vocab_parallel_cross_entropy(logits, labels, self.vocab_size, IGNORE, self.tp_group).sum() / count
        return ce, {"loss": ce.detach(), "ce": ce.detach()}

    def evaluate(self, state: Any) -> dict[str, Any]:
        from megatron_tc.distill.evaluation import append_jsonl, eval_batch_size, score_rows

        self.engine.eval()
        try:
            result = score_rows(lambda x: self.engine(x), None, self.eval_rows, self.ctx.dp_rank, self.ctx.dp_size,
                                self.ctx.dp_group, self.device, vocab_size=self.vocab_size, tp_group=self.tp_group,
                                batch_size=eval_batch_size(self.cfg))
        finally:
            self.engine.train()
        result["eval_tokens"] = result.pop("tokens")
        record = {"step": state.step, "tokens": state.tokens_seen, **result}
        if self.rank0:
            append_jsonl(self.eval_log, record)
        self.tb.scalars({"ppl": result["ppl"], "nll": result["nll"]}, state.step, prefix="pretrain_eval")
        log.info("pretrain eval at step %d (%d tokens): held-out ppl %.3f", state.step, state.tokens_seen, result["ppl"])
        return record


# ---- the model, the data, the config the trainer reads -----------------------------------------------

def shard_for_tp(model: Any, par: Any) -> None:
    """`model` tensor-parallel in place (megatron-core layers), its vocabulary padded first when TP
    does not divide the padding; the trainer's gathered state comes back at the original padding."""
    from megatron_tc.distill.stage2_setup import set_vocab_padding
    from megatron_tc.model.config import pad_vocab
    from megatron_tc.parallel.tensor_parallel import apply_tensor_parallel

    if model.arch.padded_vocab_size % par.tp_size:
        set_vocab_padding(model, pad_vocab(model.arch.vocab_size, par.tp_size))
    apply_tensor_parallel(model, par)


def read_hf_config(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """(transformers config, its dict) from a config.json file or a directory holding one."""
    from transformers import AutoConfig

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"pretrain.hf_config={path}: no such config.json")
    fields = json.loads(file.read_text())
    if "model_type" not in fields:
        raise ValueError(f"{file}: an HF config needs 'model_type' (llama, qwen2, mistral, qwen3 or gemma3)")
    kind = fields.pop("model_type")
    fields.pop("transformers_version", None)
    config = AutoConfig.for_model(kind, **fields)
    return config, config.to_dict()


def pretrain_arch(cfg: Any, tokenizer: Any) -> tuple[Any, dict[str, Any]]:
    """The model's ArchConfig (all layers attention) and the HF config dict recorded with it
    (token ids taken from the tokenizer where the config leaves them unset)."""
    from megatron_tc.convert.hf_mapping import arch_from_hf_config

    config, fields = read_hf_config(cfg.pretrain.hf_config)
    for key, value in (("bos_token_id", tokenizer.bos_token_id), ("eos_token_id", tokenizer.eos_token_id)):
        if fields.get(key) is None and value is not None:
            fields[key] = value
            setattr(config, key, value)
    if len(tokenizer) > fields["vocab_size"]:
        raise ValueError(f"pretrain.hf_config has vocab_size {fields['vocab_size']} but the tokenizer "
                         f"({cfg.data.tokenizer}) has {len(tokenizer)} tokens: raise vocab_size")
    return arch_from_hf_config(config), fields


def trainer_config(cfg: Any) -> Any:
    """The run config as the stage-2 trainer reads it: distill.stage2's optimizer and schedule
    keys taken from the pretrain section, no distillation terms."""
    p = cfg.pretrain
    s2 = dataclasses.replace(cfg.distill.stage2, steps=p.steps, tokens=p.tokens, lr=p.lr, min_lr=p.min_lr,
                             warmup_steps=p.warmup_steps, schedule=p.schedule, weight_decay=p.weight_decay,
                             grad_clip=p.grad_clip, temperature=1.0, ce_weight=1.0, hidden_weight=0.0, trainable="all")
    return dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, stage2=s2))


def _prepare_data(ctx: RunContext, tokenizer: Any, vocab_size: int) -> Any:
    """The run's PreparedData with the configured tokenizer (there is no teacher yet); installed
    as the context's data so ctx.eval_windows() and the loader see it."""
    from megatron_tc.data import DataConfig, prepare_data

    dcfg = DataConfig.from_config(ctx.cfg.data)

    def prepare():
        data = prepare_data(dcfg, ctx.paths.root, tokenizer=tokenizer, model_vocab_size=vocab_size)
        for split in ("eval", "train"):
            data.token_stream(split)
        return data

    ctx._data = ctx.rank0_first(prepare)
    return ctx._data


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    from megatron_tc.calibrate.teacher_io import _tokenizer_files

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return _tokenizer_files(Path(tmp))


def _warn_if_auto_tokenizer_differs(target: Path, tokenizer: Any, sample: str) -> None:
    """transformers 5 picks the tokenizer class of AutoTokenizer from config.json's model_type (e.g.
    qwen2 -> Qwen2Tokenizer, which rebuilds its own pre-tokenizer and drops a sentencepiece
    tokenizer's spaces). The pipeline is unaffected (the converted checkpoint's tokenizer/ has no
    config.json), but a user of the HF directory should know."""
    from transformers import AutoTokenizer

    try:
        auto = AutoTokenizer.from_pretrained(str(target))
    except Exception as err:  # noqa: BLE001  (a check that only warns must not fail the stage)
        log.warning("AutoTokenizer.from_pretrained(%s) fails (%s: %s); load this model's tokenizer with "
                    "transformers.PreTrainedTokenizerFast.from_pretrained", target, type(err).__name__, err)
        return
    if auto(sample)["input_ids"] != tokenizer(sample)["input_ids"]:
        log.warning("AutoTokenizer.from_pretrained(%s) gives %s, which tokenizes differently from the training "
                    "tokenizer; load this model's tokenizer with transformers.PreTrainedTokenizerFast.from_pretrained "
                    "(the pipeline's convert stage keeps the exact tokenizer)", target, type(auto).__name__)


# ---- the stage --------------------------------------------------------------------------------------

def pretrain_outputs(paths: Any, cfg: Any) -> list[Path]:
    return [paths.stage_dir("pretrain") / "model" / "manifest.json", Path(cfg.model.teacher) / MARKER]


def _check_export_target(target: Path) -> None:
    if target.exists() and not (target / MARKER).is_file():
        raise FileExistsError(f"model.teacher={target} exists and was not written by a pretrain stage: the pretrain "
                              "stage exports its model there; point model.teacher at a new directory (or delete it)")


def run_pretrain(ctx: RunContext, stop_after: int | None = None) -> dict[str, Any]:
    """Train cfg.pretrain.hf_config's architecture from scratch on the train split; save it as a
    megatron_tc checkpoint (<run_dir>/pretrain/model) and as an HF directory at model.teacher."""
    from megatron_tc.convert.checkpoint import save_checkpoint
    from megatron_tc.convert.export import export_to_hf
    from megatron_tc.data.tokenizer import load_tokenizer
    from megatron_tc.distill.evaluation import window_rows
    from megatron_tc.distill.runner import StageStopped
    from megatron_tc.model.transformer import HybridLM
    from megatron_tc.parallel.deepspeed_engine import build_student_engine

    cfg, par = ctx.cfg, ctx.par
    if par.pp_size > 1:  # refused by the config checks already
        raise ValueError("the pretrain stage runs with parallel.pp=1 (data and tensor parallelism, ZeRO)")
    target = Path(cfg.model.teacher)
    _check_export_target(target)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    arch, hf_fields = pretrain_arch(cfg, tokenizer)
    _prepare_data(ctx, tokenizer, arch.vocab_size)
    torch.manual_seed(cfg.run.seed)  # the same initial weights on every rank, before any sharding
    model = HybridLM(arch, init_std=cfg.pretrain.init_std)
    if par.tp_size > 1:
        total = sum(p.numel() for p in model.parameters())
        shard_for_tp(model, par)
        log.info("pretrain: tensor-parallel over %d ranks, %d of %d parameters on this rank", par.tp_size,
                 sum(p.numel() for p in model.parameters()), total)
    tcfg = trainer_config(cfg)
    d = cfg.data
    loader = ctx.data().loader("train", global_batch_size=d.global_batch_size, micro_batch_size=d.micro_batch_size,
                               dp_rank=par.dp_rank, dp_size=par.dp_size, seed=cfg.run.seed)
    rows = window_rows(ctx.eval_windows()) if evaluates_while_training(cfg.distill) else []
    out_dir = ctx.paths.stage_dir("pretrain")
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("pretrain: %s, %.1fM parameters, %d layers, hidden %d", arch.family,
             sum(p.numel() for p in model.parameters()) / 1e6, arch.num_layers, arch.hidden_size)
    ds_config = stage2_deepspeed_config(tcfg, par, ctx.device, str(ctx.paths.tensorboard), model,
                                        resume_stage=latest_zero_stage(out_dir / "checkpoints"))
    model.set_activation_checkpointing(cfg.parallel.activation_checkpointing)
    engine = build_student_engine(model, ds_config, par)
    trainer = PretrainTrainer(tcfg, par, engine, None, loader, rows, out_dir, _RenamedTB(ctx.tb), ctx.device,
                              arch.vocab_size, eval_log=out_dir / "eval_log.jsonl")
    with trainer:
        result = trainer.run(stop_after)
    if result.stopped_early:
        raise StageStopped(f"pretrain stopped at step {result.steps}")
    def save() -> None:
        source = {"stage": "pretrain", "hf_config": hf_fields, "steps": result.steps, "tokens": result.tokens,
                  "documents": ctx.data().manifest.names("train")}
        save_checkpoint(result.student_state, arch, out_dir / "model", source=source,
                        tokenizer_files=tokenizer_files(tokenizer), overwrite=True)
        export_to_hf(out_dir / "model", target, overwrite=target.exists())
        marker = {"run_dir": str(ctx.paths.root), "steps": result.steps, "tokens": result.tokens,
                  "last_eval": result.last_eval}
        (target / MARKER).write_text(json.dumps(marker, indent=1, default=str) + "\n")
        sample = (ctx.data().documents("eval") or ctx.data().documents("train"))[0].text[:4000]
        _warn_if_auto_tokenizer_differs(target, tokenizer, sample)

    ctx.on_rank0(save)
    return {"steps": result.steps, "tokens": result.tokens, "skipped_steps": result.skipped_steps,
            "last_eval": result.last_eval, "hf": str(target)}
