"""The Metaflow pipeline for real: Runner API runs, crash + resume (one crashed-and-resumed run
and one uninterrupted run per module, shared by the tests here), a two-node gang, MLflow
records, cards, and a run on an S3 datastore.

Every run uses an isolated METAFLOW_HOME, datastore, MLflow sqlite db and storage root under
a temporary directory, and a tiny config (a few iterations per stage) on the real GSM8K copy.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_core.config.pipeline import deep_merge
from grpo_core.evaluation.stats import wilson_interval
from tests.conftest import S3_ENV, free_port
from tests.flow_helpers import FLOW, TRAINING_STEPS, mf_env, run_flow, s3_creds, tiny_config
from tests.helpers import same_weights


def final_model_dir(run, step="join_gsm8k"):
    return Path(run[step].task["gsm8k"].data["model_uri"])


@pytest.fixture(scope="module")
def crashed_and_resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    # both gsm8k ranks SIGKILL themselves in iteration 4 (their 4th reward call): iteration 3 ran
    # and was logged locally, iteration 2 is the last checkpoint; the resume (no kill in its
    # environment) continues from it
    cfg = tiny_config(root, gsm8k={"rewards": [{"fn": "tests.faulty_rewards:gsm8k_correctness_killed_on_call",
                                                "weight": 1.0}]})
    failed = run_flow(root, cfg, GRPO_TEST_KILL_ON_CALL="4")
    assert failed.status == "failed", failed.stdout[-3000:]
    assert _child_runs(cfg, failed.run)["gsm8k"].info.status == "FAILED"  # not left RUNNING
    assert _parent_run(cfg, failed.run).info.status == "FAILED"  # the pipeline run too
    resumed = run_flow(root, cfg, resume_from=failed.run.id)
    assert resumed.status == "successful", resumed.stderr[-5000:]
    return root, cfg, failed.run, resumed.run


def _parent_run(cfg, run):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=cfg["tracking_uri"]).get_run(run["start"].task["ctx"].data.parent_run_id)


def _child_runs(cfg, run) -> dict:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=cfg["tracking_uri"])
    parent_id = run["start"].task["ctx"].data.parent_run_id
    return {r.data.tags["grpo.stage"]: r for r in client.search_runs(
        [client.get_run(parent_id).info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")}


def test_resume_clones_finished_steps_and_continues_the_failed_one(crashed_and_resumed):
    _, _, first, run = crashed_and_resumed
    assert run.origin_pathspec == f"GRPOFlow/{first.id}"
    for s in ("start", "load_sft", "curriculum_grpo"):
        assert run[s].task.metadata_dict.get("origin-task-id"), f"{s} was re-executed"
    assert "origin-task-id" not in run["gsm8k_grpo"].task.metadata_dict
    summary = run["gsm8k_grpo"].task["gsm8k"].data
    assert summary["resumed_from_iteration"] == 2 and summary["iterations_run"] == 4
    assert summary["model_uri"].startswith(str(crashed_and_resumed[0] / "store" / "GRPOFlow" / run.id))


@pytest.fixture(scope="module")
def uninterrupted(crashed_and_resumed):
    """The crashed run's config, run through without a crash (1 node, 2 ranks)."""
    root, cfg, _, _ = crashed_and_resumed
    straight = run_flow(root, cfg)
    assert straight.status == "successful", straight.stderr[-5000:]
    return straight.run


def test_resumed_weights_equal_an_uninterrupted_run(crashed_and_resumed, uninterrupted):
    resumed = crashed_and_resumed[3]
    assert final_model_dir(uninterrupted) != final_model_dir(resumed)
    assert same_weights(final_model_dir(uninterrupted), final_model_dir(resumed))


