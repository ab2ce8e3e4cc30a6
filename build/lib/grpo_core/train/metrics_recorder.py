"""Where a stage's metrics go: metrics.jsonl, MLflow (idempotent across resumes), stdout, the
divergence alarm, sampled completions, and the stage's closing summary.

Rank 0 records; other ranks' calls do nothing. Points reach MLflow at commit points (each
checkpoint, and the end): a stage that crashes and resumes restores metrics.jsonl as it was at
its checkpoint and resends those rows with their first timestamps, which the store keeps once, so
no iteration is logged twice and none that an outage held back is lost.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from grpo_core.config.stage import METRICS_FILE, SAMPLES_FILE
from grpo_core.evaluation.health import divergence_alarm
from grpo_core.evaluation.stats import window_change
from grpo_core.io import storage
from grpo_core.tracking.logger import open_tracker
from grpo_core.tracking.runs import plot_curves, read_jsonl

LOGGED_AT = "logged_at_ms"  # metrics.jsonl: when the row's points were logged (their MLflow timestamp)
SAMPLES_PER_LOG = 16  # sampled completions kept per logged iteration


class MetricsRecorder:
    def __init__(self, cfg, is_main: bool, rank: int, out: Path):
        self.cfg, self.is_main, self.out = cfg, is_main, out
        self.path = out / METRICS_FILE  # one JSON line per iteration
        self.spill_path = out / "pending_metrics.jsonl"  # tracking points the server did not take
        self.tracker = open_tracker(cfg.runtime.tracking_uri, cfg.runtime.tracking_run_id, rank,
                                    spill_path=str(self.spill_path))

    # ---------------------------------------------------------------- start and resume
    def log_objective(self, card: dict) -> None:
        """The stage config and its objective card as MLflow params, and objective.json. Only the
        params the run lacks: a rerun of the step (even one restarting at 0) reuses the run,
        whose output_dir and other runtime params MLflow refuses to change."""
        if not self.is_main:
            return
        storage.atomic_write_text(self.out / "objective.json", json.dumps(card, indent=1))
        self.tracker.log_params({**self.cfg.to_dict(), **{f"objective.{k}": v for k, v in card.items()}},
                                if_absent=True)
        self.tracker.log_artifact(str(self.out / "objective.json"))

    def restore(self, ckpt: Path, iteration: int) -> None:
        """metrics.jsonl as it was at the checkpoint (its copy in the checkpoint: a flow ``resume``
        runs in a fresh output_dir), then its rows queued for MLflow again with their first
        timestamps; they are sent at the next commit."""
        saved = ckpt / METRICS_FILE
        if not self.is_main or not (saved.exists() or self.path.exists()):
            return
        lines = (saved if saved.exists() else self.path).read_text().splitlines()
        keep = [ln for ln in lines if json.loads(ln)["iteration"] <= iteration]
        storage.atomic_write_text(self.path, "".join(ln + "\n" for ln in keep))
        for row in read_jsonl(str(self.path)):
            self.tracker.log({k: v for k, v in row.items() if k not in ("iteration", LOGGED_AT)},
                             step=row["iteration"], timestamp_ms=row[LOGGED_AT])

    def checkpoint_files(self) -> dict[str, Path]:
        """Files a checkpoint carries so that a resume restores them."""
        return {METRICS_FILE: self.path} if self.path.exists() else {}

    def commit(self) -> None:
        """A commit point (the checkpoint is written): metrics up to here become durable."""
        if self.is_main:
            self.tracker.flush()

    # ---------------------------------------------------------------- each iteration
    def record(self, m: dict, batch, history: list[dict]) -> None:
        """One iteration: metrics.jsonl, MLflow (sent at the next commit), the divergence alarm
        (read at evaluation points only, so it is reported once), sampled completions every
        ``sample_every`` iterations and at the first, and a line on stdout."""
        if not self.is_main:
            return
        logged_at = int(time.time() * 1000)  # kept, so a resumed stage can resend the point
        with open(self.path, "a") as f:
            f.write(json.dumps({**m, LOGGED_AT: logged_at}) + "\n")
        self.tracker.log({k: v for k, v in m.items() if k != "iteration"}, step=m["iteration"], timestamp_ms=logged_at)
        alarm = divergence_alarm(history) if "eval_accuracy" in m else None
        if alarm:
            print(f"WARNING [{self.cfg.runtime.stage}] {alarm}", flush=True)
            self.tracker.log({"alarm/reward_task_divergence": 1.0}, step=m["iteration"])
            self.tracker.set_tags({"grpo.alarm": alarm})
        if m["iteration"] % self.cfg.sample_every == 0 or m["iteration"] == 1:
            self._log_samples(m["iteration"], batch)
        print(f"[{self.cfg.runtime.stage}] it {m['iteration']:4d} reward {m['reward']:.3f} "
              f"informative {m['informative_frac']:.2f} kl {m['kl']:.4f} len {m['completion_len']:.1f}"
              + (f" eval_acc {m['eval_accuracy']:.3f}" if "eval_accuracy" in m else ""), flush=True)

    def _log_samples(self, it: int, batch) -> None:
        n = SAMPLES_PER_LOG
        samples = [{"prompt": p, "completion": t, "reward": r}
                   for p, t, r in zip(batch.prompts[:n], batch.completions[:n], batch.rewards.tolist()[:n])]
        self.tracker.log_dict({"iteration": it, "samples": samples}, f"samples/iter_{it:06d}.json")
        self.tracker.log_table({"iteration": [it] * len(samples), **{k: [s[k] for s in samples] for k in
                                ("prompt", "completion", "reward")}}, f"samples/iter_{it:06d}_table.json")
        # the live training card reads it (launcher.read_samples), MLflow or not
        storage.atomic_write_text(self.out / SAMPLES_FILE, json.dumps({"iteration": it, "samples": samples}))

    # ---------------------------------------------------------------- the end
    def close(self, iteration: int) -> dict:
        """Rank 0: the stage's first and last metrics, reward trend and mean informative fraction
        over its iterations (also to MLflow), the curves
        as a PNG, a final flush; points the server never took are reported (and kept in
        ``spill_path``). Returns the summary's metric fields."""
        rows = read_jsonl(str(self.path)) if self.path.exists() else []
        without_time = lambda row: {k: v for k, v in row.items() if k != LOGGED_AT}  # noqa: E731
        summary = {"last": without_time(rows[-1]) if rows else {}, "first": without_time(rows[0]) if rows else {}}
        if rows:
            trend = summary["reward_trend"] = window_change([r["reward"] for r in rows])
            summary["informative_mean"] = sum(r["informative_frac"] for r in rows) / len(rows)
            self.tracker.log({f"reward_trend/{k}": v for k, v in trend.items() if math.isfinite(v)}, iteration)
            self.tracker.log({"informative_frac_mean": summary["informative_mean"]}, iteration)
            self.tracker.log_artifact(plot_curves(str(self.path), str(self.out / "curves.png")))
        self.tracker.flush()
        summary["tracking_delayed_points"] = getattr(self.tracker, "delayed_points", 0)
        self.tracker.close()
        if self.spill_path.exists() and self.cfg.runtime.sync_uri:  # kept beside the checkpoints, for replay
            summary["tracking_pending_uri"] = storage.write_text(
                storage.join(self.cfg.runtime.sync_uri, self.spill_path.name), self.spill_path.read_text())
            summary["tracking_run_id"] = self.cfg.runtime.tracking_run_id
        return summary
