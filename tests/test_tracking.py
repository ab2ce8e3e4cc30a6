"""Tracking against a real MLflow server and the sqlite default; outage and recovery."""

from __future__ import annotations

import json
import signal

import pytest

from grpo_core.tracking.logger import MlflowTracker, Tracker, open_tracker
from grpo_core.tracking.runs import (
    finish_run,
    flatten_params,
    log_dataset,
    plot_curves,
    resolve_tracking_uri,
    start_child_run,
    start_parent_run,
)

pytestmark = pytest.mark.usefixtures("no_cwd_writes")  # MLflow must never fall back to the cwd

FAKE_SECRET = "wJalrXUtnFEMI-fake-secret"
CONFIG = {
    "train": {"lr": 1e-6, "max_new_tokens": 256, "tokenizer": "char"},
    "storage": {"aws": {"AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "region": "us-east-1"},
                "hf_token": "hf_fake_token_123", "apiKey": "k-123"},
    "tracking_uri": "http://alice:hunter2pass@mlflow.example:5000",
}


@pytest.fixture(params=["server", "sqlite"])
def uri(request):
    """Every run-level test runs against both backends."""
    return request.getfixturevalue("mlflow_server" if request.param == "server" else "sqlite_uri")


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


# ---------------------------------------------------------------- pure helpers


def test_resolve_tracking_uri_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    default = resolve_tracking_uri(None, str(tmp_path / "proj"))
    assert default == f"sqlite:///{tmp_path}/proj/.grpo/mlflow/mlflow.db"
    assert (tmp_path / "proj/.grpo/mlflow").is_dir()
    assert resolve_tracking_uri("http://cfg:5000", str(tmp_path)) == "http://cfg:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert resolve_tracking_uri("http://cfg:5000", str(tmp_path)) == "http://env:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:./mlruns")
    with pytest.raises(ValueError, match="file-store"):
        resolve_tracking_uri(None, str(tmp_path))


def test_flatten_params_redacts_credentials():
    flat = flatten_params(CONFIG)
    assert flat["train.lr"] == "1e-06"
    assert flat["train.max_new_tokens"] == "256"  # "tokens" is not "token"
    assert flat["train.tokenizer"] == "char"
    assert flat["storage.aws.AWS_SECRET_ACCESS_KEY"] == "***"
    assert flat["storage.hf_token"] == "***" and flat["storage.apiKey"] == "***"
    assert flat["storage.aws.region"] == "us-east-1"
    assert flat["tracking_uri"] == "http://***@mlflow.example:5000"
    assert flatten_params({"long": "x" * 7000})["long"] == "x" * 6000


def test_open_tracker_is_noop_off_rank_zero():
    for t in (open_tracker(None, None), open_tracker("http://x", "r", rank=1), Tracker()):
        assert type(t) is Tracker
        t.log({"a": 1.0}, step=0)
        assert t.flush() is True
        t.close()


def test_plot_curves(tmp_path):
    rows = [{"step": i, "reward": i / 10, "kl": 0.01 * i, "informative_frac": 0.5} for i in range(6)]
    rows.append({"step": 6, "eval_accuracy": 0.4})
    src = tmp_path / "metrics.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_curves(str(src), str(tmp_path / "plots" / "curves.png"), keys=("reward", "kl", "missing"))
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert open(plot_curves(str(empty), str(tmp_path / "e.png")), "rb").read(4) == b"\x89PNG"


# ---------------------------------------------------------------- runs, both backends


def test_parent_and_idempotent_child_runs(uri):
    parent = start_parent_run(uri, "grpo-test", {"metaflow.pathspec": "GrpoFlow/1", "cfg": CONFIG},
                              run_name="GrpoFlow-1")
    child = start_child_run(uri, parent, "curriculum", tags={"world_size": 2})
    other = start_child_run(uri, parent, "gsm8k")
    finish_run(uri, child)
    again = start_child_run(uri, parent, "curriculum")  # a resumed step re-opens its run
    assert again == child and other != child

    client = _client(uri)
    run = client.get_run(child)
    assert run.info.status == "RUNNING"
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.tags["grpo.stage"] == "curriculum" and run.data.tags["world_size"] == "2"
    tags = client.get_run(parent).data.tags
    assert tags["metaflow.pathspec"] == "GrpoFlow/1" and tags["cfg.storage.hf_token"] == "***"
    assert not any(FAKE_SECRET in v or "hunter2" in v for v in tags.values())
    finish_run(uri, parent, "FAILED")
    assert client.get_run(parent).info.status == "FAILED"
    start_child_run(uri, parent, "gsm8k")  # a resumed stage re-opens the pipeline run as well
    assert client.get_run(parent).info.status == "RUNNING"


def test_tracker_metrics_params_dataset_artifacts(uri, tmp_path, capsys):
    run_id = start_parent_run(uri, "grpo-test", {})
    tracker = MlflowTracker(uri, run_id)
    for step in range(600):  # 1200 points: two log_batch calls
        tracker.log({"reward": step / 600, "kl": 0.001 * step}, step=step)
    assert _client(uri).get_metric_history(run_id, "reward") == []  # buffered until flush
    assert tracker.flush() is True
    assert tracker.flush() is True  # nothing left: no duplicates
    tracker.log_params(CONFIG)
    tracker.set_tags({"source": "s3://key:secret@bucket/x"})
    art = tmp_path / "objective.json"
    art.write_text('{"loss": "grpo"}')
    tracker.log_artifact(str(art))
    tracker.log_dict({"samples": ["a", "b"]}, "samples/iter_3.json")
    log_dataset(uri, run_id, "gsm8k", "openai/gsm8k", "d1g3st", "train")
    log_dataset(uri, run_id, "arith", str(art), "abc", "holdout", context="eval")
    tracker.close()

    client = _client(uri)
    hist = sorted(client.get_metric_history(run_id, "reward"), key=lambda m: m.step)
    assert [m.step for m in hist] == list(range(600))
    assert hist[300].value == pytest.approx(0.5)
    run = client.get_run(run_id)
    params = run.data.params
    assert params["train.max_new_tokens"] == "256" and params["storage.aws.AWS_SECRET_ACCESS_KEY"] == "***"
    assert params["tracking_uri"] == "http://***@mlflow.example:5000"
    everything = json.dumps([params, run.data.tags])
    assert FAKE_SECRET not in everything and "hunter2" not in everything and "key:secret" not in everything
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert inputs["gsm8k"].dataset.digest == "d1g3st" and inputs["gsm8k"].dataset.source_type == "hugging_face"
    ctx = {t.key: t.value for t in inputs["arith"].tags}
    assert ctx["mlflow.data.context"] == "eval" and ctx["grpo.split"] == "holdout"
    paths = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "samples")}
    assert {"objective.json", "samples/iter_3.json"} <= paths
    assert "WARNING" not in capsys.readouterr().err

    again = MlflowTracker(uri, run_id)  # MLflow params are immutable: a 4xx, dropped, no raise
    again.log_params({"train": {"lr": 5.0}})
    assert "rejected by the server" in capsys.readouterr().err
    assert again.flush() is True and client.get_run(run_id).data.params["train.lr"] == "1e-06"


