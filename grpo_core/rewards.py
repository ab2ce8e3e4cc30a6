"""Verifiable rewards: pure functions of (completion text, gold answer) -> float.

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
An integer gold is matched with an absolute tolerance of 1e-6 (so 1,449,999 is not 1,450,000); any other
gold with a relative tolerance of 1e-6 * max(1, |gold|).
Parsing uses ``str.find``/``count`` and small regexes without nested quantifiers, so it is
linear in the input: 200k characters of adversarial text take milliseconds.

Reward functions follow the TRL signature ``fn(prompts, completions, **columns) -> list[float | None]``
where ``columns`` are dataset fields as lists and ``None`` means "not applicable to this sample".
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Callable

CORRECT_REWARD = 1.0
FORMAT_BONUS = 0.2  # for exactly one well-formed <answer>N</answer> block
MAX_REWARD = 1.2  # CORRECT_REWARD + FORMAT_BONUS
REL_TOL = Fraction(1, 10**6)  # |a - b| <= REL_TOL (integer gold), else <= REL_TOL * max(1, |gold|)
FLOAT32_MAX = 3.4028234663852886e38  # largest finite float32: rewards become a float32 tensor
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


def _normalise(text: str) -> str:
    """``text`` with LaTeX thousands separators as ``,`` and ``\\frac{a}{b}`` as ``a/b``: the one place
    numbers are prepared before ``_NUMBER`` reads them."""
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


def gsm8k_reward(completion: str, gold) -> float:
    """CORRECT_REWARD if correct plus FORMAT_BONUS if format_ok, clipped to MAX_REWARD.

    >>> gsm8k_reward("<answer>18</answer>", 18), gsm8k_reward("18", 18), gsm8k_reward("<answer>7</answer>", 8)
    (1.2, 1.0, 0.2)
    """
    reward = CORRECT_REWARD * is_correct(completion, gold) + FORMAT_BONUS * format_ok(completion)
    return min(reward, MAX_REWARD)


def _text(completion) -> str:
    """A completion as text; a TRL conversational completion (list of messages) gives its last message."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def gsm8k_correctness(prompts: list[str], completions: list[str], gold: list, **_) -> list[float | None]:
    """gsm8k_reward per completion; a row whose gold is None is not applicable (None).

    >>> gsm8k_correctness(["q", "q"], ["<answer>4</answer>", "5"], gold=[4, "4"])
    [1.2, 0.0]
    """
    if len(gold) != len(completions):
        raise ValueError(f"gsm8k_correctness: got {len(completions)} completions but {len(gold)} gold values")
    return [None if g is None else gsm8k_reward(_text(c), g) for c, g in zip(completions, gold)]


def format_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """FORMAT_BONUS per completion with exactly one well-formed numeric answer block, else 0.0.

    >>> format_reward(["q", "q"], ["<answer>4</answer>", "4"])
    [0.2, 0.0]
    """
    return [FORMAT_BONUS if format_ok(_text(c)) else 0.0 for c in completions]


def target_char_fraction(prompts: list[str], completions: list[str], target: str = "7", **_) -> list[float]:
    """Fraction of the completion's characters equal to ``target`` (0.0 when empty): a dense toy reward.

    >>> target_char_fraction(["q", "q", "q"], ["7777", "7a7b", ""])
    [1.0, 0.5, 0.0]
    """
    if not isinstance(target, str) or len(target) != 1:
        raise ValueError(f"target_char_fraction: target must be one character, got {target!r}")
    texts = [_text(c) for c in completions]
    return [t.count(target) / len(t) if t else 0.0 for t in texts]


