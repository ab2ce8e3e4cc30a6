"""The cards a user looks at (flows/cards.py).

The card functions build Metaflow's own components (VegaChart, Table, Markdown), rendered here
by their ``render()``, as Metaflow renders them into a card. ``CardStub`` stands in only for the
container a step's ``current.card[id]`` is (append, refresh), which exists only inside a running
flow; ``test_the_cards_render_in_a_real_flow`` runs one (tests/card_flow.py) and reads the cards
back, and ``test_the_live_card_shows_the_samples_a_real_stage_logs`` feeds the training card
from a real torchrun stage.
"""
import base64
import json
import os
import re
import subprocess
import sys

import pytest

from tests.card_flow import LONG, evaluation_results, metrics_rows, registry_decision, samples_logged
from tests.helpers import REPO

sys.path.insert(0, str(REPO / "flows"))
import cards


class CardStub:
    """The container a card function appends to (``current.card[id]``)."""

    def __init__(self):
        self.components, self.refreshes = [], 0

    def append(self, component) -> None:
        self.components.append(component)

    def refresh(self) -> None:
        self.refreshes += 1

    def rendered(self) -> list[dict]:
        return [c.render() for c in self.components]

    def of_type(self, kind: str) -> list[dict]:
        return [r for r in self.rendered() if r["type"] == kind]


def cell(c) -> str:
    """A rendered table cell as text (a Markdown component's source, or the string)."""
    return c["source"].strip() if isinstance(c, dict) else str(c)


def panels(spec: dict) -> dict[str, list]:
    """Panel title -> its (iteration, value) points, from the chart's data."""
    out: dict[str, list] = {}
    for row in spec["data"]["values"]:
        out.setdefault(row["panel"], []).append((row["iteration"], row["value"]))
    return out


# ---------------------------------------------------------------- training card


def test_training_card_draws_one_panel_per_metric_and_a_samples_table():
    card, rows = CardStub(), metrics_rows()
    on_progress = cards.training_card(card, "curriculum")
    on_progress(rows[:2])  # early: no evaluation and no samples yet
    (chart,) = card.of_type("vegaChart")
    pool = {title for key, title in cards.PANELS.items() if key.startswith("pool_")}  # a stage without a pool
    assert set(panels(chart["spec"])) == set(cards.PANELS.values()) - {cards.PANELS["eval_accuracy"]} - pool
    samples_table = card.of_type("table")[0]
    assert samples_table["columns"] == ["prompt", "completion", "reward"]
    assert all(cell(c) == "" for r in samples_table["data"] for c in r)

    on_progress(rows, samples=samples_logged())
    (chart,) = card.of_type("vegaChart")
    spec = chart["spec"]
    assert spec["facet"]["field"] == "panel" and spec["facet"]["sort"] == list(cards.PANELS.values())
    assert spec["resolve"]["scale"]["y"] == "independent"  # each panel its own scale
    drawn = panels(spec)
    assert list(cards.PANELS) == ["reward", "informative_frac", "kl", "completion_len", "truncated_frac",
                                  "entropy", "eval_accuracy", "pool_active", "pool_solved", "pool_resting",
                                  "pool_replayed"]
    assert set(drawn) == set(cards.PANELS.values()) - pool
    for key, title in cards.PANELS.items():  # every panel holds exactly its metric's points
        if key.startswith("pool_"):
            continue
        assert drawn[title] == [(r["iteration"], r[key]) for r in rows if key in r], key
    assert len(drawn[cards.PANELS["eval_accuracy"]]) == 3
    json.dumps(spec, allow_nan=False)  # the card's data is JSON: no NaN anywhere

    title = [cell(m) for m in card.of_type("markdown") if "Sampled completions" in m["source"]]
    assert title and "iteration 10" in title[0] and "6 of the 16" in title[0]
    table = [[cell(c) for c in r] for r in card.of_type("table")[0]["data"]]
    assert [r[2] for r in table] == ["2.000", "2.000", "0.400", "0.000", "0.000", "0.000"]  # best, then worst
    top = table[0]
    assert "What is 7 + 3? Answer inside <answer></answer>." in top[0]
    assert LONG[:200] + "…" in top[1] and LONG[:201] not in top[1]  # cut to 200 characters
    assert "line one↵line `two` <b>bold?</b>" in table[2][1]  # shown as written, in a code span
    assert table[2][1].startswith("`` ") and table[2][1].endswith(" ``")
    status = card.of_type("markdown")[0]["source"]
    assert "iteration 12" in status and "eval accuracy 0.300" in status and "entropy 0.900" in status
    assert card.refreshes == 2


