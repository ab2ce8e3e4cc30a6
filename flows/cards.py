"""Metaflow cards: what a user looks at.

- training (the GRPO steps, live): one panel per metric of ``metrics.jsonl`` and a table of
  sampled completions with their rewards, redrawn through ``launcher.launch_stage``'s ``on_progress``;
  under them, the stage's reward trend.
- evaluation (``join_evaluations``): every stage's held-out accuracy with its interval, the
  share of answers cut off, the change against the start model with its exact McNemar p on the
  same items, and a few greedy answers of every stage to the same items.
- registry (``register``): the champion/challenger decision.
"""
import math
import re

from metaflow.cards import Markdown, Table, VegaChart

# metrics.jsonl keys (one row per iteration, written by grpo_core.train.trainer) -> panel title, in panel order
PANELS = {
    "reward": "reward (mean)",
    "informative_frac": "informative fraction (groups with reward spread)",
    "kl": "KL to the reference (k3)",
    "completion_len": "completion length (tokens)",
    "truncated_frac": "truncated fraction (hit sampling.max_new_tokens)",
    "entropy": "entropy (per token)",
    "eval_accuracy": "eval accuracy (greedy, validation)",
    "pool_active": "prompt pool: active (seen, not solved or resting)",
    "pool_solved": "prompt pool: solved (retired)",
    "pool_resting": "prompt pool: resting (all wrong lately)",
    "pool_replayed": "prompt pool: replayed prompts this iteration",
}
SAMPLE_ROWS = 6  # sampled completions shown: the best and the worst rewarded of the latest batch logged
ANSWERS_PER_SET = 3  # greedy answers shown per held-out set, the same items for every stage
PROMPT_CHARS, COMPLETION_CHARS = 100, 200


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _literal(text, limit: int) -> str:
    """``text`` as Markdown that shows it as written (tags such as <answer> included): a code
    span, newlines as ↵, cut after ``limit`` characters."""
    s = "" if text is None else str(text)
    s = (s if len(s) <= limit else s[:limit] + "…").replace("\r", "").replace("\n", "↵")
    if not s.strip():
        return "*(empty)*"
    fence = "`" * (max(map(len, re.findall("`+", s)), default=0) + 1)
    return f"{fence} {s} {fence}"


# ---------------------------------------------------------------- training (live)


def curves_spec(metrics: list[dict]) -> dict:
    """Vega-Lite: one panel per metric (facet), each with its own y scale, two panels a row.
    A metric no row has yet (eval_accuracy before the first evaluation) has no panel yet."""
    rows = [{"iteration": m["iteration"], "panel": title, "value": m[k]}
            for m in metrics for k, title in PANELS.items() if _finite(m.get(k))]
    return {"$schema": "https://vega.github.io/schema/vega-lite/v5.json",
            "data": {"values": rows}, "columns": 2,
            "facet": {"field": "panel", "type": "nominal", "sort": list(PANELS.values()), "title": None,
                      "header": {"labelFontSize": 13, "labelFontWeight": "bold"}},
            "spec": {"width": 300, "height": 150, "mark": {"type": "line", "point": {"size": 20}},
                     "encoding": {"x": {"field": "iteration", "type": "quantitative",
                                        "axis": {"format": "d", "tickMinStep": 1}},
                                  "y": {"field": "value", "type": "quantitative", "title": None,
                                        "scale": {"zero": False}}}},
            "resolve": {"scale": {"y": "independent"}, "axis": {"x": "independent"}}}


