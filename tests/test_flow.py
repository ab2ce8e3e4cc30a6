"""The Metaflow pipeline for real: Runner API runs, crash + resume, Kubernetes and Argo specs, S3.

Every run uses an isolated METAFLOW_HOME, datastore, MLflow sqlite db and storage root under
a temporary directory, and a tiny config (a few iterations per stage) on the real GSM8K copy.
"""
import json
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from grpo_core.config.pipeline import deep_merge
from grpo_core.config.stages import GRPO_STAGES
from grpo_core.evaluation.stats import wilson_interval
from tests.conftest import S3_ENV, free_port
from tests.helpers import GSM8K_DIR, REPO, require_gsm8k, same_weights

FLOW = str(REPO / "flows" / "grpo_flow.py")
K8S_CFG = str(REPO / "flows" / "configs" / "kubernetes.toml")
TRAINING_STEPS = {s.step for s in GRPO_STAGES}  # the stage table names the flow's training steps
TINY = {
    "name": "tiny",
    "sft": {"steps": 30},
    "curriculum": {"iterations": 2, "prompts_per_iter": 4, "sampling": {"group_size": 4, "max_new_tokens": 12},
                   "checkpoint": {"every": 2}, "validation": {"every": 2, "size": 8}},
    "gsm8k": {"iterations": 4, "prompts_per_iter": 2, "sampling": {"group_size": 4, "max_new_tokens": 12},
              "checkpoint": {"every": 2}, "validation": {"size": 4}},
    "evaluate": {"gsm8k_size": 8, "arithmetic_size": 16, "max_new_tokens": 12},
}

os.environ.setdefault("USERNAME", "pytest")  # Runner resolves the Metaflow user in this process too


