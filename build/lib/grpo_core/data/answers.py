"""Reading the final answer of a completion, and judging it against the gold answer: pure functions.

The final answer of a completion is read, in order of priority, from
  1. ``<answer>...</answer>`` tags (all closed tags must agree: two different answers are wrong),
  2. whichever comes later in the text of
     - the last ``#### N`` line whose rest is a number (GSM8K style). Markdown headings are skipped:
       a number followed by ``.``/``)``/``:`` and text (``#### 2. Compute``, ``#### 3) Answer``) or by a
       capitalised word and more words (``#### 2 Final Answer``); ``#### 18.``, ``#### 18 apples``,
       ``#### 18 USD``, ``#### 18 Dollars``, ``#### $1,234`` count;
     - the last ``\\boxed{...}`` holding a number,
  3. the last number in the text.
Numbers are exact ``fractions.Fraction`` values. Accepted forms: ``$``, ``%``, units, thousands commas
(also the LaTeX ``1{,}000``, ``1,\\!000``, ``1\\,000``, ``1\\!000``, ``1\\ 000``), decimals, ``a/b`` and
``\\frac{a}{b}``, mixed numbers (``2 1/2`` and ``2\\frac{1}{2}`` are 5/2; ``-2 1/2`` is -5/2; the whole part
has 1-3 digits or thousands commas, the fraction is proper: ``in 2023 1/4`` and ``4 12/2`` are two numbers) and
scientific notation with at most 3 exponent digits (``1.5e6``). ``12,5`` is not a decimal comma: it reads as 5.
Digits of any script are read as their values (full-width ``１８`` and Arabic-Indic ``١٨`` are 18; superscripts such
as ``²`` are not decimal digits and stay text), and a no-break, narrow no-break or thin space between a digit and
exactly three digits is a thousands separator (``1\u00a0000`` is 1000; an ordinary space is not: ``2 100`` is two
numbers).
An integer gold is matched with an absolute tolerance of 1e-6 (so 1,449,999 is not 1,450,000); any other
gold with a relative tolerance of 1e-6 * max(1, |gold|).
Parsing uses ``str.find``/``count`` and small regexes without nested quantifiers, so it is
linear in the input (timings on adversarial text: benchmarks/NOTES.md).

"""

from __future__ import annotations

import math
import numbers
import re
import unicodedata
from decimal import Decimal
from fractions import Fraction

REL_TOL = Fraction(1, 10**6)  # |a - b| <= REL_TOL (integer gold), else <= REL_TOL * max(1, |gold|)
MAX_NUMBER_CHARS = 64  # longer digit strings are rejected, not converted (int() on 200k digits is slow)

_OPEN, _CLOSE, _BOXED = "<answer>", "</answer>", "\\boxed{"
# sign (not after a word char or ')'), then either a mixed number "2 1/2" (1-3 digits or ",ddd" groups, ONE space,
# a/b; an improper a/b is read alone in _to_fraction) or
# digits with ",ddd" groups and decimals, or ".5"; an optional exponent "e-3" (1-3 digits); optional "/den".
# No nested quantifiers (only the fixed-width ",ddd" group repeats), so matching stays linear.
_NUMBER = re.compile(
    r"(?:(?<![\w)])[-\u2212]\$?)?"
    r"(?:\d{1,3}(?:,\d{3}(?!\d))* \d+/\d+"
    r"|(?:\d+(?:,\d{3}(?!\d))*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d{1,3}(?!\d))?(?:/\d+)?)",
    re.ASCII,
)
_FRAC = re.compile(r"\\d?frac\{([-\d.,]+)\}\{([-\d.,]+)\}", re.ASCII)  # \frac{1}{2} -> 1/2
# LaTeX thousands separators between a digit and exactly three digits: 1{,}000 1,\!000 1\,000 1\!000 1\ 000
_LATEX_SEP = re.compile(r"(?<=\d)(?:\{,\}|,\\!|\\[,! ])(?=\d{3}(?!\d))", re.ASCII)
# what follows the number of a markdown heading: "#### 2. Compute", "#### 3) **Answer**", or a phrase that
# starts with a capitalised word, "#### 2 Final Answer", "#### 2 Compute the total" (one word alone is a
# unit: "#### 18 USD", "#### 18 Dollars" are answers)
_HEADING_REST = re.compile(r"\s*[.):]\s*[*_`]*[^\W\d_]|[ \t]+[*_`]*[A-Z][^\W_]*[*_`]*[ \t]+[*_`]*[^\W\d_]")
_DIGIT = re.compile(r"\d", re.ASCII)


