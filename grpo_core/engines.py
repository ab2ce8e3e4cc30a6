"""Rollout engines: the one seam between the trainer and whatever samples completions.

An engine turns prompt rows into a ``RolloutBatch`` of G completions per row, sampled from the
policy's current weights. The trainer calls exactly two methods, before every rollout:

    engine.sync_weights(model)          # the policy as it is now (after the last update)
    engine.generate(rows, G, sampling)  # -> RolloutBatch, group-contiguous

``sync_weights`` is where an engine that keeps its own copy of the weights (a vLLM server, a
separate inference process) would receive them. It is called inside the trainer's forward-only
phase, so under FSDP2 the module it gets holds full, gathered weights.

The evaluation decodes through the same seam (``evaluate.greedy_results`` with
``Sampling(greedy=True)``): in a stage, with the stage's engine; in the final evaluation step,
with "auto".

The engines here sample with the policy module itself, in this process, so syncing only records
the module. Adding an engine is one class with these two methods plus its ``ENGINES`` entry
beside it; the stage config's ``rollout_engine`` selects it by name and is validated against
``ENGINES`` (this module imports no transformers at load, so the config can read it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from grpo_core.types import RolloutBatch


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn (a stage's sampling fields; see ``GRPOConfig``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    max_prompt_tokens: int = 512
    sampler: str = "inverse_cdf"
    system_prompt: str | None = None
    greedy: bool = False
    """Argmax tokens instead of samples (the evaluation's decoding; temperature and filters unused)."""
    stop_loops: bool = False
    """Stop a completion once it repeats itself verbatim (``loops.LoopRule``; the evaluation's)."""

    @classmethod
    def of(cls, cfg) -> Sampling:
        s = cfg.sampling
        return cls(s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.max_prompt_tokens, s.sampler, cfg.system_prompt)


class RolloutEngine(Protocol):
    def sync_weights(self, model) -> None:
        """Take the policy's current weights; called before every rollout."""

    def generate(self, rows: list[dict], group_size: int, sampling: Sampling) -> RolloutBatch:
        """``group_size`` completions of every row (each a dict with ``prompt`` plus dataset
        columns), group-contiguous, with the rows' columns repeated per completion."""


class InProcessEngine:
    """Samples with the policy module itself. ``mode``: "auto" (the shared-prefix decoder where
    ``decode.fast_decode_supported``, else transformers' ``generate``), "decoder" (insist on the
    decoder) or "generate" (always ``generate``)."""

    def __init__(self, tok, mode: str = "auto"):
        self.tok, self.mode, self.model = tok, mode, None

    def sync_weights(self, model) -> None:
        self.model = model  # the same module: nothing to copy

    def generate(self, rows: list[dict], group_size: int, sampling: Sampling) -> RolloutBatch:
        from grpo_core.rollout import generate_rollouts  # transformers: not at config load

        if self.model is None:
            raise RuntimeError("sync_weights(model) must come before generate()")
        return generate_rollouts(self.model, self.tok, rows, group_size, engine=self.mode, **sampling.__dict__)


ENGINES = {
    "auto": lambda tok: InProcessEngine(tok, "auto"),
    "decoder": lambda tok: InProcessEngine(tok, "decoder"),
    "generate": lambda tok: InProcessEngine(tok, "generate"),
}


def build(name: str, tok) -> RolloutEngine:
    """The engine a stage's ``rollout_engine`` names (validated against ``ENGINES`` at config load)."""
    return ENGINES[name](tok)
