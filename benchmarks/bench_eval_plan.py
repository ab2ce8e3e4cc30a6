"""One checkpoint's GSM8K evaluation at this commit against an earlier one: the evaluation's
decoding plan, before and after.

    .venv/bin/python benchmarks/bench_eval_plan.py --before e18868b     # the default run's GSM8K sets
    .venv/bin/python benchmarks/bench_eval_plan.py --before HEAD --before-batch-size 64 --batch-size 128
                                                       # one checkout, two greedy batch sizes
    .venv/bin/python benchmarks/bench_eval_plan.py --before HEAD --model tiny --sizes 6,10 --cap 8 \
        --repeats 1 --out-dir /tmp                                    # smoke run, seconds

The job is the default run's greedy GSM8K evaluation (``flows/configs/local.toml``): the first
``--sizes`` items of ``gsm8k_test`` (any number of steps) and of ``gsm8k_test_le2`` (<= 2 steps;
the two share 40 items at the default 100 and 300), optionally k = 2 samples at temperature 1.0
for the first ``--sampled-size`` of the latter, 256-token cap, batches of ``--batch-size`` rows
(``--before-batch-size`` on the before side; both default to the default run's 64), split over
``--workers`` processes as ``evaluate.workers`` does. The same job runs from a checkout of
``--before`` (a git worktree made for the run, removed after it) and from this one, each in a
process of its own that imports its own ``grpo_core``; the two alternate A B B A ... over
``--repeats`` rounds. Figures: wall seconds per round, medians with quartiles, their ratio, and the
share of greedy answers that came out the same (the batches differ, so float rounding may flip a
near-tie), and the largest worker's peak RSS (``ru_maxrss`` of the job's child processes).
Results: ``benchmarks/results/<name>.json``. GSM8K: ``GSM8K_DIR`` or the hub.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SETS = ("gsm8k_test", "gsm8k_test_le2")


def child(a) -> None:
    """Times the job in this process's ``grpo_core`` (the tree named by ``--tree``, first on the path)."""
    sys.path.insert(0, a.tree)
    from grpo_core.config.evaluation import EvalConfig
    from grpo_core.data import tasks
    from grpo_core.data.tasks import gsm8k
    from grpo_core.evaluation import job as eval_job
    from grpo_core.evaluation.greedy import held_out_items

    assert Path(eval_job.__file__).resolve().is_relative_to(Path(a.tree).resolve()), eval_job.__file__
    size, bounded = (int(x) for x in a.sizes.split(","))
    sampled = [SETS[1]] if a.sampled_size else []
    gsm8k_table = {"size": size, "max_difficulty": 2, "bounded_size": bounded, "max_new_tokens": a.cap}
    e = EvalConfig.from_table({"max_new_tokens": 128, "batch_size": a.batch_size, "sampled_sets": sampled,
                               "sampled_k": 2, "sampled_size": a.sampled_size, "gsm8k": gsm8k_table})
    source = gsm8k.resolve_source("openai/gsm8k")
    sets = {SETS[0]: held_out_items(tasks.task("gsm8k"), {"gsm8k_source": source, "gsm8k_max_steps": 0}, size),
            SETS[1]: held_out_items(tasks.task("gsm8k"), {"gsm8k_source": source, "gsm8k_max_steps": 2}, bounded)}
    job = eval_job.EvalJob(model_uri=a.model_uri, evaluate=e, sets=sets,
                           sampled={name: sets[name][:a.sampled_size] for name in sampled},
                           temperatures={name: 1.0 for name in sampled}, label="bench")
    t0 = time.perf_counter()
    out = eval_job.run_split(job, a.workers)
    wall = time.perf_counter() - t0
    worker_rss_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    Path(a.out).write_text(json.dumps({"wall_s": wall, "worker_peak_rss_gb": worker_rss_gb, "batch_size": e.batch_size,
                                       "answers": {n: [r["completion"] for r in res]
                                                                    for n, res in out["items"].items()},
                                       "sampled_right": {n: sum(r["correct_k"] for r in res)
                                                         for n, res in out["sampled"].items()}}))