def load_reward_fn(path: str) -> Callable:
    """Import ``"package.module:function"`` and return the callable.

    >>> load_reward_fn("grpo_core.rewards:format_reward").__name__
    'format_reward'
    """
    module_name, _, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not module_name or not attr:
        raise ValueError(f"reward function path {path!r} must look like 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"reward function {path!r}: cannot import module {module_name!r} ({e}); "
            "check the spelling and that the package is installed / on PYTHONPATH"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"reward function {path!r}: module {module_name!r} has no attribute {attr!r}; "
                "check the name after ':'"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {path!r} is a {type(obj).__name__}, not callable; name a function")
    return obj


def _check_weight(weight, name: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
        raise ValueError(f"reward {name!r}: weight must be a finite number, got {weight!r}")
    return float(weight)


@dataclass(frozen=True)
class RewardSpec:
    """One reward term: ``fn`` is a ``"package.module:function"`` path, ``weight`` its multiplier."""

    fn: str
    weight: float = 1.0

    def __post_init__(self):
        if not isinstance(self.fn, str):
            raise ValueError(f"RewardSpec.fn must be a 'package.module:function' string, got {self.fn!r}")
        _check_weight(self.weight, self.fn)


def resolve_specs(specs) -> list[tuple[Callable, float, str]]:
    """Resolve RewardSpecs once into ``(callable, weight, name)``; such tuples pass through validated."""
    resolved = []
    for spec in specs:
        if isinstance(spec, RewardSpec):
            resolved.append((load_reward_fn(spec.fn), float(spec.weight), spec.fn))
            continue
        fn, weight, name = spec
        if not callable(fn):
            raise ValueError(f"reward {name!r}: {fn!r} is not callable")
        resolved.append((fn, _check_weight(weight, name), name))
    if not resolved:
        raise ValueError("no reward functions given; pass at least one RewardSpec")
    return resolved


class RewardTimeoutError(RuntimeError):
    """A reward function ran past its time limit."""


@contextmanager
def time_limit(seconds: float, name: str):
    """Raise ``RewardTimeoutError`` in the calling thread after ``seconds`` (0: no limit).

    SIGALRM only reaches the main thread; elsewhere (a reward called from a worker thread) this
    does nothing rather than install a handler Python would refuse."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise RewardTimeoutError(f"reward function {name!r} took more than {seconds:g} s for one batch "
                                 "(reward_timeout_s); make it faster (or give it its own timeout per "
                                 "sample), or raise reward_timeout_s (0 disables the limit)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def combine_rewards(specs, prompts: list[str], completions: list, columns: dict[str, list],
                    timeout_s: float = 0.0):
    """Weighted sum of reward functions per completion, plus the raw per-function values.

    None from a function means "not applicable": it adds nothing (a sample with no applicable
    function gets 0.0) and shows as nan in the breakdown (aggregate it with a nan-aware mean).
    ``timeout_s`` (0: none) limits each function's call (``time_limit``).

    >>> total, parts = combine_rewards([(format_reward, 2.0, "fmt")], ["q"], ["<answer>1</answer>"], {})
    >>> total, parts
    ([0.4], {'fmt': [0.2]})
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions; pass one prompt per completion")
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    totals, breakdown = [0.0] * n, {}
    for fn, weight, name in resolve_specs(specs):
        with time_limit(timeout_s, name):
            values = fn(prompts, completions, **columns)
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(f"reward function {name!r} returned {got} values, expected a list of {n}")
        row = []
        for i, v in enumerate(values):
            if v is None:
                row.append(math.nan)
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(
                    f"reward function {name!r} returned {v!r} at index {i}; return finite numbers or None"
                )
            row.append(float(v))
            totals[i] += weight * float(v)
        if name in breakdown:
            raise ValueError(f"reward function {name!r} is listed twice; merge the entries into one weight")
        breakdown[name] = row
    for i, t in enumerate(totals):  # the trainer holds rewards in float32: beyond its range is inf
        if not abs(t) <= FLOAT32_MAX:
            raise ValueError(f"weighted reward at index {i} is {t!r}, outside the float32 range (|r| <= "
                             f"{FLOAT32_MAX:.3g}) the trainer uses; rescale the reward functions or weights")
    return totals, breakdown
