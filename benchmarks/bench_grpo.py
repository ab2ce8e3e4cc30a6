"""GRPO iteration speed: our trainer vs TRL's GRPOTrainer on the same config, side by side.

    .venv/bin/python benchmarks/bench_grpo.py                     # all configs, ours vs TRL, in lockstep
    .venv/bin/python benchmarks/bench_grpo.py --configs ref --repeats 5 --iters 10
    .venv/bin/python benchmarks/bench_grpo.py --quick             # smoke run: tiny, ours only, seconds
    .venv/bin/python benchmarks/bench_grpo.py --configs smollm2 --threads 2 --iters 3 --warmup 1 \
        --repeats 2 --timeout 2400                                # the real model (SMOLLM2 below)
    .venv/bin/python benchmarks/bench_grpo.py --configs smollm2 --sides ours,ours+bf16,trl --threads 2 \
        --iters 3 --warmup 1 --repeats 2 --timeout 2400           # + ours sampling from a bf16 copy

Each side runs in its own worker process (so its peak RSS is that side's alone). All sides of a
run start together and then go in lockstep, one iteration at a time (ours, TRL, then TRL, ours,
...), each waiting while the other runs, so iteration i of ours and of TRL are seconds apart and
see the same machine (this VM's speed drifts by +-25% between runs a minute apart); all workers
run on the same CPU(s) (``pin_cpus``), the parent on the others. Per side: the
median over runs of each run's median seconds per iteration (the first ``--warmup`` iterations of
every run are excluded), completion tokens per second, the time split, peak RSS, mean completion
length; and ours/TRL ratios: the median (and quartiles) of the per-iteration ratios, the ratio of
medians, and the median of the per-run ratios. Results go to ``benchmarks/results/<name>.json``.

Both sides: a model directory (TRL reloads its reference model from that path), the arithmetic
prompts (GSM8K's for ``smollm2_gsm8k``) rendered by the model's chat template, the same reward,
beta 0.04 (k3 KL, reference forward), dapo loss, group-std advantages (eps 1e-4), clip 0.2, one
update per rollout batch, AdamW constant lr, grad-norm clip 1.0, temperature 1.0, top_k 0, top_p 1.0, stop at EOS or
max_new_tokens, fp32. Toy configs: a random-init Llama + character tokenizer, reward
``grpo_core.data.rewards.target_char_fraction``, lr 1e-4. The smollm2 configs: the real
SmolLM2-135M-Instruct, reward ``gsm8k_correctness``, lr 1e-5 (``SMOLLM2``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # grpo_core, lockstep, trl_runner (also as a plain script)
from lockstep import ITER, READY, RESULT, compare, cpu_set, pin_cpus, prompts_digest, run_lockstep, same_prompts  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
REWARD_FN = "grpo_core.data.rewards:target_char_fraction"
# name -> model and rollout shape; "ref" is the reference config
CONFIGS = {
    "ref": dict(hidden=64, layers=2, heads=4, group_size=8, prompts=8, max_new_tokens=32),
    "h128": dict(hidden=128, layers=2, heads=4, group_size=8, prompts=8, max_new_tokens=32),
    "t64": dict(hidden=64, layers=2, heads=4, group_size=8, prompts=8, max_new_tokens=64),
    "g16": dict(hidden=64, layers=2, heads=4, group_size=16, prompts=8, max_new_tokens=32),
    "quick": dict(hidden=32, layers=1, heads=2, group_size=4, prompts=2, max_new_tokens=8),
}
# The real model (issue #21): the packaged SmolLM2-135M-Instruct GGUF, converted once to safetensors;
# arithmetic prompts through its chat template, reward = answer correctness, lr 1e-5 (1e-4 is a toy's
# rate). Ours runs with micro_batch_groups = 1 (one group per backward, the same gradient): with our
# whole-batch backward the two workers would not fit this 24 GB machine at once (peak RSS per side:
# benchmarks/NOTES.md). Run these with --threads 2.
SMOLLM2 = dict(model="smollm2-135m-instruct", reward="grpo_core.data.rewards:gsm8k_correctness",
               common=dict(lr=1e-5), ours={"execution": {"micro_batch_groups": 1}})
# At the larger shapes TRL's whole-batch step alone outgrows 24 GB (killed at 20.6 GB at 128 tokens),
# so both sides backward one group at a time (TRL: gradient accumulation over one-group micro-batches,
# the 64 or 128 completions still generated together).
CONFIGS.update({
    "smollm2": dict(SMOLLM2, group_size=8, prompts=8, max_new_tokens=48),
    "smollm2_t128": dict(SMOLLM2, group_size=8, prompts=8, max_new_tokens=128, trl_micro_batch=8),
    "smollm2_g16": dict(SMOLLM2, group_size=16, prompts=8, max_new_tokens=48, trl_micro_batch=16),
    # Issue #34 item 4, memory at matched settings: smollm2_t128 with activation checkpointing on both
    # sides (ours checkpoints its packed scoring's layer loop; TRL the model's layers).
    "smollm2_t128_ckpt": dict(SMOLLM2, group_size=8, prompts=8, max_new_tokens=128, trl_micro_batch=8,
                              trl_gradient_checkpointing=True,
                              ours={"execution": {"micro_batch_groups": 1, "gradient_checkpointing": True}}),
    # The default run's GSM8K stage shape (issue #34): GSM8K train problems of <= 2 calculator steps,
    # 8 prompts x G=16, 256 new tokens, both sides backward one group at a time.
    "smollm2_gsm8k": dict(SMOLLM2, task="gsm8k", task_params={"gsm8k_source": "openai/gsm8k", "gsm8k_max_steps": 2},
                          group_size=16, prompts=8, max_new_tokens=256, trl_micro_batch=16),
})
# The same shape with our rollouts sampled from a bfloat16 copy of the policy
# (sampling.rollout_precision = "bf16"; the gap measured, rollout_is "none" as bf16 needs); TRL stays fp32.
BF16_ROLLOUTS = {"sampling": {"rollout_precision": "bf16"}, "loss": {"rollout_is": "none"}}
"""Our settings for sampling from the bf16 copy: the config below, and any side with a '+bf16' suffix."""
CONFIGS["smollm2_gsm8k_bf16"] = dict(CONFIGS["smollm2_gsm8k"], ours={
    "execution": {"micro_batch_groups": 1}, **BF16_ROLLOUTS})
# A config's prompts: ``task`` (default arithmetic) read with ``task_params``, on both sides in the
# order our trainer draws them (``trl_runner._dataset``).
COMMON = dict(beta=0.04, lr=1e-4, temperature=1.0, top_k=0, top_p=1.0, clip=0.2, max_grad_norm=1.0,
              loss_type="dapo", seed=0)


GAP_KEYS = ("rollout_logp_gap_mean", "rollout_is_capped_frac")
"""The trainer's metrics of a side sampling from a copy of the weights, carried per iteration and summarized."""


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def summarize(per_iter: list[dict], warmup: int) -> dict:
    """Median seconds/iteration and split over the iterations after the warm-up ones."""
    kept = per_iter[warmup:] or per_iter
    med = lambda k: statistics.median(r[k] for r in kept)  # noqa: E731
    tokens = sum(r["tokens"] for r in kept)
    seconds = sum(r["total"] for r in kept)
    out = {"s_per_iter": med("total"), "cpu_s_per_iter": med("cpu"), "tokens_per_s": tokens / seconds,
           "mean_completion_len": tokens / sum(r["completions"] for r in kept),
           "split_s": {k: med(k) for k in ("generate", "reward", "ref_old_logp", "fwd_bwd_step")},
           "iters_measured": len(kept), "iters_warmup": len(per_iter) - len(kept),
           "all_s_per_iter": [round(r["total"], 4) for r in per_iter],
           "iter_wall": [r["wall"] for r in per_iter if "wall" in r],  # [start, end] Unix times: the lockstep
           "prompt_digests": [r.get("prompts") for r in per_iter],
           "precisions": per_iter[-1].get("precisions")}  # ours: execution and rollout precision
    for k in GAP_KEYS:  # a side that samples from a copy
        if any(k in r for r in per_iter):
            out[k] = [r.get(k) for r in per_iter]
    return out


