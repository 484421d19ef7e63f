"""The study's statistics, without scipy: Student's t distribution, paired comparisons with
95% confidence intervals, Holm's correction over a family of comparisons, and the labels
the verdict uses.

A comparison is a list of paired differences over seeds (run minus reference, per seed).
Its tests: two-sided H0 "no difference" (p_diff), and one-sided H0 "worse by at least the
margin" (p_no_worse: rejecting it says the run is no worse than the reference within the
margin). Holm's step-down correction is applied to each kind of p-value over the family
(every comparison one list or table of the verdict makes). Labels, at level 0.05 after
correction: "worse" or "better" (p_diff, by the sign of the mean), else "no worse"
(p_no_worse: within the margin), else "inconclusive".
"""
from __future__ import annotations

import math
import statistics

ALPHA = 0.05


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (bisection to 1e-12), p in (0, 1)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


def compare(diffs: list[float], margin: float) -> dict:
    """A paired comparison: {"mean", "sd" (sample standard deviation of the differences), "n", "lo",
    "hi" (the 95% confidence interval of the mean, Student's t), "p_diff" (two-sided, H0: mean 0),
    "p_no_worse" (one-sided, H0: mean >= margin)}. With fewer than two differences the interval and
    p-values are nan; with zero spread (identical runs) the tests are decided by the mean alone."""
    n = len(diffs)
    mean = statistics.fmean(diffs) if diffs else math.nan
    out = {"mean": mean, "sd": math.nan, "n": n, "lo": math.nan, "hi": math.nan, "p_diff": math.nan,
           "p_no_worse": math.nan}
    if n < 2:
        return out
    sd = statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    half = t_quantile(1 - ALPHA / 2, n - 1) * se
    out.update(sd=sd, lo=mean - half, hi=mean + half)
    if se == 0.0:
        out.update(p_diff=1.0 if mean == 0.0 else 0.0, p_no_worse=0.0 if mean < margin else 1.0)
    else:
        t = mean / se
        out.update(p_diff=2.0 * (1.0 - t_cdf(abs(t), n - 1)), p_no_worse=t_cdf((mean - margin) / se, n - 1))
    return out


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given; nan stays nan and is not counted):
    the i-th smallest of m becomes max over j <= i of min(1, (m - j + 1) p_(j))."""
    valid = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m, out, running = len(valid), list(pvalues), 0.0
    for rank, (p, i) in enumerate(valid):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def label(comparison: dict) -> str:
    """"worse", "better", "no worse" (within the margin) or "inconclusive", from the adjusted p-values."""
    p_diff, p_no_worse = comparison.get("p_diff_adj", math.nan), comparison.get("p_no_worse_adj", math.nan)
    if p_diff < ALPHA:
        return "worse" if comparison["mean"] > 0 else "better"
    if p_no_worse < ALPHA:
        return "no worse"
    return "inconclusive"


class Family:
    """A family of comparisons corrected together: add them by key, then `resolve()`."""

    def __init__(self, name: str, margin: float):
        self.name, self.margin, self.items = name, margin, {}

    def add(self, key, diffs: list[float]) -> None:
        """Add the comparison `key` (any hashable) from its paired differences."""
        self.items[key] = compare(diffs, self.margin)

    def resolve(self) -> dict:
        """{key: comparison with "p_diff_adj", "p_no_worse_adj", "label" and "m" (the family's size)}."""
        keys = list(self.items)
        for kind in ("p_diff", "p_no_worse"):
            for key, adj in zip(keys, holm([self.items[k][kind] for k in keys])):
                self.items[key][f"{kind}_adj"] = adj
        m = sum(1 for k in keys if not math.isnan(self.items[k]["p_diff"]))
        for key in keys:
            self.items[key].update(label=label(self.items[key]), m=m)
        return self.items


def describe(c: dict, digits: int = 3) -> str:
    """"Δ +0.052 [+0.030, +0.074] (worse)": the mean, its 95% confidence interval and the label."""
    if c["n"] < 2:
        return f"Δ {c['mean']:+.{digits}f} (n={c['n']}: no interval)"
    return f"Δ {c['mean']:+.{digits}f} [{c['lo']:+.{digits}f}, {c['hi']:+.{digits}f}] ({c.get('label', '?')})"