def tiny_config(root, **overrides) -> dict:
    """The tiny pipeline config for a flow run; a flow run reads GSM8K, so the test needs GSM8K_DIR."""
    require_gsm8k()
    with open(REPO / "flows" / "configs" / "tiny.toml", "rb") as f:
        base = tomllib.load(f)
    cfg = deep_merge(base, TINY)
    cfg.update(storage_root=str(root / "store"), tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    return deep_merge(cfg, overrides)


def mf_env(root, **extra) -> dict:
    for d in ("mfhome", "tmp", "work"):
        (root / d).mkdir(parents=True, exist_ok=True)
    env = {"METAFLOW_HOME": str(root / "mfhome"), "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(root),
           "METAFLOW_DEFAULT_DATASTORE": "local", "METAFLOW_DEFAULT_METADATA": "local",
           "USERNAME": "pytest", "METAFLOW_TEMPDIR": str(root / "tmp"), "GSM8K_DIR": str(GSM8K_DIR),
           "GRPO_WORK_DIR": str(root / "work"), "PYTHONPATH": str(REPO)}
    return {**env, **extra}


@dataclass
class FlowResult:
    """What a Runner call left: read inside the Runner block, since closing the Runner deletes
    the files its ``stdout``/``stderr`` read from (a failing assert must still show them)."""
    status: str
    run: object
    stdout: str
    stderr: str


def run_flow(root, cfg: dict, resume_from: str | None = None, datastore: str = "local",
             **env_extra) -> FlowResult:
    from metaflow import Runner

    env = mf_env(root, **env_extra)
    opts = dict(show_output=False, env=env, cwd=str(root), datastore=datastore, file_read_timeout=900)
    config = {} if resume_from else {"config_value": [("cfg", cfg)]}  # resume reuses the origin's
    with Runner(FLOW, **config, **opts) as r:
        done = r.resume(origin_run_id=resume_from) if resume_from else r.run()
        return FlowResult(done.status, done.run, done.stdout, done.stderr)


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


def test_evaluation_results_are_put_in_stage_order():
    """The join may hand the foreach results in any order; the last must be the shipped model's."""
    from grpo_core.pipeline.evaluation_step import in_stage_order

    got = in_stage_order([{"stage": "gsm8k"}, {"stage": "sft"}, {"stage": "curriculum"}])
    assert [r["stage"] for r in got] == ["sft", "curriculum", "gsm8k"]


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


def _output_raw(root, *cfg_args, env_extra=None):
    env = {**os.environ, **mf_env(root), "METAFLOW_DATASTORE_SYSROOT_S3": "s3://ci-bucket/metaflow",
           **(env_extra or {})}
    out = subprocess.run([sys.executable, FLOW, "--datastore", "s3", *cfg_args, "output-raw", "--json"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)["graph"]


def test_kubernetes_config_puts_gpus_on_exactly_the_training_and_evaluation_steps(tmp_path):
    graph = _output_raw(tmp_path, "--config", "cfg", K8S_CFG)
    with open(K8S_CFG, "rb") as f:
        compute = tomllib.load(f)["compute"]
    for name, node in graph.items():
        decos = {d["name"]: d["attributes"] for d in node.get("decorators", [])}
        if name in TRAINING_STEPS | {"evaluate"}:
            k = decos["kubernetes"]
            assert int(k["gpu"]) == (compute["gpu"] if name in TRAINING_STEPS else 1), name
            assert ("parallel" in decos) == (name in TRAINING_STEPS), name
            if name in TRAINING_STEPS:  # the gang's rendezvous port, opened on its pods
                assert int(k["port"]) == compute["rdzv_port"], name
            assert k["image"] == compute["image"] and k["service_account"] == compute["service_account"]
        else:
            assert "kubernetes" not in decos, name


def test_a_launcher_storage_root_override_reaches_the_pods(tmp_path):
    """The TOML keeps a local storage_root, the launcher exports an s3:// GRPO_STORAGE_ROOT: each
    pod step gets it through @environment (its config validation would refuse the local root)."""
    with open(K8S_CFG, "rb") as f:
        text = f.read().decode().replace('storage_root = "s3://grpo-artifacts/pipeline"',
                                         'storage_root = ".grpo/artifacts"')
    local_root = tmp_path / "k8s_local_root.toml"
    local_root.write_text(text)
    graph = _output_raw(tmp_path, "--config", "cfg", str(local_root),
                        env_extra={"GRPO_STORAGE_ROOT": "s3://other-bucket/pipeline"})
    for name, node in graph.items():
        decos = {d["name"]: d["attributes"] for d in node.get("decorators", [])}
        if "kubernetes" in decos:
            assert decos["environment"]["vars"] == {"GRPO_STORAGE_ROOT": "s3://other-bucket/pipeline"}, name
    assert {n for n, node in graph.items() if "kubernetes" in {d["name"] for d in node.get("decorators", [])}} == \
        TRAINING_STEPS | {"evaluate"}


def test_local_config_adds_no_kubernetes(tmp_path):
    graph = _output_raw(tmp_path)
    assert all("kubernetes" not in {d["name"] for d in n.get("decorators", [])} for n in graph.values())


def test_argo_spec_requests_gpus_only_for_training_and_evaluation(tmp_path, s3_server):
    import boto3

    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", **_creds()).create_bucket(Bucket="ci-bucket")
    env = {**os.environ, **mf_env(tmp_path), **S3_ENV, "METAFLOW_S3_ENDPOINT_URL": s3_server,
           "METAFLOW_DATASTORE_SYSROOT_S3": "s3://ci-bucket/metaflow", "METAFLOW_KUBERNETES_NAMESPACE": "grpo"}
    out = subprocess.run([sys.executable, FLOW, "--datastore", "s3", "--config", "cfg", K8S_CFG,
                          "argo-workflows", "create", "--only-json"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    spec = json.loads(out.stdout[out.stdout.index("{"):])
    templates = {t["name"].replace("-", "_"): t for t in spec["spec"]["templates"]}
    res = {name: t["container"]["resources"] for name, t in templates.items() if "container" in t}
    assert res["evaluate"]["limits"]["nvidia.com/gpu"] == "1", res["evaluate"]
    for name in ("start", "load_sft", "join_curriculum", "begin_gsm8k", "join_gsm8k", "register", "end"):
        assert "nvidia.com/gpu" not in res[name].get("limits", {}), name
    for name in TRAINING_STEPS:  # a gang: one JobSet, its control pod (node 0) plus nodes - 1 workers
        jobset = _manifest(templates[name]["resource"]["manifest"])
        assert jobset["kind"] == "JobSet" and templates[name]["resource"]["action"] == "create"
        jobs = {j["name"]: j for j in jobset["spec"]["replicatedJobs"]}
        assert set(jobs) == {"control", "worker"} and jobs["control"]["replicas"] == 1
        assert "workerCount" in str(jobs["worker"]["replicas"])  # num_parallel - 1, set when the step starts
        for job in jobs.values():
            pod = job["template"]["spec"]["template"]["spec"]
            (c,) = pod["containers"]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "4", name
            assert c["image"] == "ghcr.io/grpo-pipeline/grpo-train:0.1.0"
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["MF_MASTER_PORT"] == "29400" and env["MF_MASTER_ADDR"].endswith(".grpo.svc.cluster.local")
            assert {"medium": "Memory", "sizeLimit": "16384Mi"} in [v.get("emptyDir") for v in pod["volumes"]]
    # the gang's size: the step before each training step hands Argo num_parallel at run time
    for before, gang in (("load_sft", "curriculum_grpo"), ("begin_gsm8k", "gsm8k_grpo")):
        outputs = {p["name"] for p in templates[before]["outputs"]["parameters"]}
        assert "num-parallel" in outputs, (before, outputs)
        assert gang.replace("_", "-") in json.dumps(templates[f"{before}_foreach_parallel"]["dag"])


def _manifest(text: str) -> dict:
    """A JobSet manifest from an Argo resource template: its ``{{=expr}}`` fields become strings."""
    import yaml

    return yaml.safe_load(re.sub(r"(:\s*)(\{\{=[^\n]*\}\})", lambda m: m.group(1) + json.dumps(m.group(2)), text))


def _creds():
    return {"aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"]}


def test_s3_storage_run_puts_checkpoints_and_models_on_s3(tmp_path, s3_server):
    """``--datastore s3`` and checkpoints on s3:// against a real S3 API server on loopback.

    Run through the CLI, not the Runner: with the S3 datastore the Runner (metaflow 2.19.39)
    waits on its attribute fifo after the run has finished (seen here; the run itself succeeds).
    """
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", **_creds())
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
