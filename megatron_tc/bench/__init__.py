"""Shared helpers of the benchmark scripts (tools/bench/*.py): timing, error metrics, peak
measurements, FLOP counts, model presets and result files. Nothing here is used in training."""
