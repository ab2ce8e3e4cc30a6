"""DDP vs FSDP2 at 2 ranks on the real SmolLM2-135M-Instruct: what each rank holds, its peak
memory, seconds per iteration, and the cost of gathering full weights for each rollout.

    .venv/bin/python benchmarks/bench_fsdp2.py                  # ddp then fsdp2, 1 + 2 iterations each
    .venv/bin/python benchmarks/bench_fsdp2.py --sides ddp+mb1,fsdp2+mb1 --name fsdp2_mb1_smollm2
    .venv/bin/python benchmarks/bench_fsdp2.py --iters 1 --warmup 0 --source tiny

Each side is one ``torchrun --nproc_per_node=2`` (gloo, one torch thread per rank), run one after
the other with the same seed, prompts and shape as ``bench_memory.py`` (8 prompts x G=8, 48 new
tokens, beta 0.04, fp32; each rank takes 4 prompts). Per rank it reports the bytes of parameters,
gradients and AdamW state the rank holds (a DTensor counts its local shard), the process's peak
RSS (``ru_maxrss``, model load included) and, for fsdp2, the seconds spent all-gathering full
weights before rollouts and reference scoring (``sharding.gathered``). Writes
``benchmarks/results/<name>.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
RESULTS = ROOT / "benchmarks" / "results"
SIDES = {"ddp": {}, "fsdp2": {"execution": {"parallelism": "fsdp2"}},  # whole rank batch per backward, or one group:
         "ddp+mb1": {"execution": {"micro_batch_groups": 1}},
         "fsdp2+mb1": {"execution": {"parallelism": "fsdp2", "micro_batch_groups": 1}}}


def worker(args) -> None:
    import torch
    from bench_grpo import run_ours
    from bench_memory import SHAPE

    from grpo_core.policy import sharding
    torch.set_num_threads(1)
    gather_s = []
    real = sharding.gathered

    @contextlib.contextmanager
    def timed_gather(root):  # the all-gather happens on entry
        t0 = time.perf_counter()
        with real(root):
            gather_s.append(time.perf_counter() - t0)
            yield

    sharding.gathered = timed_gather
    overrides = {"optim": {"lr": 1e-5}, "reward_fn": "grpo_core.data.rewards:gsm8k_correctness", **SIDES[args.worker]}
    holder = {}
    import grpo_core.train.trainer as trainer_module
    real_update = trainer_module.Trainer.update

    def update(self, batch):  # the rank's holdings right after an optimizer step
        out = real_update(self, batch)
        holder.update(sharding.training_bytes(self.policy.model, self.opt))
        return out

    trainer_module.Trainer.update = update
    rows = run_ours(SHAPE, args.model_dir, args.iters, args.warmup, overrides=overrides)
    kept = rows[args.warmup:] or rows
    iters = len(rows)
    res = {"rank": int(os.environ["RANK"]), "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                                                 / 2**20, 2),
           "held_gb": {k: round(v / 2**30, 3) for k, v in holder.items()}, "held_bytes": dict(holder),
           "s_per_iter": round(statistics.median(r["total"] for r in kept), 2),
           "gather_s_per_iter": round(sum(gather_s) / iters, 2), "gathers_per_iter": len(gather_s) / iters}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, res)
    if res["rank"] == 0:
        print("RESULT " + json.dumps({"side": args.worker, "settings": SIDES[args.worker], "ranks": gathered}),
              flush=True)
    from grpo_core.policy import dist
    dist.cleanup()
    dist.end_worker_process()


def table(results: list[dict]) -> str:
    lines = ["| side | params / rank GB | grads / rank GB | AdamW / rank GB | peak RSS rank 0 / 1 GB | s/iter "
             "| all-gather s/iter |", "|---|---|---|---|---|---|---|"]
    for r in results:
        r0, r1 = r["ranks"]
        h = r0["held_gb"]
        lines.append(f"| {r['side']} | {h['params']:.3f} | {h['grads']:.3f} | {h['optimizer']:.3f} | "
                     f"{r0['peak_rss_gb']:.2f} / {r1['peak_rss_gb']:.2f} | {r0['s_per_iter']:.1f} | "
                     f"{r0['gather_s_per_iter']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    from bench_memory import model_dir, run_worker

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", default="ddp,fsdp2")
    p.add_argument("--source", default="smollm2-135m-instruct",
                   help="model source (GGUF path or packaged name), or 'tiny' (a random 2-layer model)")
    p.add_argument("--iters", type=int, default=2, help="measured iterations per side")
    p.add_argument("--warmup", type=int, default=1, help="iterations excluded from the timing")
    p.add_argument("--name", default="fsdp2_smollm2")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return []
    if args.source == "tiny":
        import tempfile

        from grpo_core.model.loading import build_tiny, save_policy

        directory = str(save_policy(*build_tiny("llama", 64, 2, 4), Path(tempfile.mkdtemp()) / "tiny"))
    else:
        directory = model_dir(args.source)
    results = []
    for side in [s for s in args.sides.split(",") if s]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--worker", side, "--model-dir", directory, "--iters", str(args.iters), "--warmup", str(args.warmup)]
        results.append(run_worker(cmd, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                                  f"side {side}"))
        print(f"{side}: {results[-1]['ranks'][0]}", flush=True)
    print(table(results))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"source": args.source, "iters": args.iters, "warmup": args.warmup, "threads_per_rank": 1,
         "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