def test_reward_trend_without_an_interval():
    card, nan = CardStub(), float("nan")
    cards.training_result(card, {"reward_trend": {"window": 1, "first": 0.125, "last": 0.0625, "diff": -0.0625,
                                                  "ci_low": nan, "ci_high": nan}})
    text = card.of_type("markdown")[0]["source"]
    assert "0.125 -> 0.062 (change -0.062, too few iterations for an interval)" in text and "nan" not in text
    cards.training_result(card, {})  # no iterations run: nothing to say
    assert len(card.components) == 1


def test_samples_shown_are_the_best_and_the_worst():
    samples = [{"prompt": "p", "completion": str(k), "reward": r} for k, r in enumerate([0.5, 3, 1, float("nan"), 2])]
    assert [s["completion"] for s in cards.pick_samples(samples, 4)] == ["1", "4", "0", "3"]
    assert [s["completion"] for s in cards.pick_samples(samples[:3], 4)] == ["1", "2", "0"]


def test_the_progress_report_passes_samples_to_a_callback_that_takes_them(tmp_path):
    from grpo_core.pipeline.launcher import _ProgressReport

    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1, "reward": 0.5}\n')
    seen = {}
    _ProgressReport(lambda rows: seen.update(old=rows), tmp_path)()  # a metrics-only callback still works
    _ProgressReport(lambda rows, samples=None: seen.update(new=(rows, samples)), tmp_path)()
    assert seen["old"] == [{"iteration": 1, "reward": 0.5}] and seen["new"][1] is None
    (tmp_path / "samples_latest.json").write_text(json.dumps(samples_logged(3)))
    _ProgressReport(lambda rows, samples=None: seen.update(new=(rows, samples)), tmp_path)()
    assert seen["new"][1]["iteration"] == 3 and len(seen["new"][1]["samples"]) == 16


def _tiny_stage(tmp_path, iterations: int) -> dict:
    from grpo_core.config.stage import GRPOConfig

    model = tmp_path / "model"  # built in a process of its own: this one has loaded metaflow
    subprocess.run([sys.executable, "-m", "grpo_core.model.loading", "tiny", "--out", str(model)], check=True,
                   capture_output=True, cwd=REPO)
    return GRPOConfig(runtime=dict(model=str(model), output_dir=str(tmp_path / "out")), iterations=iterations,
                      checkpoint=dict(every=iterations), prompts_per_iter=2,
                      sampling=dict(group_size=2, max_new_tokens=8), task="arithmetic", sample_every=2,
                      rewards=[{"fn": "grpo_core.data.rewards:target_char_fraction"}]).to_dict()


def test_the_live_card_shows_the_samples_a_real_stage_logs(tmp_path):
    """launch_stage -> torchrun trainer -> samples_latest.json -> the training card's table."""
    from grpo_core.pipeline.launcher import launch_stage

    card = CardStub()
    summary = launch_stage(_tiny_stage(tmp_path, 2), nproc=1, threads=1,
                           on_progress=cards.training_card(card, "curriculum"), poll_s=0.2)
    assert summary["iterations_run"] == 2
    logged = json.loads((tmp_path / "out" / "samples_latest.json").read_text())
    assert logged["iteration"] == 2 and len(logged["samples"]) == 4  # 2 prompts x 2 completions
    title = [m["source"] for m in card.of_type("markdown") if "Sampled completions" in m["source"]]
    assert "iteration 2" in title[0]
    table = [[cell(c) for c in r] for r in card.of_type("table")[0]["data"]]
    shown = sorted(float(r[2]) for r in table if r[2])
    assert shown == pytest.approx(sorted(round(s["reward"], 3) for s in logged["samples"]), abs=1e-3)
    assert {r[0] for r in table if r[0]} <= {cards._literal(s["prompt"], cards.PROMPT_CHARS) for s in logged["samples"]}
    drawn = panels(card.of_type("vegaChart")[0]["spec"])
    assert [i for i, _ in drawn[cards.PANELS["reward"]]] == [1, 2]
    assert {cards.PANELS[k] for k in ("kl", "completion_len", "truncated_frac", "entropy")} <= set(drawn)


