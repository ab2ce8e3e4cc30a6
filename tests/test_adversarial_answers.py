"""Adversarial completions (the ADVERSARIAL table, also read by benchmarks/bench_answers.py) are
graded in linear work, and long digit strings are capped.
"""
import math
import time

import pytest

from grpo_core.data.answers import format_ok, is_correct
from grpo_core.data.rewards import gsm8k_reward

ADVERSARIAL = {
    "open tags": "<answer>" * 20000,
    "commas": "1," * 100000,
    "unclosed numbers": "<answer>1" * 20000,
    "long digits": "9" * 200000,
    "open boxed": "\\boxed{" * 50000,
    "boxed digits": "\\boxed{1" * 25000,
    "boxed braces": "\\boxed{" + "{" * 200000,
    "many closed tags": "<answer>1</answer>" * 11000,
    "many hashes": "####" * 50000 + " 1",
    "open fracs": "\\frac{1" * 30000,
    "frac commas": "\\frac{" + "1," * 100000,
    "huge tag": "<answer>" + "1" * 200000 + "</answer>",
    "signs": "-$" * 100000 + "1",
    "exponents": "1e" * 100000,
    "exponent signs": "1e-" * 70000,
    "long exponents": "1e" + "1" * 200000,
    "mixed numbers": "1 1/" * 50000,
    "mixed spaces": "1 " * 100000 + "/2",
    "latex separators": "1{,}" * 50000,
    "latex thin spaces": "1\\," * 70000,
    "latex separator groups": "1" + "\\,000" * 40000,
    "mixed fracs": "1\\frac{1}{2}" * 15000,
    "numbered headings": "#### 1. Step\n" * 15000,
    "heading spaces": "#### 1" + " " * 200000 + "A",
    "hashes and boxes": "#### 1\n\\boxed{2}" * 12000,
    "full-width digits": "\uff11" * 200000,
    "no-break groups": "1" + "\u00a0000" * 40000,
}


def _grading_cpu_seconds(text: str, repeats: int = 2) -> float:
    """The least CPU time (this thread's, so other processes' load barely counts) of grading ``text``."""
    best = math.inf
    for _ in range(repeats):
        start = time.thread_time()
        gsm8k_reward(text, 1)
        format_ok(text)
        best = min(best, time.thread_time() - start)
    return best


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_inputs_are_graded_in_linear_work(name):
    """Bounded work, not a deadline: grading the text four times over costs about four times the
    CPU (a quadratic reader costs 16x, a backtracking one far more). The ratio is of the same
    machine's figures a moment apart, so a busy CI box does not fail it; absolute figures are in
    ``benchmarks/bench_answers.py``."""
    text = ADVERSARIAL[name]
    assert gsm8k_reward(text, 1) in (0.0, 0.2, 1.0, 1.2)
    once, four_times = _grading_cpu_seconds(text), _grading_cpu_seconds(text * 4)
    assert four_times <= 10 * max(once, 1e-3), \
        f"{name}: {once:.4f} s CPU for {len(text)} chars, {four_times:.4f} s for 4 times as many"


def test_long_digit_strings_are_capped():
    assert not is_correct("9" * 200000, 9)
    assert not is_correct("<answer>" + "1" * 200000 + "</answer>", 1)
    assert is_correct("1," * 100000, 1)  # "1," is not a thousands group: the last number is 1
