"""A GRPO stage as a torchrun job: on one node, or as one node of a multi-node gang.

One node runs ``torchrun --standalone --nproc_per_node=K``. A gang of N nodes (a Metaflow
``@parallel`` step: one task per node) runs, in every task,

    torchrun --nnodes=N --node_rank=<i> --rdzv-backend=static --rdzv-endpoint=<main_ip>:<port>
             --rdzv-id=<run/step> --nproc_per_node=K

so global rank = node_rank * K + local_rank, the same layout a one-node run of N*K ranks has.
Rank 0, on node 0, writes the stage's metrics, samples and summary into node 0's output dir;
the other nodes' tasks only wait for their torchrun to finish. The launching step follows the
stage live (``on_progress``) and fails when any rank fails.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from grpo_core.config.stage import METRICS_FILE, SAMPLES_FILE
from grpo_core.io import storage
from grpo_core.io.paths import subprocess_env


@dataclass(frozen=True)
class Gang:
    """Where this task sits in a multi-node training step (one node: the defaults)."""

    nodes: int = 1
    node_index: int = 0
    main_ip: str = "127.0.0.1"
    port: int = 29400
    rdzv_id: str = "grpo"

    @property
    def leads(self) -> bool:
        """This task's node holds global rank 0 (its output dir gets the stage's results)."""
        return self.node_index == 0


def first_node(results: list[dict]) -> dict:
    """A gang's stage result: the summary node 0 returned (the others return only their index)."""
    found = [r for r in results if "node_index" not in r]
    if len(found) != 1:
        raise RuntimeError(f"expected exactly one stage summary among the gang's {len(results)} tasks, got "
                           f"{len(found)}: {results!r}")
    return found[0]


def torchrun_command(stage_json: str, nproc: int, gang: Gang = Gang()) -> list[str]:
    if gang.nodes == 1:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={gang.nodes}", f"--node_rank={gang.node_index}", "--rdzv-backend=static",
                 f"--rdzv-endpoint={gang.main_ip}:{gang.port}", f"--rdzv-id={gang.rdzv_id}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc}",
            "-m", "grpo_core.train", "--config", stage_json]


def launch_stage(stage_cfg: dict, nproc: int, threads: int, on_progress=None, poll_s: float = 5.0,
                 gang: Gang = Gang()) -> dict:
    """Run this node's part of one GRPO stage under torchrun; a failed rank fails the step.
    Returns summary.json on the leading node, ``{"node_index": i}`` on the others."""
    runtime = stage_cfg["runtime"]
    out = Path(runtime["output_dir"])
    stage_json = out / "stage.json"
    storage.atomic_write_text(stage_json, json.dumps(stage_cfg, indent=1))
    proc = subprocess.Popen(torchrun_command(str(stage_json), nproc, gang), env=subprocess_env(threads))
    report = _ProgressReport(on_progress if gang.leads else None, out)
    try:
        while True:
            try:
                rc = proc.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                report()
    finally:  # the step failing here (Ctrl-C, the task killed) must not leave torchrun training, orphaned
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if rc != 0:
        if gang.leads:
            _mark_failed(runtime.get("tracking_uri"), runtime.get("tracking_run_id"))
        raise RuntimeError(f"stage {runtime['stage']} failed: torchrun exited with {rc} "
                           f"(node {gang.node_index} of {gang.nodes}; see the rank logs above); "
                           "`resume` continues from its last checkpoint")
    if not gang.leads:
        return {"node_index": gang.node_index}
    report()
    return json.loads((out / "summary.json").read_text())


class _ProgressReport:
    """Calls ``on_progress`` with the metrics so far, and with the latest sampled completions
    (``samples=read_samples(out)``) when it takes a ``samples`` parameter. It is a view (the
    live card): one that fails warns once and is not called again; training and the step go on
    (Ctrl-C still stops them)."""

    def __init__(self, on_progress, out: Path):
        self.on_progress, self.out, self.failed = on_progress, out, False
        self.with_samples = _takes_samples(on_progress)

    def __call__(self) -> None:
        if not self.on_progress or self.failed:
            return
        try:
            extra = {"samples": read_samples(self.out)} if self.with_samples else {}
            self.on_progress(read_metrics(self.out), **extra)
        except Exception as exc:
            from grpo_core.tracking.runs import warn

            warn(f"live progress update failed ({type(exc).__name__}: {exc}); training goes on")
            self.failed = True


def _mark_failed(tracking_uri: str | None, run_id: str | None) -> None:
    """The failed stage's MLflow run and its parent (the pipeline run) show FAILED, not RUNNING
    forever; a ``resume`` sets both back to RUNNING (``start_child_run``)."""
    if not (tracking_uri and run_id):
        return
    from grpo_core.tracking.runs import finish_run, mlflow_client, warn

    try:
        finish_run(tracking_uri, run_id, "FAILED")
        parent = mlflow_client(tracking_uri).get_run(run_id).data.tags.get("mlflow.parentRunId")
        if parent:
            finish_run(tracking_uri, parent, "FAILED")
    except Exception as exc:  # the stage's own error is what the user needs to see
        warn(f"could not mark run {run_id} FAILED: {exc}")


def read_metrics(out_dir: str | Path) -> list[dict]:
    """The stage's rows so far. Read while the trainer appends: text after the last newline may
    be a row half written, so only complete lines count."""
    f = Path(out_dir) / METRICS_FILE
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().split("\n")[:-1] if line.strip()]


def read_samples(out_dir: str | Path) -> dict | None:
    """The latest sampled completions the trainer logged (``{"iteration", "samples": [{"prompt",
    "completion", "reward"}]}``, replaced atomically), or None before the first."""
    f = Path(out_dir) / SAMPLES_FILE
    return json.loads(f.read_text()) if f.exists() else None


def _takes_samples(fn) -> bool:
    import inspect

    try:
        return fn is not None and "samples" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature: metrics only
        return False