# ---------------------------------------------------------------- evaluation and registry cards


def test_evaluation_card_pairs_every_stage_with_the_start_model_on_the_same_items():
    card = CardStub()
    cards.stage_table_card(card, evaluation_results())
    tables = card.of_type("table")
    assert len(tables) == 4  # per set: the stage table and the answers
    stage_table = tables[0]
    assert stage_table["columns"][:8] == ["stage", "accuracy [95% CI]", "correct / n", "cut off", "looped",
                                          "vs sft", "McNemar p", "gained / lost"]
    rows = {r[0]: r for r in stage_table["data"]}
    assert rows["sft"][1:6] == ["0.250 [0.102, 0.495]", "4 / 16", "12.5%", "6.2%", "start model"]
    assert rows["curriculum"][3:] == ["6.2%", "0.0%", "+0.125", "0.5", "+2 / −0", "+0.125", "0.5"]  # before: the start
    assert rows["gsm8k"][5:8] == ["+0.188", "0.25", "+3 / −0"]
    assert stage_table["columns"][8:] == ["vs stage before", "McNemar p"]
    assert rows["gsm8k"][8] == "+0.062"  # against the curriculum stage: one more item right
    answers = [[cell(c) for c in r] for r in tables[1]["data"]]
    assert [r[2] for r in answers] == ["sft", "curriculum", "gsm8k"] * 3  # the same items for every stage
    disagreements = ["arithmetic_test:1", "arithmetic_test:2", "arithmetic_test:6"]
    assert [r[0] for r in answers[::3]] == disagreements
    assert answers[0][3] == "✗ wrong, cut off" and answers[1][3] == "✓ right"
    assert LONG[:200] + "…" in answers[0][4]
    assert "McNemar" in card.of_type("markdown")[0]["source"] and "95% Wilson" in card.of_type("markdown")[0]["source"]


def test_evaluation_card_shows_steps_buckets_and_sampled_accuracy_paired_with_the_start():
    card = CardStub()
    cards.stage_table_card(card, evaluation_results(with_sampled=True))
    tables = card.of_type("table")
    steps = next(t for t in tables if t["columns"][1:] == ["<=2 steps", "3 steps", "4 steps"])
    # le2 items k = 0..7 with steps k % 4 + 1; sft right on {0, 5}: <=2 steps holds items 0, 1, 4, 5
    assert {r[0]: r[1] for r in steps["data"]}["sft"] == "0.500 (2 / 4)"
    sampled = next(t for t in tables if t["columns"][:4] == ["stage", "mean@k", "pass@k", "right samples"])
    rows = {r[0]: r for r in sampled["data"]}
    assert rows["sft"][1:4] == ["0.188", "0.250", "3 / 16"]      # item 0 twice, item 5 once
    assert rows["gsm8k"][1:4] == ["0.375", "0.625", "6 / 16"] and rows["gsm8k"][4] == "+0.188"
    assert rows["gsm8k"][6] == "3 / 0"                            # items 1, 2, 6 better; none worse
    assert any("sign-flip permutation" in m["source"] for m in card.of_type("markdown"))


