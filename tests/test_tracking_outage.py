"""Training while the MLflow store is unreachable (a dead address, real trackers): the stage
finishes, its points wait beside its checkpoints, and a resume or a later step sends every point
and param once.
"""
from __future__ import annotations

import json
import shutil

import pytest

from grpo_core.train.entry import main
from tests.conftest import free_port
from tests.fault_helpers import short_stage
from tests.faults import InjectedFault, crash_after_iteration


def test_training_completes_while_the_mlflow_server_is_down(tiny, tmp_path, monkeypatch):
    """Nothing listens at the tracking URI (a dead server: connection refused on every call).
    The retry budget is shortened from 5 tries with 0.5 s backoff (15.5 s per flush) to keep
    the test fast; the tracker and the failures are real."""
    from grpo_core.tracking.logger import MlflowTracker

    monkeypatch.setattr(MlflowTracker.__init__, "__kwdefaults__",
                        {**MlflowTracker.__init__.__kwdefaults__, "max_retries": 1, "backoff_s": 0.05})
    dead = f"http://127.0.0.1:{free_port()}"
    summary = main(short_stage(tiny, tmp_path, runtime=dict(tracking_uri=dead, tracking_run_id="0" * 32)))
    assert summary["iterations_run"] == 4 and (tmp_path / "final" / "model.safetensors").exists()
    assert summary["tracking_delayed_points"] > 0
    spill = [json.loads(ln) for ln in (tmp_path / "pending_metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in spill if r["kind"] == "metric" and r["key"] == "reward"}) == [1, 2, 3, 4]
    # params wait for the server too (sent if the run lacks them: a rerun of the step reuses its run)
    assert any(r["kind"] == "param_if_absent" and r["key"] == "optim.lr" for r in spill)


def test_an_outage_then_a_crash_loses_no_point_and_no_param(tiny, tmp_path, monkeypatch):
    """MLflow down for the first attempt, which crashes after its checkpoint at iteration 2: the
    points it held back lived only in its memory. The resumed attempt, with the store back and a
    fresh output dir (a flow ``resume``), resends the restored history with its first timestamps
    and logs the params the run does not hold, so every iteration and every param arrives, each
    point once, also when the history is resent a second time."""
    from mlflow import MlflowClient

    from grpo_core.tracking.logger import MlflowTracker

    monkeypatch.setattr(MlflowTracker.__init__, "__kwdefaults__",
                        {**MlflowTracker.__init__.__kwdefaults__, "max_retries": 1, "backoff_s": 0.05})
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("outage-crash")).info.run_id
    dead = f"http://127.0.0.1:{free_port()}"
    with crash_after_iteration(3), pytest.raises(InjectedFault):
        main(short_stage(tiny, tmp_path / "a",
                         runtime=dict(tracking_uri=dead, tracking_run_id=run_id, sync_uri=str(tmp_path / "store"))))
    client.log_param(run_id, "runtime.output_dir", "first attempt's")  # as if it had reached the store
    for attempt, origin in (("b", "store"), ("c", "b/store")):  # c resumes b's finished stage: a resend only
        main(short_stage(tiny, tmp_path / attempt, runtime=dict(
            tracking_uri=store, tracking_run_id=run_id, resume_from=[str(tmp_path / origin)],
            sync_uri=str(tmp_path / attempt / "store"))))
    assert sorted(m.step for m in client.get_metric_history(run_id, "reward")) == [1, 2, 3, 4]
    params = client.get_run(run_id).data.params
    assert params["optim.lr"] == "0.003" and params["runtime.output_dir"] == "first attempt's"
    assert "objective.normaliser" in params


def test_points_kept_during_an_outage_are_replayed_by_a_later_step(tiny, tmp_path, monkeypatch):
    """MLflow unreachable for a whole stage (a dead address), the stage's run in a real store: the
    stage keeps its unsent points beside its checkpoints (a training pod's scratch would die with
    it) and the flow's ``end`` step (``pipeline.replay_tracking``) sends them once the store is
    reachable, each once even when replayed twice."""
    from mlflow import MlflowClient

    from grpo_core.pipeline.steps import replay_tracking
    from grpo_core.tracking.logger import MlflowTracker

    monkeypatch.setattr(MlflowTracker.__init__, "__kwdefaults__",
                        {**MlflowTracker.__init__.__kwdefaults__, "max_retries": 1, "backoff_s": 0.05})
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("outage")).info.run_id
    dead = f"http://127.0.0.1:{free_port()}"
    summary = main(short_stage(tiny, tmp_path / "scratch", runtime=dict(
        tracking_uri=dead, tracking_run_id=run_id, sync_uri=str(tmp_path / "store"))))
    assert summary["tracking_pending_uri"] == str(tmp_path / "store" / "pending_metrics.jsonl")
    assert client.get_metric_history(run_id, "reward") == []
    shutil.rmtree(tmp_path / "scratch")  # the pod is gone
    assert replay_tracking(dead, [summary]) == 0  # still down: a warning, the file stays
    assert replay_tracking(store, [summary]) == replay_tracking(store, [summary]) > 0
    assert sorted(m.step for m in client.get_metric_history(run_id, "reward")) == [1, 2, 3, 4]
    assert client.get_run(run_id).data.params["optim.lr"] == "0.003"