def test_a_two_node_gang_killed_and_resumed_trains_the_weights_one_node_does(crashed_and_resumed, uninterrupted):
    """compute.nodes = 2 with one rank each: every training step is a @parallel gang of two
    tasks, each running torchrun --nnodes=2 with its node_rank, meeting on 127.0.0.1. Both
    ranks SIGKILL themselves in gsm8k iteration 4; `resume` reruns the whole gang step, which
    continues from the iteration-2 checkpoint. Ranks, data split and reductions are the
    one-node 2-rank run's, so the final weights equal its uninterrupted run's bitwise."""
    root, cfg, _, _ = crashed_and_resumed
    gang_cfg = deep_merge(cfg, {"compute": {"nodes": 2, "nproc_per_node": 1, "rdzv_port": free_port()}})
    failed = run_flow(root, gang_cfg, GRPO_TEST_KILL_ON_CALL="4")
    assert failed.status == "failed", failed.stdout[-3000:]
    resumed = run_flow(root, gang_cfg, resume_from=failed.run.id)
    assert resumed.status == "successful", resumed.stderr[-5000:]
    run = resumed.run
    assert run["curriculum_grpo"].task.metadata_dict.get("origin-task-id")  # cloned, not rerun
    for step in TRAINING_STEPS:
        tasks = list(run[step])
        assert len(tasks) == 2, step
        assert sorted("node_index" in t[step.removesuffix("_grpo")].data for t in tasks) == [False, True], step
    summary = run["join_gsm8k"].task["gsm8k"].data
    assert summary["resumed_from_iteration"] == 2 and summary["iterations_run"] == 4
    assert summary["model_uri"].startswith(str(root / "store" / "GRPOFlow" / run.id))
    assert same_weights(final_model_dir(uninterrupted), Path(summary["model_uri"]))


