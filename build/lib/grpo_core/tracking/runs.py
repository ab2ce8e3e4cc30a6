"""Experiment tracking: run layout, params and redaction, datasets, and plots.

Layout: one MLflow *parent* run per Metaflow run, one *child* run per stage (``grpo.stage``
tag). Metaflow steps and torchrun ranks are separate processes, so runs are created and
re-opened by id with ``MlflowClient`` (never the fluent active-run stack), and
``start_child_run`` returns the existing child for a stage so a resumed run logs into it.

The buffered, outage-safe metric logger the trainer uses lives in ``tracking_logger``.

mlflow is imported inside functions only: ``import grpo_core`` never imports it (its import
time: benchmarks/NOTES.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from grpo_core.config.checks import check_no_credentials

MAX_PARAM_VALUE = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH in 3.17
MAX_TAG_VALUE = 8000  # MAX_TAG_VAL_LENGTH
MAX_KEY = 250  # MAX_ENTITY_KEY_LENGTH
METRICS_PER_BATCH = 1000  # MAX_METRICS_PER_BATCH: log_batch rejects more
PARAMS_PER_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH
# Our own retry loop owns retries; MLflow's default (7 HTTP retries, backoff factor 2) would
# block a flush for minutes per attempt. Applied only where the user has not set them.
HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
# Words (not substrings: "max_new_tokens" and "tokenizer" are fine) that mark a secret key.
_SECRET_WORDS = {"key", "apikey", "secret", "secrets", "token", "password", "passwd",
                 "credential", "credentials"}
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/@\s]+@")
_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def warn(msg: str) -> None:
    print(f"[tracking] WARNING: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- params and redaction


def _is_secret_key(path: str) -> bool:
    """True if any word of any dotted component names a secret (AWS_SECRET_ACCESS_KEY, apiKey)."""
    return any(w.lower() in _SECRET_WORDS for part in path.split(".") for w in _WORDS.findall(part))


def redact_value(value: str) -> str:
    """Strip userinfo from any URI inside the string: http://u:p@host -> http://***@host."""
    return _USERINFO.sub(r"\1***@", value)


def flatten_params(d: Mapping, prefix: str = "", limit: int = MAX_PARAM_VALUE) -> dict[str, str]:
    """Flatten nested dicts to dotted keys with string values that MLflow accepts.

    Values under secret-looking keys become "***" and URIs lose their credentials, because
    params and tags are readable by everyone with access to the tracking server.
    """
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten_params(v, key + ".", limit))
            continue
        text = "***" if _is_secret_key(key) else redact_value(str(v))
        out[key[:MAX_KEY]] = text[:limit]
    return out


def clean_tags(tags: Mapping | None) -> dict[str, str]:
    return flatten_params(tags or {}, limit=MAX_TAG_VALUE)


# ---------------------------------------------------------------- URIs, experiments, runs


