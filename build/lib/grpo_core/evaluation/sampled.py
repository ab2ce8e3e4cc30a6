"""Sampled accuracy: k seeded samples per held-out item, mean@k, pass@k and a paired test.

GRPO optimises the expected reward of *sampled* answers; greedy accuracy is a proxy for it, and on
a task where the policy is right a few times in a hundred (GSM8K for a 135M model) greedy decoding
hides most of what changed. So the evaluation also draws k samples per item at a fixed temperature,
with the same seed for every model (common random numbers: two models that agree on an item's
distribution tend to agree on its samples, which makes the paired test sharper).

Per item it keeps ``correct_k`` (right samples of ``k``). Summaries:

    mean@k   the mean over items of correct_k / k (an unbiased estimate of the pass rate)
    pass@k   the mean over items of the unbiased estimator 1 - C(n - c, k) / C(n, k) with n = k
             samples, c right ones (Chen et al. 2021); here n = k, so it is the share of items with
             at least one right sample

The paired test over items is a sign-flip permutation test of the mean per-item difference of
correct_k / k (``paired_sign_flip_p``): it assumes only that, with no difference between the
models, each item's difference is as likely positive as negative. Items with no difference do not
move the statistic, so the test runs over the others: exactly (all 2^m sign patterns) when there are
at most ``EXACT_UP_TO`` of them, else on ``RESAMPLES`` seeded random patterns (scipy's
``permutation_test``). At k = 1 it is McNemar's exact test.
"""
from __future__ import annotations

from math import comb

import numpy as np

EXACT_UP_TO = 18  # discordant items for which all 2^m sign patterns are enumerated
RESAMPLES = 20_000  # random sign patterns beyond that (seeded: the same p on every call)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one item with ``c`` right answers among ``n`` samples (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize_sampled(items: list[dict]) -> dict:
    """mean@k and pass@k over items (each with ``k`` and ``correct_k``), with the counts."""
    if not items:
        return {"mean_at_k": 0.0, "pass_at_k": 0.0, "k": 0, "n": 0, "samples": 0, "correct_samples": 0}
    k = items[0]["k"]
    if any(i["k"] != k for i in items):
        raise ValueError("sampled items drew different numbers of samples; summarize each k apart")
    return {"mean_at_k": sum(i["correct_k"] for i in items) / (k * len(items)),
            "pass_at_k": sum(pass_at_k(k, i["correct_k"], k) for i in items) / len(items),
            "k": k, "n": len(items), "samples": k * len(items),
            "correct_samples": sum(i["correct_k"] for i in items)}


def paired_sign_flip_p(diffs: list[float]) -> float:
    """Two-sided p of the mean of per-item differences under random sign flips (see module doc)."""
    d = np.asarray([x for x in diffs if x != 0.0], dtype=np.float64)
    if d.size == 0:
        return 1.0
    observed = abs(d.sum())
    tol = 1e-12 * max(1.0, observed)
    if d.size <= EXACT_UP_TO:
        signs = ((np.arange(2 ** d.size)[:, None] >> np.arange(d.size)) & 1) * 2 - 1   # [2^m, m]
        return float(np.mean(np.abs(signs @ d) >= observed - tol))
    from scipy.stats import permutation_test

    res = permutation_test((d,), lambda x, axis: np.abs(np.sum(x, axis=axis)), permutation_type="samples",
                           n_resamples=RESAMPLES, alternative="greater", vectorized=True,
                           rng=np.random.default_rng(0))
    return float(res.pvalue)


def compare_sampled(before: list[dict], after: list[dict]) -> dict:
    """``after`` against ``before`` on the same items: the change in mean@k and the paired p
    (items matched by id; an item in only one of them is an error)."""
    a, b = {i["item_id"]: i for i in before}, {i["item_id"]: i for i in after}
    if a.keys() != b.keys():
        raise ValueError(f"cannot pair the sampled evaluations: {len(a.keys() ^ b.keys())} items are in only one")
    ids = sorted(a)
    diffs = [b[i]["correct_k"] / b[i]["k"] - a[i]["correct_k"] / a[i]["k"] for i in ids]
    return {"delta": sum(diffs) / max(len(ids), 1), "p_value": paired_sign_flip_p(diffs),
            "better_items": sum(x > 0 for x in diffs), "worse_items": sum(x < 0 for x in diffs)}


def sampled_results(model, tok, rows: list[dict], *, k: int, temperature: float, max_new_tokens: int,
                    seed: int = 0, batch_size: int = 64, max_prompt_tokens: int = 2048,
                    system_prompt: str | None = None, grade=None, engine=None) -> list[dict]:
    """``k`` samples per row at ``temperature`` (no top-k/top-p), graded: per item ``correct_k``.
    The generator is seeded with ``seed`` before the first batch, so every model draws from the same
    random stream; answers that repeat themselves verbatim stop early, as in the greedy evaluation."""
    import torch

    from grpo_core.data.answers import is_correct
    from grpo_core.evaluation.greedy import synced_engine
    from grpo_core.rollout import engines

    grade = grade or is_correct
    sampling = engines.Sampling(temperature=temperature, max_new_tokens=max_new_tokens,
                                max_prompt_tokens=max_prompt_tokens, system_prompt=system_prompt, stop_loops=True)
    out, per_call = [], max(1, batch_size // k)
    with synced_engine(model, tok, engine) as engine:
        torch.manual_seed(seed)
        for i in range(0, len(rows), per_call):
            chunk = rows[i:i + per_call]
            batch = engine.generate(chunk, k, sampling)
            right = [bool(grade(text, gold)) for text, gold in zip(batch.completions, batch.columns["gold"])]
            lengths = batch.completion_mask.sum(-1).tolist()
            for j, row in enumerate(chunk):
                out.append({"item_id": row["id"], "k": k, "correct_k": sum(right[j * k:(j + 1) * k]),
                            "mean_tokens": sum(lengths[j * k:(j + 1) * k]) / k,
                            **({"steps": row["steps"]} if "steps" in row else {})})
    return out
