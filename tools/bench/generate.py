#!/usr/bin/env python
"""`model.generate` speed, teacher (transformers, static cache, compiled) vs exported student.

    python tools/bench/generate.py [--models smollm2-135m,llama-1b] [--prompt 32768]
        [--batches 8,1,32] [--new-tokens 48] [--repeats 3] [--prefill 4096,32768] [--profile] [--out FILE]
        [--quick] [--eager-rounds N] [--layer-graph-elements N]

--eager-rounds N measures only the prefill forward of a prompt with no whole-model graph (B=1, each
--prefill length): the teacher, the student eager, the student's first prompt of a bucket (its
layer graphs captured anew in every round) and the same prompt replaying those layer graphs,
alternating N rounds in one process, the speed-ups per round.

Prints one JSON object per measurement as it finishes (so a run cut short keeps what it has) and
writes them all to --out. See megatron_tc/bench/generate.py for what is measured.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_tc.config.errors import command_line  # noqa: E402
from megatron_tc.bench.generate import eager_prefill_rounds, role_rows, student_model, teacher_model  # noqa: E402
from megatron_tc.bench.models import PRESETS  # noqa: E402
from megatron_tc.export import graphs_megatron_tc  # noqa: E402


@command_line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m")
    p.add_argument("--prompt", type=int, default=32768)
    p.add_argument("--batches", default="8,1,32")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill", default="4096,32768", help="prompt lengths of the B=1 prefill comparison")
    p.add_argument("--roles", default="teacher,student",
                   help="teacher, student (captured decoding step on CUDA), "
                        "student-eager (no CUDA graphs: eager decoding and prefill)")
    p.add_argument("--profile", action="store_true",
                   help="add the operators of one prefill forward per case (host and device self time); with "
                        "--eager-rounds, of the teacher's prefill, the student's first prompt and its replay")
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true", help="tiny model, CPU-sized shapes (a smoke test)")
    p.add_argument("--eager-rounds", type=int, default=0, metavar="N",
                   help="only the prefill with no whole-model graph: teacher, student eager, student's first "
                        "prompt and its layer graphs replayed, alternating N rounds in one process")
    p.add_argument("--layer-graph-elements", type=int, metavar="N",
                   help="prefills of at most N activations (batch x prompt x hidden size) run from layer graphs "
                        "(default: the export's LAYER_GRAPH_ELEMENTS)")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.prompt, args.batches, args.new_tokens, args.prefill = "tiny", 32, "2", 8, "16"
        args.repeats, args.warmup_steps = 1, 1
    if args.layer_graph_elements is not None:
        if args.layer_graph_elements < 0:
            p.error(f"--layer-graph-elements must be 0 or more, got {args.layer_graph_elements}")
        graphs_megatron_tc.LAYER_GRAPH_ELEMENTS = args.layer_graph_elements
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import transformers

    rows = []
    env = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "dtype": str(dtype).removeprefix("torch.")}
    print(json.dumps({"environment": env}), flush=True)
    for name in args.models.split(","):
        arch = PRESETS[name]()
        if args.eager_rounds > 0:
            teacher, student = (build(arch, device, dtype) for build in (teacher_model, student_model))
            for row in eager_prefill_rounds(teacher, student, [int(n) for n in args.prefill.split(",")],
                                            args.eager_rounds, args.new_tokens, arch.vocab_size, device,
                                            args.profile):
                rows.append({**row, "model": name, "role": "prefill with no whole-model graph, teacher / student"})
                print(json.dumps(rows[-1]), flush=True)
            del teacher, student
            continue
        cases = [(b, args.prompt) for b in map(int, args.batches.split(","))]
        cases += [(1, n) for n in map(int, args.prefill.split(",")) if n != args.prompt]
        for role in args.roles.split(","):
            for row in role_rows(arch, role, cases, args.new_tokens, args.repeats, args.warmup_steps, device,
                                 dtype, args.profile):
                rows.append(row | {"model": name, "role": role})
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": env, "args": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
