"""One checkpoint's evaluation as a job: every held-out set decoded greedily, the sampled sets k
times per item, all from one engine; run in this process or split over local worker processes.

The job decodes *streams*, not sets (``streams``): one greedy stream per task and cap holds every
distinct row of the sets that share them, once (``gsm8k_test``'s first 100 items and
``gsm8k_test_le2``'s 300 share 40), and each sampled set is a stream of its own; a stream's rows
are ordered by prompt length, so a decoded chunk pads its prompts little. ``merge`` maps the
streams' results back onto every set in item order.

A split job (``run_split``) gives worker i of N every N-th row of every stream (``rows[i::N]``:
each worker gets a like share of short and long prompts) and seeds its sampled accuracy with
``sampled_seed + i``; the parent merges the parts. The split is fixed by the sets and N, so every
checkpoint of a run (and every run with the same ``evaluate.workers``) draws the same samples for
the same item: the paired tests still compare like with like. It exists because on a small CPU
machine N processes of one thread decode faster than one process of N threads (the decode step is
many small ops whose OpenMP barriers cost more than they share: benchmarks/NOTES.md, "Evaluation
split over processes").

    python -m grpo_core.evaluation.job --job JOB.json --shard I --of N --out PART.json

May import io, config, data, model, rollout and the evaluation's own modules.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from grpo_core.config.evaluation import EvalConfig
from grpo_core.io.paths import subprocess_env


@dataclass
class EvalJob:
    """What one checkpoint's evaluation decodes. ``sets``: greedy set name -> rows; ``sampled``:
    sampled set name -> its rows (the first ``sampled_size`` of the greedy ones); ``temperatures``:
    sampled set name -> its sampling temperature."""

    model_uri: str
    evaluate: EvalConfig
    sets: dict
    sampled: dict = field(default_factory=dict)
    temperatures: dict = field(default_factory=dict)
    system_prompt: str | None = None
    trust_remote_code: bool = False
    label: str = "evaluate"
    """Names the engine's log directory (the stage evaluated)."""

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "evaluate": self.evaluate.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> EvalJob:
        data = json.loads(text)
        return cls(**{**data, "evaluate": EvalConfig.from_table(data["evaluate"])})


@dataclass(frozen=True)
class Stream:
    """Rows decoded together, in the order decoded: greedily at ``cap`` (``k`` = 0) or ``k``
    samples each at ``temperature``; graded by ``grade``, their task's grader."""

    grade: Callable[[str, str], bool]
    cap: int
    rows: list
    k: int = 0
    temperature: float = 0.0


def streams(job: EvalJob) -> dict[str, Stream]:
    """What ``job`` decodes: ``greedy:<task>@<cap>`` (``greedy_key``) with the distinct rows of
    every set of that task and cap, and ``sampled:<set>`` per sampled set; rows ordered by prompt
    length (ties in order of first appearance)."""
    from grpo_core.data import tasks

    e, out, distinct = job.evaluate, {}, {}
    for name, rows in job.sets.items():
        key = greedy_key(job, name)
        seen = distinct.setdefault(key, {})
        for r in rows:
            seen.setdefault(row_key(r), r)
        out[key] = Stream(tasks.split_of(name)[0].grade, e.budget(name), list(seen.values()))
    for name, rows in job.sampled.items():
        out[f"sampled:{name}"] = Stream(tasks.split_of(name)[0].grade, e.budget(name), list(rows),
                                        k=e.sampled_k, temperature=job.temperatures[name])
    return {key: dataclasses.replace(s, rows=sorted(s.rows, key=prompt_length)) for key, s in out.items()}


def greedy_key(job: EvalJob, set_name: str) -> str:
    """The greedy stream that decodes ``set_name``'s rows."""
    from grpo_core.data import tasks
    return f"greedy:{tasks.split_of(set_name)[0].name}@{job.evaluate.budget(set_name)}"


def row_key(row: dict) -> str:
    """A row's identity across sets: all of it (two sets' rows decode alike only if they are alike)."""
    return json.dumps(row, sort_keys=True)


