"""Verifiable rewards: reward functions over completions, and how a stage loads, times and
combines them.

Reward functions follow the TRL signature ``fn(prompts, completions, **columns) -> list[float | None]``
where ``columns`` are dataset fields as lists (``RolloutBatch.reward_columns``) and ``None`` means
"not applicable to this sample". The built-in ones judge answers with ``grpo_core.data.answers``.
"""

from __future__ import annotations

import importlib
import math
import numbers
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from grpo_core.data.answers import format_ok, is_correct

CORRECT_REWARD = 1.0
FORMAT_BONUS = 0.2  # for exactly one well-formed <answer>N</answer> block
MAX_REWARD = 1.2  # CORRECT_REWARD + FORMAT_BONUS
FLOAT32_MAX = 3.4028234663852886e38  # largest finite float32: rewards become a float32 tensor


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

    >>> load_reward_fn("grpo_core.data.rewards:format_reward").__name__
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
