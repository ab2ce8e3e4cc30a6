"""The flow-step bodies outside a flow run: evaluation results in stage order, the tracking URI
resolved where a step runs, live metrics read while written, a torchrun stage stopped with its
step, a failing live card, and a tracking store Kubernetes pods cannot reach.
"""
import subprocess
import sys

import pytest

from tests.helpers import REPO


def test_evaluation_results_are_put_in_stage_order():
    """The join may hand the foreach results in any order; the last must be the shipped model's."""
    from grpo_core.pipeline.evaluation_step import in_stage_order

    got = in_stage_order([{"stage": "gsm8k"}, {"stage": "sft"}, {"stage": "curriculum"}])
    assert [r["stage"] for r in got] == ["sft", "curriculum", "gsm8k"]


def test_steps_resolve_the_tracking_uri_where_they_run(monkeypatch):
    """A training pod must not inherit the workstation's port-forwarded localhost from `start`:
    its own MLFLOW_TRACKING_URI wins, then the configured URI, then what `start` resolved."""
    from grpo_core.pipeline.steps import RunContext

    ctx = RunContext(flow="F", run_id="1", origin_run_id=None, storage_root="s3://b/p",
                     tracking_uri="http://localhost:5000", parent_run_id="abc")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    in_cluster = "http://mlflow.grpo.svc.cluster.local:5000"
    assert ctx.in_this_process(in_cluster).tracking_uri == in_cluster
    assert ctx.in_this_process(None).tracking_uri == "http://localhost:5000"  # local default: sqlite of start
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://pod-env:5000")
    here = ctx.in_this_process(in_cluster)
    assert here.tracking_uri == "http://pod-env:5000" and here.parent_run_id == "abc"
    assert ctx.tracking_uri == "http://localhost:5000"  # frozen: the artifact is not changed


def test_live_metrics_skip_a_row_half_written(tmp_path):
    """The card reads metrics.jsonl while the trainer appends to it: a partial last line is not a row yet."""
    from grpo_core.pipeline.launcher import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1, "reward": 0.5}\n{"iteration": 2, "rew')
    assert read_metrics(tmp_path) == [{"iteration": 1, "reward": 0.5}]
    assert read_metrics(tmp_path / "missing") == []


def _tiny_stage(tmp_path, iterations: int) -> dict:
    from grpo_core.config.stage import GRPOConfig

    model = tmp_path / "model"  # built in a process of its own: this one has loaded metaflow's typing_extensions
    subprocess.run([sys.executable, "-m", "grpo_core.model.loading", "tiny", "--out", str(model)], check=True,
                   capture_output=True, cwd=REPO)
    return GRPOConfig(runtime=dict(model=str(model), output_dir=str(tmp_path / "out")), iterations=iterations,
                      checkpoint=dict(every=iterations), prompts_per_iter=2,
                      sampling=dict(group_size=2, max_new_tokens=8), task="arithmetic",
                      rewards=[{"fn": "grpo_core.data.rewards:target_char_fraction"}]).to_dict()


def test_a_step_interrupted_while_training_runs_stops_torchrun(tmp_path):
    """Ctrl-C (or the task being killed) while torchrun trains: its ranks must not train on,
    orphaned, writing into the step's scratch dir."""
    from grpo_core.pipeline.launcher import launch_stage

    cfg, seen = _tiny_stage(tmp_path, 100_000), []

    def interrupted(rows):
        seen.append(len(rows))
        if rows:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch_stage(cfg, nproc=1, threads=1, on_progress=interrupted, poll_s=0.2)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "out" / "stage.json")], capture_output=True,
                          text=True).stdout.split()
    assert seen[-1] > 0 and left == [], left


def test_a_live_card_that_fails_does_not_stop_training(tmp_path, capsys):
    from grpo_core.pipeline.launcher import launch_stage

    calls = []

    def card_fails(rows):
        calls.append(len(rows))
        raise RuntimeError("card cannot render")

    summary = launch_stage(_tiny_stage(tmp_path, 2), nproc=1, threads=1, on_progress=card_fails, poll_s=0.2)
    assert summary["iterations_run"] == 2 and len(calls) == 1  # not called again once it failed
    assert capsys.readouterr().err.count("live progress update failed (RuntimeError: card cannot render)") == 1


def test_kubernetes_refuses_a_tracking_store_pods_cannot_reach(monkeypatch):
    """No tracking_uri in the config and no MLFLOW_TRACKING_URI: start would open the launcher's
    sqlite file, which training pods cannot reach; it stops before creating any run."""
    from grpo_core.config.pipeline import PipelineConfig
    from grpo_core.pipeline.steps import open_tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = PipelineConfig.from_dict({"storage_root": "s3://b/p", "compute": {"backend": "kubernetes", "gpu": 2,
                                                                              "nproc_per_node": 2}})
    with pytest.raises(RuntimeError, match=r"MLflow tracking URI is 'sqlite:.*training pods cannot reach"):
        open_tracking(cfg, {}, "k8s")
