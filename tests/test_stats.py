"""Hand-computed checks of the interval and the paired test used for promotion."""

import math

import numpy as np
import pytest

from grpo_core.evaluation.stats import (
    accuracy,
    binomial_two_sided_p,
    mcnemar_exact,
    paired_accuracy_diff,
    wilson_interval,
    window_change,
)


def test_wilson_no_data_is_uninformative():
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_wilson_half():
    # p=0.5, n=100, z=1.959964: z2=3.841459, denom=1.03841459, centre=0.5
    # half = z*sqrt(0.0025 + z2/40000)/denom = 1.959964*0.05095114/1.03841459 = 0.0961685
    low, high = wilson_interval(50, 100)
    assert low == pytest.approx(0.5 - 0.0961685, abs=1e-6)
    assert high == pytest.approx(0.5 + 0.0961685, abs=1e-6)


def test_wilson_zero_successes():
    # p=0: centre = (z2/2n)/(1+z2/n), half = z*sqrt(z2/4n^2)/(1+z2/n) = (z2/2n)/(1+z2/n) -> low 0
    # n=10, z2=3.841459: high = 2*0.1920729/1.3841459 = 0.277533
    low, high = wilson_interval(0, 10)
    assert low == pytest.approx(0.0, abs=1e-12)
    assert high == pytest.approx(0.3841459 / 1.3841459, abs=1e-7)


def test_wilson_is_symmetric_and_inside_unit_interval():
    low, high = wilson_interval(3, 20)
    low2, high2 = wilson_interval(17, 20)
    assert low == pytest.approx(1 - high2) and high == pytest.approx(1 - low2)
    assert 0.0 <= low < 3 / 20 < high <= 1.0


def test_wilson_rejects_bad_counts():
    with pytest.raises(ValueError):
        wilson_interval(5, 3)


def test_binomial_p_values():
    assert binomial_two_sided_p(0, 10) == 2 * 0.5**10  # 0.001953125
    # k=1, n=10: 2*(1+10)/1024 = 22/1024
    assert binomial_two_sided_p(1, 10) == pytest.approx(22 / 1024)
    assert binomial_two_sided_p(9, 10) == pytest.approx(22 / 1024)  # the smaller tail is doubled
    assert binomial_two_sided_p(5, 10) == 1.0  # the doubled tail exceeds 1: clipped
    assert binomial_two_sided_p(0, 0) == 1.0


def test_mcnemar_discordant_zero_of_ten():
    # 10 discordant items all favour B, 5 concordant items: p = 2 * 0.5**10
    a = [False] * 10 + [True] * 3 + [False] * 2
    b = [True] * 10 + [True] * 3 + [False] * 2
    r = mcnemar_exact(a, b)
    assert (r["a_only"], r["b_only"], r["both"], r["neither"], r["n"]) == (0, 10, 3, 2, 15)
    assert r["p_value"] == 0.001953125


def test_mcnemar_no_discordant_pairs():
    r = mcnemar_exact([True, False], [True, False])
    assert r["p_value"] == 1.0 and r["a_only"] == r["b_only"] == 0


def test_mcnemar_large_n_is_exact():
    # 30 vs 0 discordant: 2 * 0.5**30, well below float precision issues of a normal approx
    r = mcnemar_exact([True] * 30, [False] * 30)
    assert math.isclose(r["p_value"], 2 * 0.5**30, rel_tol=1e-12)


def test_length_mismatch_raises():
    with pytest.raises(ValueError):
        mcnemar_exact([True], [True, False])
    with pytest.raises(ValueError):
        paired_accuracy_diff([True], [])


def test_paired_accuracy_diff():
    assert paired_accuracy_diff([True, True, False, False], [True, False, False, False]) == 0.25
    assert accuracy([]) == 0.0


def test_window_change_hand_values():
    # 8 values -> window 2 (a quarter): first [1, 2], last [7, 8]; each variance 0.5
    w = window_change([1, 2, 3, 4, 5, 6, 7, 8], window=10)
    assert (w["window"], w["first"], w["last"], w["diff"]) == (2, 1.5, 7.5, 6.0)
    # Welch-Satterthwaite df = (0.25 + 0.25)^2 / (0.25^2 + 0.25^2) = 2; t(0.975, 2) = 4.302653
    half = 4.302652729911275 * math.sqrt(0.5 / 2 + 0.5 / 2)
    assert w["ci_low"] == pytest.approx(6.0 - half) and w["ci_high"] == pytest.approx(6.0 + half)


def _welch_interval(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float]:
    """mean(b) - mean(a) +- t * se with Welch-Satterthwaite df, written out in float64 (scipy gives
    only the t quantile): an implementation apart from ``window_change``'s ``ttest_ind``."""
    from scipy.stats import t

    va, vb = np.var(a, ddof=1, dtype=np.float64) / len(a), np.var(b, ddof=1, dtype=np.float64) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t.ppf(0.5 + level / 2, df) * math.sqrt(va + vb)
    diff = float(np.mean(b, dtype=np.float64) - np.mean(a, dtype=np.float64))
    return diff - half, diff + half


@pytest.mark.parametrize("vals", [
    [0.41, 0.52, 0.38, 0.47, 0.44, 0.5, 0.61, 0.55, 0.58, 0.49, 0.63, 0.57],
    [0.5, 0.5, 0.51, 0.0, 0.0, 0.0, 0.1, 0.3, 0.2, 0.9, 0.2, 1.0],  # very unequal spreads: df far from 2k - 2
])
def test_window_change_matches_a_hand_welch_interval_and_handles_short_runs(vals):
    import statistics

    w = window_change(vals, window=3)
    assert w["window"] == 3
    a, b = vals[:3], vals[-3:]
    se = math.sqrt(statistics.variance(a) / 3 + statistics.variance(b) / 3)
    assert w["diff"] == pytest.approx(statistics.mean(b) - statistics.mean(a))
    assert (w["ci_low"], w["ci_high"]) == pytest.approx(_welch_interval(a, b), rel=1e-9)
    assert w["ci_high"] - w["ci_low"] > 2 * 1.96 * se  # wider than the normal interval it replaced
    flat = window_change([0.5] * 8, window=2)
    assert (flat["ci_low"], flat["ci_high"]) == (0.0, 0.0)
    one = window_change([0.2, 0.9])  # a window of one value has no spread: no interval
    assert one["diff"] == pytest.approx(0.7) and math.isnan(one["ci_low"])
    with pytest.raises(ValueError, match="at least one value"):
        window_change([])
