import pytest
import torch

from tests.reliability._rundir import Job, build_template, clone

_NEEDS_REFERENCE = False


def pytest_collection_modifyitems(config, items):
    global _NEEDS_REFERENCE
    _NEEDS_REFERENCE = any("reference" in getattr(item, "fixturenames", ()) for item in items)


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    """The tiny run directory every stage-2 scenario copies (teacher, init student, corpus, tokenizer).
    When a collected test needs the reference run, it starts here, overlapping the tests before it."""
    base = build_template(tmp_path_factory.mktemp("template"))
    if _NEEDS_REFERENCE:
        ref = clone(base, tmp_path_factory.mktemp("reference"))
        _reference_jobs.append((ref, Job(ref, name="reference")))
    yield base
    for _, job in _reference_jobs:
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()


_reference_jobs: list = []


@pytest.fixture(scope="session")
def reference(template):
    """An uninterrupted stage-2 run (started by `template`); call the fixture's value to wait for it
    and get its base directory."""
    ref, job = _reference_jobs[0]
    return lambda: job.finished_ok() and ref


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, as in the subprocesses: tests/conftest.py sets OMP_NUM_THREADS only after
    torch is imported, so the pytest process would otherwise use every core (and spin under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
