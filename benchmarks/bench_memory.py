"""Peak memory and time per iteration of our trainer on the real SmolLM2-135M-Instruct, one
variant at a time.

Each variant runs in its own process, one after the other (never side by side: a variant peaks
at 4-10 GB and this machine has 24 GB), with the same seed, prompts and shape:

    .venv/bin/python benchmarks/bench_memory.py                       # all variants, 1 + 3 iterations each
    .venv/bin/python benchmarks/bench_memory.py --variants default,mb1 --iters 2 --warmup 1
    .venv/bin/python benchmarks/bench_memory.py --variants default,lora,lora+mb1 --name memory_lora_smollm2

Shape (issue #21's real-model reference): the packaged GGUF converted once to safetensors,
arithmetic prompts through the chat template, reward ``gsm8k_correctness``, 8 prompts x G=8,
48 new tokens, beta 0.04, lr 1e-5, temperature 1.0, fp32, one process, ``--threads`` torch
threads. Peak RSS is the process's ``ru_maxrss`` after the last iteration (model load included).
Writes ``benchmarks/results/<name>.json`` and prints a table.
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
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
RESULTS = ROOT / "benchmarks" / "results"

SHAPE = dict(group_size=8, prompts=8, max_new_tokens=48)
# name -> trainer settings changed from the defaults (what the variant measures)
VARIANTS = {
    "default": {},
    "mb2": {"execution": {"micro_batch_groups": 2}},
    "mb1": {"execution": {"micro_batch_groups": 1}},
    "ckpt": {"execution": {"gradient_checkpointing": True}},
    "mb2+ckpt": {"execution": {"micro_batch_groups": 2, "gradient_checkpointing": True}},
    "mb1+ckpt": {"execution": {"micro_batch_groups": 1, "gradient_checkpointing": True}},
    "beta0": {"loss": {"beta": 0.0}},
    # LoRA as bench_lora.py trains it (rank 16 on all linear layers; adapters take a 10x larger lr)
    "lora": {"lora": {"rank": 16, "alpha": 32.0}, "optim": {"lr": 1e-4}},
    "lora+mb1": {"lora": {"rank": 16, "alpha": 32.0}, "optim": {"lr": 1e-4}, "execution": {"micro_batch_groups": 1}},
    # the model's own LM head (SCORING below): whole [b, L, V] logits and their gradient
    "fullhead": {},
    "mb1+fullhead": {"execution": {"micro_batch_groups": 1}},
    # shared-prefix pieces padded to each piece's longest completion (SCORING below)
    "padded": {},
    "mb1+padded": {"execution": {"micro_batch_groups": 1}},
}
# name -> grpo_core.policy.scoring switches the variant sets (module settings, not trainer config)
SCORING = {"fullhead": {"HEAD_CHUNK": 0}, "mb1+fullhead": {"HEAD_CHUNK": 0},
           "padded": {"PACKED": False}, "mb1+padded": {"PACKED": False}}


def model_dir(source: str) -> str:
    from grpo_core.io.gguf import convert_gguf

    return convert_gguf(source)["uri"]


def run_worker(cmd: list[str], env: dict, label: str) -> dict:
    """Run one side's worker process; its ``RESULT {json}`` stdout line, or exit naming the side."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode or line is None:
        raise SystemExit(f"{label} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def matmul_peak_gflops(n: int = 2048, reps: int = 10) -> float:
    """This process's fp32 ``torch.mm`` throughput (median of ``reps`` n x n products) at its
    current thread count: the physical ceiling beside the update's achieved GFLOP/s."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def current_rss_gb() -> float:
    """This process's resident set now (``VmRSS``), in GB."""
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmRSS:"))
    return int(line.split()[1]) / 2**20


class SavedActivations:
    """The bytes autograd saves for backward in each scoring forward with grad (the update's
    micro-batches), parameters aside: what one backward's activations hold at its start. Storages
    are counted once however many tensors view them."""

    def __init__(self):
        self.largest = 0

    def wrap(self, score):
        import torch

        def scored(model, *args, **kwargs):
            if not torch.is_grad_enabled():
                return score(model, *args, **kwargs)
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            storages = {}

            def pack(t):
                s = t.untyped_storage()
                if s.data_ptr() not in params:
                    storages[s.data_ptr()] = s.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = score(model, *args, **kwargs)
            self.largest = max(self.largest, sum(storages.values()))
            return out
        return scored


def worker(args) -> dict:
    import resource

    import torch
    from bench_grpo import run_ours

    import grpo_core.policy.policy as policy_module
    import grpo_core.train.trainer as trainer_module
    from grpo_core.policy.sharding import training_bytes

    torch.set_num_threads(args.threads)
    from grpo_core.policy import scoring
    switches = SCORING.get(args.worker, {})
    for name, value in switches.items():
        setattr(scoring, name, value)
    overrides = {"optim": {"lr": 1e-5}, "reward_fn": "grpo_core.data.rewards:gsm8k_correctness",
                 **VARIANTS[args.worker]}
    runtime_gb = current_rss_gb()  # python, torch and transformers imported, nothing loaded
    held, saved, real_update = {}, SavedActivations(), trainer_module.Trainer.update
    policy_module.completion_logprobs = saved.wrap(policy_module.completion_logprobs)  # the update's forward

    def update(self, batch):  # what the process holds right after an optimizer step
        out = real_update(self, batch)
        held.update(training_bytes(self.policy.model, self.opt))
        ref = self.policy.ref
        held["reference"] = sum(p.numel() * p.element_size() for p in ref.parameters()) if ref else 0
        return out

    trainer_module.Trainer.update = update
    rows = run_ours(SHAPE, args.model_dir, args.iters, args.warmup, overrides=overrides)
    kept = rows[args.warmup:] or rows
    med = lambda k: round(statistics.median(r[k] for r in kept), 2)  # noqa: E731
    full = "lora" not in VARIANTS[args.worker]  # LoRA skips the base weights' gradients: another count
    achieved = statistics.median(r["update_flops"] / r["fwd_bwd_step"] for r in kept) / 1e9 if full else None
    peak = matmul_peak_gflops()
    settings = {**VARIANTS[args.worker], **{f"scoring.{name}": value for name, value in switches.items()}}
    return {"variant": args.worker, "settings": settings, "threads": args.threads,
            "update_gflops": achieved and round(achieved, 1), "matmul_peak_gflops": round(peak, 1),
            "update_of_peak": achieved and round(achieved / peak, 3),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "breakdown_gb": {"runtime": round(runtime_gb, 2), **{k: round(v / 2**30, 2) for k, v in held.items()},
                             "saved_activations": round(saved.largest / 2**30, 2)},
            "s_per_iter": med("total"), "generate_s": med("generate"), "reference_s": med("ref_old_logp"),
            "update_s": med("fwd_bwd_step"), "mean_completion_len": round(
                sum(r["tokens"] for r in kept) / sum(r["completions"] for r in kept), 1),
            "all_s_per_iter": [round(r["total"], 2) for r in rows], "reward": [r["reward_mean"] for r in rows]}


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["variant"] == "default"), results[0])
    lines = ["| variant | settings | peak RSS GB | vs default | s/iter | generate | reference | update | "
             "update GFLOP/s (of mm peak) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['variant']} | {json.dumps(r['settings']) if r['settings'] else '-'} | "
                     f"{r['peak_rss_gb']:.2f} | {r['peak_rss_gb'] / base['peak_rss_gb']:.2f}x | "
                     f"{r['s_per_iter']:.1f} | "
                     f"{r['generate_s']:.1f} | {r['reference_s']:.1f} | {r['update_s']:.1f} | "
                     + (f"{r['update_gflops']:.1f} ({r['update_of_peak']:.0%} of {r['matmul_peak_gflops']:.0f}) |"
                        if r.get("update_gflops") else "- |"))
    return "\n".join(lines)


