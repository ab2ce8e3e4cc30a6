"""Tests for grpo_core.data.rewards: answer extraction, gsm8k reward table, adversarial inputs, reward plumbing."""

import doctest
import math
import re
import time
from fractions import Fraction

import pytest

from grpo_core.data import answers, rewards
from grpo_core.data.answers import extract_answer, format_ok, gold_value, is_correct, parse_number
from grpo_core.data.rewards import (
    CORRECT_REWARD,
    FORMAT_BONUS,
    MAX_REWARD,
    RewardSpec,
    RewardTimeoutError,
    combine_rewards,
    format_reward,
    gsm8k_correctness,
    gsm8k_reward,
    load_reward_fn,
    resolve_specs,
    target_char_fraction,
)

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 1,210 + 24 clips.\n#### 1,234"

# (completion, gold, expected is_correct, expected gsm8k_reward)
CASES = [
    # the expected format: correct answer + bonus
    ("<think>6*3=18</think><answer>18</answer>", 18, True, 1.2),
    ("<answer>$1,234.00</answer>", 1234, True, 1.2),
    ("<answer>\n  18 \n</answer>\n", 18, True, 1.2),
    ("<answer>18.00</answer>", "18", True, 1.2),
    ("<answer>5 cm</answer>", 5, True, 1.2),
    ("<answer>\\boxed{18}</answer>", 18, True, 1.2),
    ("<answer>-5</answer>", -5, True, 1.2),
    ("<answer>\u22127</answer>", -7, True, 1.2),  # unicode minus
    ("<answer>0.5</answer>", ".5", True, 1.2),
    ("<answer>.5</answer>", 0.5, True, 1.2),
    ("<answer>1/2</answer>", 0.5, True, 1.2),
    ("<answer>0.1</answer>", 0.1, True, 1.2),  # float gold is read as its decimal repr, not binary
    ("<answer>1234</answer>", GSM8K_ANSWER, True, 1.2),  # raw GSM8K answer field as gold
    ("<answer>1,234</answer>", "1,234", True, 1.2),
    ("<answer>18</answer> #### 20", 18, True, 1.2),  # the tag outranks a #### line
    ("<answer>1000000.0000001</answer>", 1_000_000, True, 1.2),  # within relative 1e-6
    # well formed but wrong: bonus only
    ("<answer>17</answer>", 18, False, 0.2),
    ("<answer>-5</answer>", 5, False, 0.2),
    ("<answer>1.00001</answer>", 1, False, 0.2),  # outside 1e-6
    ("<answer>18</answer> #### 20", 20, False, 0.2),
    # correct without the bonus
    ("Step 1: 6 * 12 = 72\n#### 72", 72, True, 1.0),
    ("so she has 72 apples.", 72, True, 1.0),
    ("1,000,000 people came", 1_000_000, True, 1.0),
    ("The answer is \\boxed{18}.", 18, True, 1.0),
    ("The answer is \\boxed{18}. Check: 3 * 6 = 18, not 20", 18, True, 1.0),  # \boxed outranks last number
    ("so \\boxed{\\frac{1}{2}}", 0.5, True, 1.0),
    ("The tax is 18%", 18, True, 1.0),
    ("It costs 18 dollars", 18, True, 1.0),
    ("so x = -4", -4, True, 1.0),
    ("<answer>18</answer><answer>18.0</answer>", 18, True, 1.0),  # identical repeats: right, no bonus
    ("<answer>18", 18, True, 1.0),  # unclosed tag: falls back to the last number
    ("<answer>x = 18</answer>", 18, True, 1.0),  # lenient content is graded, but not well-formed
    # wrong, nothing
    ("<answer>18</answer><answer>20</answer>", 18, False, 0.0),  # hedging
    ("<answer>18</answer><answer>20</answer>", 20, False, 0.0),
    ("<answer>18</answer><answer>eighteen</answer>", 18, False, 0.0),
    ("<answer></answer><answer>18</answer>", 18, False, 0.0),  # one empty tag makes it wrong
    ("<answer><answer>18</answer>", 18, True, 1.0),  # nested open tag: graded leniently, not well-formed
    ("#### 18\nor maybe\n#### 20", 18, False, 0.0),  # the last #### line counts
    ("#### 18\nor maybe\n#### 20", 20, True, 1.0),
    ("#### Step 1: add\n5 + 67 = 72", 72, True, 1.0),  # a markdown heading is not a #### answer
    ("", 18, False, 0.0),
    ("  \n\t ", 18, False, 0.0),
    ("<answer></answer>", 18, False, 0.0),
    ("<answer>  </answer> the answer is 18", 18, False, 0.0),  # an empty tag is wrong, no fallback
    ("<answer>eighteen</answer>", 18, False, 0.0),
    ("3-4", -4, False, 0.0),  # a hyphen after a digit is not a sign
    ("no numbers here", 18, False, 0.0),
]


