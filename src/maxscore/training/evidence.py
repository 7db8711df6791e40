"""Paired evidence over seeds: is router B's loss lower than router A's, and how sure are we?

Two routers trained with the same seed share their initialisation (every parameter but the
router's) and their data order, so the per-seed difference ``d_s = L_B(s) - L_A(s)`` cancels
much of the seed-to-seed spread of either loss. The seeds are the sample: the interval is a
Student-t interval over the ``n`` differences with ``n - 1`` degrees of freedom (not the
validation set's standard error, which only measures the noise of the validation sample, nor a
"2 standard errors" rule, which with 2 degrees of freedom is an 82% interval).

A verdict is computed from that interval and an *equivalence margin* ``m`` (nats) stated in
advance:

* ``better`` / ``worse``: the whole interval is below / above 0 (lower loss is better);
* ``equivalent``: the whole interval lies inside ``(-m, m)``: any difference is smaller than the
  margin (two one-sided tests, each at half the complement of the confidence);
* ``inconclusive``: neither (the interval holds 0 and reaches past the margin);
* ``too few seeds``: fewer than two paired seeds, so no interval.

A difference can be both significant and smaller than the margin; it is then ``better`` or
``worse`` and flagged ``within_margin``. :func:`seeds_needed` says how many paired seeds the
observed mean and spread would need for the interval to exclude 0 with 80% power.
Composite claims (e.g. the paper's superadditivity of SoftTopk and flow) are combinations of
several routers' losses computed per seed (:func:`per_seed_combination`), so runs shared by
several terms (the reference router) enter once per seed, not as independent errors.

The t quantile is computed here (regularised incomplete beta by continued fraction, inverted by
bisection) so that the package needs no scipy; the tests check it against scipy.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = [
    "DEFAULT_CONFIDENCE",
    "DEFAULT_MARGIN",
    "PairedInterval",
    "Verdict",
    "bootstrap_interval",
    "describe",
    "format_interval",
    "judge",
    "paired_interval",
    "per_seed_combination",
    "rerun_noise",
    "seeds_needed",
    "student_t_cdf",
    "student_t_quantile",
    "within_margin",
]

Verdict = Literal["better", "worse", "equivalent", "inconclusive", "too few seeds"]

#: Two-sided confidence of every interval unless stated otherwise.
DEFAULT_CONFIDENCE = 0.95
#: Equivalence margin in nats of validation loss: differences below it are called negligible
#: (0.01 nats is a 1% change in perplexity).
DEFAULT_MARGIN = 0.01


# ------------------------------------------------------------------------------------------------
# Student's t distribution
# ------------------------------------------------------------------------------------------------
def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for numerator in (
            m * (b - m) * x / ((a + m2 - 1.0) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function, for 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    # The continued fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry
    # I_x(a, b) = 1 - I_{1-x}(b, a) beyond it.
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * _regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def student_t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on the CDF)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if student_t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


# ------------------------------------------------------------------------------------------------
# Intervals, verdicts, seeds needed
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairedInterval:
    """A Student-t interval for the mean of paired per-seed differences.

    ``sd``, ``se``, ``low`` and ``high`` are ``None`` below two differences.
    """

    n: int
    mean: float
    sd: float | None
    se: float | None
    confidence: float
    low: float | None
    high: float | None

    @property
    def df(self) -> int:
        return self.n - 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def paired_interval(
    differences: Sequence[float | None], confidence: float = DEFAULT_CONFIDENCE
) -> PairedInterval:
    """Mean of the per-seed differences with its two-sided Student-t interval.

    Missing or non-finite entries are left out (a seed without both runs is no pair).
    Raises ``ValueError`` when no difference is left.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    values = _finite(differences)
    if not values:
        raise ValueError("no paired difference to summarise (every seed lacks one of its runs)")
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return PairedInterval(n, mean, None, None, confidence, None, None)
    sd = statistics.stdev(values)
    se = sd / math.sqrt(n)
    half = student_t_quantile(0.5 + confidence / 2.0, n - 1) * se
    return PairedInterval(n, mean, sd, se, confidence, mean - half, mean + half)


