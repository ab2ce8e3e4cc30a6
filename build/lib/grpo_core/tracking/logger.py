"""The trainer's MLflow logger: buffered, flushed at checkpoint commits, and outage-safe.

``Tracker`` is the logger interface (``log(metrics, step)`` ... ``close()``) and is a no-op,
used on non-zero ranks and in tests. ``MlflowTracker`` only *buffers* metrics; the trainer
calls ``flush()`` at checkpoint commits, so a crash-and-resume never logs a step twice, and a
tracking outage delays points (spilled to a file at exit and reloaded by the next tracker on
that file: a resumed stage, or the flow's ``end`` step, which replays what a finished stage kept
beside its checkpoints) instead of killing training. Run layout, params and redaction live in ``tracking``.
"""

from __future__ import annotations

import json
import os
import posixpath
import sys
import time
from collections.abc import Callable, Mapping

from grpo_core.io.storage import atomic_write_text
from grpo_core.tracking.runs import (
    HTTP_ENV,
    METRICS_PER_BATCH,
    PARAMS_PER_BATCH,
    clean_tags,
    env_defaults,
    flatten_params,
    mlflow_client,
    read_jsonl,
    warn,
)


class Tracker:
    """No-op logger: the interface the trainer codes against (non-zero ranks, tests)."""

    delayed_points = 0

    def log(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None: ...
    def log_params(self, params: Mapping, if_absent: bool = False) -> None: ...
    def set_tags(self, tags: Mapping) -> None: ...
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None: ...
    def log_dict(self, obj, artifact_file: str) -> None: ...
    def log_table(self, data: Mapping[str, list], artifact_file: str) -> None: ...
    def flush(self) -> bool: return True  # noqa: E704
    def close(self) -> None: ...
    def __enter__(self): return self  # noqa: E704
    def __exit__(self, *exc) -> None: self.close()  # noqa: E704


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
        self._params_if_absent: dict[str, str] = {}  # sent after a look at what the run holds
        self._tags: dict[str, str] = {}
        self._artifacts: list[tuple[str, Callable[[], None]]] = []
        self._down = False  # last attempt exhausted its retries
        self._late = 0  # how many of the oldest pending metrics are already counted as delayed
        self._sent_late = 0
        self.delayed_points = 0  # points that missed at least one flush
        self.dropped_points = 0  # points the server rejected (4xx)
        if spill_path and os.path.exists(spill_path):
            self._load_spill(spill_path)

    def log(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Buffer points; ``timestamp_ms`` (default now) given again on a resend makes it a no-op."""
        ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        for k, v in metrics.items():
            try:
                self._metrics.append(self._Metric(k, float(v), ts, int(step)))
            except (TypeError, ValueError):
                warn(f"skipped non-numeric metric {k}={v!r} at step {step}")

    def log_params(self, params: Mapping, if_absent: bool = False) -> None:
        """Send params. ``if_absent``: only those the run does not hold yet (a resumed stage: its
        first attempt may have logged them, with runtime fields such as output_dir that differ
        now, which MLflow refuses to change; or never reached the server)."""
        (self._params_if_absent if if_absent else self._params).update(flatten_params(params))
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

    def log_table(self, data: Mapping[str, list], artifact_file: str) -> None:
        """A table (columns of equal length) as a JSON artifact that ``mlflow.load_table`` reads and
        the MLflow UI shows. Written once: MLflow appends to a table already at ``artifact_file``,
        and a resumed stage that logs an iteration again would repeat its rows, so a table already
        there is left as it is. Sent like ``log_dict`` (held while the server is down)."""
        columns = {k: list(v) for k, v in data.items()}

        def send() -> None:
            folder = posixpath.dirname(artifact_file) or None
            if artifact_file not in {f.path for f in self._client.list_artifacts(self.run_id, folder)}:
                self._client.log_table(self.run_id, data=columns, artifact_file=artifact_file)

        self._queue(f"table {artifact_file}", send)

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
            warn(f"{self._late} metric points delayed; they stay buffered for the next flush")
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
        warn(f"wrote {len(self._metrics)} pending metric points to {self.spill_path}")
        if self._artifacts:
            warn("not uploaded: " + ", ".join(what for what, _ in self._artifacts))

    def _call(self, what: str, fn: Callable[[], None]) -> str:
        """Run fn with exponential backoff: 'ok', 'down' (retries exhausted) or 'rejected'.

        Once the server is known to be down, one probe per call: a long outage then costs each
        flush one failed request, not a full backoff (~15 s) that stalls rank 0 every checkpoint.
        """
        retries = 0 if self._down else self.max_retries
        for attempt in range(retries + 1):
            try:
                with env_defaults(**HTTP_ENV):
                    fn()
                self._down = False
                return "ok"
            except Exception as e:  # a tracking problem must never stop training
                if not _transient(e):
                    warn(f"{what} rejected by the server, dropped: {e}")
                    return "rejected"
                if attempt == retries:
                    warn(f"{what} failed after {attempt + 1} tries: {str(e)[:300]}")
                    self._down = True
                    return "down"
                time.sleep(self.backoff_s * 2**attempt)
        return "down"

    def _send_params_tags(self) -> bool:
        from mlflow.entities import Param, RunTag

        if self._params_if_absent:
            held: dict = {}
            status = self._call("params lookup", lambda: held.update(self._client.get_run(self.run_id).data.params))
            if status == "down":
                return False
            self._params.update({k: v for k, v in self._params_if_absent.items() if k not in held})
            self._params_if_absent.clear()
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
        rows += [{"kind": "param_if_absent", "key": k, "value": v} for k, v in self._params_if_absent.items()]
        rows += [{"kind": "tag", "key": k, "value": v} for k, v in self._tags.items()]
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))

    def _load_spill(self, path: str) -> None:
        rows = read_jsonl(path)
        for r in rows:
            if r["kind"] == "metric":
                self._metrics.append(self._Metric(r["key"], r["value"], r["timestamp"], r["step"]))
            else:
                pending = {"param": self._params, "param_if_absent": self._params_if_absent}.get(r["kind"], self._tags)
                pending[r["key"]] = r["value"]
        self._late = self.delayed_points = len(self._metrics)
        print(f"[tracking] reloaded {len(rows)} spilled points from {path}", file=sys.stderr)


def open_tracker(uri: str | None, run_id: str | None, rank: int = 0,
                 spill_path: str | None = None) -> Tracker:
    """The MLflow tracker on rank 0 when a run is configured, else the no-op ``Tracker``."""
    if rank != 0 or not uri or not run_id:
        return Tracker()
    return MlflowTracker(uri, run_id, spill_path=spill_path)
