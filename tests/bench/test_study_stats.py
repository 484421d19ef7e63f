"""The study's statistics (bench/study_stats.py), without scipy, against values this file knows:
Student's t quantiles from the printed tables, its distribution function where it has a closed
form (1 and 2 degrees of freedom), a confidence interval and Holm's correction worked by hand."""
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))

from study_stats import Family, compare, holm, incomplete_beta, label, t_cdf, t_quantile  # noqa: E402

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
    c = compare(diffs, margin=0.02)
    sd = math.sqrt(sum((d - 0.11) ** 2 for d in diffs) / 4)
    half = 2.776445 * sd / math.sqrt(5)
    assert (c["mean"], c["sd"], c["n"]) == (pytest.approx(0.11), pytest.approx(sd), 5)
    assert (c["lo"], c["hi"]) == (pytest.approx(0.11 - half, abs=1e-6), pytest.approx(0.11 + half, abs=1e-6))
    t = 0.11 / (sd / math.sqrt(5))  # 15.556: two-sided p = 2 x P(T_4 > 15.556), about 1e-4
    assert c["p_diff"] == pytest.approx(2 * (1 - t_cdf(t, 4)))
    assert 5e-5 < c["p_diff"] < 2e-4
    assert c["p_no_worse"] > 0.99  # far above the margin: certainly not "no worse"
    small = compare([0.001, -0.002, 0.000, 0.002, -0.001], margin=0.02)  # tight around 0: within the margin
    assert small["p_no_worse"] < 0.001 and small["p_diff"] > 0.5
    assert math.isnan(compare([0.1], 0.02)["lo"])  # one seed: no interval
    same = compare([0.0, 0.0, 0.0], 0.02)  # identical runs
    assert (same["p_diff"], same["p_no_worse"]) == (1.0, 0.0)


def test_holm_by_hand():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> running max 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, float("nan"), 0.01]) == [pytest.approx(0.5), pytest.approx(float("nan"), nan_ok=True),
                                               pytest.approx(0.02)]
    assert holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])  # 0.8 x 2 capped at 1, then monotone
    assert holm([]) == []


def test_labels_after_correction():
    family = Family("f", margin=0.02)
    family.add("worse", [0.10, 0.12, 0.09, 0.11, 0.13])
    family.add("better", [-0.10, -0.12, -0.09, -0.11, -0.13])
    family.add("no worse", [0.001, -0.002, 0.000, 0.002, -0.001])
    family.add("inconclusive", [0.05, -0.04, 0.06, -0.05, 0.03])
    resolved = family.resolve()
    assert {k: c["label"] for k, c in resolved.items()} == {k: k for k in resolved}
    assert all(c["m"] == 4 for c in resolved.values())
    # Correction matters: p = 0.03 alone is "worse" at 5%, not among 4 comparisons.
    borderline = {"mean": 0.1, "p_diff_adj": 0.03 * 4, "p_no_worse_adj": 1.0}
    assert label(borderline) == "inconclusive"
    assert label(dict(borderline, p_diff_adj=0.03)) == "worse"