@pytest.mark.parametrize("completion,gold,correct,reward", CASES)
def test_gsm8k_table(completion, gold, correct, reward):
    assert is_correct(completion, gold) is correct
    assert gsm8k_reward(completion, gold) == reward  # exact: 0.0 / 0.2 / 1.0 / 1.2


def test_constants():
    assert (CORRECT_REWARD, FORMAT_BONUS, MAX_REWARD) == (1.0, 0.2, 1.2)
    assert CORRECT_REWARD + FORMAT_BONUS == MAX_REWARD


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("<think>a</think><answer> 18 </answer>", "18"),
        ("<answer>18</answer><answer>18.0</answer>", "18"),
        ("<answer>18</answer><answer>20</answer>", None),
        ("<answer></answer>", None),
        ("<answer>abc</answer><answer>xyz</answer>", None),  # non-numeric answers compare as text
        ("<answer>abc</answer><answer>abc</answer>", "abc"),
        ("work\n#### 1,234\n", "1,234"),
        ("so she has 72 apples.", "72"),
        ("\\boxed{18} then 20", "18"),
        ("", None),
        ("nothing", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("18", Fraction(18)),
        ("$1,234.00", Fraction(1234)),
        ("18%", Fraction(18)),
        ("-0.5", Fraction(-1, 2)),
        (".5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("1/0", None),
        ("x = 3 + 4 = 7", Fraction(7)),  # the last number
        ("", None),
        (None, None),
        ("9" * 65, None),  # over MAX_NUMBER_CHARS
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    "gold,expected",
    [(18, 18), (18.0, 18), ("18", 18), (" 1,234 \n", 1234), ("$-3.5", Fraction(-7, 2)), (GSM8K_ANSWER, 1234),
     (Fraction(1, 3), Fraction(1, 3)), (0.1, Fraction(1, 10))],
)
def test_gold_value(gold, expected):
    assert gold_value(gold) == expected


@pytest.mark.parametrize(
    "gold", ["abc", "", "#### ", "12 apples and 3 pears", None, True, float("nan"), float("inf"), [18]]
)
def test_non_numeric_gold_raises(gold):
    with pytest.raises(ValueError, match=re.escape(repr(gold))) as err:
        is_correct("<answer>18</answer>", gold)
    assert "#### N" in str(err.value)  # the message says how to fix it


@pytest.mark.parametrize(
    "completion,ok",
    [
        ("<think>x</think><answer>18</answer>", True),
        ("<answer>$1,234</answer>", True),
        ("<answer>18</answer><answer>18</answer>", False),
        ("</answer><answer>18", False),
        ("<answer>18", False),
        ("<answer><answer>18</answer>", False),
        ("<answer>18</answer><answer>", False),
        ("<answer></answer>", False),
        ("<answer>x is 18</answer>", False),
        ("<answer>18 or 20</answer>", False),
        ("18", False),
    ],
)
def test_format_ok(completion, ok):
    assert format_ok(completion) is ok


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


@pytest.mark.parametrize("completion,gold,correct", [
    ("#### \uff11\uff18", 18, True),                    # full-width digits
    ("<answer>\u0661\u0668</answer>", 18, True),        # Arabic-Indic digits
    ("The answer is \u06f1\u06f8.", 18, True),          # extended Arabic-Indic (Persian) digits
    ("#### \uff11,\uff12\uff13\uff14", 1234, True),
    ("She has 1\u00a0000 apples.", 1000, True),          # no-break space as thousands separator
    ("#### 1\u202f234\u202f567", 1234567, True),       # narrow no-break space groups
    ("Total: 1\u2009500", 1500, True),                  # thin space
    ("In 2 100 rows", 2100, False),                    # an ordinary space separates two numbers: 100
    ("In 2 100 rows", 100, True),
    ("1\u00a000", 100, False),                          # not a group of three: 1 and 00
    ("x\u00b2 = 4", 4, True),                           # a superscript is no digit: the answer is 4
    ("x\u00b2", 2, False),
])
def test_digits_of_other_scripts_and_no_break_thousands_separators(completion, gold, correct):
    assert is_correct(completion, gold) is correct, extract_answer(completion)


def test_long_digit_strings_are_capped():
    assert not is_correct("9" * 200000, 9)
    assert not is_correct("<answer>" + "1" * 200000 + "</answer>", 1)
    assert is_correct("1," * 100000, 1)  # "1," is not a thousands group: the last number is 1


def test_reward_functions_trl_signature():
    prompts = ["q"] * 4
    completions = ["<answer>4</answer>", "4", "<answer>5</answer>", "x"]
    assert gsm8k_correctness(prompts, completions, gold=[4, "4", 4, None], extra=[0] * 4) == [1.2, 1.0, 0.2, None]
    assert format_reward(prompts, completions, gold=[1] * 4) == [0.2, 0.0, 0.2, 0.0]
    conversational = [[{"role": "assistant", "content": "<answer>4</answer>"}]]
    assert gsm8k_correctness(["q"], conversational, gold=[4]) == [1.2]
    with pytest.raises(ValueError, match="2 completions but 1 gold"):
        gsm8k_correctness(["q", "q"], ["1", "2"], gold=[1])


def test_target_char_fraction():
    completions = ["7777", "7a7b", "", "abc"]
    assert target_char_fraction(["q"] * 4, completions) == [1.0, 0.5, 0.0, 0.0]
    assert target_char_fraction(["q"] * 4, completions, target="a", gold=[0] * 4) == [0.0, 0.25, 0.0, 1 / 3]
    with pytest.raises(ValueError, match="one character"):
        target_char_fraction(["q"], ["77"], target="77")


def test_load_reward_fn_success():
    assert load_reward_fn("grpo_core.data.rewards:format_reward") is format_reward


@pytest.mark.parametrize(
    "path,hint",
    [
        ("grpo_core.data.rewards.format_reward", "package.module:function"),  # missing colon
        (":format_reward", "package.module:function"),
        ("grpo_core.no_such_module:fn", "cannot import"),
        ("grpo_core.data.rewards:no_such_fn", "no attribute"),
        ("grpo_core.data.rewards:FORMAT_BONUS", "not callable"),
    ],
)
def test_load_reward_fn_errors(path, hint):
    with pytest.raises(ValueError, match=re.escape(repr(path))) as err:
        load_reward_fn(path)
    assert hint in str(err.value)


def test_reward_spec_validates_weight():
    assert RewardSpec("grpo_core.data.rewards:format_reward").weight == 1.0
    for bad in (math.nan, math.inf, "1", None, True):
        with pytest.raises(ValueError, match="finite"):
            RewardSpec("grpo_core.data.rewards:format_reward", bad)
    with pytest.raises(ValueError, match="package.module:function"):
        RewardSpec(format_reward)
    with pytest.raises(AttributeError):
        RewardSpec("m:f").weight = 2.0  # frozen


def test_combine_rewards_weights():
    specs = [RewardSpec("grpo_core.data.rewards:gsm8k_correctness"),
             RewardSpec("grpo_core.data.rewards:format_reward", -0.5)]
    completions = ["<answer>4</answer>", "4", "<answer>5</answer>"]
    totals, parts = combine_rewards(specs, ["q"] * 3, completions, {"gold": [4, 4, 4]})
    # 1.2 - 0.5*0.2, 1.0 - 0, 0.2 - 0.5*0.2
    assert totals == pytest.approx([1.1, 1.0, 0.1])
    assert parts == {
        "grpo_core.data.rewards:gsm8k_correctness": [1.2, 1.0, 0.2],
        "grpo_core.data.rewards:format_reward": [0.2, 0.0, 0.2],
    }
    resolved = resolve_specs(specs)  # resolve once, reuse
    assert [(w, n) for _, w, n in resolved] == [(1.0, specs[0].fn), (-0.5, specs[1].fn)]
    assert combine_rewards(resolved, ["q"] * 3, completions, {"gold": [4, 4, 4]})[0] == totals


def test_combine_rewards_none_is_not_applicable():
    def half(prompts, completions, **_):
        return [None, 0.5, None]

    def never(prompts, completions, **_):
        return [None, None, None]

    def one(prompts, completions, **_):
        return [1.0, None, None]

    totals, parts = combine_rewards([(half, 2.0, "half"), (never, 1.0, "never"), (one, 3.0, "one")], ["q"] * 3,
                                    ["a", "b", "c"], {})
    assert totals == [3.0, 1.0, 0.0]  # sample 2: nothing applies -> 0.0
    assert math.isnan(parts["half"][0]) and parts["half"][1] == 0.5
    assert all(math.isnan(v) for v in parts["never"])


def test_combine_rewards_errors():
    def short(prompts, completions, **_):
        return [1.0]

    def bad(prompts, completions, **_):
        return [1.0, math.nan]

    def infinite(prompts, completions, **_):
        return [math.inf, 1.0]

    args = (["q", "q"], ["a", "b"], {})
    with pytest.raises(ValueError, match=r"'my_pkg:short' returned 1 values, expected a list of 2"):
        combine_rewards([(short, 1.0, "my_pkg:short")], *args)
    with pytest.raises(ValueError, match=r"'bad'.*index 1"):
        combine_rewards([(bad, 1.0, "bad")], *args)
    with pytest.raises(ValueError, match=r"'infinite'.*index 0"):
        combine_rewards([(infinite, 1.0, "infinite")], *args)
    with pytest.raises(ValueError, match="'gen'"):
        combine_rewards([(lambda p, c, **_: (x for x in c), 1.0, "gen")], *args)
    with pytest.raises(ValueError, match="3 prompts for 2 completions"):
        combine_rewards([(format_reward, 1.0, "f")], ["q"] * 3, ["a", "b"], {})
    with pytest.raises(ValueError, match="column 'gold'"):
        combine_rewards([(format_reward, 1.0, "f")], ["q", "q"], ["a", "b"], {"gold": [1]})
    with pytest.raises(ValueError, match="listed twice"):
        combine_rewards([(format_reward, 1.0, "f"), (format_reward, 2.0, "f")], *args)
    with pytest.raises(ValueError, match="not callable"):
        resolve_specs([(3, 1.0, "three")])
    with pytest.raises(ValueError, match="no reward functions"):
        resolve_specs([])


def test_reward_time_limit_stops_a_hung_function_and_restores_the_alarm():
    """A reward function stuck in a blocking call is interrupted after timeout_s with an error
    naming it and the setting; afterwards no timer is left running and the previous SIGALRM
    handler is back. Functions within the limit are unaffected."""
    import signal
    import time

    def stuck(prompts, completions, **_):
        time.sleep(60)

    mine = signal.signal(signal.SIGALRM, signal.SIG_IGN)
    try:
        t0 = time.monotonic()
        with pytest.raises(RewardTimeoutError, match=r"'verifiers:stuck' took more than 0.3 s.*reward_timeout_s"):
            combine_rewards([(stuck, 1.0, "verifiers:stuck")], ["q"], ["a"], {}, timeout_s=0.3)
        assert time.monotonic() - t0 < 10
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        assert signal.getsignal(signal.SIGALRM) is signal.SIG_IGN
        totals, _ = combine_rewards([(format_reward, 1.0, "f")], ["q"], ["<answer>1</answer>"], {}, timeout_s=5)
        assert totals == [0.2] and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, mine)


