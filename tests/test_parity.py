"""labkit.lessons.parity's verdict on interleaved pairs of step times: decided on an interval, so noise cannot flip it.

Synthetic timings only (no ranks): the matched runs themselves are tested in test_deepspeed.py.
"""

import pytest

from labkit.lessons import parity
from labkit.measured import Measured


def _verdict(ratios: list[float]) -> parity.ParityVerdict:
    """`decide` on FSDP2 steps of 0.3 s and DeepSpeed steps at `ratios` x that."""
    return parity.decide([0.3] * len(ratios), [0.3 * r for r in ratios])


def test_the_two_runs_of_issue_29_get_the_same_verdict():
    # "1.05x, spread 1.04x: parity does NOT hold" and "1.04x ... inside that noise" came from the same machine:
    # every pair 2-7% apart is parity to within the margin, whichever of them a run happens to draw.
    for ratios in ([1.05, 1.03, 1.07, 1.04], [1.04, 1.02, 1.06, 1.05]):
        verdict = _verdict(ratios)
        assert verdict.outcome == "parity" and "parity holds on this machine" in verdict.sentence()


def test_a_gap_is_called_only_when_every_pair_shows_it_beyond_the_margin():
    slower = _verdict([1.25, 1.31, 1.22, 1.28])
    assert slower.outcome == "deepspeed slower"
    assert (
        "DeepSpeed's step was longer in every pair" in slower.sentence()
        and "does NOT hold" in slower.sentence()
    )
    assert _verdict([1 / r for r in (1.25, 1.31, 1.22, 1.28)]).outcome == "fsdp2 slower"
    # One pair inside the margin is enough to withhold it: the verdict moves to "noise", never to its opposite.
    noisy = _verdict([1.25, 1.31, 1.04, 1.28])
    assert noisy.outcome == "noise" and "within the noise of this machine" in noisy.sentence()
    assert "does NOT hold" not in noisy.sentence() and "parity holds" not in noisy.sentence()
    assert _verdict([0.85, 1.2, 1.0, 1.05]).outcome == "noise"  # pairs beyond the margin on both sides


def test_the_interval_is_the_pairs_range_with_the_sign_tests_coverage():
    verdict = parity.decide([0.30, 0.32, 0.31, 0.30], [0.33, 0.32, 0.34, 0.36])
    assert verdict.ratios == pytest.approx((1.1, 1.0, 0.34 / 0.31, 1.2))
    assert (verdict.low, verdict.high) == pytest.approx((1.0, 1.2)) and verdict.median == pytest.approx(
        1.0984, abs=1e-4
    )
    assert verdict.coverage == 1 - 2 * 0.5**4  # 88%: the chance the range holds the median ratio
    assert "88% confidence" in verdict.sentence()
    with pytest.raises(ValueError, match="pass one of each per pair"):
        parity.decide([0.3, 0.3], [0.3])


def test_pairs_alternate_which_engine_runs_first():
    m, d = parity.FSDP2_MODULES, parity.DEEPSPEED_MATCHED
    assert parity.interleaved(3) == [parity.FSDP2_BLOCKS, m, d, d, m, m, d]


def test_one_run_each_is_ranked_only_beyond_the_margin_and_both_spreads():
    def steps(*s):
        return Measured.of(s)

    assert parity.faster({"fsdp2": steps(0.29, 0.30, 0.31), "deepspeed": steps(0.37, 0.375, 0.38)}) == "fsdp2"
    assert (
        parity.faster({"fsdp2": steps(0.317, 0.32), "deepspeed, its defaults": steps(0.231, 0.24)})
        == "deepspeed, its defaults"
    )
    assert parity.faster({"fsdp2": steps(0.30, 0.30), "deepspeed": steps(0.32, 0.32)}) is None  # 7%: even
    # 25% apart at the medians, but a step of each overlaps the other's: this run cannot tell them apart
    assert parity.faster({"fsdp2": steps(0.20, 0.30, 0.45), "deepspeed": steps(0.30, 0.375, 0.40)}) is None
    record = {"step_time_s": [0.9, 0.30, 0.32]}
    assert parity.steps_measured(record).values == (0.30, 0.32)  # step 0 warms up
