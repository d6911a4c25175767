"""Shared helpers of the benchmark scripts (tools/bench_*.py): timing, error metrics, peak
measurements, FLOP counts, model presets and result files. Nothing here is used in training."""
