"""The ``[evaluate]`` table: how every stage's checkpoint is evaluated, with one table per task.

    [evaluate]              what every set shares: decoding engine, batch, sampled accuracy
    [evaluate.<task>]       that task's held-out sets: size, generation cap, difficulty bound
    [evaluate.vllm]         the vLLM server, when ``engine = "vllm"``

A task's table holds the task's own evaluation settings, with the task's defaults
(``Task.eval_defaults``) under what the file gives, so a new task needs no field here.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field

from grpo_core.config.checks import ConfigError, check_choice, from_dict, require
from grpo_core.config.groups import ROLLOUT_ENGINES, VllmSettings
from grpo_core.data import tasks
from grpo_core.data.tasks import dataset_name

MOVED = {"gsm8k_size": "[evaluate.gsm8k] size",
         "arithmetic_size": "[evaluate.arithmetic] size (0 there means all of the split; -1 skips it)",
         "gsm8k_max_steps": "[evaluate.gsm8k] max_difficulty", "gsm8k_bounded_size": "[evaluate.gsm8k] bounded_size",
         "gsm8k_max_new_tokens": "[evaluate.gsm8k] max_new_tokens"}
"""``[evaluate]`` fields that now live in a task's table: named in the error a config using them gets."""


@dataclass
class TaskEval:
    """One task's held-out evaluation (``[evaluate.<task>]``): its test split, and with
    ``max_difficulty`` also that split bounded by difficulty (``<task>_test_le<N>``)."""

    size: int = 300
    """Items of the task's test split: N, 0 for all, -1 to skip the set (the first N, or a seeded
    sample of N where the task's rows come in a systematic order)."""
    max_new_tokens: int = 0
    """Generation cap of the task's sets, the same for every model; 0: ``evaluate.max_new_tokens``.
    An answer that repeats itself verbatim stops early and counts as looped, not cut
    (``grpo_core/rollout/loops.py``)."""
    max_difficulty: int = 0
    """> 0 adds the set ``<task>_test_le<N>``: test problems whose difficulty (the task's
    ``difficulty_param``; GSM8K: calculator steps) is at most N."""
    bounded_size: int = 300
    """Items of ``<task>_test_le<N>``: N, 0 for all."""

    def check(self, where: str, task: tasks.Task) -> None:
        require(self.size >= -1, f"{where}.size", f"must be >= -1 (N items, 0 for all, -1 to skip), got {self.size}")
        for name in ("max_new_tokens", "max_difficulty", "bounded_size"):
            require(getattr(self, name) >= 0, f"{where}.{name}", f"must be >= 0, got {getattr(self, name)}")
        require(not self.max_difficulty or task.difficulty_param is not None, f"{where}.max_difficulty",
                f"task {task.name!r} has no difficulty bound; remove max_difficulty")


