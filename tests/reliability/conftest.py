import pytest
import torch

from tests.reliability._rundir import Job, build_template, clone


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    """The tiny run directory every stage-2 scenario copies (teacher, init student, corpus, tokenizer)."""
    return build_template(tmp_path_factory.mktemp("template"))


@pytest.fixture(scope="session")
def reference(template, tmp_path_factory):
    """An uninterrupted stage-2 run, started at once (it overlaps the first test that uses it);
    call the fixture's value to wait for it and get its base directory."""
    base = clone(template, tmp_path_factory.mktemp("reference"))
    job = Job(base, name="reference")
    yield lambda: job.finished_ok() and base
    if job.proc.poll() is None:
        job.proc.kill()
        job.proc.wait()


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread, as in the subprocesses: tests/conftest.py sets OMP_NUM_THREADS only after
    torch is imported, so the pytest process would otherwise use every core (and spin under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
