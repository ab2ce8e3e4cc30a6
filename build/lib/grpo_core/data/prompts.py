"""A stage's prompts: its task's rows (``grpo_core.data.tasks``) in a resumable order.

Training draws only the "train" split of the stage's task; the periodic evaluation and the
promotion gate use a fixed subset of its "validation" split.
"""
from __future__ import annotations

import torch

from grpo_core.data import tasks

SFT_FORMAT = "<think>{think}</think><answer>{answer}</answer>"


def sft_target(row: dict) -> str:
    """The completion SFT teaches: reasoning in <think>, the number in <answer>."""
    return SFT_FORMAT.format(think=row.get("think", ""), answer=row["gold"])


class PromptStream:
    """Deterministic, resumable order over rows: epoch-wise permutations seeded by (seed, epoch).

    ``take(position, n)`` is a pure function of its arguments, so a restarted stage that knows
    its data position draws exactly the prompts an uninterrupted run would have drawn.
    """

    def __init__(self, rows: list[dict], seed: int):
        if not rows:
            raise ValueError("no prompts to train on")
        self.rows, self.seed = rows, seed

    def _perm(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def take(self, position: int, n: int) -> list[dict]:
        out, size = [], len(self.rows)
        while len(out) < n:
            epoch, offset = divmod(position + len(out), size)
            perm = self._perm(epoch)
            out.extend(self.rows[i] for i in perm[offset:offset + n - len(out)])
        return out


def task_rows(cfg, split: str) -> list[dict]:
    """Rows of ``split`` of a GRPOConfig's task, read with its params."""
    task = tasks.task(cfg.task)
    return task.rows(split, **task.params_of(cfg))


def train_rows(cfg) -> list[dict]:
    """Training rows for a GRPOConfig (the train split of its task)."""
    return task_rows(cfg, "train")


def eval_rows(cfg, size: int) -> list[dict]:
    """A fixed subset of the validation split for periodic evaluation and the promotion gate:
    disjoint from training and from the test items the final evaluation reports."""
    return fixed_subset(task_rows(cfg, "validation"), size)


def fixed_subset(rows: list[dict], size: int) -> list[dict]:
    """The same ``size`` rows (all, if fewer) on every call: a seeded shuffle's first ones."""
    return PromptStream(rows, seed=12345).take(0, min(size, len(rows)))