@dataclass
class EvalConfig:
    """Held-out evaluation of every stage's checkpoint: greedy accuracy on each set, and sampled
    accuracy (mean@k, pass@k; ``grpo_core/evaluation/sampled.py``) on the sets ``sampled_sets`` names.
    Each task's sets are set up in its own table, ``[evaluate.<task>]`` (``TaskEval``)."""

    max_new_tokens: int = 64
    """Generation cap of a task whose table sets none (report the share of answers it cut off:
    keep it under 5%)."""
    sampled_sets: list = field(default_factory=list)
    """Sets that also get sampled accuracy, e.g. ["gsm8k_test_le2"]; each must be evaluated."""
    sampled_k: int = 2
    """Samples per item for sampled accuracy (mean@k, pass@k)."""
    sampled_size: int = 200
    """Items of each sampled set that are sampled (the first N of the greedy items; 0 for all)."""
    sampled_temperature: float = 0.0
    """Sampling temperature of sampled accuracy; 0 takes the sampling temperature of the last GRPO
    stage that trains on the set's task (what that stage optimised)."""
    sampled_seed: int = 0
    """Seed of the sampled evaluation: the same for every model (paired samples)."""
    batch_size: int = 64
    """Completions per generate call (rows that finish leave the batch; see ``decode.py``)."""
    max_prompt_tokens: int = 2048
    """Longest prompt read; longer ones keep their end."""
    engine: str = "auto"
    """What decodes the evaluation, one of the rollout engines: auto (the in-process decoder) or
    vllm (a vLLM server of its own environment, set up by ``[evaluate.vllm]``; started for each
    checkpoint's evaluation and stopped after it)."""
    workers: int = 1
    """Local processes that share one checkpoint's evaluation on the local backend, each taking
    every N-th row of each decoding stream (a task's sets together, a row they share decoded once,
    shortest prompts first) with the machine's cores shared out as torch threads
    (``grpo_core/evaluation/job.py``): on a small CPU machine 2 processes of one thread evaluate in
    about 0.85x the wall time of one process of two (benchmarks/NOTES.md). Sampled accuracy seeds
    worker i with ``sampled_seed + i``, so its samples depend on N; greedy answers may too, at rare
    near-ties, as the batches do (they also depend on the sizes of the task's other sets): compare
    runs with the same N and sets. Not with engine = "vllm"; other backends evaluate in one process
    per pod."""
    vllm: VllmSettings = field(default_factory=VllmSettings)
    """The server of ``engine = "vllm"`` (``[evaluate.vllm]``: the fields of a stage's vllm table;
    it serves the checkpoint in fp32, as the evaluation loads it)."""
    tasks: dict = field(default_factory=dict)
    """Task name -> ``TaskEval`` (or its table): the ``[evaluate.<task>]`` tables; a task without
    one gets its defaults. A config file writes them as ``[evaluate.<task>]``, not under ``tasks``."""

    def __post_init__(self):
        require(self.sampled_size >= 0, "evaluate.sampled_size", f"must be >= 0 (N items, 0 for all), got "
                f"{self.sampled_size}")
        require(self.sampled_seed >= 0, "evaluate.sampled_seed", f"must be >= 0, got {self.sampled_seed}")
        for name in ("max_new_tokens", "batch_size", "sampled_k", "max_prompt_tokens"):
            require(getattr(self, name) >= 1, f"evaluate.{name}", f"must be >= 1, got {getattr(self, name)}")
        require(math.isfinite(self.sampled_temperature) and self.sampled_temperature >= 0,
                "evaluate.sampled_temperature", f"must be >= 0 (0: the stage's), got {self.sampled_temperature}")
        require(all(isinstance(n, str) for n in self.sampled_sets), "evaluate.sampled_sets",
                f"{self.sampled_sets!r}: give a list of evaluated set names, e.g. [\"gsm8k_test_le2\"]")
        check_choice(self.engine, ROLLOUT_ENGINES, "evaluate.engine")
        require(isinstance(self.workers, int) and not isinstance(self.workers, bool) and self.workers >= 1,
                "evaluate.workers",
                f"must be an integer >= 1 (1: evaluate in one process), got {self.workers!r}")
        require(self.workers == 1 or self.engine != "vllm", "evaluate.workers",
                "splits the work of an in-process engine; engine \"vllm\" decodes in a server of its own: "
                "set workers = 1")
        self.vllm.check("evaluate")
        given = dict(self.tasks)
        names = dict.fromkeys([*tasks.registry(), *given])
        self.tasks = {name: self._task_eval(name, given.get(name, {})) for name in names}

    @classmethod
    def from_table(cls, data: dict, where: str = "evaluate") -> EvalConfig:
        """``[evaluate]`` with its task tables; a field that moved into a task's table is an error
        naming where it lives now."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a table/dict, got {type(data).__name__}")
        for old, new in MOVED.items():
            if old in data:
                raise ConfigError(f"{where}.{old} moved to the task's table: write it as {new}")
        known = tasks.registry()
        require("tasks" not in data, f"{where}.tasks", "write each task's table as [evaluate.<task>], e.g. "
                "[evaluate.gsm8k] size = 100")
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in fields and key not in known:
                close = difflib.get_close_matches(key, [*known, *fields], n=1)
                raise ConfigError(f"unknown field {where}.{key}: neither an [evaluate] field nor a task's table "
                                  f"(tasks: {', '.join(known)})." + (f" Did you mean {close[0]!r}?" if close else ""))
        per_task = {name: table for name, table in data.items() if name in known}
        for name, table in per_task.items():
            require(isinstance(table, dict), f"{where}.{name}", f"must be a table ([evaluate.{name}] with size, "
                    f"max_new_tokens, ...), got {type(table).__name__}")
        rest = {k: v for k, v in data.items() if k not in known}
        return from_dict(cls, {**rest, "tasks": {n: from_dict(TaskEval, {**dict(known[n].eval_defaults), **t},
                                                                 f"{where}.{n}") for n, t in per_task.items()}},
                         where)

    def _task_eval(self, name: str, table: TaskEval | dict) -> TaskEval:
        """A task's table, checked: given, or read over the task's defaults."""
        task = tasks.task(name)
        if not isinstance(table, TaskEval):
            require(isinstance(table, dict), f"evaluate.{name}", f"must be a table, got {type(table).__name__}")
            table = from_dict(TaskEval, {**dict(task.eval_defaults), **table}, f"evaluate.{name}")
        table.check(f"evaluate.{name}", task)
        return table

    def to_dict(self) -> dict:
        """The table as a config file writes it (the task tables under their task's name)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tasks"}
        out["vllm"] = dataclasses.asdict(self.vllm)
        return {**out, **{name: dataclasses.asdict(te) for name, te in self.tasks.items()}}

    def set_names(self, task_names) -> list[str]:
        """The sets evaluated for stages training on ``task_names``: each task's test split unless
        skipped, then its bounded split ``<task>_test_le<N>`` where its table sets max_difficulty."""
        names = []
        for t in dict.fromkeys(task_names):
            te = self.task_eval(t)
            names += [dataset_name(t, "test")] if te.size != -1 else []
            names += [dataset_name(t, "test", te.max_difficulty)] if te.max_difficulty else []
        return names

    def size(self, set_name: str) -> int | None:
        """How many items of a set the evaluation reads: N, None for all of them, 0 to skip it."""
        t, _, bound = tasks.parse_dataset_name(set_name)
        te = self.task_eval(t.name)
        n = te.bounded_size if bound else te.size
        return 0 if n == -1 else n or None

    def budget(self, set_name: str) -> int:
        """The generation cap of one evaluation set (every model gets the same)."""
        return self.task_eval(tasks.parse_dataset_name(set_name)[0].name).max_new_tokens or self.max_new_tokens

    def task_eval(self, task_name: str) -> TaskEval:
        """A task's table (its defaults for a task registered after this config was read)."""
        return self.tasks.get(task_name) or self._task_eval(task_name, {})
