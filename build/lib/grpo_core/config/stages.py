"""The pipeline's GRPO stages, declared once: the config, the pipeline and the flow's training
steps read their names, tasks and steps from this table.

    stage        the config table ([curriculum]), the MLflow child run and the evaluated checkpoint
    task         GRPOConfig.task: which task's prompts it trains on (``grpo_core/data/tasks``); its
                 datasets are named <task>_train, <task>_validation
    step         the flow's @parallel training step that runs it

The flow evaluates the start model ("sft") and then each stage's model, in this order.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str
    task: str
    step: str


GRPO_STAGES = (
    Stage("curriculum", "arithmetic", "curriculum_grpo"),
    Stage("gsm8k", "gsm8k", "gsm8k_grpo"),
)
EVALUATED = ("sft",) + tuple(s.name for s in GRPO_STAGES)  # the checkpoints the flow evaluates, in order


def stage(name: str) -> Stage:
    """The table row of GRPO stage ``name``."""
    for s in GRPO_STAGES:
        if s.name == name:
            return s
    raise KeyError(f"no GRPO stage {name!r}; the stages are {[s.name for s in GRPO_STAGES]}")