def prompt_length(row: dict) -> int:
    """The prompt's length in characters: a tokenizer-free stand-in for its tokens."""
    return len(str(row.get("prompt", "")))


def run(job: EvalJob, shard: int = 0, shards: int = 1) -> dict:
    """The results of ``shard``'s share (every ``shards``-th row from the ``shard``-th) of each of
    ``job``'s streams: stream key -> results in the stream's order; ``merge`` makes them sets."""
    import torch

    from grpo_core.evaluation.greedy import greedy_results
    from grpo_core.evaluation.sampled import sampled_results
    from grpo_core.model.loading import load_policy

    torch.manual_seed(0)
    e = job.evaluate
    model, tok = load_policy(job.model_uri, trust_remote_code=job.trust_remote_code)
    if torch.cuda.is_available():
        model.to("cuda")
    common = dict(batch_size=e.batch_size, max_prompt_tokens=e.max_prompt_tokens, system_prompt=job.system_prompt)
    out = {}
    with evaluation_engine(e, job.label, model, tok, job.sets) as engine:
        for key, s in streams(job).items():
            rows = s.rows[shard::shards]
            if s.k:
                out[key] = sampled_results(model, tok, rows, k=s.k, temperature=s.temperature, max_new_tokens=s.cap,
                                           seed=e.sampled_seed + shard, grade=s.grade, engine=engine, **common)
            else:
                out[key] = greedy_results(model, tok, rows, max_new_tokens=s.cap, grade=s.grade, engine=engine,
                                          **common)
    return out


def evaluate(job: EvalJob, workers: int = 1) -> dict:
    """``job``'s results per set in item order, ``{"items": {...}, "sampled": {...}}``: in this
    process, or split over ``workers`` local processes (``run_split``)."""
    return run_split(job, workers) if workers > 1 else merge(job, [run(job)])


