"""Metaflow cards: live training curves on the GRPO steps, the stage table on evaluation."""
from metaflow.cards import Markdown, Table, VegaChart

CURVES = ("reward", "informative_frac", "kl", "eval_accuracy")


def _spec(rows: list[dict]) -> dict:
    return {"$schema": "https://vega.github.io/schema/vega-lite/v5.json", "width": 520, "height": 240,
            "data": {"values": rows}, "mark": {"type": "line", "point": True},
            "encoding": {"x": {"field": "iteration", "type": "quantitative"},
                         "y": {"field": "value", "type": "quantitative"},
                         "color": {"field": "metric", "type": "nominal"}}}


def training_card(card, stage: str):
    """Returns an on_progress(metrics) callback that redraws the curves while torchrun runs."""
    chart = VegaChart(_spec([]))
    status = Markdown(f"# GRPO stage `{stage}`\nwaiting for the first iteration...")
    card.append(status)
    card.append(chart)

    def on_progress(metrics: list[dict]) -> None:
        rows = [{"iteration": m["iteration"], "metric": k, "value": m[k]}
                for m in metrics for k in CURVES if k in m and m[k] == m[k]]
        chart.update(_spec(rows))
        if metrics:
            last = metrics[-1]
            status.update(f"# GRPO stage `{stage}`\niteration {last['iteration']}: reward "
                          f"{last['reward']:.3f}, informative {last['informative_frac']:.2f}, "
                          f"kl {last['kl']:.4f}")
        card.refresh()

    return on_progress


def training_result(card, summary: dict) -> None:
    """The stage's verdict under its curves: first-vs-last window reward with its interval."""
    t = summary.get("reward_trend")
    if t:
        card.append(Markdown(f"**Reward, mean of the first vs last {t['window']} iterations:** "
                             f"{t['first']:.3f} -> {t['last']:.3f} (change {t['diff']:+.3f}, "
                             f"95% CI [{t['ci_low']:+.3f}, {t['ci_high']:+.3f}])"))


def stage_table_card(card, results: list[dict]) -> None:
    """Accuracy of every stage on every held-out set, with 95% intervals."""
    sets = list(results[0]["summary"])
    card.append(Markdown("# Held-out accuracy by stage (greedy, 95% Wilson interval)"))
    card.append(Table([[r["stage"]] + [f"{r['summary'][s]['accuracy']:.3f} "
                                       f"[{r['summary'][s]['ci_low']:.3f}, {r['summary'][s]['ci_high']:.3f}] "
                                       f"n={r['summary'][s]['n']}" for s in sets] for r in results],
                      headers=["stage"] + sets))
