"""Evaluations at once or one after another: what the local backend's evaluation lock buys.

    .venv/bin/python benchmarks/bench_eval_concurrency.py --model smollm2-135m-instruct --copies 3 --size 100

The flow's ``evaluate`` foreach starts one task per checkpoint together. On one machine they share
its cores: each task's torch uses every core, so N tasks at once run N x cores threads. This
starts ``--copies`` greedy evaluations of the same model on the same held-out arithmetic items as
separate processes (as Metaflow's local runtime does), first all at once, then one after another,
alternating for ``--repeats`` rounds, and prints the wall time of each way. Results go to
``benchmarks/results/<name>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _evaluate_cmd(model: str, size: int, cap: int) -> list[str]:
    return [sys.executable, "-m", "grpo_core.evaluation", "--model", model, "--set", "arithmetic_test",
            "--size", str(size), "--max-new-tokens", str(cap), "--arithmetic-max", "30"]


def timed(commands: list[list[str]], together: bool) -> float:
    """Wall seconds to run every command, all at once or one after another."""
    start = time.perf_counter()
    if together:
        procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.DEVNULL) for c in commands]
        codes = [p.wait() for p in procs]
    else:
        codes = [subprocess.run(c, cwd=ROOT, stdout=subprocess.DEVNULL).returncode for c in commands]
    if any(codes):
        raise RuntimeError(f"an evaluation failed: exit codes {codes}")
    return time.perf_counter() - start


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="what --model of grpo_core.evaluation.greedy takes")
    p.add_argument("--copies", type=int, default=3, help="evaluations (the flow evaluates 3 checkpoints)")
    p.add_argument("--size", type=int, default=100, help="held-out arithmetic items per evaluation")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--name", default="eval_concurrency")
    a = p.parse_args(argv)
    commands = [_evaluate_cmd(a.model, a.size, a.max_new_tokens)] * a.copies
    rounds = []
    for r in range(a.repeats):
        order = (True, False) if r % 2 == 0 else (False, True)  # ABBA: drift hits both ways alike
        got = {("together" if t else "in_turn"): timed(commands, t) for t in order}
        rounds.append(got)
        print(json.dumps({"round": r, **{k: round(v, 1) for k, v in got.items()}}), flush=True)
    med = {k: statistics.median(x[k] for x in rounds) for k in ("together", "in_turn")}
    report = {"copies": a.copies, "size": a.size, "max_new_tokens": a.max_new_tokens, "model": a.model,
              "cpus": os.cpu_count(), "rounds": rounds, "median_s": med,
              "together_over_in_turn": med["together"] / med["in_turn"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{a.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"median_s": med, "together_over_in_turn": round(report["together_over_in_turn"], 2)}))
    return report


if __name__ == "__main__":
    main()
