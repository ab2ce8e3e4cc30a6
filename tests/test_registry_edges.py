"""Registry edges: the promotion boundary with a configured alpha, reached through the pipeline's
register step, and the compare CLI as a newcomer types it (no URI given, a wrong model name)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from grpo_core.config.pipeline import PipelineConfig
from grpo_core.evaluation.stats import mcnemar_exact
from grpo_core.pipeline.steps import RunContext, register
from grpo_core.tracking.registry import aliases_by_version, main
from grpo_core.tracking.runs import mlflow_client, start_parent_run
from tests.helpers import REPO
from tests.test_registry import N, _register, items, model_dir  # noqa: F401  (model_dir: a module fixture)

pytestmark = pytest.mark.usefixtures("no_cwd_writes")
START_RIGHT = 20  # the start model's right items; a version with START_RIGHT + g gains g, loses none


@pytest.mark.parametrize("alpha,gained,decision", [
    (0.0625, 6, "promoted"),    # p = 2 / 2**6 = 0.03125, below alpha
    (0.0625, 5, "challenger"),  # p = 2 / 2**5 = 0.0625 exactly: the rule is p < alpha, so not promoted
    (0.0625, 4, "challenger"),  # p = 0.125, above
    (0.07, 5, "promoted"),      # the same items under alpha 0.07: the configured alpha decides, not 0.05
])
def test_the_configured_alpha_decides_at_the_boundary(sqlite_uri, model_dir, tmp_path, alpha, gained,  # noqa: F811
                                                      decision):
    assert mcnemar_exact([True] * gained, [False] * gained)["p_value"] == pytest.approx(2 / 2**gained)
    name = f"grpo-alpha-{gained}-{alpha}"
    cfg = PipelineConfig.from_dict({"storage_root": str(tmp_path / "store"), "sft": {"source": "tiny-local"},
                                    "register": {"alpha": alpha, "model_name": name, "primary": "gsm8k_test"}})
    parent = start_parent_run(sqlite_uri, "grpo", {})
    ctx = RunContext("GRPOFlow", "1", None, cfg.storage_root, sqlite_uri, parent)
    final = {"model_uri": model_dir, "stage": "gsm8k", "items": {"gsm8k_test": items(START_RIGHT + gained)}}
    start = {"items": {"gsm8k_test": items(START_RIGHT)}}
    result = register(cfg, ctx, final, {}, "GRPOFlow/1/register/1", start=start)
    assert result["decision"] == decision, result["reason"]
    assert result["compared_items"] == N and result["p_value"] == pytest.approx(2 / 2**gained)
    assert f"(alpha {alpha})" in result["reason"]
    assert aliases_by_version(mlflow_client(sqlite_uri), name) == {1: ["champion" if decision == "promoted"
                                                                      else "challenger"]}


@pytest.fixture
def default_store(tmp_path, _sqlite_template, model_dir, monkeypatch):  # noqa: F811
    """A project whose local default store (.grpo/mlflow/mlflow.db) holds grpo-smollm2 v1, as the
    default run leaves it; MLFLOW_TRACKING_URI unset, as in a new shell."""
    from grpo_core.tracking import registry
    db = tmp_path / "project" / ".grpo" / "mlflow" / "mlflow.db"
    db.parent.mkdir(parents=True)
    shutil.copyfile(_sqlite_template, db)
    uri = f"sqlite:///{db}"
    _register(uri, model_dir, 30, name="grpo-smollm2")
    monkeypatch.setattr(registry, "PROJECT_DIR", tmp_path / "project")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return uri


def test_compare_finds_the_local_default_store_without_a_uri(default_store, capsys):
    assert main(["compare", "grpo-smollm2"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["version", "aliases"] and table[1].split()[:2] == ["1", "champion"], table


def test_compare_with_no_store_says_where_it_looked(tmp_path, monkeypatch):
    from grpo_core.tracking import registry
    monkeypatch.setattr(registry, "PROJECT_DIR", tmp_path / "empty")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(SystemExit, match=r"no MLflow store at .*empty/\.grpo/mlflow/mlflow\.db.*--tracking-uri"):
        main(["compare", "grpo-smollm2"])
    assert not (tmp_path / "empty" / ".grpo" / "mlflow" / "mlflow.db").exists()  # no empty db left behind


def test_an_unknown_model_is_one_line_naming_the_registered_ones(default_store):
    with pytest.raises(SystemExit, match=r"no registered model 'grpo-gsm8k' .*registered: grpo-smollm2$"):
        main(["compare", "grpo-gsm8k"])
    out = subprocess.run([sys.executable, "-m", "grpo_core.tracking.registry", "compare", "grpo-gsm8k",
                          "--tracking-uri", default_store], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"python -m grpo_core.tracking.registry: error: no registered model 'grpo-gsm8k' in {default_store}; "
        "registered: grpo-smollm2"], out.stderr