def breakdown_table(results: list[dict]) -> str:
    """Where each variant's peak goes: the runtime before loading, the bytes held after a step,
    the largest micro-batch's saved activations, and the rest (transients of backward and
    generation, allocator slack)."""
    keys = ("runtime", "params", "reference", "grads", "optimizer", "saved_activations")
    lines = ["| variant | peak RSS GB | runtime | policy | reference | gradients | AdamW | saved activations "
             "(largest micro-batch) | rest |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = r["breakdown_gb"]
        rest = r["peak_rss_gb"] - sum(b.get(k, 0) for k in keys)
        lines.append(f"| {r['variant']} | {r['peak_rss_gb']:.2f} | "
                     + " | ".join(f"{b.get(k, 0):.2f}" for k in keys) + f" | {rest:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--source", default="smollm2-135m-instruct", help="model source (GGUF path or packaged name)")
    p.add_argument("--iters", type=int, default=3, help="measured iterations per variant")
    p.add_argument("--warmup", type=int, default=1, help="iterations excluded from the timing")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--name", default="memory_smollm2")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return []
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}; known: {list(VARIANTS)}")
    directory = model_dir(args.source)
    results = []
    for name in names:
        cmd = [sys.executable, __file__, "--worker", name, "--model-dir", directory, "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--threads", str(args.threads)]
        results.append(run_worker(cmd, {**os.environ, "OMP_NUM_THREADS": str(args.threads)}, f"variant {name}"))
        print(f"{name}: {results[-1]['peak_rss_gb']} GB, {results[-1]['s_per_iter']} s/iter", flush=True)
    print(table(results))
    print(breakdown_table(results))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"shape": SHAPE, "source": args.source, "iters": args.iters, "warmup": args.warmup, "results": results},
        indent=1))
    return results


if __name__ == "__main__":
    main()