def _frac_to_slash(m: re.Match) -> str:
    # "3\frac{1}{2}" is the mixed number 3 1/2: keep the whole part apart from the numerator
    space = " " if m.start() > 0 and m.string[m.start() - 1] in "0123456789" else ""
    return f"{space}{m.group(1)}/{m.group(2)}"


# a no-break (U+00A0), narrow no-break (U+202F) or thin (U+2009) space between a digit and exactly three digits
_SPACE_SEP = re.compile("(?<=[0-9])[\u00a0\u202f\u2009](?=[0-9]{3}(?![0-9]))")


def _ascii_digits(text: str) -> str:
    """``text`` with every decimal digit of another script (full-width, Arabic-Indic, ...) as its ASCII digit."""
    if text.isascii():
        return text
    return "".join(str(unicodedata.decimal(ch)) if ch.isdecimal() and not ch.isascii() else ch for ch in text)


def _normalise(text: str) -> str:
    """``text`` with digits of every script as ASCII digits, no-break-space and LaTeX thousands separators
    as ``,`` and ``\\frac{a}{b}`` as ``a/b``: the one place numbers are prepared before ``_NUMBER`` reads
    them. Each replacement keeps the length up to the ``\\frac`` step, which comes last."""
    text = _SPACE_SEP.sub(",", _ascii_digits(text))
    return _FRAC.sub(_frac_to_slash, _LATEX_SEP.sub(",", text))


def _to_fraction(token: str) -> Fraction | None:
    token = token.replace(",", "").replace("$", "").replace("\u2212", "-")
    if len(token) > MAX_NUMBER_CHARS:
        return None
    sign = -1 if token.startswith("-") else 1  # of the whole value: -2 1/2 is -5/2
    whole, _, frac = token.lstrip("-").rpartition(" ")
    num, _, den = frac.partition("/")
    if den and int(den) == 0:
        return None
    value = Fraction(num) / (Fraction(den) if den else 1)
    if whole and value >= 1:  # "so 4 12/2": two numbers, not a mixed one; the last is the fraction
        return value
    return sign * (Fraction(whole) + value if whole else value)


def parse_number(text: str | None) -> Fraction | None:
    """Value of the last number in ``text`` as an exact ``Fraction``, or None.

    Tolerates ``$``, thousands commas (also LaTeX ``1{,}000``), ``%``, units, ``\\frac{a}{b}``, ``a/b``,
    mixed numbers (``2 1/2``, ``2\\frac{1}{2}``) and exponents (``1.5e6``).
    Numbers longer than MAX_NUMBER_CHARS characters give None.

    >>> parse_number("$1,234.00")
    Fraction(1234, 1)
    >>> parse_number("so she has -0.5 apples.")
    Fraction(-1, 2)
    >>> parse_number("1/2"), parse_number("no digits")
    (Fraction(1, 2), None)
    >>> parse_number("\\boxed{1{,}000}"), parse_number("-2 1/2"), parse_number("1.5e6")
    (Fraction(1000, 1), Fraction(-5, 2), Fraction(1500000, 1))
    """
    last = _last_number(text) if text else None
    return _to_fraction(last) if last else None


def _last_number(text: str) -> str | None:
    """The last number token of ``text`` (normalised), or None."""
    last = None
    for last in _NUMBER.finditer(_normalise(text)):
        pass
    return last.group() if last else None


def _clean_match(text: str) -> re.Match | None:
    """The match of the one number ``text`` holds (allowing ``$``, ``\\boxed{}``, ``%``, units), else None.
    Its ``.string`` is the normalised text, so what follows the number is ``m.string[m.end():]``."""
    s = text.strip()
    if s.startswith(_BOXED) and s.endswith("}"):
        s = s[len(_BOXED) : -1].strip()
    s = _normalise(s.lstrip("$").strip())
    m = _NUMBER.match(s)
    if not m or _DIGIT.search(s, m.end()):
        return None
    return m


def _clean_number(text: str) -> Fraction | None:
    """Value of ``text`` if it is one number (allowing ``$``, ``\\boxed{}``, ``%``, units), else None."""
    m = _clean_match(text)
    return _to_fraction(m.group()) if m else None


def _hash_answer(line: str) -> bool:
    """True if the rest of a ``####`` line is a number answer, not a numbered markdown heading."""
    m = _clean_match(line)
    return m is not None and _to_fraction(m.group()) is not None and not _HEADING_REST.match(m.string, m.end())


def _agree(contents: list[str]) -> str | None:
    """The common answer of several candidates, or None if two differ (no hedging)."""
    keys = {c if (v := parse_number(c)) is None else v for c in contents}  # non-numeric: compare as text
    return contents[0] if len(keys) == 1 and contents[0] else None  # an empty tag is no answer


