"""The study's statistics (bench/study/stats.py), without scipy, against values this file knows:
Student's t quantiles from the printed tables, its distribution function where it has a closed
form (1 and 2 degrees of freedom), a confidence interval, a family's simultaneous level and the
smallest detectable difference worked by hand, and labels that never contradict their interval."""
import math

import pytest

from bench.study.stats import Family, compare, detectable, incomplete_beta, label, t_cdf, t_quantile

# t_{0.975, df} as printed in every statistics table (two-sided 95%).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228, 30: 2.042}


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantiles_match_the_tables(df):
    assert t_quantile(0.975, df) == pytest.approx(T975[df], abs=5e-4)
    assert t_quantile(0.025, df) == pytest.approx(-T975[df], abs=5e-4)


@pytest.mark.parametrize("t", [-3.0, -0.4, 0.0, 0.7, 2.5, 10.0])
def test_t_distribution_where_it_has_a_closed_form(t):
    assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)  # Cauchy
    assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    assert incomplete_beta(1.0, 1.0, 0.3) == pytest.approx(0.3)  # I_x(1, 1) = x
    assert incomplete_beta(2.0, 1.0, 0.3) == pytest.approx(0.09)  # I_x(a, 1) = x^a


def test_a_paired_comparison_by_hand():
    diffs = [0.10, 0.12, 0.09, 0.11, 0.13]  # mean 0.11, sample sd sqrt(0.001 / 4) = 0.0158114
    c = compare(diffs)
    sd = math.sqrt(sum((d - 0.11) ** 2 for d in diffs) / 4)
    half = 2.776445 * sd / math.sqrt(5)
    assert (c["mean"], c["sd"], c["n"]) == (pytest.approx(0.11), pytest.approx(sd), 5)
    assert (c["lo"], c["hi"]) == (pytest.approx(0.11 - half, abs=1e-6), pytest.approx(0.11 + half, abs=1e-6))
    wide = compare(diffs, confidence=0.99)  # t_{0.995, 4} = 4.604 from the tables
    assert wide["hi"] - wide["mean"] == pytest.approx(4.604 * sd / math.sqrt(5), abs=1e-3)
    assert math.isnan(compare([0.1])["lo"])  # one seed: no interval
    same = compare([0.0, 0.0, 0.0])  # identical runs: the interval is the mean itself
    assert (same["lo"], same["hi"]) == (0.0, 0.0)


def test_labels_are_read_off_the_interval():
    assert label({"lo": -0.3, "hi": -0.1}, 0.05) == "better"
    assert label({"lo": 0.1, "hi": 0.3}, 0.05) == "worse"
    assert label({"lo": -0.1, "hi": 0.04}, 0.05) == "no worse"
    assert label({"lo": -0.1, "hi": 0.04}, None) == "inconclusive"  # equivalence not tested
    assert label({"lo": -0.1, "hi": 0.2}, 0.05) == "inconclusive"
    assert label({"lo": float("nan"), "hi": float("nan")}, 0.05) == "inconclusive"


def test_the_smallest_detectable_difference_by_hand():
    # (t_{0.975, 4} + t_{0.8, 4}) x sd / sqrt(5) with t_{0.8, 4} = 0.941 (tables)
    assert detectable(0.02, 5, 0.05) == pytest.approx((2.776 + 0.941) * 0.02 / math.sqrt(5), abs=1e-4)
    assert math.isnan(detectable(0.02, 1, 0.05))


def test_a_family_corrects_its_intervals_and_labels_from_them():
    family = Family("f", margin=0.05)
    family.add("worse", [0.10, 0.12, 0.09, 0.11, 0.13])
    family.add("better", [-0.10, -0.12, -0.09, -0.11, -0.13])
    family.add("no worse", [0.001, -0.002, 0.000, 0.002, -0.001])
    family.add("inconclusive", [0.05, -0.04, 0.06, -0.05, 0.03])
    resolved = family.resolve()
    assert {k: c["label"] for k, c in resolved.items()} == {k: k for k in resolved}
    assert all(c["m"] == 4 and c["confidence"] == pytest.approx(1 - 0.05 / 4) for c in resolved.values())
    for c in resolved.values():  # never a label its interval contradicts
        assert (c["hi"] < 0) == (c["label"] == "better") and (c["lo"] > 0) == (c["label"] == "worse")
    assert family.summary["equivalence_tested"] and family.summary["seeds"] == 5
    with pytest.raises(ValueError, match="added twice"):
        family.add("worse", [0.1, 0.2])
    # Three seeds of a noisy difference: the margin cannot be supported, so nothing is "no worse".
    noisy = Family("g", margin=0.01)
    noisy.add("a", [0.001, -0.004, 0.003])
    noisy.add("b", [0.02, -0.03, 0.01])
    out = noisy.resolve()
    assert not noisy.summary["equivalence_tested"] and noisy.summary["detectable"] > 0.01
    assert all(c["label"] == "inconclusive" for c in out.values())
