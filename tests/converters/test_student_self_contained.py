"""An exported student loads with trust_remote_code where megatron_tc cannot be imported, on the
newest (pinned) and the oldest supported transformers, and matches the in-package model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_tc.convert import checkpoint as ckpt
from megatron_tc.convert.export import export_to_hf
from megatron_tc.export import REMOTE_FILES
from megatron_tc.model import HybridLM, generate
from tests.converters.helpers import tiny_arch

ROOT = Path(__file__).resolve().parents[2]

OLDEST = "5.17.0"  # the oldest transformers release exported students support (docs/conversion.md)
# what the oldest release needs beside the pinned environment: huggingface_hub 1.x (2.x is refused) and httpx
OLDEST_PACKAGES = (f"transformers=={OLDEST}", "huggingface_hub==1.33.0", "httpx==0.28.1", "httpcore==1.0.9")

SCRIPT = r"""
import importlib.abc, sys

class NoMegatronTC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "megatron_tc":
            raise ImportError("megatron_tc is deliberately not importable here")

sys.meta_path.insert(0, NoMegatronTC())
import torch, transformers
hf, ids_file, out_file = sys.argv[1:4]
model = transformers.AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True, dtype=torch.float32).eval()
ids = torch.load(ids_file)
with torch.no_grad():
    logits = model(input_ids=ids).logits
greedy = model.generate(ids[:1, :9], max_new_tokens=10, min_new_tokens=10, do_sample=False)
beams = model.generate(ids[:, :9], attention_mask=torch.ones(2, 9, dtype=torch.long), num_beams=2,
                       max_new_tokens=4, min_new_tokens=4, do_sample=False)
torch.save({"version": transformers.__version__, "module": type(model).__module__,
            "imported": sorted(m for m in sys.modules if m.split(".")[0] == "megatron_tc"),
            "logits": logits, "greedy": greedy, "beams": beams}, out_file)
"""


def oldest_transformers() -> str:
    """A --target directory holding transformers OLDEST: $MEGATRON_TC_TRANSFORMERS_OLDEST, else the
    one tools/setup_env.sh installs into .cache/ (skipped, saying how to get it, when absent)."""
    given = os.environ.get("MEGATRON_TC_TRANSFORMERS_OLDEST")
    path = Path(given) if given else ROOT / ".cache" / f"transformers-{OLDEST}"
    if not (path / "transformers").is_dir():
        pytest.skip(f"transformers {OLDEST} not found at {path}: run tools/setup_env.sh, or pip install --no-deps "
                    f"--target DIR {' '.join(OLDEST_PACKAGES)} and set MEGATRON_TC_TRANSFORMERS_OLDEST=DIR")
    return str(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = HybridLM(tiny_arch("GAGA", tie_embeddings=False)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    root = tmp_path_factory.mktemp("self_contained")
    ck = ckpt.save_checkpoint(model.state_dict(), model.arch, root / "ck", 1, 1, source={"hf_config": {"eos_token_id": 2}})
    return model, export_to_hf(ck, root / "hf")


def test_export_holds_the_package_modules_verbatim(exported):
    _, hf = exported
    source = Path(__file__).resolve().parents[2] / "megatron_tc" / "export"
    for name in REMOTE_FILES:
        assert (hf / name).read_text() == (source / name).read_text()
        assert "megatron_tc." not in (hf / name).read_text().replace("megatron_tc.py", "")


@pytest.mark.parametrize("release", ["pinned", "oldest"])
def test_loads_without_megatron_tc_and_matches_the_in_package_model(exported, release, tmp_path):
    model, hf = exported
    ids = torch.randint(3, 300, (2, 70))  # longer than one GDN chunk (64)
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "run.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    if release == "oldest":
        env["PYTHONPATH"] = oldest_transformers()
    run = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(hf), str(tmp_path / "ids.pt"),
                          str(tmp_path / "out.pt")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    if release == "oldest":
        assert out["version"] == OLDEST
    assert out["module"].startswith("transformers_modules.") and out["imported"] == []
    with torch.no_grad():
        assert (out["logits"] - model(ids)).abs().max().item() <= 1e-5
    assert torch.equal(out["greedy"], generate(model, ids[:1, :9], 10))
    assert out["beams"].shape == (2, 13)


def test_every_generation_mode_on_the_oldest_release(tmp_path):
    """tests/converters/test_student_generate.py again, with the oldest supported transformers."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([oldest_transformers(), str(root)])}
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             env=env, capture_output=True, text=True, timeout=300)
    assert version.stdout.strip() == OLDEST, version.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
                          str(root / "tests" / "converters" / "test_student_generate.py")],
                         cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