@pytest.mark.parametrize("module", [answers, rewards])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# --- #### lines: numbered markdown headings are not answers; the later of #### and \boxed wins ---------------


@pytest.mark.parametrize(
    "completion",
    [
        "#### 1. Understand\n...\n#### 2. Compute\n3*6 = 18, so \\boxed{18}.",
        "#### 2. Final Answer\nThe total is 18.",
        "#### 3) Answer\n\\boxed{18}",
        "#### 4: Result\n6 * 3 = 18",
        "#### 2 Final Answer\nThe total is 18.",  # a capitalised phrase
        "#### 2 Compute the total\n9 * 2 = 18",
        "#### 2.Compute\n18",
        "#### 2. **Compute**\n\\boxed{18}",
        "#### 1.5. Check\n18",
    ],
)
def test_hash_numbered_heading_is_not_an_answer(completion):
    assert extract_answer(completion) == "18"
    assert is_correct(completion, 18)
    assert gsm8k_reward(completion, 18) == 1.0


@pytest.mark.parametrize(
    "completion,expected,gold",
    [
        ("work\n#### 18.", "18.", 18),  # a trailing period is not a heading
        ("work\n#### 18 apples\nso 20 was wrong", "18 apples", 18),
        ("work\n#### $1,234", "$1,234", 1234),
        ("work\n#### -3.5", "-3.5", Fraction(-7, 2)),
        ("#### 2. Plan\n#### 18", "18", 18),  # the last #### line that is an answer
        ("#### 18 Dollars\nThat's 2 more than last week.", "18 Dollars", 18),  # capitalised units
        ("#### 18 USD\n(6 items at $3 each)", "18 USD", 18),
    ],
)
def test_hash_number_lines_still_count(completion, expected, gold):
    assert extract_answer(completion) == expected
    assert is_correct(completion, gold)


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("#### 20\nRecheck: 3*6 = 18, so \\boxed{18}", "18"),  # \boxed after ####: \boxed
        ("\\boxed{20}\nRecheck: 3*6 = 18\n#### 18", "18"),  # #### after \boxed: ####
        ("#### 18\n\\boxed{eighteen} 20", "18"),  # a non-numeric \boxed does not count
        ("#### \\boxed{18}", "18"),  # the same answer either way
        ("<answer>7</answer> #### 18 \\boxed{20}", "7"),  # tags still come first
    ],
)
def test_later_of_hash_and_boxed_wins(completion, expected):
    assert extract_answer(completion) == expected


