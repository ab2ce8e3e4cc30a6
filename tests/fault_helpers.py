"""Builders shared by the fault-injection tests: a short stage on the tiny model, its torchrun
process (started, waited for, its workers found), and a small checkpointable training state.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from grpo_core.config.pipeline import deep_merge
from tests.helpers import REPO, SEVENS, stage_args

TORCHRUN_TIMEOUT_S = 240


def short_stage(tiny, out, **kw) -> list[str]:
    base = dict(runtime=dict(model=str(tiny), output_dir=str(out)), rewards=SEVENS, iterations=4, optim=dict(lr=3e-3),
                loss=dict(beta=0.0), prompts_per_iter=4, sampling=dict(group_size=4, max_new_tokens=8),
                checkpoint=dict(every=2))
    return stage_args(**deep_merge(base, kw))


def logged_iterations(out: Path) -> list[int]:
    f = out / "metrics.jsonl"
    return [json.loads(ln)["iteration"] for ln in f.read_text().splitlines()] if f.exists() else []


def small_state(seed: int = 0):
    """A real model/optimizer/scheduler triple, small enough to checkpoint in milliseconds."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
    return model, opt, sched


def start_torchrun(tiny, out, log: Path, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "grpo_core.train", *short_stage(tiny, out, **kw)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def finish_torchrun(proc: subprocess.Popen, log: Path) -> int:
    try:
        return proc.wait(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"torchrun did not finish in {TORCHRUN_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def wait_for_iteration(proc: subprocess.Popen, out: Path, log: Path, iteration: int) -> None:
    """Until the running stage has logged ``iteration`` (its metrics.jsonl), or fail."""
    deadline = time.monotonic() + TORCHRUN_TIMEOUT_S
    while not any(i >= iteration for i in logged_iterations(out)):
        assert proc.poll() is None, f"torchrun exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no iteration {iteration} in time"
        time.sleep(0.05)


def torchrun_worker(torchrun_pid: int, rank: int) -> psutil.Process:
    for child in psutil.Process(torchrun_pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no torchrun worker with RANK={rank} under pid {torchrun_pid}")
