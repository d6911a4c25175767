"""Sweep 2 makes the readout sums after o_proj (G, r, YY) only for the closed forms whose strategy
reads them (the fitted gate's); everything else it makes is unchanged, and a strategy that needs
them refuses stats without them before any work."""
import pytest
import torch

from megatron_tc.calibrate.policies import readout_gap
from megatron_tc.calibrate.readout import PRODUCT_KEYS
from megatron_tc.calibrate.readout_mixers import readout_closed_forms
from megatron_tc.calibrate.stats import collect_stats
from megatron_tc.calibrate.statsfile import StatsMismatchError, TaylorStats
from megatron_tc.calibrate.strategies import REGISTRY, Taylor, TaylorFit, get_strategy
from megatron_tc.calibrate.student import build_student, calibrate_student
from tests.parallel._workers_stats import row_batches, tiny_teacher_and_rows

PATTERN = "GAG"
CONVERTED = [0, 2]


def _stats(strategies):
    teacher, ids, doc_ids = tiny_teacher_and_rows()
    meta = {"teacher_sha256": "t", "seq_len": 24}
    return collect_stats(teacher, row_batches(ids, doc_ids, range(4)), CONVERTED, meta,
                         readout_strategies=[get_strategy(s) for s in strategies],
                         student_arch=teacher.arch.with_pattern(PATTERN), chunk_size=5, progress=False)


@pytest.fixture(scope="module")
def both():
    """(stats as the pass makes them, stats with the products forced for taylor too) of taylor_calibrate and
    taylor_fit-closed over the same rows."""
    made = _stats(["taylor_calibrate", "taylor_fit-closed"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Taylor, "readout_products", True)
        forced = _stats(["taylor_calibrate", "taylor_fit-closed"])
    return made, forced


def test_every_registered_strategy_gets_the_products_it_reads():
    """The sums of a readout name are made by its closed form's strategy: it must make the products
    whenever a strategy sharing them reads them (the fitted-gate ones), and only then."""
    needing = set()
    for name in REGISTRY:
        strategy = get_strategy(name)
        if strategy.needs_readout:
            closed_form = readout_closed_forms([strategy])[strategy.readout_name]
            assert closed_form.readout_products == strategy.readout_products, name
            needing |= {name} if strategy.readout_products else set()
    assert needing == {"taylor_fit-closed", "taylor_fit+gatefit", "taylor_fit-meangate"}


def test_taylor_calibrate_sums_no_products_and_initializes_the_same_layers(both):
    made, forced = both
    assert made.meta["readout"]["taylor"] == {"candidates": 1, "products": False}
    assert forced.meta["readout"]["taylor"]["products"] is True
    assert made.sums.keys() == forced.sums.keys() - {f"readout.taylor.layers.{l}.{k}" for l in CONVERTED
                                                      for k in PRODUCT_KEYS}
    for key, value in made.sums.items():
        assert torch.equal(value, forced.sums[key]), key
    teacher = tiny_teacher_and_rows()[0]
    students = [build_student(teacher, PATTERN, "taylor_calibrate", stats, teacher_sha256="t") for stats in both]
    lean, full = (student.state_dict() for student in students)
    assert lean.keys() == full.keys()
    for key, value in lean.items():
        assert torch.equal(value, full[key]), key


def test_the_fitted_gate_still_gets_its_products(both):
    made = both[0]
    assert made.meta["readout"]["taylor_fit-closed"] == {"candidates": 8, "products": True}
    heads = tiny_teacher_and_rows()[0].arch.num_heads
    for layer in CONVERTED:
        readout = made.readout("taylor_fit-closed", layer)
        assert readout["G"].shape == (8 * heads, 8 * heads) and readout["r"].shape == (8 * heads,)
        assert float(readout["YY"]) > 0 and float(readout["G"].diagonal().min()) > 0
    assert len(readout_gap(made, 1).keep) == 1


def test_a_strategy_needing_products_refuses_stats_without_them(tmp_path):
    with pytest.MonkeyPatch.context() as patch:  # the pass as if taylor_fit-closed did not read them
        patch.setattr(TaylorFit, "readout_products", False)
        _stats(["taylor_fit-closed"]).save(tmp_path / "stats.pt")
    stats = TaylorStats.load(tmp_path / "stats.pt")
    assert stats.meta["readout"]["taylor_fit-closed"]["products"] is False
    assert not set(PRODUCT_KEYS) & set(stats.readout("taylor_fit-closed", 0))
    wanted = "lack the sums after o_proj .* rerun the statistics pass with taylor_fit-meangate"
    with pytest.raises(StatsMismatchError, match=wanted) as err:  # before the teacher is even looked at
        calibrate_student(None, [1], "taylor_fit-meangate", stats=stats, progress=False)
    assert "\n" not in str(err.value)
    with pytest.raises(StatsMismatchError, match="lack the sums after o_proj"):
        build_student(tiny_teacher_and_rows()[0], PATTERN, "taylor_fit-closed", stats, teacher_sha256="t")
    with pytest.raises(StatsMismatchError, match="that readout_gap reads"):
        readout_gap(stats, 1)
    with pytest.raises(ValueError, match="fitted-gate strategy"):
        readout_gap(stats, 1, strategy="taylor_fit")
