"""The promotion gate: a stage ends early once a metric has reached its threshold for `patience`
consecutive measurements (e.g. validation accuracy >= 0.95 at 2 evaluations in a row).

Pure: it sees only the metrics it is given. Its one piece of state, the current run of hits, is
checkpointed with the stage (`state_dict`), so a resumed stage counts on from where it stopped.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PromotionGate:
    metric: str | None  # None: no gate
    threshold: float
    patience: int
    hits: int = 0

    @classmethod
    def from_config(cls, cfg) -> PromotionGate:
        return cls(cfg.gate.metric, cfg.gate.threshold, cfg.gate.patience)

    @property
    def fired(self) -> bool:
        return self.metric is not None and self.hits >= self.patience

    def observe(self, metrics: dict) -> bool:
        """Count this iteration's metrics; True when the gate fires. An iteration that did not
        measure the metric (e.g. no evaluation) neither counts nor breaks the run of hits."""
        if self.metric is None or self.metric not in metrics:
            return False
        self.hits = self.hits + 1 if metrics[self.metric] >= self.threshold else 0
        return self.fired

    def state_dict(self) -> dict:
        return {"gate_hits": self.hits}

    def load_state_dict(self, state: dict) -> None:
        self.hits = int(state.get("gate_hits", 0))