def interleave(parts: list[list], total: int) -> list:
    """The inverse of taking ``rows[i::N]`` for i < N = len(parts): item p of the whole comes from
    part p % N, position p // N."""
    if sum(len(p) for p in parts) != total:
        raise ValueError(f"the parts hold {sum(len(p) for p in parts)} items, the set {total}")
    return [parts[p % len(parts)][p // len(parts)] for p in range(total)]


def merge(job: EvalJob, parts: list[dict]) -> dict:
    """The parts' stream results as ``job``'s sets in item order: ``{"items": {set: [...]},
    "sampled": {set: [...]}}``, a row that two sets share given the same result in both."""
    by_row = {}
    for key, s in streams(job).items():
        results = interleave([p[key] for p in parts], len(s.rows))
        if stray := next((res["item_id"] for r, res in zip(s.rows, results) if res["item_id"] != r["id"]), None):
            raise ValueError(f"the parts of {key} do not follow this job's plan: {stray} is out of place")
        by_row[key] = {row_key(r): res for r, res in zip(s.rows, results)}
    return {"items": {name: [dict(by_row[greedy_key(job, name)][row_key(r)]) for r in rows]
                      for name, rows in job.sets.items()},
            "sampled": {name: [dict(by_row[f"sampled:{name}"][row_key(r)]) for r in rows]
                        for name, rows in job.sampled.items()}}


def worker_threads(workers: int) -> int:
    """Torch threads per worker: this process's cores shared out, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


def run_split(job: EvalJob, workers: int, threads: int | None = None) -> dict:
    """``job`` over ``workers`` local processes (``python -m grpo_core.evaluation.job``), each with
    ``threads`` torch threads (default ``worker_threads``); merged into item order. A worker that
    fails fails the evaluation, naming it; the others are stopped, and none outlives this call,
    nor this process if it is killed outright (``die_with_parent``). ``-P``: the worker imports
    grpo_core from ``PROJECT_DIR``, never from a checkout in its working directory."""
    threads = threads or worker_threads(workers)
    env = subprocess_env(threads)
    with tempfile.TemporaryDirectory(prefix=f"grpo-{job.label}-split-") as tmp:
        spec = Path(tmp) / "job.json"
        spec.write_text(job.to_json())
        outs = [Path(tmp) / f"part{i}.json" for i in range(workers)]
        procs = []
        try:
            for i, out in enumerate(outs):
                command = [sys.executable, "-P", "-m", "grpo_core.evaluation.job", "--job", str(spec), "--shard",
                           str(i), "--of", str(workers), "--out", str(out), "--parent", str(os.getpid())]
                procs.append(subprocess.Popen(command, env=env))
            codes = _wait_all(procs)
        finally:  # Ctrl-C or a failed step: no worker keeps decoding, orphaned
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=30)
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = [(i, rc) for i, rc in enumerate(codes) if rc != 0]
        if failed:
            raise RuntimeError(f"evaluation of {job.label}: worker {failed[0][0]} of {workers} exited with "
                               f"{failed[0][1]} (its log is above); evaluate.workers = 1 evaluates in one process")
        return merge(job, [json.loads(out.read_text()) for out in outs])


def _wait_all(procs: list, poll_s: float = 0.5) -> list[int]:
    """Exit codes of ``procs`` once all have ended, or as soon as one fails (the rest then still
    running, for the caller to stop)."""
    import time

    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return [0 if c is None else c for c in codes]
        time.sleep(poll_s)


@contextlib.contextmanager
def evaluation_engine(e: EvalConfig, label: str, model, tok, sets: dict):
    """The engine ``evaluate.engine`` names, for one checkpoint's evaluation, closed after it (a
    vLLM server stops with the block, also when it fails). It takes the weights once: every set
    of one checkpoint is decoded from the same weights. It decodes in the model's dtype (fp32 as
    the evaluation loads it); its longest sequence is the longest prompt read plus the largest cap
    of the sets evaluated; a server's log goes to a new directory per evaluation."""
    import torch

    from grpo_core.rollout import engines

    bf16 = next(model.parameters()).dtype == torch.bfloat16
    spec = engines.EngineSpec(vllm=e.vllm, precision="bf16" if bf16 else "fp32",
                              max_model_len=e.max_prompt_tokens + max((e.budget(n) for n in sets), default=1),
                              seed=e.sampled_seed,
                              log_dir=tempfile.mkdtemp(prefix=f"grpo-evaluate-{label}-") if e.engine == "vllm" else ".",
                              where="evaluate.vllm")
    engine = SyncedOnce(engines.build(e.engine, tok, spec))
    try:
        yield engine
    finally:
        engine.close()


class SyncedOnce:
    """An engine that takes the weights at its first ``sync_weights`` only: within one
    checkpoint's evaluation they do not change, and a vLLM engine would write and reload them
    for every set."""

    def __init__(self, engine):
        self.engine, self.synced = engine, False

    def sync_weights(self, model) -> None:
        if not self.synced:
            self.engine.sync_weights(model)
            self.synced = True

    def generate(self, rows, group_size, sampling):
        return self.engine.generate(rows, group_size, sampling)

    def close(self) -> None:
        self.engine.close()


def die_with_parent(parent: int) -> None:
    """End this worker when the process that started it dies, even by SIGKILL (a Metaflow task
    killed after a sibling failed runs no cleanup): Linux's parent-death signal, then a check that
    the parent did not die before it was set. Elsewhere only the check runs."""
    import signal

    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        sys.exit(f"evaluation worker: its parent {parent} is gone")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True, help="the job's JSON (EvalJob.to_json)")
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--of", type=int, default=1)
    p.add_argument("--out", required=True, help="where this shard's results go (JSON)")
    p.add_argument("--parent", type=int, help="the pid of the process that started this worker: end with it")
    a = p.parse_args(argv)
    if a.parent:
        die_with_parent(a.parent)
    if not 0 <= a.shard < a.of:
        p.error(f"--shard must be in 0..{a.of - 1}, got {a.shard}")
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
    result = run(EvalJob.from_json(Path(a.job).read_text()), a.shard, a.of)
    tmp = Path(f"{a.out}.tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(a.out)


if __name__ == "__main__":
    main()
