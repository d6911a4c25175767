"""How the calibration tokens are shared out: statistics on data.calib_tokens, alignment on the first
calibrate.align_tokens of them, taylor_fit's held-out step choice on the tokens after them."""
import pytest

from megatron_tc.config import apply_overrides, config_from_dict
from megatron_tc.distill.stages import alignment_tokens, heldout_calibration_tokens


def make(*overrides: str):
    return config_from_dict(apply_overrides({"model": {"teacher": "t"}}, overrides))


@pytest.mark.parametrize("align, calib, want", [(4096, 8192, 4096), (8192, 8192, 8192), (32768, 16384, 16384)])
def test_alignment_trains_on_the_first_align_tokens_never_past_calib_tokens(align, calib, want):
    assert alignment_tokens(make(f"calibrate.align_tokens={align}", f"data.calib_tokens={calib}")) == want


def test_heldout_slice_is_a_quarter_of_the_calibration_tokens_and_at_least_one_row():
    assert heldout_calibration_tokens(make("data.calib_tokens=32768", "data.seq_len=512")) == 8192
    assert heldout_calibration_tokens(make("data.calib_tokens=256", "data.seq_len=512")) == 512
