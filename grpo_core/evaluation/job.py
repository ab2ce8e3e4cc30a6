"""One checkpoint's evaluation as a job: every held-out set decoded greedily, the sampled sets k
times per item, all from one engine; run in this process or split over local worker processes.

A split job (``run_split``) gives worker i of N every N-th item of every set (``rows[i::N]``:
each worker gets a like share of easy and hard items) and seeds its sampled accuracy with
``sampled_seed + i``; the parent merges the parts back into item order. The split is fixed by N,
so every checkpoint of a run (and every run with the same ``evaluate.workers``) draws the same
samples for the same item: the paired tests still compare like with like. It exists because on a
small CPU machine N processes of one thread decode faster than one process of N threads (the
decode step is many small ops whose OpenMP barriers cost more than they share:
benchmarks/NOTES.md, "Evaluation split over processes").

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


def run(job: EvalJob, shard: int = 0, shards: int = 1) -> dict:
    """Greedy results of ``job``'s sets and sampled results of its sampled sets, for the items of
    ``shard`` (every ``shards``-th item from the ``shard``-th): ``{"items": {...}, "sampled": {...}}``."""
    import torch

    from grpo_core.data import tasks
    from grpo_core.evaluation.greedy import greedy_results
    from grpo_core.evaluation.sampled import sampled_results
    from grpo_core.model.loading import load_policy

    torch.manual_seed(0)
    e = job.evaluate
    model, tok = load_policy(job.model_uri, trust_remote_code=job.trust_remote_code)
    if torch.cuda.is_available():
        model.to("cuda")
    grade = {name: tasks.split_of(name)[0].grade for name in job.sets}
    common = dict(batch_size=e.batch_size, max_prompt_tokens=e.max_prompt_tokens, system_prompt=job.system_prompt)
    with evaluation_engine(e, job.label, model, tok, job.sets) as engine:
        items = {name: greedy_results(model, tok, rows[shard::shards], max_new_tokens=e.budget(name),
                                      grade=grade[name], engine=engine, **common)
                 for name, rows in job.sets.items()}
        sampled = {name: sampled_results(model, tok, rows[shard::shards], k=e.sampled_k,
                                         temperature=job.temperatures[name], max_new_tokens=e.budget(name),
                                         seed=e.sampled_seed + shard, grade=grade[name], engine=engine, **common)
                   for name, rows in job.sampled.items()}
    return {"items": items, "sampled": sampled}


def interleave(parts: list[list], total: int) -> list:
    """The inverse of taking ``rows[i::N]`` for i < N = len(parts): item p of the whole comes from
    part p % N, position p // N."""
    if sum(len(p) for p in parts) != total:
        raise ValueError(f"the parts hold {sum(len(p) for p in parts)} items, the set {total}")
    return [parts[p % len(parts)][p // len(parts)] for p in range(total)]


def merge(job: EvalJob, parts: list[dict]) -> dict:
    """The split runs' results in item order, as ``run(job)`` returns them."""
    return {"items": {name: interleave([p["items"][name] for p in parts], len(rows))
                      for name, rows in job.sets.items()},
            "sampled": {name: interleave([p["sampled"][name] for p in parts], len(rows))
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
