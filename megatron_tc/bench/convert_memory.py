"""Peak resident memory of converting and resharding a checkpoint of Llama-3-8B's exact shape.

A random bf16 HF checkpoint with Llama-3-8B's widths (hidden 4096, FFN 14336, 32 heads, 8 KV
heads, vocabulary 128256, untied head; ~16 GB at 32 layers) is written tensor by tensor; then
`tools/convert_hf_to_megatron.py --tp 2 --pp 2` and `tools/reshard.py --tp 4 --pp 1` run as
child processes under `/usr/bin/time -v` (peak RSS, wall time). Logits parity is checked on a
2-layer cut of the same widths: the HF model and the converted checkpoint, one after the other
(each alone in memory), on the same random tokens.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from megatron_tc.config.errors import command_line
from megatron_tc.convert.lazy import LazyTensor

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
ROWS_PER_CHUNK = 1024


class RandomNormal(LazyTensor):
    """Seeded normal values (mean `mean`, std `std`), generated in row chunks when written."""

    def __init__(self, shape: tuple[int, ...], seed: int, std: float, mean: float = 0.0,
                 dtype: torch.dtype = torch.bfloat16):
        self.shape, self.seed, self.std, self.mean, self.dtype = tuple(shape), seed, std, mean, dtype

    def fill(self, out: torch.Tensor) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        for start in range(0, self.shape[0], ROWS_PER_CHUNK):
            rows = out[start:start + ROWS_PER_CHUNK]
            rows.copy_(torch.randn(rows.shape, generator=gen) * self.std + self.mean)


def llama3_8b_config(num_layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=num_layers, **LLAMA3_8B, architectures=["LlamaForCausalLM"])


def write_random_llama(directory: Path, num_layers: int, seed: int = 0) -> int:
    """A random bf16 HF Llama checkpoint of Llama-3-8B's widths; returns its weight bytes."""
    from megatron_tc.convert.export import save_weights

    config = llama3_8b_config(num_layers)
    h, f, d = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "lm_head.weight": (config.vocab_size, h),
              "model.norm.weight": (h,)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    weights = {name: RandomNormal(shape, seed + k, std=0.02 if len(shape) == 2 else 0.1,
                                  mean=0.0 if len(shape) == 2 else 1.0)
               for k, (name, shape) in enumerate(shapes.items())}
    directory.mkdir(parents=True, exist_ok=True)
    config.dtype = "bfloat16"
    config.save_pretrained(str(directory))
    save_weights(weights, directory)
    return sum(w.nbytes() for w in weights.values())


def timed_child(cmd: list[str]) -> dict[str, Any]:
    """Run `cmd` niced under /usr/bin/time -v; peak RSS (MiB) and wall seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    full = ["nice", "-n", "19", "/usr/bin/time", "-v", *cmd]
    done = subprocess.run(full, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", done.stderr).group(1)
    seconds = sum(float(x) * 60**i for i, x in enumerate(reversed(wall.split(":"))))
    shown = ["python", *(os.path.relpath(c) if os.path.isabs(c) and "tools" in c else c for c in cmd[1:])]
    return {"command": " ".join(shown), "peak_rss_mib": round(rss_kb / 1024, 1), "wall_s": round(seconds, 1)}


def logits_parity(hf_dir: Path, ckpt: Path, dtype: torch.dtype = torch.float32, seq_len: int = 16,
                  seed: int = 0) -> dict[str, Any]:
    """Max |logit difference| of the HF model and the converted checkpoint (both in `dtype`),
    loaded one after the other."""
    from transformers import AutoModelForCausalLM

    from megatron_tc.convert.hf_to_megatron import load_hybrid_lm

    ids = torch.randint(0, LLAMA3_8B["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
        want = hf(input_ids=ids).logits.float()
        del hf
        gc.collect()
        ours = load_hybrid_lm(ckpt, dtype=dtype)
        got = ours(ids)[..., : want.shape[-1]].float()
        del ours
    diff = (got - want).abs().max().item()
    return {"max_abs_logit_diff": diff, "top1_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
            "logit_std": want.std().item(), "tokens": seq_len, "dtype": str(dtype).removeprefix("torch.")}


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="runs/convert_memory", help="scratch directory (git-ignored; ~50 GB at 32 layers)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--parity-layers", type=int, default=2, help="layers of the cut used for logits parity (0: skip)")
    p.add_argument("--parity-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of both models in the parity check (float32 needs ~6 GB at 2 layers)")
    p.add_argument("--out", default="docs/results/convert_memory.json")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (default: delete them)")
    args = p.parse_args(argv)
    work = Path(args.work)
    tools = Path(__file__).resolve().parents[2] / "tools"
    py = sys.executable
    result: dict[str, Any] = {"date": dt.date.today().isoformat(), "hardware": f"{platform.machine()}, "
                              f"{os.cpu_count()} CPU cores", "software": _versions(), "config": {"layers": args.layers,
                              **{k: v for k, v in LLAMA3_8B.items() if k != "rope_parameters"}, "dtype": "bfloat16"},
                              "command": " ".join(["python", "tools/bench/convert_memory.py", *(argv or sys.argv[1:])])}
    try:
        start = time.perf_counter()
        src, tp2pp2, tp4 = work / "hf", work / "tp2pp2", work / "tp4pp1"
        result["weight_bytes"] = write_random_llama(src, args.layers)
        result["write_source_s"] = round(time.perf_counter() - start, 1)
        print(f"wrote {result['weight_bytes'] / 1e9:.1f} GB of random weights in {result['write_source_s']} s",
              flush=True)
        result["convert_tp2_pp2"] = timed_child([py, str(tools / "convert_hf_to_megatron.py"), "--hf", str(src),
                                                 "--out", str(tp2pp2), "--tp", "2", "--pp", "2", "--overwrite"])
        print(result["convert_tp2_pp2"], flush=True)
        shutil.rmtree(src)
        result["reshard_tp4_pp1"] = timed_child([py, str(tools / "reshard.py"), "--ckpt", str(tp2pp2),
                                                 "--out", str(tp4), "--tp", "4", "--pp", "1", "--overwrite"])
        print(result["reshard_tp4_pp1"], flush=True)
        if not args.keep:
            shutil.rmtree(tp2pp2)
            shutil.rmtree(tp4)
        if args.parity_layers:
            cut, cut_ck = work / "hf_cut", work / "cut_tp2pp2"
            write_random_llama(cut, args.parity_layers, seed=1)
            timed_child([py, str(tools / "convert_hf_to_megatron.py"), "--hf", str(cut), "--out", str(cut_ck),
                         "--tp", "2", "--pp", "2", "--overwrite"])
            parity = logits_parity(cut, cut_ck, getattr(torch, args.parity_dtype))
            result["parity_cut"] = {"layers": args.parity_layers, "layout": "tp2 x pp2", **parity}
            print(result["parity_cut"], flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _versions() -> dict[str, str]:
    import safetensors
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__}
