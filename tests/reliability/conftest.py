import pytest

from tests.reliability._rundir import build_template


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    """The tiny run directory every stage-2 scenario copies (teacher, init student, corpus, tokenizer)."""
    return build_template(tmp_path_factory.mktemp("template"))
