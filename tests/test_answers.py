"""Answer reading and grading (grpo_core.data.answers): the GSM8K reward table, answer
extraction, number parsing, gold values and the format check.
"""
import re
from fractions import Fraction

import pytest

from grpo_core.data.answers import extract_answer, format_ok, gold_value, is_correct, parse_number
from grpo_core.data.rewards import CORRECT_REWARD, FORMAT_BONUS, MAX_REWARD, gsm8k_reward

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