def build_model_dir(spec: dict, path: Path) -> Path:
    """A random tiny model saved to ``path``, or (``spec["model"]``) a real one's converted dir."""
    from grpo_core.io.gguf import convert_gguf
    from grpo_core.model.loading import build_tiny, save_policy

    if "model" in spec:
        return Path(convert_gguf(spec["model"])["uri"])
    model, tok = build_tiny("llama", spec["hidden"], spec["layers"], spec["heads"], seed=COMMON["seed"])
    return save_policy(model, tok, path)


# ----------------------------------------------------------------------------- our side

# Our speed levers, each of which a side named "ours-<lever>" switches off (before/after in one run)
LEVERS = {"decode": "shared-prefix decode loop (else transformers generate)",
          "score": "shared-prefix scoring forward for reference and policy (else full forward)",
          "chunks": "length-sorted scoring chunks that skip positions after EOS (else one padded call; "
                    "padded pieces only, so packing goes off too)",
          "head": "LM head run in position chunks (else the model's own head: whole [b, L, V] logits; "
                  "packed scoring needs the chunked head, so packing goes off too)",
          "pack": "packed, padding-free scoring of shared prompts (else padded pieces through the model's forward)"}


class Side(NamedTuple):
    kind: str                # "ours" or "trl"
    levers: list[str]        # our levers switched off
    compiled: bool           # "+compile"
    setting: str | None = None  # our settings suffix ("bf16" or "autocast"), a key of OUR_SETTINGS


