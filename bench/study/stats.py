"""The study's statistics, without scipy: Student's t distribution, paired comparisons with
confidence intervals, families of comparisons corrected together, the labels the verdict uses,
and the smallest difference a family's seeds can detect.

A comparison is a list of paired differences over seeds (run minus reference, per seed). Each
belongs to exactly one family; a family of m comparisons prints simultaneous intervals
(Bonferroni: each at confidence 1 - ALPHA/m), and every label is read off the printed interval,
so a label never contradicts its interval: "better" (the whole interval below 0), "worse" (the
whole interval above 0), "no worse" (the interval straddles 0 and lies below the margin: worse
by less than the margin at most), else "inconclusive". "No worse" is used only where the
family's seeds can support the margin: the smallest difference they detect with 80% power
(`detectable`) must be at most the margin; elsewhere equivalence is not tested.
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


def compare(diffs: list[float], confidence: float = 1 - ALPHA) -> dict:
    """A paired comparison: {"mean", "sd" (sample standard deviation of the differences), "n", "lo",
    "hi" (the two-sided `confidence` interval of the mean, Student's t), "confidence"}. With fewer
    than two differences the interval is nan; with zero spread (identical runs) it is the mean itself."""
    n = len(diffs)
    mean = statistics.fmean(diffs) if diffs else math.nan
    out = {"mean": mean, "sd": math.nan, "n": n, "lo": math.nan, "hi": math.nan, "confidence": confidence}
    if n < 2:
        return out
    sd = statistics.stdev(diffs)
    half = t_quantile(1 - (1 - confidence) / 2, n - 1) * sd / math.sqrt(n)
    out.update(sd=sd, lo=mean - half, hi=mean + half)
    return out


def label(comparison: dict, margin: float | None) -> str:
    """The label its interval says (module docstring); margin None: equivalence not tested."""
    lo, hi = comparison["lo"], comparison["hi"]
    if math.isnan(lo) or math.isnan(hi):
        return "inconclusive"
    if hi < 0:
        return "better"
    if lo > 0:
        return "worse"
    if margin is not None and hi < margin:
        return "no worse"
    return "inconclusive"


def detectable(sd: float, n: int, alpha: float, power: float = 0.8) -> float:
    """The smallest true difference a paired t-test of n seeds at two-sided level `alpha` detects with
    probability `power` (normal-shift approximation: (t_{1-alpha/2} + t_{power}) sd / sqrt(n), n - 1
    degrees of freedom); nan below two seeds or with an unknown spread."""
    if n < 2 or math.isnan(sd):
        return math.nan
    return (t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


class Family:
    """Comparisons corrected together: add them by key, then `resolve()`. Each key is added once (a
    comparison belongs to one family: Comparisons checks that across families)."""

    def __init__(self, name: str, margin: float, question: str = ""):
        self.name, self.margin, self.question, self.items = name, margin, question, {}

    def add(self, key, diffs: list[float]) -> None:
        """Add the comparison `key` (any hashable) from its paired differences."""
        if key in self.items:
            raise ValueError(f"family {self.name!r}: comparison {key!r} added twice")
        self.items[key] = list(diffs)

    def resolve(self) -> dict:
        """{key: comparison at the family's simultaneous level, with "label", "m", "margin" (None where the
        family cannot support its margin)}; the family's own summary is in `self.summary`."""
        testable = [d for d in self.items.values() if len(d) >= 2]
        m = max(1, len(testable))
        confidence = 1 - ALPHA / m
        sds = sorted(statistics.stdev(d) for d in testable)
        sd = sds[len(sds) // 2] if sds else math.nan
        n = min((len(d) for d in testable), default=0)
        smallest = detectable(sd, n, ALPHA / m)
        supported = not math.isnan(smallest) and smallest <= self.margin
        self.summary = {"name": self.name, "question": self.question, "m": len(testable), "confidence": confidence,
                        "median_sd": sd, "seeds": n, "detectable": smallest, "margin": self.margin,
                        "equivalence_tested": supported}
        out = {}
        for key, diffs in self.items.items():
            c = compare(diffs, confidence)
            c.update(label=label(c, self.margin if supported else None), m=len(testable), family=self.name)
            out[key] = c
        return out


def describe(c: dict, digits: int = 3) -> str:
    """"Δ +0.052 [+0.030, +0.074] (worse)": the mean, its interval and the label."""
    if c["n"] < 2:
        return f"Δ {c['mean']:+.{digits}f} (n={c['n']}: no interval)"
    return f"Δ {c['mean']:+.{digits}f} [{c['lo']:+.{digits}f}, {c['hi']:+.{digits}f}] ({c.get('label', '?')})"