# --- tolerance: absolute for integer golds, relative otherwise -------------------------------------------


@pytest.mark.parametrize(
    "answer,gold,correct",
    [
        ("1,449,999", "#### 1,450,000", False),
        ("1,450,001", 1_450_000, False),
        ("999999999", 10**9, False),
        ("1,450,000", "#### 1,450,000", True),
        ("17.9999999", 18, True),  # within absolute 1e-6
        ("1000000.0000001", 1_000_000, True),
        ("1000000.000002", 1_000_000, False),
        ("18.0", 18.0, True),  # a float gold with an integer value is an integer gold
        ("1450000.5", 1450000.5, True),
        ("1450001", 1450000.5, True),  # non-integer gold: relative 1e-6 * |gold| (~1.45)
        ("1449998", 1450000.5, False),
        ("0.3333333", Fraction(1, 3), True),
    ],
)
def test_integer_gold_uses_absolute_tolerance(answer, gold, correct):
    assert is_correct(f"<answer>{answer}</answer>", gold) is correct
    assert gsm8k_reward(f"<answer>{answer}</answer>", gold) == (1.2 if correct else 0.2)


# --- number syntax: LaTeX thousands separators, mixed numbers, scientific notation --------------------------


@pytest.mark.parametrize("sep", ["{,}", ",\\!", "\\,", "\\!", "\\ "])
def test_latex_thousands_separators(sep):
    n = f"1{sep}000"
    assert parse_number(f"\\boxed{{{n}}}") == 1000
    assert is_correct(f"The answer is \\boxed{{{n}}}.", 1000)
    assert gsm8k_reward(f"<answer>{n}</answer>", "#### 1,000") == 1.2
    assert gsm8k_reward(f"<answer>\\boxed{{{n}}}</answer>", 1000) == 1.2
    assert is_correct(f"work\n#### {n}", 1000)
    assert parse_number(f"1{sep}234{sep}567.5") == Fraction(2469135, 2)
    assert parse_number(f"\\frac{{1{sep}000}}{{4}}") == 250
    assert parse_number(f"1{sep}25") == 25  # not a group of three: two numbers, the last is 25
    assert parse_number(f"1{sep}2500") == 2500


