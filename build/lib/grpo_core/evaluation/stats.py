"""Small-sample statistics for evaluation and promotion decisions.

Eval sets here are a few hundred items, so intervals and tests are exact or
small-sample-correct rather than normal approximations of differences (scipy does the
distributions):

- ``wilson_interval``: a binomial proportion interval that stays inside [0, 1] and behaves at
  0/n and n/n, unlike the Wald interval.
- ``mcnemar_exact``: two models graded on the same items are paired, so the test uses only the
  discordant items (one right, the other wrong) and an exact binomial tail.
"""

from __future__ import annotations

from collections.abc import Sequence


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for k successes out of n (scipy's ``binomtest(...).proportion_ci``).

    With no data the proportion is unconstrained, so n=0 gives (0.0, 1.0).
    """
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k} n={n}")
    if n == 0:
        return 0.0, 1.0
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def binomial_two_sided_p(k: int, n: int) -> float:
    """Exact two-sided p-value of k successes in n fair coin flips (``scipy.stats.binomtest``;
    for p = 1/2 the two tails are mirror images, so this is twice the smaller tail, at most 1)."""
    from scipy.stats import binomtest

    return 1.0 if n == 0 else float(binomtest(k, n, 0.5).pvalue)


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict:
    """Exact McNemar test for paired per-item correctness of models A and B.

    Items both models get right (or wrong) carry no information about which is better; under
    the null each discordant item is equally likely to favour A or B, hence a binomial(n, 1/2)
    on the discordant count. Returns the four cell counts, ``n`` and ``p_value`` (1.0 when there
    are no discordant items).
    """
    if len(a) != len(b):
        raise ValueError(f"paired results must have equal length, got {len(a)} and {len(b)}")
    a_only = sum(1 for x, y in zip(a, b) if x and not y)
    b_only = sum(1 for x, y in zip(a, b) if y and not x)
    both = sum(1 for x, y in zip(a, b) if x and y)
    return {
        "a_only": a_only,
        "b_only": b_only,
        "both": both,
        "neither": len(a) - a_only - b_only - both,
        "n": len(a),
        "p_value": binomial_two_sided_p(a_only, a_only + b_only),
    }


def accuracy(results: Sequence[bool]) -> float:
    """Fraction correct; 0.0 for an empty list so callers need no special case."""
    return sum(1 for r in results if r) / len(results) if results else 0.0


def paired_accuracy_diff(a: Sequence[bool], b: Sequence[bool]) -> float:
    """acc(A) - acc(B) on the same items (lengths must match, as in ``mcnemar_exact``)."""
    if len(a) != len(b):
        raise ValueError(f"paired results must have equal length, got {len(a)} and {len(b)}")
    return accuracy(a) - accuracy(b)


def window_change(values: Sequence[float], window: int = 10, level: float = 0.95) -> dict:
    """Mean of the first vs the last ``window`` values, their difference and its Welch interval.

    Per-iteration training reward swings a lot (a fresh prompt sample each iteration), so
    "iteration 1 -> iteration N" says little; comparing window means with an unequal-variance
    (Welch) t interval, Welch-Satterthwaite degrees of freedom, says whether the curve rose by
    more than its noise (a normal z would be too narrow for windows of 10 or fewer). It treats
    iterations as independent; the rewards of a policy that is learning are autocorrelated, so
    read the interval as optimistic. The window shrinks to a quarter of the values for short
    runs, so for two or more values the two windows never overlap.
    """
    from scipy.stats import ttest_ind

    vals = [float(v) for v in values]
    k = max(1, min(window, len(vals) // 4)) if vals else 0
    if k == 0:
        raise ValueError("window_change needs at least one value")
    first, last = vals[:k], vals[-k:]
    m1, m2 = sum(first) / k, sum(last) / k
    low = high = float("nan")
    if k > 1:
        if max(first) == min(first) and max(last) == min(last):  # no spread: scipy returns nan
            low = high = m2 - m1
        else:
            ci = ttest_ind(last, first, equal_var=False).confidence_interval(level)
            low, high = float(ci.low), float(ci.high)
    return {"window": k, "first": m1, "last": m2, "diff": m2 - m1, "ci_low": low, "ci_high": high}