def _tag_contents(text: str) -> list[str] | None:
    """Stripped contents of closed <answer> blocks; None if there are none. Stops at an unclosed tag."""
    contents, i = [], 0
    while (start := text.find(_OPEN, i)) != -1:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end == -1:
            break
        contents.append(text[start + len(_OPEN) : end].strip())
        i = end + len(_CLOSE)
    return contents or None


def _last_boxed(text: str) -> tuple[int, str] | None:
    """(position, stripped content) of the last ``\\boxed{...}``; None if there is none or it is unclosed."""
    pos = text.rfind(_BOXED)
    if pos == -1:
        return None
    depth, start = 1, pos + len(_BOXED)
    for i, ch in enumerate(text[start:], start):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return pos, text[start:i].strip()
    return None


def _last_hash(text: str) -> tuple[int, str] | None:
    """(position, stripped line) of the last ``#### N`` answer line (see ``_hash_answer``), or None."""
    parts = text.split("####")
    pos = len(text)
    for part in reversed(parts[1:]):
        pos -= len(part) + len("####")
        line = part.partition("\n")[0].strip()
        if _hash_answer(line):
            return pos, line
    return None


def extract_answer(completion: str) -> str | None:
    """The raw final-answer string of a completion, or None (see the module docstring for the rules).

    >>> extract_answer("<think>6*3</think><answer> 18 </answer>")
    '18'
    >>> extract_answer("<answer>18</answer><answer>20</answer>") is None  # hedging
    True
    >>> extract_answer("Step 1...\\n#### 72"), extract_answer("so she has 72 apples.")
    ('72', '72')
    >>> extract_answer("#### 1. Plan\\n3*6 = 18, so \\\\boxed{18}.")  # a heading is not an answer
    '18'
    >>> extract_answer("\\\\boxed{20} Recheck: 3*6 = 18\\n#### 18")  # the later of #### and \\boxed wins
    '18'
    """
    if not completion:
        return None
    tagged = _tag_contents(completion)
    if tagged is not None:
        return _agree(tagged)
    hashed = _last_hash(completion)
    boxed = _last_boxed(completion)
    if boxed is not None and parse_number(boxed[1]) is None:
        boxed = None
    if hashed is not None or boxed is not None:
        return max(c for c in (hashed, boxed) if c is not None)[1]  # the later one (positions differ)
    return _last_number(completion)


def gold_value(gold) -> Fraction:
    """The gold answer as a ``Fraction``: a number, a numeric string, or a GSM8K answer ending in ``#### N``.

    >>> gold_value(18), gold_value("1,234"), gold_value("48/2 = 24 clips\\n#### 72")
    (Fraction(18, 1), Fraction(1234, 1), Fraction(72, 1))
    """
    value = None
    if isinstance(gold, bool):
        pass  # True/False is never a numeric answer
    elif isinstance(gold, numbers.Rational) or (isinstance(gold, Decimal) and gold.is_finite()):
        value = Fraction(gold)
    elif isinstance(gold, numbers.Real) and math.isfinite(gold):
        value = Fraction(repr(float(gold)))  # 0.1 -> 1/10, not the binary expansion
    elif isinstance(gold, str):
        value = _clean_number(gold.rpartition("####")[2])
    if value is None:
        raise ValueError(
            f"gold answer {gold!r} is not a number; pass an int/float, a numeric string such as '1,234', "
            "or a GSM8K answer ending in '#### N'"
        )
    return value


def is_correct(completion: str, gold) -> bool:
    """True if the completion's final answer equals ``gold`` numerically.

    An integer gold allows an absolute error of REL_TOL = 1e-6 (17.9999999 matches 18, but 1,449,999
    does not match 1,450,000); any other gold a relative one, REL_TOL * max(1, |gold|).

    >>> is_correct("<answer>$1,234.00</answer>", 1234), is_correct("<answer>18</answer>", "#### 20")
    (True, False)
    >>> is_correct("<answer>17.9999999</answer>", 18), is_correct("<answer>1,449,999</answer>", 1450000)
    (True, False)
    """
    target = gold_value(gold)
    value = parse_number(extract_answer(completion))
    tol = REL_TOL if target.denominator == 1 else REL_TOL * max(1, abs(target))
    return value is not None and abs(value - target) <= tol


def format_ok(completion: str) -> bool:
    """True for exactly one ``<answer>...</answer>`` block whose content is a single number.

    >>> format_ok("<think>...</think><answer>18</answer>"), format_ok("<answer>x is 18</answer>")
    (True, False)
    """
    if not completion or completion.count(_OPEN) != 1 or completion.count(_CLOSE) != 1:
        return False
    start, end = completion.find(_OPEN) + len(_OPEN), completion.find(_CLOSE)
    return _clean_number(completion[start:end]) is not None  # empty if </answer> comes first
