"""Reward functions that misbehave on purpose, importable as ``tests.faulty_rewards:<name>``.

``huge_on_calls`` returns finite but enormous rewards (1e38, within float32) on chosen calls.
With ``scale="none"`` (Dr. GRPO) the advantages are then ~1e37 and the loss or the gradient
overflows float32, a real non-finite update that the trainer must skip. Which calls misbehave
is set by ``HUGE_ON_CALLS`` (a set of 1-based call numbers); tests reset ``CALLS`` first.
"""
from __future__ import annotations

HUGE = 1e38
CALLS = {"n": 0}
HUGE_ON_CALLS: set[int] = set()


def reset(huge_on_calls) -> None:
    CALLS["n"] = 0
    HUGE_ON_CALLS.clear()
    HUGE_ON_CALLS.update(huge_on_calls)


def huge_on_calls(prompts, completions, **_):
    """target_char_fraction('7'), except on the chosen calls: 1e38 on even rows, 0 on odd rows."""
    CALLS["n"] += 1
    if CALLS["n"] in HUGE_ON_CALLS:
        return [HUGE if i % 2 == 0 else 0.0 for i in range(len(completions))]
    return [c.count("7") / len(c) if c else 0.0 for c in completions]


def wrong_length(prompts, completions, **_):
    return [0.0] * (len(completions) - 1)


def hangs(prompts, completions, **_):
    """A verifier stuck forever (a deadlocked subprocess, a lost network call)."""
    import time
    time.sleep(3600)
    return [0.0] * len(completions)


def hangs_on_rank_1(prompts, completions, **_):
    """Rank 1 stuck in its verifier while rank 0 goes on to the next collective."""
    import os
    import time
    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    return [0.0] * len(completions)


def always_zero(prompts, completions, **_):
    """A verifier nothing satisfies: every group is uninformative."""
    return [0.0] * len(completions)


def sevens_on_even_rows(prompts, completions, **_):
    """target_char_fraction('7') on even rows, None (not applicable) on odd ones."""
    return [(c.count("7") / len(c) if c else 0.0) if i % 2 == 0 else None for i, c in enumerate(completions)]


KILL_ON_CALL_ENV = "GRPO_TEST_KILL_ON_CALL"
KILLS = {"n": 0}


def gsm8k_correctness_killed_on_call(prompts, completions, **columns):
    """``gsm8k_correctness``, except that a process whose environment sets GRPO_TEST_KILL_ON_CALL=N
    SIGKILLs itself on its N-th call: a training worker lost mid-stage (the OOM killer, a node
    gone), with no exception handler, ``finally`` or atexit running. Every rank counts its own
    calls (one per iteration without dynamic sampling), so N = k + 1 kills each rank in iteration
    k + 1, after iteration k was trained and, when due, checkpointed."""
    import os
    import signal

    from grpo_core.data.rewards import gsm8k_correctness

    KILLS["n"] += 1
    if os.environ.get(KILL_ON_CALL_ENV) == str(KILLS["n"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return gsm8k_correctness(prompts, completions, **columns)