def resolve_tracking_uri(configured: str | None, project_dir: str, fallback: str | None = None) -> str:
    """Env ``MLFLOW_TRACKING_URI`` > configured > ``fallback`` > ``sqlite:///<project>/.grpo/mlflow/mlflow.db``.

    MLflow's own default is a sqlite db and ``mlruns`` in the *cwd*, and its file store raises
    in 3.x, so we never fall back to either. ``fallback`` is a URI resolved earlier (by the
    flow's ``start``) that later steps reuse when neither the env nor the config names one.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI") or configured
    if uri:
        if uri.startswith(("file:", "/", ".")):
            raise ValueError(f"file-store tracking URI {uri!r} is unsupported in MLflow 3; "
                             "use sqlite:///<abs path>.db or an http(s) server")
        check_no_credentials(uri)
        return uri
    if fallback:
        return fallback
    db_dir = Path(project_dir).resolve() / ".grpo" / "mlflow"
    db_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db_dir / 'mlflow.db'}"


def mlflow_client(uri: str):
    """An MlflowClient bound to ``uri`` for tracking and registry (no process-wide state)."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def sqlite_path(uri: str) -> Path | None:
    """The db file of a ``sqlite:///`` URI (relative paths are relative to the cwd), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):]).resolve()


def ensure_experiment(uri: str, name: str, artifact_location: str | None = None) -> str:
    """Get or create the experiment; return its id.

    For sqlite the artifact root is set explicitly to ``<db dir>/artifacts`` (MLflow would
    use ``./mlruns`` of whatever cwd the step runs in). Servers choose their own root.
    """
    from mlflow.exceptions import MlflowException

    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    db = sqlite_path(uri)
    if artifact_location is None and db is not None:
        artifact_location = (db.parent / "artifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as e:  # another process created it first
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def start_parent_run(uri: str, experiment: str, tags: dict, run_name: str | None = None) -> str:
    """Create the parent run of one pipeline run and return its id (left RUNNING)."""
    exp_id = ensure_experiment(uri, experiment)
    return mlflow_client(uri).create_run(exp_id, tags=clean_tags(tags), run_name=run_name).info.run_id


def start_child_run(uri: str, parent_run_id: str, stage: str, tags: dict | None = None) -> str:
    """Return the child run for ``stage`` under the parent, creating it if absent.

    Idempotent so a resumed Metaflow step (new process, same parent id) reuses its run; a
    reused run, and a parent a failed stage marked FAILED, are set back to RUNNING.
    """
    client = mlflow_client(uri)
    parent = client.get_run(parent_run_id)
    if parent.info.status != "RUNNING":
        client.update_run(parent_run_id, status="RUNNING")
    found = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.`grpo.stage` = '{stage}'",
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    if found:
        run_id = found[0].info.run_id
        if found[0].info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        return run_id
    all_tags = {**clean_tags(tags), "mlflow.parentRunId": parent_run_id, "grpo.stage": stage}
    name = f"{parent.info.run_name}/{stage}" if parent.info.run_name else stage
    return client.create_run(parent.info.experiment_id, tags=all_tags, run_name=name).info.run_id


def finish_run(uri: str, run_id: str, status: str = "FINISHED") -> None:
    """Mark a run terminated (FINISHED, FAILED or KILLED)."""
    mlflow_client(uri).set_terminated(run_id, status=status)


def _dataset_source(source: str, split: str | None):
    """Map a source string to an MLflow DatasetSource: hub ids become Hugging Face sources."""
    import warnings

    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    if source.startswith("hf://") or ("://" not in source and not os.path.exists(source)):
        return HuggingFaceDatasetSource(path=source.removeprefix("hf://"), split=split)
    try:
        with warnings.catch_warnings():  # "can be interpreted in multiple ways" is noise
            warnings.simplefilter("ignore")
            return resolve_dataset_source(source)
    except Exception:
        return CodeDatasetSource(tags={"source": source})


def log_dataset(uri: str, run_id: str, name: str, source: str, digest: str, split: str,
                context: str = "training") -> None:
    """Record a dataset as a run input (what ``mlflow.log_input`` does, but by run id)."""
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    ds = MetaDataset(source=_dataset_source(redact_value(source), split), name=name, digest=digest)
    tags = [InputTag("mlflow.data.context", context), InputTag("grpo.split", split)]
    mlflow_client(uri).log_inputs(run_id, [DatasetInput(ds._to_mlflow_entity(), tags=tags)])


@contextlib.contextmanager
def env_defaults(**values: str):
    """Set environment variables the user has not set, for one block (MLflow reads them per call)."""
    ours = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in ours})
    try:
        yield
    finally:
        for k in ours:
            os.environ.pop(k, None)


# ---------------------------------------------------------------- plots


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(metrics_jsonl_path: str, out_png: str,
                keys: Iterable[str] = ("reward", "informative_frac", "kl", "eval_accuracy")) -> str:
    """One panel per key found in a metrics JSON-lines file (one object per step).

    x is the row's ``step`` or ``iteration`` (else the line number). Keys that never appear are
    skipped, so one call serves every stage. Uses ``Figure`` directly: no pyplot global state
    and no backend switch in the caller's process.
    """
    from matplotlib.figure import Figure

    rows = read_jsonl(metrics_jsonl_path)
    series = {k: [(r.get("step", r.get("iteration", i)), r[k]) for i, r in enumerate(rows)
                  if isinstance(r.get(k), (int, float))] for k in keys}
    series = {k: pts for k, pts in series.items() if pts}
    fig = Figure(figsize=(7, 2.4 * max(1, len(series))))
    axes = fig.subplots(max(1, len(series)), 1, squeeze=False)[:, 0]
    for ax, (key, pts) in zip(axes, series.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    if not series:
        axes[0].text(0.5, 0.5, "no data", ha="center", va="center")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return str(out_png)
