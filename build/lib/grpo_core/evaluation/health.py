"""Training-health signals computed from the metric history (pure functions, no I/O).

The reward-vs-task divergence alarm: GRPO can learn to please the reward (format bonus, a
hackable checker) while held-out accuracy falls. When, over the last ``window`` evaluations,
the training reward trends up and held-out accuracy trends down by more than ``tolerance``,
we say so loudly instead of letting a rising reward curve look like progress.
"""
from __future__ import annotations

DEFAULT_WINDOW = 3        # evaluations compared; fewer points say nothing about a trend
DEFAULT_TOLERANCE = 0.02  # absolute change below this is noise for both curves


def _slope(ys: list[float]) -> float:
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    den = sum((i - mx) ** 2 for i in range(n)) or 1.0
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / den


def divergence_alarm(history: list[dict], window: int = DEFAULT_WINDOW,
                     tolerance: float = DEFAULT_TOLERANCE) -> str | None:
    """A message if reward rose while eval accuracy fell over the last ``window`` evaluations.

    ``history``: per-iteration dicts with ``reward`` and, on evaluation iterations,
    ``eval_accuracy``. The reward at each evaluation is the mean since the previous one.
    """
    points, since = [], []
    for h in history:
        since.append(h["reward"])
        if "eval_accuracy" in h and h["eval_accuracy"] == h["eval_accuracy"]:  # not NaN
            points.append((sum(since) / len(since), h["eval_accuracy"], h["iteration"]))
            since = []
    if len(points) < window:
        return None
    rewards, accs, its = zip(*points[-window:])
    rise, fall = _slope(list(rewards)) * (window - 1), _slope(list(accs)) * (window - 1)
    if rise > tolerance and fall < -tolerance:
        return (f"reward-vs-task divergence: training reward rose {rise:+.3f} while held-out "
                f"accuracy moved {fall:+.3f} over iterations {its[0]}..{its[-1]}; the policy may be "
                "exploiting the reward (check format bonus / samples)")
    return None