def test_mlflow_records_every_stage_without_duplicate_steps(crashed_and_resumed):
    from mlflow import MlflowClient

    root, cfg, _, run = crashed_and_resumed
    client = MlflowClient(tracking_uri=cfg["tracking_uri"])
    parent_id = run["start"].task["ctx"].data.parent_run_id
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["metaflow.run_id"] != run.id  # created by the origin run's start, reused
    assert parent.data.tags["grpo.config"] == "tiny" and "git.commit" in parent.data.tags
    children = {r.data.tags["grpo.stage"]: r for r in client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")}
    assert {"load_sft", "curriculum", "gsm8k", "evaluate", "register"} <= set(children)
    assert children["gsm8k"].info.status == "FINISHED"  # FAILED by the crash, reopened by the resume
    steps = [m.step for m in client.get_metric_history(children["gsm8k"].info.run_id, "reward")]
    assert steps == [1, 2, 3, 4], steps  # iteration 3 ran twice, but was logged once
    gsm = children["gsm8k"]
    assert gsm.data.params["loss.type"] == "dapo" and "objective.normaliser" in gsm.data.params
    assert {d.dataset.name for d in gsm.inputs.dataset_inputs} == {"gsm8k_train"}  # no eval_every, no gate
    curriculum_data = {d.dataset.name for d in children["curriculum"].inputs.dataset_inputs}
    assert curriculum_data == {"arithmetic_train", "arithmetic_validation"}
    assert children["curriculum"].data.metrics["reward_trend/window"] >= 1
    ev = children["evaluate"].data.metrics
    results = run["join_evaluations"].task["results"].data
    for r in results:  # each stage's logged accuracy is the share of its items graded correct
        for name, items in r["items"].items():
            k = sum(bool(i["correct"]) for i in items)
            assert ev[f"eval/{name}/{r['stage']}/accuracy"] == pytest.approx(k / len(items)), (r["stage"], name)
    final_items = results[-1]["items"]["gsm8k_test"]  # the unqualified figures are the shipped model's
    k, n = sum(bool(i["correct"]) for i in final_items), len(final_items)
    acc = "eval/gsm8k_test/accuracy"
    assert ev[acc] == pytest.approx(k / n)
    assert (ev[f"{acc}_ci_low"], ev[f"{acc}_ci_high"]) == pytest.approx(wilson_interval(k, n))
    assert "eval/arithmetic_test/sft/accuracy" in ev
    version = client.get_model_version("grpo-gsm8k", run["register"].task["registry"].data["version"])
    assert version.tags["grpo.config"] == "tiny"


def test_end_prints_stage_table_and_reward_trend(crashed_and_resumed):
    *_, run = crashed_and_resumed
    out = run["end"].task.stdout
    assert "arithmetic_test" in out and "gsm8k_test" in out and "95% CI" in out, out
    assert "curriculum GRPO: " in out and "means of the first/last" in out, out


def test_evaluation_keeps_per_item_results_for_every_stage(crashed_and_resumed):
    _, _, _, run = crashed_and_resumed
    results = run["join_evaluations"].task["results"].data
    assert [r["stage"] for r in results] == ["sft", "curriculum", "gsm8k"]
    for r in results:
        assert len(r["items"]["gsm8k_test"]) == 8 and len(r["items"]["arithmetic_test"]) == 16
        assert {i["item_id"] for i in r["items"]["gsm8k_test"]} == {f"gsm8k_test:{k}" for k in range(8)}
    card = card_data(run["join_evaluations"].task, "evaluation")
    assert "arithmetic_test" in card and "curriculum" in card and "95% Wilson" in card
    training = card_data(run["curriculum_grpo"].task, "training")
    assert "informative" in training and "mean of the first vs last" in training


def card_data(task, card_id: str) -> str:
    """The JSON a Metaflow card embeds (base64 in its self-contained HTML), as text."""
    import base64
    import re

    from metaflow import namespace
    from metaflow.cards import get_cards

    namespace(None)  # the flow ran as user 'pytest'; CI's own user differs
    html = get_cards(task, id=card_id)[0].get()
    blobs = re.findall(r'__MF_DATA__\["[^"]+"\] = "([A-Za-z0-9+/=]+)"', html)
    assert blobs, "card has no embedded data"
    return "".join(base64.b64decode(b).decode() for b in blobs)


def test_s3_storage_run_puts_checkpoints_and_models_on_s3(tmp_path, s3_server):
    """``--datastore s3`` and checkpoints on s3:// against a real S3 API server on loopback.

    Run through the CLI, not the Runner: with the S3 datastore the Runner (metaflow 2.19.39)
    waits on its attribute fifo after the run has finished (seen here; the run itself succeeds).
    """
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", **s3_creds())
    s3.create_bucket(Bucket="mf-bucket")
    cfg = tiny_config(tmp_path, storage_root="s3://mf-bucket/pipeline",
                      gsm8k={"iterations": 2}, curriculum={"iterations": 2})
    env = {**os.environ, **mf_env(tmp_path), **S3_ENV, "METAFLOW_S3_ENDPOINT_URL": s3_server,
           "METAFLOW_DATASTORE_SYSROOT_S3": "s3://mf-bucket/metaflow"}
    out = subprocess.run([sys.executable, FLOW, "--datastore", "s3", "--config-value", "cfg", json.dumps(cfg),
                          "run", "--run-id-file", str(tmp_path / "run_id")], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-5000:]
    run_id = (tmp_path / "run_id").read_text().strip()
    prefix = f"pipeline/GRPOFlow/{run_id}/"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="mf-bucket", Prefix=prefix, MaxKeys=1000)["Contents"]]
    assert f"{prefix}gsm8k_grpo/final/model.safetensors" in keys
    assert f"{prefix}load_sft/model/model.safetensors" in keys
    assert any("gsm8k_grpo/checkpoints/ckpt-000002/manifest.json" in k for k in keys)
    assert s3.list_objects_v2(Bucket="mf-bucket", Prefix="metaflow/GRPOFlow/")["KeyCount"] > 0  # datastore too
    assert re.search(r"registry: grpo-gsm8k v1 -> (promoted|challenger) ", out.stdout + out.stderr), out.stdout[-3000:]
