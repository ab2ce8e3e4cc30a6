"""Greedy held-out accuracy, per item, with a 95% interval.

Per-item results (``item_id``, ``correct``) are kept, not only the mean: the registry compares a
new model with the champion on the *same* items with a paired test, which is far more
sensitive than comparing two accuracies.

    python -m grpo_core.evaluation --model DIR --set arithmetic_test --size 200
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch

from grpo_core.data.answers import is_correct
from grpo_core.evaluation.stats import mcnemar_exact, wilson_interval


def greedy_results(model, tok, rows: list[dict], *, max_new_tokens: int, batch_size: int = 64,
                   max_prompt_tokens: int = 2048, system_prompt: str | None = None, grade=is_correct,
                   engine=None, stop_loops: bool = True) -> list[dict]:
    """Greedy completion and its correctness for every row, graded by ``grade`` (the task's), and
    how it ended (``loops.ending``): ``capped`` (decoding reached ``max_new_tokens``), ``looped``
    (it repeated itself verbatim, and decoding stops there when ``stop_loops``; or it was capped
    while repeating itself with changing numbers) and ``truncated`` (capped while not looping);
    else it ended with a stop token. The completions come from ``engine`` (a stage's rollout
    engine; default: ``engines.build("auto", tok)``), synced to ``model``, so prompts render and
    decode as the stage's rollouts do."""
    from grpo_core.rollout import engines
    from grpo_core.rollout.loops import digit_token_ids, ending, looped

    sampling = engines.Sampling(max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                                system_prompt=system_prompt, greedy=True, stop_loops=stop_loops)
    digits, out = digit_token_ids(tok), []
    with synced_engine(model, tok, engine) as engine:
        for i in range(0, len(rows), batch_size):
            chunk = rows[i:i + batch_size]
            batch = engine.generate(chunk, 1, sampling)
            answer_tokens = batch.completion_mask.sum(-1) - (~batch.truncated).long()  # before the stop token
            loops = looped(batch.completion_ids, answer_tokens).tolist()
            for j, (row, text, loop) in enumerate(zip(chunk, batch.completions, loops)):
                n = int(answer_tokens[j])
                how = ending(batch.completion_ids[j, :n], n >= max_new_tokens, loop, digits)
                out.append({"item_id": row["id"], "correct": bool(grade(text, row["gold"])), "gold": row["gold"],
                            "completion": text, **how, **({"steps": row["steps"]} if "steps" in row else {})})
    return out


@contextlib.contextmanager
def synced_engine(model, tok, engine=None):
    """``engine`` (default: ``engines.build("auto", tok)``) synced to ``model`` in eval mode for
    the block; the model's train/eval mode comes back after it. The evaluations' one setup."""
    from grpo_core.rollout import engines
    engine = engine or engines.build("auto", tok)
    was_training = model.training
    model.eval()
    engine.sync_weights(model)
    try:
        yield engine
    finally:
        model.train(was_training)


STEP_BUCKETS = (("<=2", 0, 2), ("3", 3, 3), ("4", 4, 4), ("5+", 5, 10**9))
"""GSM8K's difficulty buckets by calculator steps (0-step problems, 18 of 1,319 test items, go with 1-2)."""


def summarize(results: list[dict]) -> dict:
    """Accuracy with its Wilson 95% interval, the counts it came from, and the shares of answers
    (``greedy_results``) that the cap cut off while not looping (``truncated_frac``: a cap that
    cuts many answers measures the cap, not the model), that looped (``looped_frac``), and that
    reached the cap for either reason (``capped_frac``). Items that carry their ``steps`` (GSM8K)
    also get ``by_steps``: accuracy and count per ``STEP_BUCKETS`` bucket that holds any."""
    out = _accuracy_summary(results)
    if results and all("steps" in r for r in results):
        out["by_steps"] = {label: {"accuracy": sum(r["correct"] for r in chunk) / len(chunk), "n": len(chunk)}
                           for label, low, high in STEP_BUCKETS
                           if (chunk := [r for r in results if low <= r["steps"] <= high])}
    return out


def _accuracy_summary(results: list[dict]) -> dict:
    n = len(results)
    k = sum(r["correct"] for r in results)
    low, high = wilson_interval(k, n)
    share = lambda key: sum(bool(r.get(key)) for r in results) / n if n else 0.0  # noqa: E731
    return {"accuracy": k / n if n else 0.0, "ci_low": low, "ci_high": high, "n": n, "correct": k,
            "truncated_frac": share("truncated"), "looped_frac": share("looped"), "capped_frac": share("capped")}


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
    """The held-out sets named in ``params`` (set name -> the params its data was fingerprinted
    with; ``PipelineConfig.eval_set_names``), each sized by ``eval_cfg.size(name)``
    (``held_out_items``); a set sized 0 is skipped."""
    from grpo_core.data import tasks
    return {name: held_out_items(tasks.split_of(name)[0], task_params, size)
            for name, task_params in params.items() if (size := eval_cfg.size(name)) != 0}


def held_out_items(task, params: dict, size: int | None) -> list[dict]:
    """``size`` items of ``task``'s test split (None: all of them): a seeded sample for a task
    whose rows come in a systematic order, else the first N."""
    from grpo_core.data.prompts import fixed_subset

    rows = task.rows("test", **params)
    return fixed_subset(rows, size or len(rows)) if task.shuffled_subsets else rows[:size]


def main(argv=None):
    import dataclasses

    from grpo_core.config.stage import GRPOConfig
    from grpo_core.data import tasks
    from grpo_core.model.loading import load_policy

    registry = tasks.registry()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="hub id, local dir, .gguf file or s3:// URI")
    p.add_argument("--set", default="arithmetic_test", choices=[tasks.dataset_name(t, "test") for t in registry])
    p.add_argument("--size", type=int, default=200, help="items (N of the test split; 0: all of it)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--keep-loops", action="store_true",
                   help="decode answers that repeat themselves verbatim to the cap (default: stop them)")
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for param in sorted({q for t in registry.values() for q in t.params}):  # the data each task reads
        kind = str if defaults[param] is None else type(defaults[param])
        p.add_argument(f"--{param.replace('_', '-')}", dest=param, default=defaults[param], type=kind,
                       help=f"the task's {param} (default: %(default)s)")
    a = p.parse_args(argv)
    if a.size < 0:
        p.error(f"--size must be >= 0 (0: all of {a.set}), got {a.size}")
    task, _ = tasks.split_of(a.set)
    fields = GRPOConfig(task=task.name, runtime={"stage": "evaluate"}, **{q: getattr(a, q) for q in task.params})
    params = task.params_of(fields)
    rows = held_out_items(task, params, a.size or None)
    model, tok = load_policy(a.model)
    torch.manual_seed(0)
    res = greedy_results(model, tok, rows, max_new_tokens=a.max_new_tokens, grade=task.grade,
                         stop_loops=not a.keep_loops)
    print(json.dumps({"set": a.set, "data": task.identity("test", **params)["source"], **summarize(res)}))


if __name__ == "__main__":
    main()
