"""A flow that draws the pipeline's three cards (flows/cards.py) from fixed data, through
Metaflow's real card machinery: tests/test_cards.py runs it and reads the cards back.

The data comes from the functions the pipeline uses (``evaluate.summarize``,
``evaluation_step.paired_with_start``, ``registry.decide_promotion``) on made-up per-item results,
and metrics rows with the keys the trainer writes to metrics.jsonl.
"""
import os
import sys
from pathlib import Path

if all(os.environ.get(v, "root") == "root" for v in ("METAFLOW_USER", "USERNAME", "USER")):
    os.environ["METAFLOW_USER"] = "grpo"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flows"))

from metaflow import FlowSpec, card, current, step

from cards import registry_card, stage_table_card, training_card, training_result

LONG = "<think>" + "carry the one, " * 30 + "</think><answer>7</answer>"  # longer than the card shows


def metrics_rows(n: int = 12, pool: bool = False) -> list[dict]:
    """Rows as grpo_core.train.trainer writes them to metrics.jsonl (eval_accuracy every 4th; with
    ``pool``, the prompt pool's counts)."""
    rows = []
    for it in range(1, n + 1):
        row = {"iteration": it, "reward": 0.2 + 0.05 * it, "reward_std": 0.3, "informative_frac": 0.9 - 0.03 * it,
               "completion_len": 30.0 - it, "truncated_frac": max(0.0, 0.5 - 0.05 * it), "tokens_per_s": 100.0,
               "lr": 1e-5, "skipped_updates": 0, "kl": 0.001 * it, "clip_frac": 0.0, "entropy": 1.5 - 0.05 * it,
               "loss": 0.01, "grad_norm": float("nan") if it == 3 else 1.0, "logged_at_ms": 1_700_000_000_000 + it}
        if it % 4 == 0:
            row.update(eval_accuracy=0.1 * it / 4, eval_n=8)
        if pool:
            row.update(pool_active=2.0 * it, pool_solved=float(it // 3), pool_resting=float(it), pool_replayed=2.0,
                       pool_seen=4.0 * it, pool_replayable=1.0)
        rows.append(row)
    return rows


def samples_logged(iteration: int = 10) -> dict:
    """What the trainer writes to samples_latest.json: 16 samples, best rewards at 7 and 15."""
    completions = [f"<think>{k} + 3</think><answer>{k + 3}</answer>" for k in range(16)]
    completions[4] = "line one\nline `two` <b>bold?</b>"
    completions[7] = LONG
    return {"iteration": iteration, "samples": [
        {"prompt": f"What is {k} + 3? Answer inside <answer></answer>.", "completion": c,
         "reward": 2.0 if k in (7, 15) else round(0.1 * (k % 5), 2)} for k, c in enumerate(completions)]}


def evaluation_results(with_sampled: bool = False) -> list[dict]:
    """Three stages on two held-out sets, paired with the start model as join_evaluations does;
    ``with_sampled`` adds a GSM8K set with calculator steps and sampled accuracy (k = 2)."""
    from grpo_core.evaluation.greedy import summarize
    from grpo_core.evaluation.sampled import summarize_sampled
    from grpo_core.pipeline.evaluation_step import paired_with_start

    def items(name, n, right, cut=(), loops=()):
        return [{"item_id": f"{name}:{k}", "correct": k in right, "gold": str(k * 2),
                 "completion": LONG if k == 1 else f"<answer>{k * 2 if k in right else -1}</answer>",
                 "truncated": k in cut, "looped": k in loops} for k in range(n)]

    results = []
    stages = (("sft", {0, 5}, {1, 2}, {3}), ("curriculum", {0, 1, 5, 6}, {2}, ()),
              ("gsm8k", {0, 1, 2, 5, 6}, (), ()))
    for stage, right, cut, loops in stages:
        it = {"arithmetic_test": items("arithmetic_test", 16, right | {10, 11}, cut, loops),
              "gsm8k_test": items("gsm8k_test", 8, right, cut, loops)}
        sampled = {}
        if with_sampled:
            it["gsm8k_test_le2"] = [{**i, "steps": k % 4 + 1} for k, i in enumerate(items("le2", 8, right))]
            sampled["gsm8k_test_le2"] = [{"item_id": f"le2:{k}", "k": 2, "correct_k": (k in right) + (k == 0)}
                                         for k in range(8)]
        results.append({"stage": stage, "model_uri": f"/m/{stage}", "items": it, "sampled": sampled,
                        "summary": {k: summarize(v) for k, v in it.items()},
                        "sampled_summary": {k: {**summarize_sampled(v), "temperature": 1.0}
                                            for k, v in sampled.items()}})
    return paired_with_start(results)


def registry_decision() -> dict:
    from grpo_core.tracking.registry import decide_promotion

    final = evaluation_results()[-1]["items"]["gsm8k_test"]
    champion = [{**i, "correct": i["item_id"] == "gsm8k_test:0"} for i in final]
    return {**decide_promotion(final, champion, "significant", 0.05), "champion_version": 3, "version": 4,
            "model_name": "grpo-gsm8k", "rule": "significant", "eval_set": "gsm8k_test"}


class CardFlow(FlowSpec):
    @card(type="blank", id="training")
    @card(type="blank", id="evaluation")
    @card(type="blank", id="registry")
    @step
    def start(self):
        on_progress = training_card(current.card["training"], "curriculum")
        on_progress(metrics_rows()[:2])  # early, before any sample was logged
        on_progress(metrics_rows(), samples=samples_logged())
        training_result(current.card["training"], {"reward_trend": {"window": 3, "first": 0.3, "last": 0.75,
                                                                     "diff": 0.45, "ci_low": 0.2, "ci_high": 0.7}})
        stage_table_card(current.card["evaluation"], evaluation_results())
        registry_card(current.card["registry"], registry_decision())
        self.next(self.end)

    @step
    def end(self):
        pass


if __name__ == "__main__":
    CardFlow()