def test_log_table_writes_a_table_mlflow_reads_once(sqlite_uri):
    """Sampled completions as an MLflow table: ``mlflow.load_table`` reads it back; a resumed stage
    logging the same iteration again adds no second copy of its rows (MLflow's log_table appends)."""
    run_id = start_parent_run(sqlite_uri, "grpo-test", {})
    table = {"iteration": [10, 10], "prompt": ["1+1?", "2+2?"], "completion": ["<answer>2</answer>", "5"],
             "reward": [1.0, 0.0]}
    tracker = MlflowTracker(sqlite_uri, run_id)
    tracker.log_table(table, "samples/iter_000010_table.json")
    tracker.log_table(table, "samples/iter_000010_table.json")
    tracker.close()
    Tracker().log_table(table, "samples/iter_000010_table.json")  # the no-op tracker takes it too
    run = _client(sqlite_uri).get_run(run_id)
    assert _load_table(sqlite_uri, run, "samples/iter_000010_table.json").to_dict("list") == table
    logged = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert {"path": "samples/iter_000010_table.json", "type": "table"} in logged  # the UI lists it as a table


def _load_table(uri, run, artifact_file):
    """``mlflow.load_table`` as a user calls it: it searches the runs with the process-wide
    tracking URI and experiment (MlflowClient.load_table does too, whatever client it is on)."""
    import mlflow

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("MLFLOW_EXPERIMENT_ID", run.info.experiment_id)
        return mlflow.load_table(artifact_file, run_ids=[run.info.run_id])


# ---------------------------------------------------------------- outage


def _steps(uri, run_id, key="reward"):
    return sorted(m.step for m in _client(uri).get_metric_history(run_id, key))


