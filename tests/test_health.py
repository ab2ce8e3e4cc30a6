"""The reward-vs-task divergence alarm fires on the failure mode and stays quiet otherwise."""
from grpo_core.evaluation.health import divergence_alarm


def _history(rewards, accs, every=2):
    hist, a = [], iter(accs)
    for i, r in enumerate(rewards, 1):
        h = {"iteration": i, "reward": r}
        if i % every == 0:
            h["eval_accuracy"] = next(a)
        hist.append(h)
    return hist


def test_alarm_when_reward_rises_and_accuracy_falls():
    msg = divergence_alarm(_history([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.5, 0.4, 0.3]))
    assert msg and "divergence" in msg and "iterations 2..6" in msg


def test_quiet_when_both_rise_or_too_few_points_or_noise():
    assert divergence_alarm(_history([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.3, 0.4, 0.5])) is None
    assert divergence_alarm(_history([0.1, 0.2, 0.3, 0.4], [0.5, 0.3])) is None       # 2 < window
    assert divergence_alarm(_history([0.5, 0.5, 0.5, 0.51, 0.5, 0.5], [0.5, 0.49, 0.5])) is None
    assert divergence_alarm(_history([0.1] * 6, [0.5, 0.4, 0.3])) is None             # reward flat


def test_nan_evaluations_are_ignored():
    h = _history([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], [float("nan"), 0.5, 0.4, 0.3])
    assert divergence_alarm(h) is not None
