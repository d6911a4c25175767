"""Evaluation: how converted students compare with their teachers (docs/evaluation.md).

- `loading`: `load_model(path)` for HF dirs, .gguf files and megatron_tc checkpoints -> a
  `LoadedModel` (a logits callable + tokenizer + cached greedy generate).
- `perplexity`: ppl, KL(teacher || student) per token, top-1 agreement over a text file
  (non-overlapping windows, fp64 sums); CLI `tools/evaluate.py`.
- `harness`: lm-evaluation-harness through its own HFLM (`megatron_tc` registered on import), plus `LogitsLM` for bare logits callables.
- `long_context`: synthetic associative-recall probe at 1k..32k tokens, teacher vs student.
- `tokens_to_target`: eval logs (eval_log.jsonl / TensorBoard) -> tokens to reach ppl targets,
  ratios vs naive and taylor_calibrate.
- `plots`, `report`: PNG of eval ppl vs tokens; markdown report (`tools/report.py`).
- `grid`: init x policy x teacher grid with a `run_cell` boundary (`tools/run_grid.py`).

Import the submodules you need; this package imports nothing heavy.
"""