OUR_SETTINGS = {"bf16": BF16_ROLLOUTS, "autocast": {"execution": {"precision": "bf16"}}}
"""Suffixes that run our side with other settings (ours only): "+bf16" samples from the bfloat16
copy of the policy; "+autocast" runs rollouts, scoring and the update under bf16 autocast
(``execution.precision = "bf16"``). The two exclude each other, as the config does."""


def parse_side(name: str) -> Side:
    """"ours[-<lever>...][+compile][+bf16|+autocast]" or "trl[+compile]" -> its ``Side``.

    "+compile": ours with ``compile_scoring`` (torch.compile of the scoring forwards), TRL with
    ``torch_compile=True`` (HF Trainer compiles the model it trains), so both can be compared
    compiled too. The first iterations compile: raise ``--warmup`` to keep them out of the timing.
    "+bf16", "+autocast": ``OUR_SETTINGS``, so one lockstep run times ours in fp32, ours with a
    precision lever and TRL side by side.
    """
    base, *extras = name.split("+")
    kind, *levers = base.split("-")
    settings = [e for e in extras if e in OUR_SETTINGS]
    bad = (kind not in ("ours", "trl") or (kind == "trl" and (levers or settings)) or len(settings) > 1
           or len(set(extras)) != len(extras) or any(e != "compile" and e not in OUR_SETTINGS for e in extras))
    if bad:
        raise SystemExit(f"unknown side {name!r}: use ours[-<lever>...][+compile][+bf16|+autocast] or trl[+compile]")
    unknown = [lv for lv in levers if lv not in LEVERS]
    if unknown:
        raise SystemExit(f"unknown lever {unknown[0]!r} in side {name!r}; known: {sorted(LEVERS)}")
    return Side(kind, levers, "compile" in extras, settings[0] if settings else None)


def disable_levers(names: list[str]) -> None:
    from grpo_core.policy import scoring
    from grpo_core.rollout import decode
    for name in names:
        if name not in LEVERS:
            raise SystemExit(f"unknown lever {name!r}; known: {sorted(LEVERS)}")
        if name == "decode":
            decode.fast_decode_supported = lambda model: False
        if name == "score":
            scoring.groups_share_prompts = lambda batch: False
        if name == "chunks":  # a lever of the padded pieces, which packing replaces
            scoring.SCORE_CALL_COST, scoring.PACKED = float("inf"), False
        if name == "head":
            scoring.HEAD_CHUNK = 0
        if name == "pack":
            scoring.PACKED = False


def update_flops(model, batch) -> float:
    """Matmul FLOPs of one full-fine-tuning forward + backward over ``batch`` as our update runs
    it: 6 x the non-embedding parameters per token forwarded (every completion token, plus each
    group's prompt once: the shared-prefix scorer), plus 6 x hidden x vocab for the LM head at
    each completion token. Attention's own score and value matmuls are left out (small at these
    lengths), and so is padding: the figure counts useful work."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - emb.numel() - (0 if head is emb else head.numel())
    completion = float(batch.completion_mask.sum())
    prompt = float(batch.prompt_mask[::batch.group_size].sum())
    return 6.0 * body * (completion + prompt) + 6.0 * emb.shape[1] * head.shape[0] * completion


def common_of(spec: dict) -> dict:
    """The settings both sides share: COMMON, with the config's own changes."""
    return {**COMMON, **spec.get("common", {})}


