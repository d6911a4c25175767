"""The code an exported hybrid student carries (`trust_remote_code`), one source of truth.

The modules below import only torch and transformers (and fla, optionally, by name); the export
copies them verbatim into the student's directory, and `megatron_tc.convert.hf_student` uses the
same modules in-package, so the loaded class is the same code with or without megatron_tc.
"""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
REMOTE_FILES = ("configuration_megatron_tc.py", "modeling_megatron_tc.py", "layers_megatron_tc.py",
                "attention_megatron_tc.py", "cache_megatron_tc.py", "gated_delta_megatron_tc.py",
                "graphs_megatron_tc.py")


def remote_code() -> dict[str, str]:
    """{file name: source} of the files an exported student directory holds."""
    return {name: (HERE / name).read_text() for name in REMOTE_FILES}
