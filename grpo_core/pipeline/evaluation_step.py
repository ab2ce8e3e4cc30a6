"""What the flow's evaluation steps do: evaluate one checkpoint, pair the stages, log, summarise.

Every checkpoint (the start model, then each GRPO stage's) gets the same held-out items, prompts
and generation caps per set (``PipelineConfig.eval_set_names``): greedy per-item correctness on
every set, and on the sets ``evaluate.sampled_sets`` names also k seeded samples per item
(``grpo_core/evaluation/sampled.py``). Each later stage is paired with the start model and with the
stage before it on the same items: exact McNemar p for greedy, a sign-flip permutation p for
sampled accuracy.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

from grpo_core.config import stages
from grpo_core.config.pipeline import PipelineConfig
from grpo_core.pipeline.steps import RunContext, child_run, stage_system_prompt

EVAL_LOCK = Path(tempfile.gettempdir()) / "grpo-evaluate.lock"  # local evaluations take turns on it
ITEM_COLUMNS = ("item_id", "correct", "gold", "steps", "truncated", "looped", "capped", "completion")


def in_stage_order(results: list[dict]) -> list[dict]:
    """Evaluation results sorted sft, curriculum, gsm8k: the last one is the shipped model's,
    whatever order the foreach join hands them in."""
    return sorted(results, key=lambda r: stages.EVALUATED.index(r["stage"]))


def evaluate_checkpoint(cfg: PipelineConfig, stage: str, model_uri: str, datasets: dict) -> dict:
    """Per-item results of one checkpoint on every held-out set (the data ``start`` fingerprinted),
    with summaries; on a GPU when the step has one. On the local backend the evaluations of one
    machine take turns (``EVAL_LOCK``): the foreach starts them together, and on two cores three at
    once run slower than one after another (benchmarks/NOTES.md)."""
    from grpo_core.io import locks
    if cfg.compute.backend != "local":
        return _evaluate(cfg, stage, model_uri, datasets)
    with locks.exclusive(EVAL_LOCK, waiting=f"evaluate {stage}: waiting for this machine's other evaluations"):
        return _evaluate(cfg, stage, model_uri, datasets)


def _evaluate(cfg: PipelineConfig, stage: str, model_uri: str, datasets: dict) -> dict:
    """One checkpoint's results and summaries; split over ``evaluate.workers`` local processes on
    the local backend (``grpo_core/evaluation/job.py``)."""
    from grpo_core.evaluation import job as eval_job
    from grpo_core.evaluation.greedy import eval_sets, summarize
    from grpo_core.evaluation.sampled import summarize_sampled

    e = cfg.evaluate
    sets = eval_sets(e, {name: datasets[name]["params"] for name in cfg.eval_set_names()})
    job = eval_job.EvalJob(
        model_uri=model_uri, evaluate=e, sets=sets,
        sampled={name: sets[name][:e.sampled_size or None] for name in e.sampled_sets},
        temperatures={name: cfg.sampled_temperature(name) for name in e.sampled_sets},
        system_prompt=stage_system_prompt(cfg, stage), label=stage,
        trust_remote_code=any(getattr(cfg, s.name).get("trust_remote_code", False) for s in stages.GRPO_STAGES))
    workers = e.workers if cfg.compute.backend == "local" else 1
    out = eval_job.evaluate(job, workers)
    items, sampled = out["items"], out["sampled"]
    return {"stage": stage, "model_uri": model_uri, "items": items, "sampled": sampled,
            "system_prompt": job.system_prompt, "engine": e.engine, "workers": workers,
            "summary": {name: summarize(res) for name, res in items.items()},
            "sampled_summary": {name: {**summarize_sampled(res), "temperature": job.temperatures[name]}
                                for name, res in sampled.items()}}


def paired_with_start(results: list[dict]) -> list[dict]:
    """Each later stage's ``vs_start`` (against the first result, the start model) and
    ``vs_previous`` (against the stage before it), per set: greedy accuracy change with its exact
    McNemar p, and for sampled sets (``sampled_vs_start``, ``sampled_vs_previous``) the mean@k
    change with its sign-flip permutation p. The second of each says whether a stage lost what
    the one before it gained."""
    from grpo_core.evaluation.greedy import compare_to_start
    from grpo_core.evaluation.sampled import compare_sampled

    start = results[0]
    for before, r in zip(results, results[1:]):
        r["vs_start"] = {name: compare_to_start(start["items"][name], r["items"][name]) for name in r["items"]}
        r["vs_previous"] = {name: {**compare_to_start(before["items"][name], r["items"][name]),
                                   "stage": before["stage"]} for name in r["items"]}
        sampled = r.get("sampled", {})
        r["sampled_vs_start"] = {name: compare_sampled(start["sampled"][name], res) for name, res in sampled.items()}
        r["sampled_vs_previous"] = {name: {**compare_sampled(before["sampled"][name], res), "stage": before["stage"]}
                                    for name, res in sampled.items()}
    return results


def _greedy_metrics(r: dict, name: str) -> dict:
    s, vs = r["summary"][name], r.get("vs_start", {}).get(name, {})
    prefix = f"eval/{name}/{r['stage']}"
    out = {f"{prefix}/accuracy": s["accuracy"], f"{prefix}/ci_low": s["ci_low"], f"{prefix}/ci_high": s["ci_high"],
           f"{prefix}/n": s["n"], f"{prefix}/truncated_frac": s.get("truncated_frac", 0.0),
           f"{prefix}/looped_frac": s.get("looped_frac", 0.0), f"{prefix}/capped_frac": s.get("capped_frac", 0.0),
           **{f"{prefix}/vs_start_{k}": vs[k] for k in ("delta", "p_value") if k in vs}}
    for label, b in s.get("by_steps", {}).items():
        key = label.replace("<=", "le").replace("+", "plus")  # MLflow metric names: no '<' or '+'
        out.update({f"{prefix}/steps_{key}/accuracy": b["accuracy"], f"{prefix}/steps_{key}/n": b["n"]})
    return out


def _sampled_metrics(r: dict, name: str) -> dict:
    s, vs = r["sampled_summary"][name], r.get("sampled_vs_start", {}).get(name, {})
    prefix = f"eval/{name}/{r['stage']}"
    return {f"{prefix}/mean_at_k": s["mean_at_k"], f"{prefix}/pass_at_k": s["pass_at_k"],
            f"{prefix}/sampled_k": s["k"], f"{prefix}/sampled_n": s["n"],
            **{f"{prefix}/sampled_vs_start_{k}": vs[k] for k in ("delta", "p_value") if k in vs}}


def log_evaluation(ctx: RunContext, results: list[dict], datasets: dict) -> None:
    """Every stage's accuracies, named by their data, on the evaluate child run (+ per-item JSON):
    greedy with the share of answers cut by the cap and its GSM8K steps buckets, sampled mean@k and
    pass@k, and past the start model the change against it with its p
    (``eval/<set>/<stage>/vs_start_p_value``, ``.../sampled_vs_start_p_value``)."""
    from grpo_core.tracking.logger import open_tracker
    from grpo_core.tracking.runs import mlflow_client

    run_id = child_run(ctx, "evaluate", datasets, names=sorted(results[0]["summary"]))
    logged = set(mlflow_client(ctx.tracking_uri).get_run(run_id).data.metrics)  # a rerun logs nothing twice
    with open_tracker(ctx.tracking_uri, run_id) as t:
        for r in results:
            for name in r["summary"]:
                if f"eval/{name}/{r['stage']}/accuracy" in logged:
                    continue
                t.log({**_greedy_metrics(r, name), **(_sampled_metrics(r, name) if name in r.get("sampled", {})
                                                       else {})}, step=0)
                t.log_dict(r["items"][name], f"eval/{r['stage']}/items_{name}.json")
                t.log_table({k: [i.get(k) for i in r["items"][name]] for k in ITEM_COLUMNS},
                            f"eval/{r['stage']}/items_{name}_table.json")  # browsable in the MLflow UI
                if name in r.get("sampled", {}):
                    t.log_dict(r["sampled"][name], f"eval/{r['stage']}/sampled_{name}.json")
        final = results[-1]
        for name, s in final["summary"].items():  # the shipped model's numbers, unqualified
            if f"eval/{name}/accuracy" in logged:
                continue
            t.log({f"eval/{name}/accuracy": s["accuracy"], f"eval/{name}/accuracy_ci_low": s["ci_low"],
                   f"eval/{name}/accuracy_ci_high": s["ci_high"],
                   **({f"eval/{name}/mean_at_k": final["sampled_summary"][name]["mean_at_k"]}
                      if name in final.get("sampled_summary", {}) else {})}, step=0)


def _p(value) -> str:
    return "-" if value is None else f"{value:.2g}"


def _paired_cells(pairs) -> str:
    return "".join(f"{vs['delta']:>+{w}.3f}{vs['p_value']:>9.2g}" if vs else f"{'-':>{w}}{'':>9}" for vs, w in pairs)


def _greedy_lines(results: list[dict], name: str) -> list[str]:
    lines = [f"{name} greedy (same {results[0]['summary'][name]['n']} items for every stage)",
             f"  {'stage':<12}{'accuracy [95% CI]':>26}{'cut':>7}{'looped':>8}{'vs start':>10}{'p':>9}"
             f"{'vs previous':>13}{'p':>9}   by steps"]
    for r in results:
        x = r["summary"][name]
        paired = _paired_cells(((r.get("vs_start", {}).get(name), 10), (r.get("vs_previous", {}).get(name), 13)))
        steps = " ".join(f"{k}:{b['accuracy']:.2f}/{b['n']}" for k, b in x.get("by_steps", {}).items())
        lines.append(f"  {r['stage']:<12}{x['accuracy']:>9.3f} [{x['ci_low']:.3f}, {x['ci_high']:.3f}]"
                     f"{x.get('truncated_frac', 0.0):>7.1%}{x.get('looped_frac', 0.0):>8.1%}{paired}   {steps}")
    return lines


def _sampled_lines(results: list[dict], name: str) -> list[str]:
    s0 = results[0]["sampled_summary"][name]
    lines = [f"{name} sampled (k={s0['k']} at temperature {s0['temperature']}, same {s0['n']} items and seed)",
             f"  {'stage':<12}{'mean@k':>9}{'pass@k':>9}{'vs start':>10}{'p':>9}{'vs previous':>13}{'p':>9}"]
    for r in results:
        x = r["sampled_summary"][name]
        paired = _paired_cells(((r.get("sampled_vs_start", {}).get(name), 10),
                                (r.get("sampled_vs_previous", {}).get(name), 13)))
        lines.append(f"  {r['stage']:<12}{x['mean_at_k']:>9.3f}{x['pass_at_k']:>9.3f}{paired}")
    return lines


def _stage_line(name: str, st: dict) -> str:
    last, trend = st.get("last", {}), st.get("reward_trend")
    interval = ("too few iterations for an interval" if not trend or math.isnan(trend["ci_low"])
                else f"95% CI [{trend['ci_low']:+.3f}, {trend['ci_high']:+.3f}]")
    change = (f"reward {trend['first']:.3f} -> {trend['last']:.3f} (means of the first/last {trend['window']} "
              f"iterations; change {trend['diff']:+.3f}, {interval})" if trend else "no iterations run")
    informative = st.get("informative_mean", last.get("informative_frac", 0))
    return (f"{name} GRPO: {st['iterations_run']} iterations, {change}, informative fraction {informative:.2f}"
            + (" (mean over iterations)" if "informative_mean" in st else " (last iteration)")
            + (" (promotion gate)" if st.get("promoted_by_gate") else ""))


def summary_table(results: list[dict], trained: dict[str, dict], registry: dict) -> str:
    """A plain-text table per set: every stage's greedy accuracy with its 95% interval, the shares
    of answers cut by the cap and that looped, GSM8K's steps buckets, and the change against the
    start model and the stage before with its exact McNemar p; then sampled mean@k and pass@k with
    their paired p; then each GRPO stage's reward trend and informative fraction, and the registry
    decision. ``trained``: each GRPO stage's summary, by stage name, in the stage table's order."""
    lines = []
    for name in results[0]["summary"]:
        lines += _greedy_lines(results, name)
        if name in results[0].get("sampled_summary", {}):
            lines += _sampled_lines(results, name)
    lines += [_stage_line(name, st) for name, st in trained.items()]
    lines.append(f"registry: {registry.get('model_name')} v{registry.get('version')} -> {registry.get('decision')} "
                 f"(p={_p(registry.get('p_value'))}, {registry.get('compared_items')} items)")
    return "\n".join(lines)
