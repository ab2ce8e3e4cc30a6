"""Tasks: where a stage's prompts and held-out items come from, one file per task.

Each module in this package defines ``TASK``, a :class:`Task`; the registry finds them by
listing the package, so adding a task is adding a file. A task gives:

    params       the GRPOConfig fields that choose its data (an operand range, a dataset source)
    eval_defaults  its held-out evaluation's defaults (size, cap), under ``[evaluate.<task>]``
    rows         rows(split, **params) -> [{"id", "prompt", "gold", "think"}]: the prompt is the raw
                 question (the tokenizer's chat template wraps it), gold a plain decimal number
    identity     identity(split, **params) -> {"source", "split", "digest"}: lineage for MLflow
                 and the registry (models are compared item by item only on equal digests)
    grade        grade(completion, gold) -> bool: what the evaluation counts as correct
    resolve      configured params -> the params read (e.g. GSM8K_DIR over the configured source)

Three disjoint splits, so no reported accuracy is chosen on the data it reports: training draws
only "train"; the periodic evaluation and the promotion gate during a stage use "validation";
the final evaluation of every stage uses "test". A dataset is named ``<task>_<split>``
(``arithmetic_test``, ``gsm8k_train``) everywhere: MLflow datasets, metrics, registry tags.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from grpo_core.data.answers import is_correct

SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class Task:
    name: str
    params: tuple[str, ...]
    rows: Callable[..., list[dict]]
    identity: Callable[..., dict]
    grade: Callable[[str, str], bool] = is_correct
    resolve: Callable[[dict], dict] = lambda params: params
    """Turns configured params into the ones read (e.g. GSM8K_DIR over the configured source)."""
    shuffled_subsets: bool = False
    """Rows come in a systematic order, so an evaluation subset is a seeded sample, not the first N."""
    unreadable_hint: str = ""
    """What to do when the data cannot be read (shown with the error)."""
    eval_defaults: tuple = ()
    """The task's ``[evaluate.<task>]`` defaults as (field, value) pairs (``config.evaluation.TaskEval``)."""
    difficulty_param: str | None = None
    """The param that bounds a problem's difficulty (GSM8K's ``gsm8k_max_steps``), or None: a
    dataset ``<task>_<split>_le<N>`` reads the split with it set to N; ``<task>_<split>`` with it
    unbounded (0)."""

    def params_of(self, cfg) -> dict:
        """This task's params read from a GRPOConfig (or any object with those fields), resolved."""
        return self.resolve({p: getattr(cfg, p) for p in self.params})


@functools.cache
def registry() -> dict[str, Task]:
    """Every task in this package, by name."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        task = getattr(importlib.import_module(f"{__name__}.{info.name}"), "TASK", None)
        if isinstance(task, Task):
            found[task.name] = task
    return found


def task(name: str) -> Task:
    tasks = registry()
    if name not in tasks:
        raise KeyError(f"no task {name!r}; the tasks are {sorted(tasks)} (one file each in grpo_core/data/tasks/)")
    return tasks[name]


def dataset_name(task_name: str, split: str, bound: int = 0) -> str:
    """The one name of a task's split: ``arithmetic_test``, ``gsm8k_validation``; with a difficulty
    ``bound`` (``Task.difficulty_param``), ``gsm8k_test_le2``."""
    check_split(split)
    return f"{task_name}_{split}" + (f"_le{bound}" if bound else "")


def parse_dataset_name(name: str) -> tuple[Task, str, int]:
    """The task, split and difficulty bound (0: none) a dataset name denotes
    (``gsm8k_test_le2`` -> GSM8K, "test", 2)."""
    base, bound = name, 0
    head, _, tail = name.rpartition("_le")
    if head and tail.isdigit() and int(tail) > 0:
        base, bound = head, int(tail)
    task_name, _, split = base.rpartition("_")
    if split not in SPLITS or task_name not in registry():
        raise KeyError(f"{name!r} names no dataset; use <task>_<split> (or <task>_<split>_le<N> for a task with a "
                       f"difficulty bound) with a task in {sorted(registry())} and a split in {SPLITS}")
    if bound and registry()[task_name].difficulty_param is None:
        raise KeyError(f"{name!r}: task {task_name!r} has no difficulty bound; use {base!r}")
    return task(task_name), split, bound


def split_of(name: str) -> tuple[Task, str]:
    """The task and split a dataset name denotes (``gsm8k_test`` -> GSM8K, "test")."""
    t, split, _ = parse_dataset_name(name)
    return t, split


def bounded_params(t: Task, params: dict, bound: int) -> dict:
    """``params`` with ``t``'s difficulty param set to ``bound`` (0: unbounded); a task without one
    keeps its params."""
    return params if t.difficulty_param is None else {**params, t.difficulty_param: bound}


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def bucket(key: str) -> int:
    """A stable 0..99 hash bucket of ``key``: the split rule of every task."""
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 100
