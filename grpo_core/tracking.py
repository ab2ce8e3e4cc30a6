"""Experiment tracking: run layout, a buffered MLflow logger that survives outages, and plots.

Layout: one MLflow *parent* run per Metaflow run, one *child* run per stage (``grpo.stage``
tag). Metaflow steps and torchrun ranks are separate processes, so runs are created and
re-opened by id with ``MlflowClient`` (never the fluent active-run stack), and
``start_child_run`` returns the existing child for a stage so a resumed run logs into it.

``Tracker`` is the logger interface (``log(metrics, step)`` ... ``close()``) and is a no-op,
used on non-zero ranks and in tests. ``MlflowTracker`` only *buffers* metrics; the trainer
calls ``flush()`` at checkpoint commits, so a crash-and-resume never logs a step twice, and a
tracking outage delays points instead of killing training.

mlflow is imported inside functions only: ``import grpo_core`` must stay fast (mlflow takes ~2 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

MAX_PARAM_VALUE = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH in 3.17
MAX_TAG_VALUE = 8000  # MAX_TAG_VAL_LENGTH
MAX_KEY = 250  # MAX_ENTITY_KEY_LENGTH
METRICS_PER_BATCH = 1000  # MAX_METRICS_PER_BATCH: log_batch rejects more
PARAMS_PER_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH
# Our own retry loop owns retries; MLflow's default (7 HTTP retries, backoff factor 2) would
# block a flush for minutes per attempt. Applied only where the user has not set them.
_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
# Words (not substrings: "max_new_tokens" and "tokenizer" are fine) that mark a secret key.
_SECRET_WORDS = {"key", "apikey", "secret", "secrets", "token", "password", "passwd",
                 "credential", "credentials"}
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)[^/@\s]+@")
_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def _warn(msg: str) -> None:
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


def resolve_tracking_uri(configured: str | None, project_dir: str) -> str:
    """Env ``MLFLOW_TRACKING_URI`` > configured > ``sqlite:///<project>/.grpo/mlflow/mlflow.db``.

    MLflow's own default is a sqlite db and ``mlruns`` in the *cwd*, and its file store raises
    in 3.x, so we never fall back to either.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI") or configured
    if uri:
        if uri.startswith(("file:", "/", ".")):
            raise ValueError(f"file-store tracking URI {uri!r} is unsupported in MLflow 3; "
                             "use sqlite:///<abs path>.db or an http(s) server")
        return uri
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
    reused run is set back to RUNNING.
    """
    client = mlflow_client(uri)
    parent = client.get_run(parent_run_id)
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


# ---------------------------------------------------------------- loggers


class Tracker:
    """No-op logger: the interface the trainer codes against (non-zero ranks, tests)."""

    delayed_points = 0

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_params(self, params: Mapping) -> None: ...
    def set_tags(self, tags: Mapping) -> None: ...
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None: ...
    def log_dict(self, obj, artifact_file: str) -> None: ...
    def flush(self) -> bool: return True  # noqa: E704
    def close(self) -> None: ...
    def __enter__(self): return self  # noqa: E704
    def __exit__(self, *exc) -> None: self.close()  # noqa: E704


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


def _transient(exc: Exception) -> bool:
    """Connection errors and 5xx are worth retrying; a 4xx (bad value) never succeeds."""
    from mlflow.exceptions import MlflowException

    return not isinstance(exc, MlflowException) or exc.get_http_status_code() >= 500


class MlflowTracker(Tracker):
    """Buffered MLflow logger for one run. Never raises on tracking errors.

    Metrics wait in memory until ``flush``. Params, tags and artifacts are sent at once unless
    the server is known to be down, in which case they wait for the next flush too. Metric
    timestamps are fixed at ``log`` time, so a resent batch writes identical rows, which
    MLflow's store keeps once (verified in tests/test_tracking.py).
    """

    def __init__(self, uri: str, run_id: str, *, max_retries: int = 5, backoff_s: float = 0.5,
                 spill_path: str | None = None):
        from mlflow.entities import Metric

        self.uri, self.run_id, self.spill_path = uri, run_id, spill_path
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self._client, self._Metric = mlflow_client(uri), Metric
        self._metrics: list = []  # pending Metric entities, oldest first
        self._params: dict[str, str] = {}
        self._tags: dict[str, str] = {}
        self._artifacts: list[tuple[str, Callable[[], None]]] = []
        self._down = False  # last attempt exhausted its retries
        self._late = 0  # how many of the oldest pending metrics are already counted as delayed
        self._sent_late = 0
        self.delayed_points = 0  # points that missed at least one flush
        self.dropped_points = 0  # points the server rejected (4xx)
        if spill_path and os.path.exists(spill_path):
            self._load_spill(spill_path)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            try:
                self._metrics.append(self._Metric(k, float(v), ts, int(step)))
            except (TypeError, ValueError):
                _warn(f"skipped non-numeric metric {k}={v!r} at step {step}")

    def log_params(self, params: Mapping) -> None:
        self._params.update(flatten_params(params))
        if not self._down:
            self._send_params_tags()

    def set_tags(self, tags: Mapping) -> None:
        self._tags.update(clean_tags(tags))
        if not self._down:
            self._send_params_tags()

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Upload now (or at the next flush while the server is down: keep the file until then)."""
        self._queue(f"artifact {local_path}",
                    lambda: self._client.log_artifact(self.run_id, local_path, artifact_path))

    def log_dict(self, obj, artifact_file: str) -> None:
        self._queue(f"dict {artifact_file}", lambda: self._client.log_dict(self.run_id, obj, artifact_file))

    def _queue(self, what: str, fn: Callable[[], None]) -> None:
        self._artifacts.append((what, fn))
        if not self._down:
            self._send_artifacts()

    def flush(self) -> bool:
        """Send everything pending; False (with a warning) if the server stays unreachable."""
        ok = self._send_params_tags() and self._send_metrics() and self._send_artifacts()
        if not ok:
            self.delayed_points += len(self._metrics) - self._late
            self._late = len(self._metrics)
            _warn(f"{self._late} metric points delayed; they stay buffered for the next flush")
            return False
        if self._sent_late:
            print(f"[tracking] flushed {self._sent_late} delayed points", file=sys.stderr, flush=True)
            self._sent_late = 0
        if self.spill_path and os.path.exists(self.spill_path):
            os.remove(self.spill_path)
        return True

    def close(self) -> None:
        """Flush; on failure write pending points to ``spill_path`` (reloaded by the next tracker)."""
        if self.flush() or not self.spill_path:
            return
        self._write_spill(self.spill_path)
        _warn(f"wrote {len(self._metrics)} pending metric points to {self.spill_path}")
        if self._artifacts:
            _warn("not uploaded: " + ", ".join(what for what, _ in self._artifacts))

    def _call(self, what: str, fn: Callable[[], None]) -> str:
        """Run fn with exponential backoff: 'ok', 'down' (retries exhausted) or 'rejected'.

        Once the server is known to be down, one probe per call: a long outage then costs each
        flush one failed request, not a full backoff (~15 s) that stalls rank 0 every checkpoint.
        """
        retries = 0 if self._down else self.max_retries
        for attempt in range(retries + 1):
            try:
                with env_defaults(**_HTTP_ENV):
                    fn()
                self._down = False
                return "ok"
            except Exception as e:  # a tracking problem must never stop training
                if not _transient(e):
                    _warn(f"{what} rejected by the server, dropped: {e}")
                    return "rejected"
                if attempt == retries:
                    _warn(f"{what} failed after {attempt + 1} tries: {str(e)[:300]}")
                    self._down = True
                    return "down"
                time.sleep(self.backoff_s * 2**attempt)
        return "down"

    def _send_params_tags(self) -> bool:
        from mlflow.entities import Param, RunTag

        for pending, make, field in ((self._params, Param, "params"), (self._tags, RunTag, "tags")):
            while pending:
                keys = list(pending)[:PARAMS_PER_BATCH]
                batch = [make(k, pending[k]) for k in keys]
                fn = lambda: self._client.log_batch(self.run_id, **{field: batch})  # noqa: E731
                if self._call(f"{len(batch)} {field}", fn) == "down":
                    return False
                for k in keys:
                    pending.pop(k)
        return True

    def _send_metrics(self) -> bool:
        while self._metrics:
            chunk = self._metrics[:METRICS_PER_BATCH]
            status = self._call(f"{len(chunk)} metric points",
                                lambda: self._client.log_batch(self.run_id, metrics=chunk))
            if status == "down":
                return False
            if status == "rejected":
                self.dropped_points += len(chunk)
            else:
                self._sent_late += min(len(chunk), self._late)
            self._late = max(0, self._late - len(chunk))
            del self._metrics[:len(chunk)]
        return True

    def _send_artifacts(self) -> bool:
        while self._artifacts:
            what, fn = self._artifacts[0]
            if self._call(what, fn) == "down":
                return False
            self._artifacts.pop(0)
        return True

    def _write_spill(self, path: str) -> None:
        """JSON lines {"kind": "metric"|"param"|"tag", ...}, replaced atomically."""
        rows = [{"kind": "metric", "key": m.key, "value": m.value, "timestamp": m.timestamp,
                 "step": m.step} for m in self._metrics]
        rows += [{"kind": "param", "key": k, "value": v} for k, v in self._params.items()]
        rows += [{"kind": "tag", "key": k, "value": v} for k, v in self._tags.items()]
        with open(f"{path}.tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(f"{path}.tmp", path)

    def _load_spill(self, path: str) -> None:
        rows = _read_jsonl(path)
        for r in rows:
            if r["kind"] == "metric":
                self._metrics.append(self._Metric(r["key"], r["value"], r["timestamp"], r["step"]))
            else:
                (self._params if r["kind"] == "param" else self._tags)[r["key"]] = r["value"]
        self._late = self.delayed_points = len(self._metrics)
        print(f"[tracking] reloaded {len(rows)} spilled points from {path}", file=sys.stderr)


def open_tracker(uri: str | None, run_id: str | None, rank: int = 0,
                 spill_path: str | None = None) -> Tracker:
    """The MLflow tracker on rank 0 when a run is configured, else the no-op ``Tracker``."""
    if rank != 0 or not uri or not run_id:
        return Tracker()
    return MlflowTracker(uri, run_id, spill_path=spill_path)


# ---------------------------------------------------------------- plots


def _read_jsonl(path: str) -> list[dict]:
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

    rows = _read_jsonl(metrics_jsonl_path)
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
