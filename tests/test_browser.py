"""What a user looks at, opened in headless Chromium: the three cards README points to and the
MLflow pages it describes, all from the one tiny run of README's run command (``newcomer``).

Each page must render its panels, tables and values (compared with what the flow stored: its
artifacts, MLflow's records), and the browser must report no script error (console errors and
uncaught exceptions) while it does. The MLflow pages are served by README's own ``mlflow ui``
command on the run's store.
"""
import json
import re
import sys

import pytest

from tests.browser import Page
from tests.helpers import REPO
from tests.newcomer import kind_of, readme_commands

sys.path.insert(0, str(REPO / "flows"))
import cards  # the flow's card module: its panel titles and table headers


@pytest.fixture(scope="module")
def card_files(newcomer, tmp_path_factory):
    """The run's cards as HTML files, and the artifacts they show."""
    out = tmp_path_factory.mktemp("cards")
    done = newcomer.typed(f"python {REPO / 'tests' / 'newcomer_cards.py'} {newcomer.first_run_id} {out}")
    assert done.returncode == 0, done.stdout[-3000:]
    return out, json.loads((out / "artifacts.json").read_text())


@pytest.fixture(scope="module")
def mlflow_ui(newcomer):
    """README's ``mlflow ui`` on the run's store (a free port in place of README's)."""
    uis = [c for c in readme_commands((REPO / "README.md").read_text()) if kind_of(c) == "mlflow ui"]
    if not uis:
        pytest.fail("README shows no `mlflow ui` command in a fenced code block", pytrace=False)
    return newcomer.mlflow_ui(uis[0])


def _open_card(browser, path) -> Page:
    page = Page(browser, path.as_uri())
    page.wait_for(lambda: page.tables(), "the card's tables")
    return page


CHART_PANELS_JS = """
return [...document.querySelectorAll('.role-scope.cell > g')].map(cell => ({
  title: (cell.querySelector('.role-title-text text') || {}).textContent,
  points: [...cell.querySelectorAll('.mark-symbol path')].map(p => p.getAttribute('aria-label'))}));"""


def drawn_panels(page) -> dict[str, list[tuple[int, float]]]:
    """Panel title -> the (iteration, value) points drawn in it (Vega's SVG, read from its labels)."""
    cells = page.wait_for(lambda: page.js(CHART_PANELS_JS), "the chart's panels")
    out = {}
    for cell in cells:
        points = [re.fullmatch(r"iteration: (\d+); value: (\S+)", label).groups() for label in cell["points"]]
        out[cell["title"]] = [(int(i), float(v)) for i, v in points]
    return out


def test_training_card_draws_every_metric_mlflow_has_and_the_samples(browser, card_files, newcomer):
    """The curriculum step's card: one panel per metric, holding the points MLflow recorded for
    it; the samples table holds completions the trainer logged, best first."""
    client, run = _child_run(newcomer, "curriculum")
    recorded = {title: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                          key=lambda m: m.step)]
                for key, title in cards.PANELS.items() if key in run.data.metrics}
    assert len(recorded) >= 6, run.data.metrics
    page = _open_card(browser, card_files[0] / "training.html")
    drawn = drawn_panels(page)
    assert set(drawn) == set(recorded)
    for title, points in recorded.items():
        assert [i for i, _ in drawn[title]] == [i for i, _ in points], title
        assert [v for _, v in drawn[title]] == pytest.approx([v for _, v in points], rel=1e-9, abs=1e-12), title
    [samples] = [t for t in page.tables() if t["headers"] == ["prompt", "completion", "reward"]]
    title = re.search(r"Sampled completions, iteration (\d+)\n(\d+) of the (\d+) logged", page.text())
    assert title, page.text()[:2000]
    iteration, shown, logged = map(int, title.groups())
    assert len(samples["rows"]) == shown == min(logged, cards.SAMPLE_ROWS)
    rewards = [float(r[2]) for r in samples["rows"]]
    assert rewards == sorted(rewards, reverse=True)
    logged_rows = _logged_samples(client, run.info.run_id, iteration)
    for prompt, completion, reward in samples["rows"]:
        assert any(completion in s["completion"].replace("\n", "↵") and f"{s['reward']:.3f}" == reward
                   for s in logged_rows), (completion, reward)
    trend = card_files[1]["curriculum"]["reward_trend"]
    assert f"{trend['first']:.3f} -> {trend['last']:.3f}" in page.text()
    assert page.errors() == []