def test_a_pooled_stage_draws_the_pool_panels():
    card, rows = CardStub(), metrics_rows(pool=True)
    cards.training_card(card, "gsm8k")(rows)
    (chart,) = card.of_type("vegaChart")
    drawn = panels(chart["spec"])
    for key in ("pool_active", "pool_solved", "pool_resting", "pool_replayed"):
        assert drawn[cards.PANELS[key]] == [(r["iteration"], r[key]) for r in rows], key


def test_evaluation_card_without_paired_results_or_items():
    """Results from before the paired comparison and the cut-off share: dashes, no error."""
    results = [{"stage": r["stage"], "summary": {k: {"accuracy": s["accuracy"], "ci_low": s["ci_low"],
                                                     "ci_high": s["ci_high"], "n": s["n"]}
                                                 for k, s in r["summary"].items()}}
               for r in evaluation_results()]
    card = CardStub()
    cards.stage_table_card(card, results)
    tables = card.of_type("table")
    assert len(tables) == 2  # no answers tables without items
    assert tables[0]["data"][1] == ["curriculum", "0.375 [0.185, 0.614]", "16", "–", "–", "–", "–", "–", "–", "–"]


def test_registry_card_shows_the_decision():
    d = registry_decision()
    card = CardStub()
    cards.registry_card(card, d)
    head = card.of_type("markdown")[0]["source"]
    assert "grpo-gsm8k` v4 → **challenger**" in head and "@challenger" in head and d["reason"] in head
    assert "`@champion` is unchanged" in head
    fields = {r[0]: r[1] for r in card.of_type("table")[0]["data"]}
    assert fields["decision"] == "challenger" and fields["items compared"] == "8"
    assert fields["right only in this version"] == "4" and fields["right only in champion v3"] == "0"
    assert fields["accuracy of champion v3 (those items)"] == "0.125"
    assert fields["exact McNemar p"] == f"{d['p_value']:.4g}" and fields["champion version"] == "3"


def test_registry_card_of_a_first_version_compared_with_the_start_model():
    d = {**registry_decision(), "decision": "promoted", "champion_version": None, "compared_with": "start model"}
    card = CardStub()
    cards.registry_card(card, d)
    head = card.of_type("markdown")[0]["source"]
    assert "this version is `@champion` now" in head and "previous-champion" not in head
    fields = {r[0]: r[1] for r in card.of_type("table")[0]["data"]}
    assert fields["compared with"] == "start model" and fields["right only in start model"] == "0"
    assert fields["champion version"] == "–"


# ---------------------------------------------------------------- a real flow


def test_the_cards_render_in_a_real_flow(tmp_path):
    from metaflow import Runner, namespace
    from metaflow.cards import get_cards

    for d in ("mfhome", "tmp"):
        (tmp_path / d).mkdir()
    env = {"METAFLOW_HOME": str(tmp_path / "mfhome"), "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(tmp_path),
           "METAFLOW_DEFAULT_DATASTORE": "local", "METAFLOW_DEFAULT_METADATA": "local", "USERNAME": "pytest",
           "METAFLOW_TEMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(REPO)}
    os.environ.setdefault("USERNAME", "pytest")
    with Runner(str(REPO / "tests" / "card_flow.py"), show_output=False, env=env, cwd=str(tmp_path)) as r:
        done = r.run()
        assert done.status == "successful", done.stderr[-3000:]
        task = done.run["start"].task
    namespace(None)
    seen = {}
    for card_id in ("training", "evaluation", "registry"):
        html = get_cards(task, id=card_id)[0].get()
        blobs = re.findall(r'__MF_DATA__\["[^"]+"\] = "([A-Za-z0-9+/=]+)"', html)
        seen[card_id] = "".join(base64.b64decode(b).decode() for b in blobs)
    for title in cards.PANELS.values():
        assert title in seen["training"]
    assert "Sampled completions, iteration 10" in seen["training"] and "mean of the first vs last" in seen["training"]
    assert "McNemar p" in seen["evaluation"] and "gsm8k_test: greedy answers to 3 items" in seen["evaluation"]
    assert "not promoted" in seen["registry"] and "grpo-gsm8k" in seen["registry"]
