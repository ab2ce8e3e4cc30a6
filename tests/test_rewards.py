"""Reward plumbing (grpo_core.data.rewards): TRL-style reward functions, loading them by path,
weights, combining (None is not applicable, bad outputs named), the time limit, and the
modules' docstring examples.
"""
import doctest
import math
import re

import pytest

from grpo_core.data import answers, rewards
from grpo_core.data.rewards import (
    RewardSpec,
    RewardTimeoutError,
    combine_rewards,
    format_reward,
    gsm8k_correctness,
    load_reward_fn,
    resolve_specs,
    target_char_fraction,
)


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
