"""Greedy held-out accuracy, per item, with a 95% interval.

Per-item results (``item_id``, ``correct``) are kept, not only the mean: the registry compares a
new model with the champion on the *same* items with a paired test, which is far more
sensitive than comparing two accuracies.

    python -m grpo_core.evaluate --model DIR --set arithmetic_test --size 200
"""
from __future__ import annotations

import argparse
import json

import torch

from grpo_core.answers import is_correct
from grpo_core.stats import mcnemar_exact, wilson_interval


def greedy_results(model, tok, rows: list[dict], *, max_new_tokens: int, batch_size: int = 64,
                   max_prompt_tokens: int = 2048, system_prompt: str | None = None, grade=is_correct,
                   engine=None) -> list[dict]:
    """Greedy completion, correctness and whether it was cut off at ``max_new_tokens`` (no stop
    token), for every row, graded by ``grade`` (the task's). The completions come from ``engine``
    (a stage's rollout engine; default: ``engines.build("auto", tok)``), synced to ``model``, so
    prompts render and decode as the stage's rollouts do."""
    from grpo_core import engines

    engine = engine or engines.build("auto", tok)
    sampling = engines.Sampling(max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                                system_prompt=system_prompt, greedy=True)
    was_training = model.training
    model.eval()
    engine.sync_weights(model)
    out = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        batch = engine.generate(chunk, 1, sampling)
        for row, text, cut in zip(chunk, batch.completions, batch.truncated.tolist()):
            out.append({"item_id": row["id"], "correct": bool(grade(text, row["gold"])),
                        "gold": row["gold"], "completion": text, "truncated": bool(cut)})
    model.train(was_training)
    return out


def summarize(results: list[dict]) -> dict:
    """Accuracy with its Wilson 95% interval, the counts it came from, and the share of answers
    cut off by the generation cap (a cap that cuts many answers measures the cap, not the model)."""
    n = len(results)
    k = sum(r["correct"] for r in results)
    low, high = wilson_interval(k, n)
    cut = sum(bool(r.get("truncated")) for r in results)
    return {"accuracy": k / n if n else 0.0, "ci_low": low, "ci_high": high, "n": n, "correct": k,
            "truncated_frac": cut / n if n else 0.0}


def compare_to_start(start: list[dict], other: list[dict]) -> dict:
    """``other`` against ``start`` on the same items: accuracy change and exact McNemar p on the
    discordant pairs (items matched by id; an item missing from either side is an error)."""
    a, b = {r["item_id"]: r["correct"] for r in start}, {r["item_id"]: r["correct"] for r in other}
    if a.keys() != b.keys():
        raise ValueError(f"cannot pair the evaluations: {len(a.keys() ^ b.keys())} items are in only one "
                         "of them; evaluate both models on the same set")
    ids = sorted(a)
    test = mcnemar_exact([a[i] for i in ids], [b[i] for i in ids])
    return {"delta": (sum(b.values()) - sum(a.values())) / max(len(ids), 1), "p_value": test["p_value"],
            "gained": test["b_only"], "lost": test["a_only"]}


def eval_sets(eval_cfg, params: dict[str, dict]) -> dict[str, list[dict]]:
    """The held-out sets: the test split of each task in ``params`` (task name -> its params) that
    ``eval_cfg`` sizes, as ``<task>_test``: a seeded sample of N for a task whose rows come in a
    systematic order, else its first N."""
    from grpo_core import tasks
    from grpo_core.data import fixed_subset

    sets = {}
    for name, task_params in params.items():
        size = eval_cfg.size(name)
        if size != 0:
            task = tasks.task(name)
            rows = task.rows("test", **task_params)
            sets[tasks.dataset_name(name, "test")] = (fixed_subset(rows, size or len(rows)) if task.shuffled_subsets
                                                      else rows[:size])
    return sets


def main(argv=None):
    from grpo_core import tasks
    from grpo_core.config import GRPOConfig
    from grpo_core.models import load_policy
    from grpo_core.pipeline_config import EvalConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="hub id, local dir, .gguf file or s3:// URI")
    p.add_argument("--set", default="arithmetic_test", choices=("arithmetic_test", "gsm8k_test"))
    p.add_argument("--size", type=int, default=200, help="items (N of the test split; 0: all of it)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--arithmetic-ops", default="+-*", help="arithmetic the model was trained on (its test split)")
    p.add_argument("--arithmetic-min", type=int, default=0)
    p.add_argument("--arithmetic-max", type=int, default=20)
    p.add_argument("--gsm8k-source", default="openai/gsm8k", help="hub id or dir (GSM8K_DIR wins)")
    a = p.parse_args(argv)
    task, _ = tasks.split_of(a.set)
    if a.size < (1 if task.name == "arithmetic" else 0):
        p.error(f"--size must be >= {1 if task.name == 'arithmetic' else 0} for {a.set}, got {a.size}")
    cfg = EvalConfig(gsm8k_size=a.size if task.name == "gsm8k" else -1, arithmetic_size=a.size,
                     max_new_tokens=a.max_new_tokens)
    fields = GRPOConfig(stage="evaluate", model="-", arithmetic_ops=a.arithmetic_ops, arithmetic_min=a.arithmetic_min,
                        arithmetic_max=a.arithmetic_max, gsm8k_source=a.gsm8k_source)
    params = task.params_of(fields)
    rows = eval_sets(cfg, {task.name: params})[a.set]
    model, tok = load_policy(a.model)
    torch.manual_seed(0)
    res = greedy_results(model, tok, rows, max_new_tokens=a.max_new_tokens, grade=task.grade)
    print(json.dumps({"set": a.set, "data": task.identity("test", **params)["source"], **summarize(res)}))


if __name__ == "__main__":
    main()