def test_outage_delays_points_then_sends_each_once(mlflow_servers, tmp_path, capsys):
    """Kill the server mid-run: nothing raises, points wait, and arrive exactly once."""
    srv = mlflow_servers()
    run_id = start_parent_run(srv.url, "outage", {})
    spill = tmp_path / "pending_metrics.jsonl"
    fast = dict(max_retries=1, backoff_s=0.05, spill_path=str(spill))
    t1 = MlflowTracker(srv.url, run_id, **fast)
    for step in range(5):
        t1.log({"reward": float(step)}, step)
    assert t1.flush() is True

    srv.stop(signal.SIGKILL)  # a crash, not a clean shutdown
    for step in range(5, 10):
        t1.log({"reward": float(step)}, step)
    assert t1.flush() is False
    assert t1.delayed_points == 5
    t1.log_params({"lr": 0.1})
    for step in range(10, 15):
        t1.log({"reward": float(step)}, step)
    t1.close()  # still down: spills points 5..14 and the param
    err = capsys.readouterr().err
    assert "5 metric points delayed" in err and f"to {spill}" in err
    assert t1.delayed_points == 10
    assert len(spill.read_text().splitlines()) == 11

    srv2 = mlflow_servers(port=srv.port, db=tmp_path / "srv" / "mlflow.db")
    t2 = MlflowTracker(srv2.url, run_id, spill_path=str(spill))  # a resumed process replays
    assert t2.delayed_points == 10
    assert t2.flush() is True and not spill.exists()
    assert "flushed 10 delayed points" in capsys.readouterr().err
    assert _steps(srv2.url, run_id) == list(range(15))
    assert _client(srv2.url).get_run(run_id).data.params["lr"] == "0.1"
    # The crashed process's buffer resent: same timestamps, so the store keeps one copy.
    assert t1.flush() is True
    assert "flushed 10 delayed points" in capsys.readouterr().err
    assert _steps(srv2.url, run_id) == list(range(15))


def test_known_outage_costs_one_probe_per_call_not_a_full_backoff(mlflow_server):
    """After retries are exhausted once, later calls try once: a long outage must not stall
    rank 0 for the whole backoff (~15 s) at every checkpoint flush."""
    tracker = MlflowTracker(mlflow_server, start_parent_run(mlflow_server, "probe", {}),
                            max_retries=3, backoff_s=0.001)
    tries = []

    def unreachable():
        tries.append(1)
        raise ConnectionError("connection refused")

    assert tracker._call("metrics", unreachable) == "down" and len(tries) == 4
    assert tracker._call("metrics", unreachable) == "down" and len(tries) == 5
    assert tracker._call("metrics", lambda: None) == "ok"  # the server is back: full retries again
    assert tracker._call("metrics", unreachable) == "down" and len(tries) == 9


def test_a_rerun_of_the_evaluation_logging_adds_no_second_point(sqlite_uri):
    """join_evaluations run again (its task failed after logging): every accuracy stays one point."""
    from grpo_core.pipeline.evaluation_step import log_evaluation
    from grpo_core.pipeline.steps import RunContext
    from grpo_core.tracking.runs import start_parent_run

    parent = start_parent_run(sqlite_uri, "rerun", {"grpo.config": "t"})
    ctx = RunContext("F", "1", None, "/tmp/unused", sqlite_uri, parent)
    datasets = {"arithmetic_test": {"source": "arithmetic:+-*:0..20", "split": "test", "digest": "d"}}
    summary = lambda acc: {"arithmetic_test": {"accuracy": acc, "ci_low": 0.1, "ci_high": 0.9, "n": 4}}  # noqa: E731
    results = [{"stage": stage, "summary": summary(acc),
                "items": {"arithmetic_test": [{"item_id": "a", "correct": True}]}}
               for stage, acc in (("sft", 0.25), ("gsm8k", 0.5))]
    for _ in range(2):
        log_evaluation(ctx, results, datasets)
    client = _client(sqlite_uri)
    run = client.search_runs([client.get_run(parent).info.experiment_id], "tags.`grpo.stage` = 'evaluate'")[0]
    for key, value in (("eval/arithmetic_test/sft/accuracy", 0.25), ("eval/arithmetic_test/accuracy", 0.5)):
        assert [m.value for m in client.get_metric_history(run.info.run_id, key)] == [value], key
    items = _load_table(sqlite_uri, run, "eval/gsm8k/items_arithmetic_test_table.json")  # per item, once
    assert list(items.columns) == ["item_id", "correct", "gold", "steps", "truncated", "looped", "capped",
                                   "completion"]
    assert items[["item_id", "correct"]].to_dict("list") == {"item_id": ["a"], "correct": [True]}