def timed(tree: str, a, model_uri: str, batch_size: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, __file__, "--child", "--tree", tree, "--model-uri", model_uri, "--out", f.name,
                        "--sizes", a.sizes, "--sampled-size", str(a.sampled_size), "--cap", str(a.cap),
                        "--workers", str(a.workers), "--batch-size", str(batch_size)], check=True, cwd=tree)
        return json.loads(Path(f.name).read_text())


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], text=True, capture_output=True).stdout.strip()


def model_for(a) -> str:
    if a.model != "tiny":
        return a.model
    sys.path.insert(0, str(ROOT))
    from grpo_core.model.loading import build_tiny, save_policy
    uri = tempfile.mkdtemp(prefix="bench-eval-plan-")
    save_policy(*build_tiny("llama", hidden=32, layers=2, heads=4), uri)
    return uri


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="the commit to compare this checkout with (required, but for --child)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="load_policy name or dir; 'tiny' for a smoke run")
    p.add_argument("--sizes", default="100,300", help="items of gsm8k_test and of gsm8k_test_le2")
    p.add_argument("--sampled-size", type=int, default=0, help="of gsm8k_test_le2's, items sampled k = 2 times")
    p.add_argument("--cap", type=int, default=256, help="max_new_tokens")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="evaluate.batch_size of this checkout's side")
    p.add_argument("--before-batch-size", type=int,
                   help="evaluate.batch_size of the before side (default: --batch-size)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of A B (then B A, ...)")
    p.add_argument("--name", default="eval_plan")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--model-uri", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(a)
    if not a.before:
        p.error("--before REV is required: the commit to compare this checkout with")
    model_uri = model_for(a)
    base = tempfile.mkdtemp(prefix="bench-eval-plan-tree-")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", base, a.before], check=True)
    trees = {"before": base, "after": str(ROOT)}
    batch = {"before": a.before_batch_size or a.batch_size, "after": a.batch_size}
    try:
        rounds, answers, peak_rss_gb = [], {}, {}
        for r in range(a.repeats):
            got = {}
            for way in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                res = timed(trees[way], a, model_uri, batch[way])
                got[way] = res["wall_s"]
                peak_rss_gb.setdefault(way, []).append(res["worker_peak_rss_gb"])
                assert res["batch_size"] == batch[way], (res["batch_size"], batch[way])
                answers.setdefault(way, res)
            rounds.append(got)
            print(json.dumps({"round": r, **{k: round(v, 1) for k, v in got.items()}}), flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", base], check=False)
        if a.model == "tiny":
            shutil.rmtree(model_uri, ignore_errors=True)
    from bench_decode import quartiles
    same = {n: sum(x == y for x, y in zip(answers["before"]["answers"][n], answers["after"]["answers"][n]))
            / max(1, len(answers["after"]["answers"][n])) for n in SETS}
    summary = {way: [round(v, 1) for v in quartiles([x[way] for x in rounds])] for way in trees}
    ratio = statistics.median(x["after"] / x["before"] for x in rounds)
    report = {"command": " ".join(["benchmarks/bench_eval_plan.py", *(argv or sys.argv[1:])]), "model": a.model,
              "before": git("rev-parse", "--short", a.before), "after": git("rev-parse", "--short", "HEAD"),
              "after_tree_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
              "sizes": a.sizes, "sampled_size": a.sampled_size, "cap": a.cap, "workers": a.workers,
              "batch_size": batch, "worker_peak_rss_gb": {way: round(max(v), 2) for way, v in peak_rss_gb.items()},
              "cpus": os.cpu_count(), "rounds": rounds, "wall_s_q1_med_q3": summary, "after_over_before_median": ratio,
              "same_greedy_answers": same,
              "sampled_right": {way: answers[way]["sampled_right"] for way in trees}}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{a.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"wall_s_q1_med_q3": summary, "after_over_before_median": round(ratio, 3),
                      "same_greedy_answers": same, "batch_size": batch,
                      "worker_peak_rss_gb": report["worker_peak_rss_gb"]}))
    return report


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT / "benchmarks")]  # bench_decode's quartiles (also as a plain script)
    main()
