"""One iteration's metrics: a rank's named sums, and the metrics computed from their sums over ranks.

Two pure steps around one collective (`dist.all_reduce_named`), so the reductions carry names,
not positions, and the arithmetic is testable without a model or a process group:

    sums = dist.all_reduce_named(local_sums(batch, roll, upd, reward_names))
    metrics = iteration_metrics(iteration, sums, ...)

Means over rows divide by all ranks' rows; token means (KL, clip fractions, ratio, entropy) by all
ranks' loss tokens, since ranks may hold different numbers of them; each reward function's mean is
over the rows it returned a number for.
"""
from __future__ import annotations

import math

from grpo_core.algo.core import informative_mask
from grpo_core.rollout.batch import RolloutBatch

TOKEN_MEANS = ("kl", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy")


def local_sums(batch: RolloutBatch, roll: dict, upd: dict, reward_names: list[str]) -> dict[str, float]:
    """This rank's additive contributions to the iteration's metrics, named.

    ``roll``: the rollout's group counts (``informative_groups``, ``drawn_groups``); ``upd``: the
    update's stats (token means over its ``num_tokens`` loss tokens, its ``loss``);
    ``reward_names``: the reward functions, in the order of ``batch.reward_parts``' columns."""
    lens = batch.completion_mask.sum(-1).float()
    informative = informative_mask(batch.rewards, batch.group_size).float()
    tokens = upd["num_tokens"]
    sums = {"reward": batch.rewards.sum().item(), "reward_sq": (batch.rewards ** 2).sum().item(),
            "rows": float(len(batch)), "kept_informative_groups": informative.sum().item(),
            "kept_groups": float(informative.numel()), "completion_tokens": lens.sum().item(),
            "truncated": batch.truncated.float().sum().item(),
            "informative_groups": float(roll["informative_groups"]), "drawn_groups": float(roll["drawn_groups"]),
            "loss_tokens": tokens, "loss": upd["loss"]}
    sums.update({f"{k} x tokens": upd[k] * tokens for k in TOKEN_MEANS})
    parts = batch.reward_parts  # [B, K]; NaN where a function returned None for the row
    applies = ~parts.isnan()
    for name, total, rows in zip(reward_names, parts.nan_to_num(0.0).sum(0).tolist(), applies.sum(0).tolist()):
        sums[f"reward_sum/{name}"], sums[f"reward_rows/{name}"] = total, float(rows)
    return sums


def iteration_metrics(iteration: int, sums: dict[str, float], *, seconds: float, world_size: int,
                      lr: float, grad_norm: float, skipped_updates: int, timings: dict[str, float],
                      dynamic: dict | None = None) -> dict:
    """The iteration's metrics from ``sums`` (``local_sums`` summed over ranks).

    ``seconds``: the iteration's wall time (tokens/s); ``timings``: seconds per phase, logged
    rounded; ``dynamic``: the rollout's ``dynamic_rounds``/``dynamic_drawn`` with dynamic sampling.
    The loss is DDP's: the mean of the ranks' losses."""
    n = max(sums["rows"], 1.0)
    mean = sums["reward"] / n
    m = {"iteration": iteration, "reward": mean,
         "reward_std": math.sqrt(max(sums["reward_sq"] / n - mean ** 2, 0.0)),
         "informative_frac": sums["informative_groups"] / max(sums["drawn_groups"], 1.0),
         "completion_len": sums["completion_tokens"] / n, "truncated_frac": sums["truncated"] / n,
         "tokens_per_s": sums["completion_tokens"] / max(seconds, 1e-9), "lr": lr,
         "skipped_updates": skipped_updates}
    if dynamic is not None:
        m.update(informative_frac_kept=sums["kept_informative_groups"] / max(sums["kept_groups"], 1.0),
                 dynamic_rounds=dynamic["dynamic_rounds"], dynamic_drawn=dynamic["dynamic_drawn"])
    tokens = max(sums["loss_tokens"], 1.0)
    m.update({k: sums[f"{k} x tokens"] / tokens for k in TOKEN_MEANS})
    m["loss"] = sums["loss"] / world_size
    m["grad_norm"] = grad_norm
    m.update({k: round(v, 4) for k, v in timings.items()})
    for key, total in sums.items():
        if key.startswith("reward_sum/"):
            name = key.removeprefix("reward_sum/")
            rows = sums[f"reward_rows/{name}"]
            if rows:  # a function that applied to no row this iteration has no mean
                m[f"reward/{name.split(':')[-1]}"] = total / rows
    return m


# ----------------------------------------------------------------------------- rollout/trainer mismatch
MISMATCH_SUMS = ("tokens", "gap_sum", "ratio_sum", "capped")
MISMATCH_MAXES = ("gap_max", "ratio_max", "neg_ratio_min")


def new_mismatch() -> dict[str, float]:
    """An empty accumulator of ``losses.rollout_is_weights`` stats (``add_mismatch``)."""
    return {**dict.fromkeys(MISMATCH_SUMS, 0.0), "gap_max": 0.0, "ratio_max": -math.inf, "neg_ratio_min": -math.inf}


def add_mismatch(acc: dict[str, float], stats: dict) -> None:
    """Fold one micro-batch's ``rollout_is_weights`` stats into ``acc`` (sums add, extremes extend)."""
    for k in MISMATCH_SUMS:
        acc[k] += float(stats[k])
    acc["gap_max"] = max(acc["gap_max"], float(stats["gap_max"]))
    acc["ratio_max"] = max(acc["ratio_max"], float(stats["ratio_max"]))
    acc["neg_ratio_min"] = max(acc["neg_ratio_min"], -float(stats["ratio_min"]))


def mismatch_metrics(sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float]:
    """The iteration's mismatch metrics from accumulators summed (``MISMATCH_SUMS``) and maxed
    (``MISMATCH_MAXES``) over ranks: the trainer/sampler log-prob gap |old_logp - sampler_logp|
    (mean, max over tokens), the importance ratio before its cap (min, mean, max) and the share
    of tokens the cap changed."""
    n = sums["tokens"]
    if not n:
        return {}
    return {"rollout_logp_gap_mean": sums["gap_sum"] / n, "rollout_logp_gap_max": maxes["gap_max"],
            "rollout_is_ratio_min": -maxes["neg_ratio_min"], "rollout_is_ratio_mean": sums["ratio_sum"] / n,
            "rollout_is_ratio_max": maxes["ratio_max"], "rollout_is_capped_frac": sums["capped"] / n}