@pytest.mark.parametrize(
    "text,value",
    [
        ("3\\frac{1}{2}", Fraction(7, 2)),
        ("3\\dfrac{1}{2}", Fraction(7, 2)),
        ("3 \\frac{1}{2}", Fraction(7, 2)),
        ("-3\\frac{1}{2}", Fraction(-7, 2)),
        ("2 1/2", Fraction(5, 2)),
        ("-2 1/2", Fraction(-5, 2)),
        ("\u22122 1/2", Fraction(-5, 2)),
        ("$1,002 3/4", Fraction(4011, 4)),
        ("it took 2 1/2 hours", Fraction(5, 2)),
        ("2  1/2", Fraction(1, 2)),  # two spaces: not a mixed number
        ("2\t1/2", Fraction(1, 2)),
        ("2.5 1/2", Fraction(1, 2)),  # the whole part is an integer
        ("2 1/0", None),
        ("In 2023 1/4 of the people", Fraction(1, 4)),  # a year, then a fraction: not mixed
        ("so 4 12/2", Fraction(6)),  # an improper fraction after a number: two numbers
        ("\\frac{1}{2}", Fraction(1, 2)),
        ("x\\frac{1}{2}", Fraction(1, 2)),
    ],
)
def test_mixed_numbers(text, value):
    assert parse_number(text) == value


