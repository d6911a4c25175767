"""EngineOwner: leaving `with trainer:` releases the engines; a failure while releasing them after the
run has failed does not hide the run's own error (the real release is tested on ZeRO-3 engines in
tests/parallel: _workers_distill.nan_policies, _workers_zero)."""
import pytest

from megatron_tc.parallel.deepspeed_engine import EngineOwner


class _EngineThatCannotBeDestroyed:
    module = None

    def destroy(self):
        raise RuntimeError("destroy failed")


class _Owner(EngineOwner):
    def __init__(self):
        self.engine, self.teacher = _EngineThatCannotBeDestroyed(), None


def test_the_runs_error_wins_over_a_release_failure():
    with pytest.warns(UserWarning, match="after NotImplementedError failed: RuntimeError"):
        with pytest.raises(NotImplementedError, match="the run's error"):
            with _Owner():
                raise NotImplementedError("the run's error")


def test_a_release_failure_after_a_clean_run_is_raised():
    with pytest.raises(RuntimeError, match="destroy failed"):
        with _Owner():
            pass