def reward_of(spec: dict) -> str:
    """The reward both sides score with: the config's, else the toy ``REWARD_FN``."""
    return spec.get("reward", REWARD_FN)


def run_ours(spec: dict, model_dir: str, iters: int, warmup: int, gate=None, emit=None,
             compile_scoring: bool = False, overrides: dict | None = None) -> list[dict]:
    """Our trainer's iterations; ``gate()`` (if given) is called before each one and ``emit(row)``
    after it (the lockstep protocol of ``run_lockstep``). ``overrides``: GRPOConfig fields that
    replace the bench's common settings (``reward_fn`` names the reward instead); the config's
    ``ours`` fields apply first."""
    import torch

    from grpo_core.config.pipeline import deep_merge
    from grpo_core.config.stage import GRPOConfig
    from grpo_core.policy import dist
    from grpo_core.rollout.generate import render_prompts
    from grpo_core.train.trainer import TIMED_PHASES, Trainer, iteration_seed

    out_dir = tempfile.mkdtemp(prefix="bench_ours_")
    settings = deep_merge(spec.get("ours", {}), dict(overrides or {}))
    reward_fn = settings.pop("reward_fn", reward_of(spec))
    common = common_of(spec)
    cfg = GRPOConfig(**deep_merge(dict(
        task=spec.get("task", "arithmetic"), **spec.get("task_params", {}),
        rewards=[{"fn": reward_fn, "weight": 1.0}], prompts_per_iter=spec["prompts"],
        iterations=iters + warmup, seed=common["seed"], runtime=dict(model=model_dir, output_dir=out_dir),
        sampling=dict(group_size=spec["group_size"], max_new_tokens=spec["max_new_tokens"],
                      temperature=common["temperature"], top_k=common["top_k"], top_p=common["top_p"]),
        loss=dict(type=common["loss_type"], beta=common["beta"], clip_low=common["clip"]),
        optim=dict(lr=common["lr"], max_grad_norm=common["max_grad_norm"], mu=1),
        execution=dict(compile_scoring=compile_scoring)), settings))
    trainer = Trainer(cfg, dist.init())
    rows = []
    for it in range(1, iters + warmup + 1):  # the body of Trainer.run without checkpoints / eval
        if gate:
            gate()
        trainer.timings = dict.fromkeys(TIMED_PHASES, 0.0)  # this iteration's phases only
        torch.manual_seed(iteration_seed(cfg.seed, it, 0))
        t0, c0, w0 = time.perf_counter(), time.process_time(), time.time()
        batch, roll = trainer.rollout()
        upd = trainer.update(batch)
        m = trainer.iteration_metrics(it, batch, roll, upd, time.perf_counter() - t0)
        total = time.perf_counter() - t0
        t = trainer.timings
        rows.append({"total": total, "cpu": time.process_time() - c0, "wall": [w0, time.time()],
                     "generate": t["time_generate"], "reward": t["time_reward"],
                     "ref_old_logp": t["time_ref"], "fwd_bwd_step": t["time_update"] - t["time_ref"],
                     "tokens": float(batch.completion_mask.sum()), "completions": len(batch),
                     "update_flops": update_flops(trainer.policy.model, batch),
                     "prompts": prompts_digest(render_prompts(trainer.policy.tok, batch.prompts)),
                     "reward_mean": m["reward"], "kl": m["kl"],
                     "precisions": {"execution": cfg.execution.precision, "rollout": cfg.sampling.rollout_precision},
                     **{k: m[k] for k in GAP_KEYS if k in m}})
        if emit:
            emit(rows[-1])
    return rows


