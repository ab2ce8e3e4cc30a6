"""What each flow step does, so ``flows/grpo_flow.py`` stays a readable list of steps.

The flow owns orchestration state (Metaflow artifacts: URIs, run ids, small metrics); this
module turns a validated ``PipelineConfig`` plus that state into work: dataset identities,
the MLflow parent/child runs, the bootstrap SFT, a GRPO stage's config (``grpo_core.pipeline.launcher``
runs it under torchrun), evaluation of a checkpoint, registration. Models and checkpoints travel through
storage keyed by ``<storage_root>/<flow>/<run_id>/<step>/``, never as pickled artifacts.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from grpo_core.config import stages
from grpo_core.config.pipeline import PipelineConfig
from grpo_core.data import tasks
from grpo_core.io import storage
from grpo_core.io.paths import PROJECT_DIR

RESUME_CHAIN = "resume_chain.json"  # in a training step's storage: the earlier attempts it resumes from


@dataclass(frozen=True)
class RunContext:
    """Where one Metaflow run keeps its things (plain values, picklable as an artifact)."""

    flow: str
    run_id: str
    origin_run_id: str | None
    storage_root: str
    tracking_uri: str
    parent_run_id: str

    def in_this_process(self, configured: str | None) -> RunContext:
        """This context with the tracking URI as the process running a step sees it.

        Precedence: this process's MLFLOW_TRACKING_URI, then the configured URI, then the one
        ``start`` resolved (the local default's sqlite file). So a training pod never inherits a
        workstation-only address that ``start`` saw (a port-forwarded ``localhost``): it uses
        its own environment or the configured in-cluster URI.
        """
        from grpo_core.tracking.runs import resolve_tracking_uri

        return replace(self, tracking_uri=resolve_tracking_uri(configured, str(PROJECT_DIR),
                                                               fallback=self.tracking_uri))

    def step_uri(self, step: str, run_id: str | None = None) -> str:
        return storage.join(self.storage_root, self.flow, run_id or self.run_id, step)

    def scratch(self, step: str) -> Path:
        p = Path(work_root()) / self.flow / self.run_id / step
        p.mkdir(parents=True, exist_ok=True)
        return p


def work_root() -> str:
    """Local scratch for a step (metrics, checkpoints before upload): GRPO_WORK_DIR or .grpo/work."""
    return os.environ.get("GRPO_WORK_DIR") or str(PROJECT_DIR / ".grpo" / "work")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_DIR, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def storage_root(cfg: PipelineConfig) -> str:
    root = os.environ.get("GRPO_STORAGE_ROOT") or cfg.storage_root
    if storage.is_s3(root) or os.path.isabs(root):
        return root
    return str(PROJECT_DIR / root)



def dataset_identities(cfg: PipelineConfig) -> dict:
    """Source, split, digest and the params read, of every split of every stage's task, named
    ``<task>_<split>``, and of every bounded evaluation set (``gsm8k_test_le2``); fails fast,
    naming the dataset, if one cannot be read. Train and validation are read with the stage's
    params (its difficulty bound included); a test set with its own bound (none: unbounded)."""
    out = {}
    for s in stages.GRPO_STAGES:
        task = tasks.task(s.task)
        params = task.params_of(cfg.stage(s.name, model="-"))
        for split in tasks.SPLITS:
            read = params if split != "test" else tasks.bounded_params(task, params, 0)
            out[tasks.dataset_name(s.task, split)] = _identity(task, tasks.dataset_name(s.task, split), split, read)
        for name in cfg.eval_set_names():
            named, split, bound = tasks.parse_dataset_name(name)
            if named.name == s.task and bound:
                out[name] = _identity(task, name, split, tasks.bounded_params(task, params, bound))
    local = sorted({d["source"] for d in out.values() if Path(d["source"]).is_dir()})
    if cfg.compute.backend == "kubernetes" and local:
        from grpo_core.tracking.runs import warn
        warn(f"datasets are read from {local}, directories on this machine; training and evaluation pods "
             "read the same paths and fail unless their image holds the data there (for GSM8K, unset "
             "GSM8K_DIR to use the hub).")
    return out


def _identity(task, name: str, split: str, params: dict) -> dict:
    try:
        return {**task.identity(split, **params), "params": params}
    except Exception as exc:
        raise RuntimeError(f"{name} could not be read ({type(exc).__name__}: {exc}). {task.unreadable_hint}"
                           .strip()) from exc


def open_tracking(cfg: PipelineConfig, tags: dict, run_name: str) -> tuple[str, str]:
    """Resolve the tracking URI and create the MLflow parent run; returns (uri, run_id)."""
    from grpo_core.tracking.logger import open_tracker
    from grpo_core.tracking.runs import resolve_tracking_uri, start_parent_run

    uri = resolve_tracking_uri(cfg.tracking_uri, str(PROJECT_DIR))
    if cfg.compute.backend == "kubernetes" and not uri.startswith(("http://", "https://", "databricks")):
        raise RuntimeError(f"compute.backend = 'kubernetes' but the MLflow tracking URI is {uri!r}: training "
                           "pods cannot reach a file or sqlite store on this machine, and their points would "
                           "be lost. Set tracking_uri (or MLFLOW_TRACKING_URI) to the in-cluster MLflow server.")
    run_id = start_parent_run(uri, cfg.experiment, tags, run_name=run_name)
    with open_tracker(uri, run_id) as t:
        t.log_params(cfg.to_dict())
    return uri, run_id


def child_run(ctx: RunContext, stage: str, datasets: dict | None = None, names=()) -> str:
    from grpo_core.tracking.runs import log_dataset, start_child_run

    run_id = start_child_run(ctx.tracking_uri, ctx.parent_run_id, stage, {"grpo.metaflow_run": ctx.run_id})
    for name in names:
        d = datasets[name]
        split = tasks.split_of(name)[1]
        context = {"train": "training", "validation": "validation", "test": "evaluation"}[split]
        log_dataset(ctx.tracking_uri, run_id, name, d["source"], d["digest"], d["split"], context=context)
    return run_id


def load_sft(cfg: PipelineConfig, ctx: RunContext, datasets: dict) -> tuple[str, dict]:
    """The SFT checkpoint URI and what identifies it: bootstrap it here; convert a GGUF source
    (a ``.gguf`` file or a packaged name) once into ``<storage_root>/models/gguf/<sha256>``,
    recording ``sft_source``/``sft_sha256`` on the load_sft child run; or pass a hub id / dir /
    s3:// through."""
    from grpo_core.io import gguf
    from grpo_core.tracking.logger import open_tracker

    if gguf.is_gguf_source(cfg.sft.source):
        done = gguf.convert_gguf(cfg.sft.source, storage.join(storage_root(cfg), "models"))
        record = {"sft_source": done["source"], "sft_sha256": done["sha256"]}
        with open_tracker(ctx.tracking_uri, child_run(ctx, "load_sft")) as t:
            t.log_params({**record, "sft_uri": done["uri"]})
        return done["uri"], record
    if cfg.sft.source != "bootstrap":
        return cfg.sft.source, {"sft_source": cfg.sft.source}
    import torch

    from grpo_core.pipeline.sft import bootstrap

    torch.set_num_threads(max(os.cpu_count() or 1, 1))
    local = ctx.scratch("load_sft") / "model"
    metrics = bootstrap(cfg.sft, local, gsm8k=datasets["gsm8k_train"]["source"])
    uri = storage.put_dir(local, storage.join(ctx.step_uri("load_sft"), "model"))
    with open_tracker(ctx.tracking_uri, child_run(ctx, "load_sft")) as t:
        t.log_params(cfg.sft.__dict__)
        t.log(metrics, step=cfg.sft.steps)
    return uri, metrics


def sft_model_tags(cfg: PipelineConfig, ctx: RunContext) -> dict:
    """Registry tags naming the start model: ``model.source``, and for a GGUF source
    ``model.sha256``, as ``load_sft`` returned and logged them (the params of its child run)."""
    from grpo_core.io import gguf
    from grpo_core.tracking.runs import mlflow_client, warn

    if not gguf.is_gguf_source(cfg.sft.source):
        return {"model.source": cfg.sft.source}
    client = mlflow_client(ctx.tracking_uri)
    found = client.search_runs([client.get_run(ctx.parent_run_id).info.experiment_id], max_results=1,
                               filter_string=f"tags.mlflow.parentRunId = '{ctx.parent_run_id}' and "
                                             "tags.`grpo.stage` = 'load_sft'")
    params = found[0].data.params if found else {}
    if "sft_sha256" not in params:
        warn(f"the load_sft run of {ctx.parent_run_id} holds no sft_sha256; the model version gets no model.sha256 tag")
    return {"model.source": params.get("sft_source", cfg.sft.source),
            **({"model.sha256": params["sft_sha256"]} if "sft_sha256" in params else {})}


def stage_config(cfg: PipelineConfig, stage: str, step: str, model_uri: str, ctx: RunContext,
                 datasets: dict, node_index: int = 0) -> dict:
    """The GRPOConfig of a stage with its runtime fields filled in (validated). In a multi-node
    gang, node 0 (global rank 0: the one that logs and saves) opens the stage's MLflow run and
    records the resume chain; the other nodes get the same stage without them, in an output
    dir of their own (gang tasks can share one machine)."""
    task = stages.stage(stage).task
    validated = cfg.stage(stage).reads_validation()
    names = (tasks.dataset_name(task, "train"),) + ((tasks.dataset_name(task, "validation"),) if validated else ())
    resume = [ctx.step_uri(step)] + (resume_chain(ctx.step_uri(step, ctx.origin_run_id)) if ctx.origin_run_id else [])
    out = ctx.scratch(step)
    if node_index == 0:
        storage.write_text(storage.join(ctx.step_uri(step), RESUME_CHAIN), json.dumps(resume[1:]))
        run_id = child_run(ctx, stage, datasets, names)
    else:
        out, run_id = out / f"node-{node_index}", None
        out.mkdir(parents=True, exist_ok=True)
    sc = cfg.stage(stage, model=model_uri, output_dir=str(out), sync_uri=ctx.step_uri(step),
                   resume_from=resume, tracking_uri=ctx.tracking_uri, tracking_run_id=run_id)
    for field_name, value in datasets[names[0]]["params"].items():  # what start fingerprinted: a pod's
        setattr(sc, field_name, value)                                 # environment may lack GSM8K_DIR
    return sc.to_dict()


def resume_chain(origin_uri: str) -> list[str]:
    """The origin run's step storage, then the ones it resumed from in turn: a stage searches them
    all for its newest checkpoint. Each attempt records its chain, so a resume of a resume whose
    middle attempt failed before holding a complete checkpoint (killed while copying one over)
    still finds the first attempt's."""
    recorded = storage.read_text(storage.join(origin_uri, RESUME_CHAIN))
    return [origin_uri] + (json.loads(recorded) if recorded else [])


def stage_system_prompt(cfg: PipelineConfig, stage: str) -> str | None:
    """The system prompt a checkpoint is evaluated and served with: its stage's; the start model
    takes the first GRPO stage's, so the start row and that stage see the same prompts."""
    return getattr(cfg, "curriculum" if stage == "sft" else stage).get("system_prompt")


def register(cfg: PipelineConfig, ctx: RunContext, final: dict, datasets: dict, pathspec: str,
             start: dict | None = None) -> dict:
    """Register the final model and decide champion/challenger on the same items; ``start``: the
    start model's evaluation, which a first version must beat to become champion."""
    from grpo_core.tracking.registry import register_model

    run_id = child_run(ctx, "register")
    model_dir = storage.get_dir(final["model_uri"], Path(tempfile.mkdtemp(prefix="grpo_register_")))
    r = cfg.register
    tags = {"metaflow.pathspec": pathspec, "grpo.config": cfg.name,
            **{f"dataset.{k}.digest": v["digest"] for k, v in datasets.items()}, **sft_model_tags(cfg, ctx)}
    result = register_model(ctx.tracking_uri, run_id, str(model_dir), r.model_name, eval_items=final["items"],
                            primary=r.primary, tags=tags, rule=r.rule, alpha=r.alpha,
                            max_new_tokens=cfg.evaluate.budget(r.primary),
                            system_prompt=stage_system_prompt(cfg, final["stage"]),
                            baseline_items=start["items"].get(r.primary) if start else None)
    from grpo_core.tracking.runs import mlflow_client

    result["description"] = version_description(result, final, start)
    mlflow_client(ctx.tracking_uri).update_model_version(r.model_name, result["version"], result["description"])
    return result


def version_description(decision: dict, final: dict, start: dict | None) -> str:
    """One line for the registry: the decision and on which items, then every evaluated set's
    change against the start model on the same items (greedy, and sampled mean@k), with its p
    (``final``'s ``vs_start`` / ``sampled_vs_start``, from ``evaluation_step.paired_with_start``)."""
    head = (f"{decision['decision']} on {decision.get('eval_set')} ({decision.get('compared_items')} items; "
            f"{decision.get('reason')})")
    parts = []
    for name, vs in final.get("vs_start", {}).items():
        before, after = start["summary"][name], final["summary"][name]
        parts.append(f"{name} greedy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
                     f"(p={vs['p_value']:.2g}, {after['n']} items)")
    for name, vs in final.get("sampled_vs_start", {}).items():
        before, after = start["sampled_summary"][name], final["sampled_summary"][name]
        parts.append(f"{name} mean@{after['k']} {before['mean_at_k']:.3f} -> {after['mean_at_k']:.3f} "
                     f"(p={vs['p_value']:.2g}, {after['n']} items)")
    if start is None or not parts:
        return head
    return f"{head}. Against the start model ({start.get('stage', 'sft')}): " + "; ".join(parts)


def replay_tracking(tracking_uri: str, summaries: list[dict]) -> int:
    """Send the points a stage could not (MLflow was down at its last flush; the stage kept them
    beside its checkpoints, ``tracking_pending_uri``). A training pod's scratch dies with it, so
    this runs in a later step. Replaying twice stores each point once (fixed timestamps).
    Returns the number of metric points sent; on failure warns and leaves the file for later."""
    from grpo_core.tracking.logger import MlflowTracker
    from grpo_core.tracking.runs import warn

    sent = 0
    for s in summaries:
        uri = s.get("tracking_pending_uri")
        text = storage.read_text(uri) if uri else None
        if not text:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            spill = Path(tmp) / "pending_metrics.jsonl"
            spill.write_text(text)
            tracker = MlflowTracker(tracking_uri, s["tracking_run_id"], spill_path=str(spill))
            points = tracker.delayed_points
            if tracker.flush():
                sent += points
            else:
                warn(f"MLflow still unreachable: {points} points of stage {s.get('stage')} stay in {uri}")
    return sent


def finish(ctx: RunContext, status: str = "FINISHED") -> None:
    from grpo_core.tracking.runs import finish_run, mlflow_client

    client = mlflow_client(ctx.tracking_uri)
    parent = client.get_run(ctx.parent_run_id)
    for run in client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{ctx.parent_run_id}'"):
        finish_run(ctx.tracking_uri, run.info.run_id, status)
    finish_run(ctx.tracking_uri, ctx.parent_run_id, status)
