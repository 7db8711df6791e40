"""Paired evidence over seeds (maxscore.training.evidence), against scipy and constructed data."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maxscore.training import evidence

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 11, 30, 200])
@pytest.mark.parametrize("p", [0.5, 0.8, 0.9, 0.95, 0.975, 0.995, 0.025])
def test_t_quantile_matches_scipy(df: int, p: float) -> None:
    assert evidence.student_t_quantile(p, df) == pytest.approx(
        scipy_stats.t.ppf(p, df), rel=1e-8, abs=1e-10
    )


@pytest.mark.parametrize("df", [1, 2, 5, 40])
@pytest.mark.parametrize("t", [-6.0, -1.3, 0.0, 0.4, 2.0, 9.0])
def test_t_cdf_matches_scipy(df: int, t: float) -> None:
    assert evidence.student_t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), abs=1e-12)


def test_interval_by_hand() -> None:
    # d = [1, 2, 3]: mean 2, sd 1, se 1/sqrt(3), t_{0.975, 2} = 4.302652729...
    interval = evidence.paired_interval([1.0, 2.0, 3.0])
    half = 4.302652729749464 / math.sqrt(3.0)
    assert (interval.n, interval.df, interval.mean, interval.sd) == (3, 2, 2.0, 1.0)
    assert interval.low == pytest.approx(2.0 - half)
    assert interval.high == pytest.approx(2.0 + half)


def test_interval_skips_missing_pairs_and_needs_one() -> None:
    assert evidence.paired_interval([0.1, None, float("nan"), 0.3]).n == 2
    single = evidence.paired_interval([0.1])
    assert single.low is None and evidence.judge(single) == "too few seeds"
    with pytest.raises(ValueError, match="no paired difference"):
        evidence.paired_interval([None])


def test_interval_covers_at_its_level() -> None:
    """Normal differences, 3 seeds: the 95% t interval holds the true mean ~95% of the time
    (a z interval, or 2 SE, would cover about 80%)."""
    rng = random.Random(1)
    trials, covered = 4000, 0
    for _ in range(trials):
        interval = evidence.paired_interval([rng.gauss(0.3, 1.0) for _ in range(3)])
        covered += interval.low <= 0.3 <= interval.high
    assert 0.935 < covered / trials < 0.965


def _noisy(mean: float, sd: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


def test_known_effect_is_found() -> None:
    # router 0.01 nats better than the reference, per-seed spread 0.004, 12 seeds
    summary = evidence.describe(_noisy(-0.01, 0.004, 12, seed=3), margin=0.005)
    assert summary["verdict"] == "better"
    assert not summary["within_margin"]
    assert summary["high"] < 0


def test_null_effect_is_not_called_a_gain() -> None:
    """Over many constructed studies with no true difference, 'better' is called in about
    2.5% of them (one tail of a 95% interval), never as a rule."""
    calls = [
        evidence.judge(evidence.paired_interval(_noisy(0.0, 0.01, 5, seed=s)), margin=0.005)
        for s in range(2000)
    ]
    assert calls.count("better") / len(calls) < 0.04
    assert calls.count("worse") / len(calls) < 0.04
    assert calls.count("inconclusive") / len(calls) > 0.9


def test_equivalence_needs_the_whole_interval_inside_the_margin() -> None:
    tight = [0.001, -0.001, 0.0005, -0.0004, 0.0002, 0.0, 0.0003, -0.0002]
    assert evidence.judge(evidence.paired_interval(tight), margin=0.01) == "equivalent"
    # the same mean with a spread that reaches past the margin is not "negligible"
    wide = [0.02, -0.02, 0.015, -0.018]
    assert evidence.judge(evidence.paired_interval(wide), margin=0.01) == "inconclusive"
    # non-significance alone is not equivalence: two seeds, tiny mean, huge interval
    assert evidence.judge(evidence.paired_interval([0.004, -0.003]), 0.01) == "inconclusive"


def test_significant_but_within_margin_is_flagged() -> None:
    values = [-0.002, -0.0021, -0.0019, -0.002, -0.0022, -0.0018]
    summary = evidence.describe(values, margin=0.01)
    assert summary["verdict"] == "better" and summary["within_margin"]


def test_seeds_needed_matches_the_power_table() -> None:
    # effect size 1 (mean / sd), two-sided 5%, power 80%: the paired t test needs n = 10
    assert evidence.seeds_needed(1.0, 1.0) == 10
    # effect size 0.5: n = 34 (noncentral-t power tables give 34)
    assert evidence.seeds_needed(0.5, 1.0) == 34
    assert evidence.seeds_needed(0.0, 1.0) is None
    assert evidence.seeds_needed(0.1, None) is None
    assert evidence.seeds_needed(-0.005, 0.01) == evidence.seeds_needed(0.005, 0.01)


def test_seeds_needed_gives_the_power_it_promises() -> None:
    n = evidence.seeds_needed(0.005, 0.008)
    assert n is not None
    rng = random.Random(7)
    hits = sum(
        evidence.judge(evidence.paired_interval([rng.gauss(0.005, 0.008) for _ in range(n)]))
        == "worse"
        for _ in range(1500)
    )
    assert 0.75 < hits / 1500 < 0.88


def test_composite_claim_is_computed_per_seed() -> None:
    losses = {
        "gshard": {1: 5.10, 2: 5.00, 3: 5.20},
        "gshard-s": {1: 5.11, 2: 5.01, 3: 5.21},
        "gshard-m": {1: 5.13, 2: 5.03},
        "maxscore": {1: 5.10, 2: 5.00, 3: 5.20},
    }
    excess = evidence.per_seed_combination(
        losses, {"gshard-s": 1.0, "gshard-m": 1.0, "maxscore": -1.0, "gshard": -1.0}
    )
    assert excess == pytest.approx({1: 0.04, 2: 0.04})  # seed 3 lacks gshard-m
    # the shared GShard run cancels: a seed-level shift of every router changes nothing
    shifted = {r: {s: v + 0.3 * s for s, v in by.items()} for r, by in losses.items()}
    assert evidence.per_seed_combination(
        shifted, {"gshard-s": 1.0, "gshard-m": 1.0, "maxscore": -1.0, "gshard": -1.0}
    ) == pytest.approx(excess)


def test_rerun_noise() -> None:
    noise = evidence.rerun_noise([(5.0, 5.02), (5.1, 5.1)])
    assert noise is not None and noise["pairs"] == 2
    assert noise["max_abs_difference"] == pytest.approx(0.02)
    assert noise["run_sd"] == pytest.approx(math.sqrt((0.02**2) / 2 / 2))
    assert evidence.rerun_noise([]) is None


def test_bootstrap_is_a_check_not_a_replacement() -> None:
    assert evidence.bootstrap_interval([0.1, 0.2]) is None
    low, high = evidence.bootstrap_interval([0.1, 0.2, 0.3, 0.25, 0.15]) or (0, 0)
    assert 0.1 <= low < 0.2 < high <= 0.3


def test_format_interval() -> None:
    text = evidence.format_interval(evidence.describe([0.001, 0.003, 0.002]))
    assert text.startswith("+0.0020 [") and "95% t, n=3" in text
    assert "no interval" in evidence.format_interval(evidence.describe([0.001]))


finite = st.floats(min_value=-1.0, max_value=1.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=2, max_size=12), st.floats(0.0, 0.1))
def test_verdict_properties(values: list[float], margin: float) -> None:
    interval = evidence.paired_interval(values)
    assert interval.low <= interval.mean <= interval.high
    verdict = evidence.judge(interval, margin)
    mirrored = evidence.judge(evidence.paired_interval([-v for v in values]), margin)
    swap = {"better": "worse", "worse": "better"}
    assert mirrored == swap.get(verdict, verdict)
    if verdict == "better":
        assert interval.high < 0
    if verdict == "equivalent":
        assert -margin < interval.low and interval.high < margin