def worker(args) -> dict:
    import torch

    if args.cpus:
        os.sched_setaffinity(0, cpu_set(args.cpus))
    torch.set_num_threads(args.threads)
    spec = CONFIGS[args.config]
    t0 = time.perf_counter()
    gate = lambda: print(READY, flush=True) or sys.stdin.readline()  # noqa: E731  (idle until "go")
    emit = lambda row: print(ITER + json.dumps(row), flush=True)  # noqa: E731
    kind, levers, compiled, setting = parse_side(args.worker)
    if kind == "ours":
        disable_levers(levers)
        rows = run_ours(spec, args.model_dir, args.iters, args.warmup, gate, emit, compile_scoring=compiled,
                        overrides=OUR_SETTINGS.get(setting))
    else:
        from trl_runner import run_trl

        rows = run_trl(spec, common_of(spec), reward_of(spec), args.model_dir, args.iters, args.warmup, gate,
                       emit, torch_compile=compiled)
    gate()  # idle until every side has run its last iteration: wrapping up must not share their CPU
    released = time.time()
    res = summarize(rows, args.warmup)
    res.update(side=args.worker, config=args.config, threads=torch.get_num_threads(),
               peak_rss_mb=round(peak_rss_mb(), 1), wall_s=round(time.perf_counter() - t0, 2),
               final_reward=rows[-1].get("reward_mean"), final_kl=rows[-1].get("kl"), released_at=released)
    return res