def test_mixed_numbers_grading_and_format():
    assert gsm8k_reward("<answer>3\\frac{1}{2}</answer>", 3.5) == 1.2
    assert gsm8k_reward("<answer>3\\frac{1}{2}</answer>", "#### 31/2") == 0.2
    assert gsm8k_reward("<answer>2 1/2</answer>", Fraction(5, 2)) == 1.2
    assert gsm8k_reward("<answer>-2 1/2</answer>", -2.5) == 1.2
    assert is_correct("so \\boxed{2\\frac{1}{2}} cups", 2.5)
    assert is_correct("work\n#### 2 1/2", 2.5)
    assert gold_value("#### 2 1/2") == Fraction(5, 2)
    assert format_ok("<answer>2 1/2</answer>") and format_ok("<answer>3\\frac{1}{2}</answer>")


@pytest.mark.parametrize(
    "text,value",
    [
        ("1e3", Fraction(1000)),
        ("1.5e6", Fraction(1500000)),
        ("1.5E+6", Fraction(1500000)),
        ("2.5e-3", Fraction(1, 400)),
        ("-4e2", Fraction(-400)),
        (".5e1", Fraction(5)),
        ("1,000e3", Fraction(10**6)),
        ("about 1e999 atoms", Fraction(10**999)),
        ("3eggs", Fraction(3)),  # an exponent needs digits
        ("2e", Fraction(2)),
        ("2e+", Fraction(2)),
        ("it has 12 eggs", Fraction(12)),
        ("1e1234", Fraction(1234)),  # more than 3 exponent digits is no exponent
        ("9" * 63 + "e3", None),  # over MAX_NUMBER_CHARS with the exponent
        ("9" * 60 + "e3", Fraction(10**63 - 1000)),
    ],
)
def test_scientific_notation(text, value):
    assert parse_number(text) == value


def test_scientific_notation_grading_and_format():
    assert gsm8k_reward("<answer>1.5e6</answer>", 1_500_000) == 1.2
    assert is_correct("so \\boxed{1e3}", "#### 1,000")
    assert is_correct("The answer is 1e3.", 1000)
    assert is_correct("work\n#### 1.5e6", 1_500_000)
    assert not is_correct("<answer>1e3</answer>", 3)
    assert format_ok("<answer>1e3</answer>") and not format_ok("<answer>1e1234</answer>")


def test_decimal_comma_is_unchanged():
    assert parse_number("12,5") == 5 and extract_answer("12,5") == "5"
    assert not format_ok("<answer>12,5</answer>")