def _logged_samples(client, run_id: str, iteration: int) -> list[dict]:
    """The sampled completions MLflow holds for ``iteration`` (its samples table artifact)."""
    import mlflow

    [path] = [f.path for f in client.list_artifacts(run_id, "samples") if f.path.endswith("_table.json")
              and int(re.search(r"iter_(\d+)", f.path).group(1)) == iteration]
    table = mlflow.artifacts.load_dict(client.download_artifacts(run_id, path))
    return [dict(zip(table["columns"], row)) for row in table["data"]]


def test_evaluation_card_shows_every_stages_accuracy_on_every_set(browser, card_files):
    results = card_files[1]["results"]
    page = _open_card(browser, card_files[0] / "evaluation.html")
    stage_tables = [t for t in page.tables() if t["headers"][:3] == ["stage", "accuracy [95% CI]", "correct / n"]]
    sets = list(results[0]["summary"])
    assert len(stage_tables) == len(sets)
    text = page.text()
    for name, table in zip(sets, stage_tables):
        assert name in text
        assert [row[0] for row in table["rows"]] == [r["stage"] for r in results], name
        for row, r in zip(table["rows"], results):
            s = r["summary"][name]
            assert row[1] == f"{s['accuracy']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]", (name, row)
            assert row[2] == f"{s['correct']} / {s['n']}", (name, row)
    assert page.errors() == []


def test_registry_card_shows_the_decision_mlflow_recorded(browser, card_files, newcomer):
    from mlflow import MlflowClient

    decision = card_files[1]["registry"]
    version = MlflowClient(tracking_uri=newcomer.tracking_uri).get_model_version(
        decision["model_name"], str(decision["version"]))
    page = _open_card(browser, card_files[0] / "registry.html")
    page.wait_for_text(f"Registry: {decision['model_name']} v{decision['version']} → {decision['decision']}")
    [table] = [t for t in page.tables() if t["headers"] == ["field", "value"]]
    fields = dict(table["rows"])
    assert fields["model"] == decision["model_name"] and fields["version"] == str(version.version)
    assert fields["decision"] == decision["decision"] == version.tags["decision"]
    assert page.errors() == []


# ---------------------------------------------------------------- MLflow


def _child_run(newcomer, stage: str):
    """The MLflow child run of ``stage`` under the first run's parent run."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=newcomer.tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    [run] = client.search_runs(experiments, f"tags.`grpo.stage` = '{stage}'")
    return client, run


def test_mlflow_training_run_page_plots_every_metric(browser, newcomer, mlflow_ui):
    """README: a training child run's Model metrics tab plots reward, informative_frac, kl,
    completion_len, truncated_frac and entropy per iteration."""
    client, run = _child_run(newcomer, "curriculum")
    per_iteration = [k for k in cards.PANELS if k in run.data.metrics and
                     len(client.get_metric_history(run.info.run_id, k)) > 1]
    assert {"reward", "kl", "entropy"} <= set(per_iteration), run.data.metrics
    page = Page(browser, f"{mlflow_ui}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/model-metrics")
    name = run.info.run_name
    page.wait_for_text_while_scrolling(*(f"{name} ({k})" for k in per_iteration))  # a chart per metric: its legend
    assert page.errors() == []


def test_mlflow_registered_model_page_lists_versions_with_their_aliases(browser, newcomer, mlflow_ui):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=newcomer.tracking_uri)
    [model] = client.search_registered_models()
    versions = [client.get_model_version(model.name, v.version)  # a search leaves aliases out
                for v in client.search_model_versions(f"name='{model.name}'")]
    assert any(v.aliases for v in versions), "a registration sets @champion or @challenger"
    page = Page(browser, f"{mlflow_ui}/#/models/{model.name}")
    page.wait_for_text(*(f"Version {v.version}" for v in versions))
    rows = page.wait_for(lambda: page.js(
        "return [...document.querySelectorAll('[role=row], tr')].map(r => r.innerText.replace(/\\s+/g, ' '))"),
        "the versions table")
    for v in versions:
        [row] = [r for r in rows if r.startswith(f"Version {v.version} ")]
        assert all(f"@ {alias}" in row for alias in v.aliases), (row, v.aliases)
    assert page.errors() == []