def cpu_model() -> dict:
    """Model name, family/model numbers and vector extensions from /proc/cpuinfo (Linux): ratios
    move between CPUs (matmul-heavy code gains more from AVX-512 than overhead-bound code)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    field = lambda name: next((ln.split(":", 1)[1].strip() for ln in text.splitlines()  # noqa: E731
                               if ln.split(":", 1)[0].strip() == name), None)
    flags = set((field("flags") or "").split())
    return {"cpu_model": field("model name"), "cpu_family": field("cpu family"), "cpu_model_number": field("model"),
            "cpu_vector": sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "fma"))}


def machine() -> dict:
    import platform

    import torch
    import transformers

    info = {"nproc": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu": platform.processor() or platform.machine()}
    info.update(cpu_model())
    try:
        import trl
        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    return info


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="ref,h128,t64,g16", help=f"comma list of {sorted(CONFIGS)}")
    p.add_argument("--sides", default="ours,trl",
                   help="comma list run in lockstep: ours, trl, or ours-<lever>[-<lever>] to switch "
                        f"levers off: {', '.join(f'{k} = {v}' for k, v in LEVERS.items())}; a '+compile' "
                        "suffix (ours+compile, trl+compile) runs that side with torch.compile; '+bf16' samples "
                        "ours from a bfloat16 copy of the policy (rollout_is none), '+autocast' runs ours under "
                        "bf16 autocast (execution.precision bf16)")
    p.add_argument("--iters", type=int, default=8, help="measured iterations per run")
    p.add_argument("--warmup", type=int, default=2, help="iterations per run excluded from the timing")
    p.add_argument("--repeats", type=int, default=3, help="runs per side and config (alternated)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in every run (both sides)")
    p.add_argument("--timeout", type=int, default=900, help="seconds allowed per run")
    p.add_argument("--no-pin", action="store_true",
                   help="let the OS place the workers (default: all on the same --threads CPUs, the parent elsewhere)")
    p.add_argument("--cpus", default="", help=argparse.SUPPRESS)
    p.add_argument("--name", default=None, help="results file name (default: bench_<configs>.json)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--quick", action="store_true", help="smoke run: tiny config, ours only, 1+1 iterations")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--table", metavar="JSON", help="print the markdown table of a results file and exit")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())))
        return {}
    if args.worker:
        print(RESULT + json.dumps(worker(args)), flush=True)
        return {}
    if args.quick:
        args.configs, args.sides, args.iters, args.warmup, args.repeats = "quick", "ours", 2, 1, 1
        args.name = args.name or "quick"
    sides = [s for s in args.sides.split(",") if s]
    if len(set(sides)) != len(sides):
        raise SystemExit(f"--sides must not repeat a side: {args.sides}")
    for side in sides:  # a bad name fails here, before any worker starts
        parse_side(side)
    parent_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if parent_cpus and not args.no_pin and not args.cpus:
        args.cpus = ",".join(map(str, pin_cpus(sorted(parent_cpus), args.threads)))
    try:
        if args.cpus and len(parent_cpus) > args.threads:  # the parent and its reader threads off the workers' CPUs
            os.sched_setaffinity(0, parent_cpus - cpu_set(args.cpus))
        return _run(args, sides)
    finally:
        if parent_cpus:
            os.sched_setaffinity(0, parent_cpus)


def _run(args, sides: list[str]) -> dict:
    configs = [c for c in args.configs.split(",") if c]
    report = {"machine": machine(), "threads": args.threads, "worker_cpus": args.cpus or None, "iters": args.iters,
              "warmup": args.warmup,
              "repeats": args.repeats, "common": COMMON, "command": " ".join([Path(sys.executable).name] + sys.argv),
              "configs": {}}
    with tempfile.TemporaryDirectory(prefix="bench_models_") as tmp:
        for name in configs:
            model_dir = build_model_dir(CONFIGS[name], Path(tmp) / name)
            runs = {s: [] for s in sides}
            for r in range(args.repeats):
                results = run_lockstep(__file__, sides, name, model_dir, args)
                for side in sides:
                    res = results[side]
                    runs[side].append(res)
                    print(f"[{name} #{r + 1}] {side:10s} {res['s_per_iter']:.4f} s/iter "
                          f"(cpu {res['cpu_s_per_iter']:.4f}) "
                          f"{res['tokens_per_s']:8.0f} tok/s  rss {res['peak_rss_mb']:.0f} MB  "
                          f"len {res['mean_completion_len']:.1f}  split {fmt_split(res['split_s'])}", flush=True)
            same = same_prompts(runs)
            report["configs"][name] = {"spec": CONFIGS[name], "summary": compare(runs), "runs": runs,
                                       "same_prompts": same}
            print(f"== {name}: every side saw the same prompts in every iteration: {same}")
            print_summary(name, report["configs"][name]["summary"])
    out = Path(args.out_dir) / f"{args.name or 'bench_' + '_'.join(configs)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}\n\n{markdown_table(report)}")
    return report


def markdown_table(report: dict) -> str:
    """The NOTES.md results table: one row per config and side."""
    lines = ["| config | side | median s/iter | CPU s/iter | tokens/s | peak RSS MB | mean len | s/iter vs TRL "
             "(median of iteration pairs [IQR]; of medians; median of run pairs) | CPU vs TRL | RSS vs TRL |",
             "|" + "---|" * 10]
    for name, c in report["configs"].items():
        for side, v in c["summary"].items():
            if not isinstance(v, dict):  # files written before per-side ratios keep them at this level
                continue
            f = lambda k, spec=".2f": format(v[k], spec) if k in v else "-"  # noqa: E731  (older files lack cpu)
            q = v.get("ratio_vs_trl_iter_pairs_iqr")  # files before session 4 lack it
            iqr = "[{:.2f}, {:.2f}]; ".format(*q) if q else ""
            r = (f"{f('ratio_vs_trl_iter_pairs_median')} {iqr}{f('ratio_vs_trl')}; {f('ratio_vs_trl_pairs_median')} | "
                 f"{f('cpu_ratio_vs_trl')} | "
                 f"{f('rss_ratio_vs_trl')}") if "ratio_vs_trl" in v else "- | - | -"
            lines.append(f"| {name} | {side} | {v['s_per_iter']:.3f} | {f('cpu_s_per_iter', '.3f')} | "
                         f"{v['tokens_per_s']:.0f} | {v['peak_rss_mb']:.0f} | {v['mean_completion_len']:.1f} | {r} |")
    return "\n".join(lines)


def fmt_split(split: dict) -> str:
    return " ".join(f"{k[:6]}={v:.3f}" for k, v in split.items())


def print_summary(name: str, summary: dict) -> None:
    for side, v in summary.items():
        ratio = (f"  ratio vs TRL {v['ratio_vs_trl']:.3f} (iteration pairs median "
                 f"{v['ratio_vs_trl_iter_pairs_median']:.3f}, run pairs median {v['ratio_vs_trl_pairs_median']:.3f}, "
                 f"cpu {v['cpu_ratio_vs_trl']:.3f}, rss {v['rss_ratio_vs_trl']:.2f})") if "ratio_vs_trl" in v else ""
        print(f"== {name} {side:10s} median {v['s_per_iter']:.4f} s/iter  {v['tokens_per_s']:.0f} tok/s  "
              f"rss {v['peak_rss_mb']:.0f} MB  len {v['mean_completion_len']:.1f}{ratio}", flush=True)


if __name__ == "__main__":
    main()
