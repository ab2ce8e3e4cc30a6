"""One checkpoint's evaluation in one process or split over worker processes (``evaluate.workers``).

    .venv/bin/python benchmarks/bench_eval_split.py                      # GSM8K <= 2 steps, SmolLM2
    .venv/bin/python benchmarks/bench_eval_split.py --model tiny --size 8 --sampled-size 4 --cap 8 \
        --repeats 1 --out-dir /tmp                                     # smoke run, seconds

The job is the default run's GSM8K evaluation shape: greedy answers to the first ``--size`` GSM8K
test problems of <= 2 calculator steps, and k = 2 samples at temperature 1.0 for the first
``--sampled-size`` of them, 256-token cap, batches of 64, the in-process decoder. Way A runs it as
one worker process holding every core as torch threads (what ``evaluate.workers = 1`` does, in a
process of its own so both ways pay a process start and a model load); way B splits it over
``--workers`` processes (``grpo_core.evaluation.job.run_split``, the cores shared out). The ways
alternate A B B A ... over ``--repeats`` rounds; figures are medians with quartiles of wall seconds
per round, and the share of greedy answers that came out the same both ways (the batches differ,
so float rounding may flip a near-tie). Results: ``benchmarks/results/<name>.json``. GSM8K:
``GSM8K_DIR`` (a local copy of openai/gsm8k) or the hub.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # grpo_core, bench_decode (also as a plain script)
RESULTS = ROOT / "benchmarks" / "results"

from bench_decode import quartiles  # noqa: E402

from grpo_core.config.evaluation import EvalConfig  # noqa: E402
from grpo_core.evaluation import job as eval_job  # noqa: E402

SET = "gsm8k_test_le2"


def build_job(model_uri: str, size: int, sampled_size: int, cap: int) -> eval_job.EvalJob:
    from grpo_core.data import tasks
    from grpo_core.data.tasks import gsm8k
    from grpo_core.evaluation.greedy import held_out_items

    e = EvalConfig.from_table({"max_new_tokens": cap, "batch_size": 64, "sampled_sets": [SET], "sampled_k": 2,
                               "sampled_size": sampled_size, "gsm8k": {"size": -1, "max_difficulty": 2,
                                                                       "bounded_size": size, "max_new_tokens": cap}})
    params = {"gsm8k_source": gsm8k.resolve_source("openai/gsm8k"), "gsm8k_max_steps": 2}
    rows = held_out_items(tasks.task("gsm8k"), params, size)
    return eval_job.EvalJob(model_uri=model_uri, evaluate=e, sets={SET: rows}, sampled={SET: rows[:sampled_size]},
                            temperatures={SET: 1.0}, label="bench")


def timed(job: eval_job.EvalJob, workers: int, threads: int) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = eval_job.run_split(job, workers, threads)
    return time.perf_counter() - t0, out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="load_policy name or dir; 'tiny' for a smoke run")
    p.add_argument("--size", type=int, default=96, help="greedy GSM8K <= 2-step test items")
    p.add_argument("--sampled-size", type=int, default=32, help="of them, items sampled k = 2 times")
    p.add_argument("--cap", type=int, default=256, help="max_new_tokens")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="rounds of A B (then B A, ...)")
    p.add_argument("--name", default="eval_split")
    p.add_argument("--out-dir", default=str(RESULTS))
    a = p.parse_args(argv)
    cores = eval_job.worker_threads(1)
    model_uri = a.model
    if a.model == "tiny":  # a saved random-init Llama: seconds, for the smoke run
        import tempfile

        from grpo_core.model.loading import build_tiny, save_policy
        model_uri = tempfile.mkdtemp(prefix="bench-eval-split-")
        save_policy(*build_tiny("llama", hidden=32, layers=2, heads=4), model_uri)
    job = build_job(model_uri, a.size, a.sampled_size, a.cap)
    ways = {"one_process": (1, cores), "split": (a.workers, eval_job.worker_threads(a.workers))}
    rounds, answers = [], {}
    for r in range(a.repeats):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        got = {}
        for way in order:
            got[way], out = timed(job, *ways[way])
            answers.setdefault(way, [x["completion"] for x in out["items"][SET]])
        rounds.append(got)
        print(json.dumps({"round": r, **{k: round(v, 1) for k, v in got.items()}}), flush=True)
    same = sum(x == y for x, y in zip(answers["one_process"], answers["split"])) / max(1, len(answers["split"]))
    summary = {way: {"s_q1_med_q3": [round(v, 1) for v in quartiles([x[way] for x in rounds])], "workers": w,
                     "threads": t}
               for way, (w, t) in ways.items()}
    ratio = statistics.median(x["split"] / x["one_process"] for x in rounds)
    report = {"command": " ".join(["benchmarks/bench_eval_split.py", *(argv or sys.argv[1:])]), "model": a.model,
              "set": SET, "size": a.size, "sampled_size": a.sampled_size, "sampled_k": 2, "cap": a.cap,
              "cpus": os.cpu_count(), "rounds": rounds, "summary": summary, "split_over_one_median": ratio,
              "same_greedy_answers": same}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{a.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"summary": summary, "split_over_one_median": round(ratio, 3), "same_greedy_answers": same}))
    return report


if __name__ == "__main__":
    main()
