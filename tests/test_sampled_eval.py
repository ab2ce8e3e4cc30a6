"""Sampled accuracy: pass@k and mean@k against brute force, the paired test against enumeration
and McNemar, and seeded sampling on a real (tiny) model."""
import itertools
import random
from fractions import Fraction

import pytest

from grpo_core.evaluation.sampled import (
    EXACT_UP_TO,
    compare_sampled,
    paired_sign_flip_p,
    pass_at_k,
    sampled_results,
    summarize_sampled,
)
from grpo_core.evaluation.stats import mcnemar_exact


def _brute_pass_at_k(n, c, k):
    """The share of k-subsets of n samples (c right) that hold at least one right sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_right_sample(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(_brute_pass_at_k(n, c, k)), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(4, 5, 2)
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(4, 1, 0)


def test_summary_counts_samples_and_items():
    items = [{"item_id": i, "k": 2, "correct_k": c} for i, c in enumerate([0, 1, 2, 0])]
    s = summarize_sampled(items)
    assert s["mean_at_k"] == pytest.approx(3 / 8)          # 3 right of 8 samples
    assert s["pass_at_k"] == pytest.approx(2 / 4)          # 2 of 4 items have a right sample
    assert (s["k"], s["n"], s["samples"], s["correct_samples"]) == (2, 4, 8, 3)
    with pytest.raises(ValueError, match="different numbers"):
        summarize_sampled(items + [{"item_id": 9, "k": 3, "correct_k": 1}])


def _enumerated_p(diffs):
    """Every sign pattern over all items (zeros included), in exact fractions."""
    d = [Fraction(x).limit_denominator(1000) for x in diffs]
    observed = abs(sum(d))
    hits = sum(abs(sum(s * x for s, x in zip(signs, d))) >= observed
               for signs in itertools.product((1, -1), repeat=len(d)))
    return hits / 2 ** len(d)


@pytest.mark.parametrize("seed", range(6))
def test_sign_flip_p_equals_enumeration_over_every_sign_pattern(seed):
    rng = random.Random(seed)
    diffs = [rng.choice([-1, -0.5, 0, 0, 0.5, 1]) for _ in range(12)]
    assert paired_sign_flip_p(diffs) == pytest.approx(_enumerated_p(diffs), abs=1e-12)


@pytest.mark.parametrize("gained, lost", [(5, 0), (7, 2), (3, 3), (12, 4), (0, 1)])
def test_at_k_1_the_sign_flip_test_is_mcnemars_exact_test(gained, lost):
    a = [False] * gained + [True] * lost + [True] * 4 + [False] * 6
    b = [True] * gained + [False] * lost + [True] * 4 + [False] * 6
    diffs = [float(y) - float(x) for x, y in zip(a, b)]
    assert paired_sign_flip_p(diffs) == pytest.approx(mcnemar_exact(a, b)["p_value"], abs=1e-12)


def test_beyond_the_exact_range_the_resampled_p_is_close_to_the_exact_one():
    gained, lost = 17, 6                                    # 23 differing items: resampled
    assert gained + lost > EXACT_UP_TO
    diffs = [1.0] * gained + [-1.0] * lost + [0.0] * 100
    exact = mcnemar_exact([False] * gained + [True] * lost, [True] * gained + [False] * lost)["p_value"]
    p = paired_sign_flip_p(diffs)
    assert p == pytest.approx(exact, abs=0.01) and p == paired_sign_flip_p(diffs)  # seeded: repeatable


def test_compare_sampled_pairs_items_by_id():
    before = [{"item_id": f"i{j}", "k": 2, "correct_k": c} for j, c in enumerate([0, 0, 1, 2])]
    after = [{"item_id": f"i{j}", "k": 2, "correct_k": c} for j, c in enumerate([1, 2, 1, 1])][::-1]
    vs = compare_sampled(before, after)
    assert vs["delta"] == pytest.approx((0.5 + 1.0 + 0 - 0.5) / 4)
    assert (vs["better_items"], vs["worse_items"]) == (2, 1)
    with pytest.raises(ValueError, match="only one"):
        compare_sampled(before, after[:-1])


def test_sampled_results_are_seeded_and_graded_per_item(tiny):
    from grpo_core.model.loading import load_policy

    model, tok = load_policy(str(tiny))
    rows = [{"id": f"r{i}", "prompt": f"What is {i} + 1?", "gold": str(i + 1), "steps": i % 3} for i in range(5)]
    grade = lambda text, gold: "7" in text  # noqa: E731  (the tiny model emits 7s now and then)
    once = sampled_results(model, tok, rows, k=3, temperature=1.0, max_new_tokens=8, seed=5, batch_size=6,
                           grade=grade)
    again = sampled_results(model, tok, rows, k=3, temperature=1.0, max_new_tokens=8, seed=5, batch_size=6,
                            grade=grade)
    other = sampled_results(model, tok, rows, k=3, temperature=1.0, max_new_tokens=8, seed=6, batch_size=6,
                            grade=lambda text, gold: True)
    assert once == again                                       # the same seed: the same samples
    assert [i["item_id"] for i in once] == [r["id"] for r in rows] and all(i["k"] == 3 for i in once)
    assert [i["steps"] for i in once] == [r["steps"] for r in rows]
    assert all(i["correct_k"] == 3 for i in other)             # every sample graded, k per item
