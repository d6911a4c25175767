"""megatron_tc.distill.host_memory: with the settings applied, a buffer allocated after a larger one
was freed is served from the kept heap (no page faults); the switch and glibc's own
variables are honoured; a bad switch value is one clear error."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_tc.distill import host_memory

# allocate and touch 320 MiB, free it, then count the minor page faults of a 256 MiB buffer (smaller,
# so that it fits the freed block whatever small allocations landed after it, as a step's buffers do)
PROBE = """
import json, resource, sys
import torch
from megatron_tc.distill.host_memory import keep_freed_host_memory
done = keep_freed_host_memory() if sys.argv[1] == "keep" else "untouched"
def faults_of_one_buffer(mib):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(mib * 2**18)  # every page written
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_buffer(320)
print(json.dumps({"done": done, "faults": faults_of_one_buffer(256)}))
"""


def probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in host_memory.GLIBC_ENV and k != host_memory.ENV}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, "OMP_NUM_THREADS": "1", **env},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_buffer_is_reused_without_page_faults():
    pages = 256 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    plain, kept = probe("plain"), probe("keep")
    assert plain["faults"] > pages // 2  # a fresh mapping, faulted in page by page again
    assert kept["done"].startswith("freed memory kept for reuse")
    assert kept["faults"] < pages // 20


def test_the_switch_and_glibcs_own_variables_leave_malloc_alone():
    assert probe("keep", MEGATRON_TC_KEEP_HOST_MEMORY="0")["done"] == "left as it is ($MEGATRON_TC_KEEP_HOST_MEMORY=0)"
    assert probe("keep", MALLOC_ARENA_MAX="2")["done"].startswith("freed memory kept")  # not one of the four
    assert probe("keep", MALLOC_TRIM_THRESHOLD_="1048576")["done"] == \
        "left to the MALLOC_* variables set in the environment"


def test_a_bad_switch_value_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "yes")
    with pytest.raises(ValueError, match=r"MEGATRON_TC_KEEP_HOST_MEMORY='yes': use 1 .* or 0"):
        host_memory.keep_freed_host_memory()
