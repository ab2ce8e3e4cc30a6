"""LoRA against full fine-tuning on the real SmolLM2-135M-Instruct: the default run's curriculum
stage, trained once per variant, then scored on the same held-out arithmetic items as the start
model (paired: exact McNemar p against the start and between the variants).

    .venv/bin/python benchmarks/bench_lora.py                        # lora only (full: see below)
    .venv/bin/python benchmarks/bench_lora.py --variants full,lora   # both, one after the other
    .venv/bin/python benchmarks/bench_lora.py --variants full --keep # add full to the saved lora run

Each variant is ``flows/configs/local.toml``'s ``[curriculum]`` table (8 prompts x G=8, 48 new
tokens, beta 0.04) at the schedule the recorded results used (``MEASURED``: 30 iterations at lr
1e-5, whatever local.toml's own schedule) with the variant's changes, trained by ``python -m grpo_core.train``
in a child process of its own (peak RSS: that process's ``ru_maxrss``, model loading included;
seconds per iteration: the median over iterations of metrics.jsonl's phase times). Evaluation is
the pipeline's: greedy, the first ``[evaluate.arithmetic] size`` items of the 0..30 test split, cap
``max_new_tokens``. Writes ``benchmarks/results/<name>.json`` with every item's result.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
RESULTS = ROOT / "benchmarks" / "results"
PHASES = ("time_generate", "time_reward", "time_ref", "time_update")  # metrics.jsonl's seconds per phase

# the curriculum schedule of results/lora_smollm2.json, kept so that the command reproduces it
MEASURED = {"iterations": 30, "optim": {"lr": 1e-5}}
# name -> curriculum fields changed from MEASURED (LoRA: 10x the full fine-tuning rate, the
# usual LoRA rule; rank 16 on every linear layer)
VARIANTS = {
    "full": {},
    "lora": {"lora": {"rank": 16, "alpha": 32.0}, "optim": {"lr": 1e-4}},
}


def stage_config(variant: str, model: str, out: Path, iterations: int | None) -> dict:
    from grpo_core.config.pipeline import PipelineConfig, deep_merge, parse_config_text

    pipe = PipelineConfig.from_dict(parse_config_text((ROOT / "flows/configs/local.toml").read_text()))
    changes = {**VARIANTS[variant], **({"iterations": iterations} if iterations else {})}
    table = deep_merge(deep_merge(pipe.curriculum, MEASURED), changes)
    cfg = PipelineConfig.from_dict({**pipe.to_dict(), "curriculum": table})
    return cfg.stage("curriculum", model=model, output_dir=str(out)).to_dict()


def train(variant: str, model: str, work: Path, iterations: int | None, threads: int) -> dict:
    out = work / variant
    cfg = stage_config(variant, model, out, iterations)
    out.mkdir(parents=True, exist_ok=True)
    (work / f"{variant}.json").write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "grpo_core.train", "--config", str(work / f"{variant}.json")],
                   env=env, check=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {"variant": variant, "settings": VARIANTS[variant], "iterations": len(rows), "wall_s": round(wall, 1),
            "s_per_iter": round(statistics.median(sum(r[k] for k in PHASES) for r in rows), 1),
            **{f"{k}_median": round(statistics.median(r[k] for r in rows), 1) for k in PHASES},
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
            "reward_first5": round(statistics.mean(r["reward"] for r in rows[:5]), 3),
            "reward_last5": round(statistics.mean(r["reward"] for r in rows[-5:]), 3),
            "final": str(out / "final")}


def evaluate(model_dir: str) -> list[dict]:
    import torch

    from grpo_core.config.pipeline import PipelineConfig, parse_config_text
    from grpo_core.data import tasks
    from grpo_core.evaluation.greedy import eval_sets, greedy_results
    from grpo_core.model.loading import load_policy

    pipe = PipelineConfig.from_dict(parse_config_text((ROOT / "flows/configs/local.toml").read_text()))
    task = tasks.task("arithmetic")
    params = task.params_of(pipe.stage("curriculum", model="-"))
    rows = eval_sets(pipe.evaluate, {"arithmetic_test": params})["arithmetic_test"]
    model, tok = load_policy(model_dir)
    torch.manual_seed(0)
    return greedy_results(model, tok, rows, max_new_tokens=pipe.evaluate.budget("arithmetic_test"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="lora")
    p.add_argument("--source", default="smollm2-135m-instruct")
    p.add_argument("--iterations", type=int, default=0, help="0: local.toml's")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default="/tmp/bench_lora")
    p.add_argument("--name", default="lora_smollm2")
    p.add_argument("--keep", action="store_true",
                   help="keep the saved results' other variants (same source, same start items)")
    a = p.parse_args(argv)
    import torch

    from grpo_core.evaluation.greedy import compare_to_start, summarize
    from grpo_core.io.gguf import convert_gguf

    torch.set_num_threads(a.threads)
    start = convert_gguf(a.source)["uri"]
    work = Path(a.work)
    out = {"source": a.source, "threads": a.threads, "date": time.strftime("%Y-%m-%d"), "variants": []}
    start_items = evaluate(start)
    out["start"] = {**summarize(start_items), "items": start_items}
    for variant in a.variants.split(","):
        trained = train(variant, start, work, a.iterations or None, a.threads)
        items = evaluate(trained["final"])
        out["variants"].append({**trained, **summarize(items), "vs_start": compare_to_start(start_items, items),
                                "items": items})
        print(json.dumps({k: v for k, v in out["variants"][-1].items() if k != "items"}), flush=True)
    saved = RESULTS / f"{a.name}.json"
    if a.keep and saved.exists():
        before = json.loads(saved.read_text())
        same = before["source"] == a.source and before["start"]["items"] == out["start"]["items"]
        if not same:
            raise SystemExit(f"--keep: {saved} was measured on another source or other start items")
        ran = {v["variant"] for v in out["variants"]}
        out["variants"] += [v for v in before["variants"] if v["variant"] not in ran]
        out["variants"].sort(key=lambda v: list(VARIANTS).index(v["variant"]))
    if len(out["variants"]) == 2:
        out["second_vs_first"] = compare_to_start(out["variants"][0]["items"], out["variants"][1]["items"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.name}.json").write_text(json.dumps(out, indent=1))
    print(f"start {out['start']['accuracy']:.3f}; " + "; ".join(
        f"{v['variant']} {v['accuracy']:.3f} (p={v['vs_start']['p_value']:.2g}, {v['s_per_iter']} s/it, "
        f"{v['peak_rss_gb']} GB)" for v in out["variants"]))


if __name__ == "__main__":
    main()