def bootstrap_interval(
    differences: Sequence[float | None],
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean difference (``None`` below three seeds).

    A check on the t interval's normality assumption, not a replacement: with few seeds the
    bootstrap interval is too narrow (it cannot see spread the sample did not show).
    """
    values = _finite(differences)
    if len(values) < 3:
        return None
    rng = random.Random(seed)
    n = len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(resamples))
    alpha = (1.0 - confidence) / 2.0
    return means[int(alpha * (resamples - 1))], means[int((1.0 - alpha) * (resamples - 1))]


def judge(interval: PairedInterval, margin: float = DEFAULT_MARGIN) -> Verdict:
    """The verdict on ``router - reference`` loss differences (lower loss is better)."""
    if margin < 0:
        raise ValueError(f"equivalence margin must be >= 0, got {margin}")
    if interval.low is None or interval.high is None:
        return "too few seeds"
    if interval.high < 0.0:
        return "better"
    if interval.low > 0.0:
        return "worse"
    if -margin < interval.low and interval.high < margin:
        return "equivalent"
    return "inconclusive"


def within_margin(interval: PairedInterval, margin: float = DEFAULT_MARGIN) -> bool:
    """Whether the whole interval lies inside ``(-margin, margin)``."""
    if interval.low is None or interval.high is None:
        return False
    return -margin < interval.low and interval.high < margin


def seeds_needed(
    mean: float,
    sd: float | None,
    confidence: float = DEFAULT_CONFIDENCE,
    power: float = 0.8,
    max_seeds: int = 100_000,
) -> int | None:
    """Paired seeds for a true difference ``mean`` with per-seed spread ``sd`` to be resolved.

    The smallest ``n >= 2`` with ``sqrt(n) |mean| / sd >= t_{1-a/2, n-1} + t_{power, n-1}``
    (a = 1 - confidence): the two-sided interval excludes 0 with probability ``power``.
    ``None`` when it cannot be computed (no spread measured, or no effect: ``mean == 0``) or
    exceeds ``max_seeds``.
    """
    if sd is None or not math.isfinite(mean) or mean == 0.0:
        return None
    if sd == 0.0:
        return 2
    effect = abs(mean) / sd
    upper = 0.5 + confidence / 2.0

    def enough(n: int) -> bool:
        needed = student_t_quantile(upper, n - 1) + student_t_quantile(power, n - 1)
        return math.sqrt(n) * effect >= needed

    if not enough(max_seeds):
        return None
    low, high = 2, max_seeds
    while low < high:  # enough(n) is monotone in n
        mid = (low + high) // 2
        if enough(mid):
            high = mid
        else:
            low = mid + 1
    return low


# ------------------------------------------------------------------------------------------------
# Composite claims and same-seed noise
# ------------------------------------------------------------------------------------------------
def per_seed_combination(
    losses: Mapping[str, Mapping[int, float]], coefficients: Mapping[str, float]
) -> dict[int, float]:
    """``sum_r c_r * L_r(s)`` for every seed ``s`` that has a run of every router in
    ``coefficients``.

    ``losses`` maps router -> seed -> loss. E.g. the superadditivity excess of the paper's
    Table 3, ``gain(S+M) - gain(S) - gain(M)`` with ``gain(X) = L_gshard - L_X``, is
    ``{"gshard-s": 1, "gshard-m": 1, "maxscore": -1, "gshard": -1}``: the GShard run enters once
    per seed, so the interval over seeds carries the covariance the three gains share.
    """
    seeds: set[int] | None = None
    for router in coefficients:
        have = set(losses.get(router, {}))
        seeds = have if seeds is None else seeds & have
    return {s: sum(c * losses[r][s] for r, c in coefficients.items()) for s in sorted(seeds or ())}


def rerun_noise(pairs: Sequence[tuple[float, float]]) -> dict[str, Any] | None:
    """Same-seed noise from runs trained twice with identical settings.

    Returns the number of pairs, the mean and largest ``|a - b|``, and the implied standard
    deviation of one run around its seed's expectation, ``sqrt(mean((a - b)^2) / 2)``.
    """
    finite = [(a, b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
    if not finite:
        return None
    gaps = [abs(a - b) for a, b in finite]
    return {
        "pairs": len(finite),
        "mean_abs_difference": statistics.fmean(gaps),
        "max_abs_difference": max(gaps),
        "run_sd": math.sqrt(statistics.fmean(g * g for g in gaps) / 2.0),
    }


def describe(
    differences: Sequence[float | None],
    confidence: float = DEFAULT_CONFIDENCE,
    margin: float = DEFAULT_MARGIN,
) -> dict[str, Any]:
    """Everything a report states about one paired comparison, as plain data.

    Keys: the interval's fields (``n``, ``mean``, ``sd``, ``se``, ``confidence``, ``low``,
    ``high``), ``df``, ``verdict``, ``within_margin``, ``margin``, ``seeds_needed`` (80% power
    at the observed mean and spread) and ``bootstrap`` (percentile interval, three seeds up).
    """
    interval = paired_interval(differences, confidence)
    out = interval.to_dict()
    out.update(
        df=interval.df,
        margin=margin,
        verdict=judge(interval, margin),
        within_margin=within_margin(interval, margin),
        seeds_needed=seeds_needed(interval.mean, interval.sd, confidence),
        bootstrap=bootstrap_interval(differences, confidence),
    )
    return out


def format_interval(summary: Mapping[str, Any], digits: int = 4) -> str:
    """``+0.0045 [-0.0021, +0.0111] (n=3)`` from :func:`describe`'s output."""
    mean = f"{summary['mean']:+.{digits}f}"
    if summary.get("low") is None:
        return f"{mean} (n={summary['n']}, no interval)"
    level = round(100 * summary["confidence"])
    return (
        f"{mean} [{summary['low']:+.{digits}f}, {summary['high']:+.{digits}f}] "
        f"({level}% t, n={summary['n']})"
    )
