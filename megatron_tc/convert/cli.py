"""Command lines behind tools/convert_hf_to_megatron.py, convert_megatron_to_hf.py,
verify_conversion.py and reshard.py. Bad input exits with status 2 and a one-line error."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Callable

from megatron_tc.convert.checkpoint import DTYPES

DTYPE_CHOICES = ["auto", *sorted(DTYPES)]


def _run(work: Callable[[], int]) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logger = logging.getLogger("megatron_tc.convert")
    if not logger.handlers:  # phase timings on stdout, without changing other libraries' logging
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    from megatron_tc.convert.errors import CheckpointError, ConversionError
    from megatron_tc.convert.hf_mapping import HFMappingError
    from megatron_tc.model.config import ArchConfigError

    try:
        return work()
    except (ConversionError, CheckpointError, HFMappingError, ArchConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def convert_hf_to_megatron_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="HF model (dir, .gguf, or dir with one .gguf) -> megatron_tc TP x PP checkpoint")
    p.add_argument("--hf", required=True, help="HF model directory, a .gguf file, or a directory holding one .gguf")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (must divide heads and KV groups)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="cast weights (auto: keep the source's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    def work() -> int:
        from megatron_tc.convert.hf_to_megatron import convert_hf_to_megatron

        start = time.perf_counter()
        out = convert_hf_to_megatron(args.hf, args.out, args.tp, args.pp, dtype=args.dtype,
                                     overwrite=args.overwrite, progress=not args.no_progress)
        print(f"wrote {out} (tp={args.tp}, pp={args.pp}) in {time.perf_counter() - start:.1f} s")
        return 0

    return _run(work)


def convert_megatron_to_hf_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="megatron_tc checkpoint -> HF directory (teacher family format, or "
                                            "a megatron_tc_hybrid student)")
    p.add_argument("--ckpt", required=True, help="megatron_tc checkpoint directory")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="cast weights (auto: keep)")
    p.add_argument("--as-student", action="store_true", help="write the megatron_tc_hybrid format even for an "
                                                             "all-attention checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    def work() -> int:
        from megatron_tc.convert.export import export_to_hf

        start = time.perf_counter()
        out = export_to_hf(args.ckpt, args.out, overwrite=args.overwrite, dtype=args.dtype, as_student=args.as_student,
                           progress=not args.no_progress)
        print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
        return 0

    return _run(work)


def verify_conversion_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="max logit difference and top-1 agreement of a checkpoint vs its HF model")
    p.add_argument("--hf", required=True, help="HF model directory, .gguf, or directory holding one .gguf")
    p.add_argument("--ckpt", required=True, help="megatron_tc checkpoint directory")
    p.add_argument("--tol", type=float, default=1e-4, help="max allowed |logit difference| (fp32)")
    p.add_argument("--num-random", type=int, default=4, help="random-token prompts (fixed seed)")
    p.add_argument("--seq-len", type=int, default=32, help="length of the random prompts")
    args = p.parse_args(argv)

    def work() -> int:
        import torch

        from megatron_tc.convert.verify import verify_conversion

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
        result = verify_conversion(args.hf, args.ckpt, num_random=args.num_random, seq_len=args.seq_len)
        verdict = "PASS" if result.passed(args.tol) else "FAIL"
        print(f"{result.summary()}; tolerance {args.tol:g}: {verdict}")
        return 0 if result.passed(args.tol) else 1

    return _run(work)


def reshard_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="rewrite a megatron_tc checkpoint with another TP x PP (no HF detour)")
    p.add_argument("--ckpt", required=True, help="source checkpoint directory")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    def work() -> int:
        from megatron_tc.convert.checkpoint import reshard

        start = time.perf_counter()
        out = reshard(args.ckpt, args.out, args.tp, args.pp, overwrite=args.overwrite, progress=not args.no_progress)
        print(f"wrote {out} (tp={args.tp}, pp={args.pp}) in {time.perf_counter() - start:.1f} s")
        return 0

    return _run(work)
