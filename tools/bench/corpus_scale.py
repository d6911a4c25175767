#!/usr/bin/env python
"""CPU benchmark: tools/preprocess.py's peak resident memory and MB/s on a corpus of real text
repeated with variation, and the loader's memory over the resulting store, at several sizes.

    python tools/bench/corpus_scale.py --tokenizer TOKENIZER [--gb 1 5] [--out docs/results/corpus_scale.json]
"""
import sys

from megatron_tc.bench.corpus_scale import main

if __name__ == "__main__":
    sys.exit(main())
