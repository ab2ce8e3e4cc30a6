"""Greedy held-out accuracy, per item, with a 95% interval.

Per-item results (``item_id``, ``correct``) are kept, not only the mean: the registry compares a
new model with the champion on the *same* items with a paired test, which is far more
sensitive than comparing two accuracies.

    python -m grpo_core.evaluate --model DIR --set arith_holdout --size 200
"""
from __future__ import annotations

import argparse
import json

import torch

from grpo_core.answers import is_correct
from grpo_core.rollout import generate_rollouts
from grpo_core.stats import mcnemar_exact, wilson_interval


def greedy_results(model, tok, rows: list[dict], *, max_new_tokens: int, batch_size: int = 64,
                   max_prompt_tokens: int = 2048, system_prompt: str | None = None) -> list[dict]:
    """Greedy completion, correctness and whether it was cut off at ``max_new_tokens`` (no stop
    token), for every row. Prompts render as rollouts render them (``rollout.render_prompts``)."""
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        batch = generate_rollouts(model, tok, chunk, 1, temperature=1.0, top_p=1.0, top_k=0,
                                  max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                                  greedy=True, system_prompt=system_prompt)
        for row, text, cut in zip(chunk, batch.completions, batch.truncated.tolist()):
            out.append({"item_id": row["id"], "correct": bool(is_correct(text, row["gold"])),
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


def eval_sets(eval_cfg, arith: dict) -> dict[str, list[dict]]:
    """The pipeline's held-out sets: GSM8K test (first N, or all) and held-out arithmetic."""
    from grpo_core.config import gsm8k_source
    from grpo_core.data import arithmetic_rows, fixed_subset, gsm8k_rows

    sets = {}
    if eval_cfg.arith_size:
        rows = arithmetic_rows(arith.get("arith_ops", "+-*"), arith.get("arith_min", 0),
                               arith.get("arith_max", 20), "test")
        sets["arith_holdout"] = fixed_subset(rows, eval_cfg.arith_size)
    if eval_cfg.gsm8k_size >= 0:  # -1 skips GSM8K
        source = gsm8k_source(arith.get("gsm8k_source", "openai/gsm8k"))
        sets["gsm8k_test"] = gsm8k_rows(source, "test", limit=eval_cfg.gsm8k_size or None)
    return sets


def main(argv=None):
    from grpo_core.config import gsm8k_source
    from grpo_core.models import load_policy

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="hub id, local dir or s3:// URI")
    p.add_argument("--set", default="arith_holdout", choices=("arith_holdout", "gsm8k_test"))
    p.add_argument("--size", type=int, default=200, help="items (the first N of the split; 0: all GSM8K test)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--arith-ops", default="+-*", help="arithmetic the model was trained on (its test split)")
    p.add_argument("--arith-min", type=int, default=0)
    p.add_argument("--arith-max", type=int, default=20)
    p.add_argument("--gsm8k-source", default="openai/gsm8k", help="hub id or dir (GSM8K_DIR wins)")
    a = p.parse_args(argv)
    from grpo_core.pipeline_config import EvalConfig

    arith = a.set == "arith_holdout"
    if a.size < (1 if arith else 0):
        p.error(f"--size must be >= {1 if arith else 0} for {a.set}")
    cfg = EvalConfig(gsm8k_size=-1 if arith else a.size, arith_size=a.size if arith else 0,
                     max_new_tokens=a.max_new_tokens)
    data = {"arith_ops": a.arith_ops, "arith_min": a.arith_min, "arith_max": a.arith_max,
            "gsm8k_source": a.gsm8k_source}
    rows = eval_sets(cfg, data)[a.set]
    model, tok = load_policy(a.model)
    torch.manual_seed(0)
    res = greedy_results(model, tok, rows, max_new_tokens=a.max_new_tokens)
    described = (f"arithmetic {a.arith_ops} over {a.arith_min}..{a.arith_max}, test split" if arith
                 else f"{gsm8k_source(a.gsm8k_source)} test split")
    print(json.dumps({"set": a.set, "data": described, **summarize(res)}))


if __name__ == "__main__":
    main()
