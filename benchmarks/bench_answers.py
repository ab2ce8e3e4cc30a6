"""Grading speed on adversarial completions: how long ``gsm8k_reward`` + ``format_ok`` take on each
~200k-character input of tests/test_adversarial_answers.py's ADVERSARIAL table (the unit test checks only that
the work grows linearly). Prints the median and quartiles per input and writes
benchmarks/results/bench_answers.json.

    PYTHONPATH=. python benchmarks/bench_answers.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from grpo_core.data.answers import format_ok
from grpo_core.data.rewards import gsm8k_reward
from tests.test_adversarial_answers import ADVERSARIAL

RESULTS = Path(__file__).resolve().parent / "results" / "bench_answers.json"


def seconds_per_input(text: str, repeats: int) -> list[float]:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        gsm8k_reward(text, 1)
        format_ok(text)
        runs.append(time.perf_counter() - start)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = {}
    print(f"{'input':26s} {'chars':>8s} {'median ms':>10s} {'q1 ms':>8s} {'q3 ms':>8s}")
    for name, text in ADVERSARIAL.items():
        q1, med, q3 = statistics.quantiles(seconds_per_input(text, args.repeats), n=4)
        rows[name] = {"chars": len(text), "median_s": med, "q1_s": q1, "q3_s": q3}
        print(f"{name:26s} {len(text):8d} {med * 1e3:10.2f} {q1 * 1e3:8.2f} {q3 * 1e3:8.2f}")
    RESULTS.write_text(json.dumps({"repeats": args.repeats, "inputs": rows}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
