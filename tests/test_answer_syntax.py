"""Answer syntax the reader handles: #### lines against numbered headings and \\boxed, tolerance by
gold type, digits of other scripts, no-break and LaTeX thousands separators, mixed numbers,
scientific notation, decimal commas.
"""
from fractions import Fraction

import pytest

from grpo_core.data.answers import extract_answer, format_ok, gold_value, is_correct, parse_number
from grpo_core.data.rewards import gsm8k_reward

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