def pick_samples(samples: list[dict], k: int = SAMPLE_ROWS) -> list[dict]:
    """The highest and the lowest rewarded (about half each), highest first; all when <= k."""
    order = sorted(range(len(samples)), key=lambda i: -samples[i]["reward"] if _finite(samples[i].get("reward"))
                   else math.inf)
    if len(order) > k:
        order = order[:k - k // 2] + order[len(order) - k // 2:]
    return [samples[i] for i in order]


def _status(stage: str, last: dict | None) -> str:
    if not last:
        return f"# GRPO stage `{stage}`\nwaiting for the first iteration..."
    parts = [f"{k.replace('_', ' ')} {last[k]:{fmt}}" for k, fmt in
             (("reward", ".3f"), ("informative_frac", ".2f"), ("kl", ".4f"), ("completion_len", ".1f"),
              ("truncated_frac", ".2f"), ("entropy", ".3f"), ("eval_accuracy", ".3f")) if _finite(last.get(k))]
    return f"# GRPO stage `{stage}`\niteration {last['iteration']}: " + ", ".join(parts)


def training_card(card, stage: str):
    """Returns an ``on_progress(metrics, samples=None)`` callback that redraws the panels and the
    samples table while torchrun runs. ``samples``: the trainer's latest ``samples_latest.json``
    ({"iteration", "samples": [{"prompt", "completion", "reward"}]}), or None before the first."""
    status = Markdown(_status(stage, None))
    chart = VegaChart(curves_spec([]))
    samples_title = Markdown("### Sampled completions\nnone logged yet")
    cells = [[Markdown(" ") for _ in range(3)] for _ in range(SAMPLE_ROWS)]  # a Table cannot be replaced;
    for c in (status, chart, samples_title, Table(cells, headers=["prompt", "completion", "reward"])):
        card.append(c)  # its cells can be updated

    def on_progress(metrics: list[dict], samples: dict | None = None) -> None:
        chart.update(curves_spec(metrics))
        status.update(_status(stage, metrics[-1] if metrics else None))
        if samples and samples.get("samples"):
            shown = pick_samples(samples["samples"])
            samples_title.update(f"### Sampled completions, iteration {samples.get('iteration')}\n"
                                 f"{len(shown)} of the {len(samples['samples'])} logged: the highest and the "
                                 "lowest rewards (↵ is a newline)")
            for i, row in enumerate(cells):
                s = shown[i] if i < len(shown) else None
                row[0].update(_literal(s["prompt"], PROMPT_CHARS) if s else " ")
                row[1].update(_literal(s["completion"], COMPLETION_CHARS) if s else " ")
                row[2].update(f"{s['reward']:.3f}" if s and _finite(s.get("reward")) else " ")
        card.refresh()

    return on_progress


def training_result(card, summary: dict) -> None:
    """The stage's verdict under its curves: first-vs-last window reward with its interval."""
    t = summary.get("reward_trend")
    if t:
        ci = (f", 95% CI [{t['ci_low']:+.3f}, {t['ci_high']:+.3f}]" if _finite(t.get("ci_low")) and
              _finite(t.get("ci_high")) else ", too few iterations for an interval")
        card.append(Markdown(f"**Reward, mean of the first vs last {t['window']} iterations:** "
                             f"{t['first']:.3f} -> {t['last']:.3f} (change {t['diff']:+.3f}{ci})"))


# ---------------------------------------------------------------- evaluation


def _paired(vs: dict | None) -> list[str]:
    """Change, exact McNemar p and gained / lost of one paired comparison (dashes when absent)."""
    if not vs:
        return ["–", "–", "–"]
    p = vs.get("p_value")
    return [f"{vs['delta']:+.3f}" if _finite(vs.get("delta")) else "–", f"{p:.2g}" if _finite(p) else "–",
            f"+{vs.get('gained', '?')} / −{vs.get('lost', '?')}"]


def _stage_row(r: dict, name: str, is_start: bool) -> list[str]:
    s = r.get("summary", {}).get(name, {})
    acc = (f"{s['accuracy']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]"
           if all(_finite(s.get(k)) for k in ("accuracy", "ci_low", "ci_high")) else "–")
    count = f"{s['correct']} / {s['n']}" if "correct" in s and "n" in s else str(s.get("n", "–"))
    cut, loops = (f"{s[k]:.1%}" if _finite(s.get(k)) else "–" for k in ("truncated_frac", "looped_frac"))
    if is_start:
        return [r["stage"], acc, count, cut, loops, "start model", "", "", "", ""]
    previous = (r.get("vs_previous") or {}).get(name)
    return ([r["stage"], acc, count, cut, loops] + _paired((r.get("vs_start") or {}).get(name))
            + _paired(previous)[:2])


def _steps_rows(results: list[dict], name: str) -> list[list[str]]:
    """A header and one row per stage of greedy accuracy per GSM8K steps bucket (none: [])."""
    buckets = results[0].get("summary", {}).get(name, {}).get("by_steps")
    if not buckets:
        return []
    rows = [["stage"] + [f"{k} steps" for k in buckets]]
    for r in results:
        b = r["summary"][name].get("by_steps", {})
        rows.append([r["stage"]] + [f"{b[k]['accuracy']:.3f} ({round(b[k]['accuracy'] * b[k]['n'])} / {b[k]['n']})"
                                    if k in b else "–" for k in buckets])
    return rows


def _sampled_header(s: dict, name: str, start: str) -> str:
    return (f"### {name}: sampled accuracy (k = {s['k']} samples per item at temperature {s['temperature']}, "
            f"the same {s['n']} items and seed for every stage)\n**mean@k**: right samples / all samples. "
            "**pass@k**: items with at least one right sample. **p**: paired sign-flip permutation test on the "
            f"per-item share of right samples against `{start}` (exact up to 18 items that differ).")


def _sampled_row(r: dict, name: str, is_start: bool) -> list[str]:
    s = r.get("sampled_summary", {}).get(name, {})
    head = [r["stage"], f"{s.get('mean_at_k', 0):.3f}", f"{s.get('pass_at_k', 0):.3f}",
            f"{s.get('correct_samples', '?')} / {s.get('samples', '?')}"]
    if is_start:
        return head + ["start model", "", "", "", ""]
    vs, prev = (r.get(k, {}).get(name) or {} for k in ("sampled_vs_start", "sampled_vs_previous"))
    cell = lambda v, key, fmt: format(v[key], fmt) if _finite(v.get(key)) else "–"  # noqa: E731
    return head + [cell(vs, "delta", "+.3f"), cell(vs, "p_value", ".2g"),
                   f"{vs.get('better_items', '?')} / {vs.get('worse_items', '?')}",
                   cell(prev, "delta", "+.3f"), cell(prev, "p_value", ".2g")]


def answer_items(results: list[dict], name: str, k: int = ANSWERS_PER_SET) -> list[str]:
    """``k`` item ids every stage answered: first those the stages disagree on, then the first items."""
    per_stage = [{i["item_id"]: i for i in r.get("items", {}).get(name, [])} for r in results]
    if not per_stage or not per_stage[0]:
        return []
    common = [i for i in per_stage[0] if all(i in p for p in per_stage)]
    split = [i for i in common if len({bool(p[i].get("correct")) for p in per_stage}) > 1]
    return (split + [i for i in common if i not in split])[:k]


def stage_table_card(card, results: list[dict]) -> None:
    """Per held-out set: every stage's accuracy (95% Wilson), cut-off share, change and exact
    McNemar p against the start model (``results[0]``) on the same items; then a few greedy
    answers of every stage to the same items."""
    start = results[0]["stage"]
    card.append(Markdown(
        "# Held-out accuracy by stage (greedy, 95% Wilson interval)\n"
        "Every stage answers the same items. **cut off**: answers that hit the generation cap while "
        "not looping. **looped**: answers stopped once they repeated themselves verbatim (at least 3 "
        "copies of a cycle, 64+ tokens: greedy decoding would repeat it to any cap), or cut off by the "
        "cap while repeating their own earlier text with only the numbers changing. "
        f"**vs {start}**: accuracy change against the start model `{start}`, with the exact McNemar p on "
        f"the items the two disagree on (**gained / lost**: right only here / only in `{start}`). "
        "**vs stage before**: the same against the stage this one continued from."))
    for name in results[0].get("summary", {}):
        card.append(Markdown(f"## {name}"))
        card.append(Table([_stage_row(r, name, i == 0) for i, r in enumerate(results)],
                          headers=["stage", "accuracy [95% CI]", "correct / n", "cut off", "looped", f"vs {start}",
                                   "McNemar p", "gained / lost", "vs stage before", "McNemar p"]))
        steps = _steps_rows(results, name)
        if steps:
            card.append(Markdown(f"### {name}: greedy accuracy by calculator steps (right / items)"))
            card.append(Table(steps[1:], headers=steps[0]))
        if name in results[0].get("sampled_summary", {}):
            card.append(Markdown(_sampled_header(results[0]["sampled_summary"][name], name, start)))
            card.append(Table([_sampled_row(r, name, i == 0) for i, r in enumerate(results)],
                              headers=["stage", "mean@k", "pass@k", "right samples", f"vs {start}", "p",
                                       "items better / worse", "vs stage before", "p"]))
        ids = answer_items(results, name)
        if not ids:
            continue
        rows = []
        for item_id in ids:
            for j, r in enumerate(results):
                it = next(i for i in r["items"][name] if i["item_id"] == item_id)
                mark = "✓ right" if it.get("correct") else "✗ wrong"
                mark += ", cut off" if it.get("truncated") else ", looped" if it.get("looped") else ""
                rows.append([item_id if j == 0 else "", str(it.get("gold", "")) if j == 0 else "", r["stage"], mark,
                             Markdown(_literal(it.get("completion"), COMPLETION_CHARS))])
        card.append(Markdown(f"### {name}: greedy answers to {len(ids)} items (those the stages disagree on "
                             "first; ↵ is a newline)"))
        card.append(Table(rows, headers=["item", "gold", "stage", "", "answer"]))


# ---------------------------------------------------------------- registry

def _fields(other: str) -> dict[str, str]:
    """Decision keys -> row titles; ``other``: what this version was compared with."""
    return {"model_name": "model", "version": "version", "decision": "decision", "eval_set": "compared on",
            "compared_with": "compared with", "champion_version": "champion version",
            "compared_items": "items compared", "challenger_accuracy": "accuracy of this version (those items)",
            "champion_accuracy": f"accuracy of {other} (those items)", "a_only": "right only in this version",
            "b_only": f"right only in {other}", "p_value": "exact McNemar p", "rule": "rule", "reason": "reason"}


def _meaning(d: dict) -> str:
    champion = d.get("champion_version") is not None
    return {"first": "no champion yet: this version is `@champion`",
            "promoted": "promoted: this version is `@champion` now"
                        + (" (the one it replaced: `@previous-champion`)" if champion else ""),
            "challenger": "not promoted: this version is `@challenger`; "
                          + ("`@champion` is unchanged" if champion else "there is no `@champion` yet"),
            }.get(d.get("decision"), "")


def registry_card(card, decision: dict) -> None:
    """The decision ``pipeline.register`` returned (``registry.register_model``): against the
    champion, or (no champion yet) the start model when ``compared_with`` says so."""
    d = decision or {}
    other = d.get("compared_with") or (f"champion v{d['champion_version']}" if d.get("champion_version") is not None
                                       else "the champion")
    card.append(Markdown(f"# Registry: `{d.get('model_name')}` v{d.get('version')} → **{d.get('decision')}**\n"
                         f"{_meaning(d)}\n\n**Why:** {d.get('reason', '–')}"))
    fields = _fields(other)
    keys = [k for k in fields if k in d] + [k for k in d if k not in fields]
    fmt = lambda v: "–" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    card.append(Table([[fields.get(k, k), fmt(d[k])] for k in keys], headers=["field", "value"]))
