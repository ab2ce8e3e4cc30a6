"""Decoding throughput: tokens/s of the rollout engine's decoder vs batch and cap, greedy and
sampled, against the fp32 compute floor, with levers switched on and off side by side.

    .venv/bin/python benchmarks/bench_decode.py                          # GSM8K shape, SmolLM2
    .venv/bin/python benchmarks/bench_decode.py --sampled 8x16 --greedy "" --caps 256 \
        --levers shared_prefix --repeats 3                               # one lever, A B A B
    .venv/bin/python benchmarks/bench_decode.py --sampled "" --greedy "" --step-shapes 64,128,256,8x16 \
        --levers shared_prefix                                           # one step at context P + 128
    .venv/bin/python benchmarks/bench_decode.py --sampled 8x16 --greedy "" --precisions fp32,bf16 \
        --name decode_bf16                                               # the rollout_precision lever
    .venv/bin/python benchmarks/bench_decode.py --model tiny --sampled 2x2 --greedy 4 --caps 8 \
        --repeats 1 --out-dir /tmp                                      # smoke run, seconds

Prompts: GSM8K train questions whose reference solution has <= 2 ``<<...>>`` calculator steps
(the GSM8K stage's easy problems) for sampling (``NxG``: N prompts, G samples each, temperature
1.0, the inverse-CDF sampler), and GSM8K test questions for greedy decoding (``R`` rows, G = 1,
stopping loops as the evaluation does). Every run goes through ``rollout.generate_rollouts``
with the decoder engine, so it times what ``InProcessEngine.generate`` does (prompt rendering,
prefill, decode, detokenizing). tokens: completion tokens up to and including the stop token.

Precisions: ``fp32`` decodes with the model itself, ``bf16`` with the engine's bfloat16 copy
(``engines.Bf16Copy``, what ``sampling.rollout_precision = "bf16"`` samples with); each repeat runs
both in turn. The floor stays the fp32 one, so a bf16 share above 100% is possible; the bf16
``torch.mm`` rate is recorded beside it.

Floor: the median fp32 ``torch.mm`` rate (1024^3, the same threads) over 2 x parameters FLOP per
token, measured again just before every sampled/greedy run (the run's share of the floor is
against that one; one-step timings use the start's). Each repeat runs every config and every
lever state in turn (A B A B ...), seeded the same per repeat; figures are medians with
quartiles over repeats. Results:
``benchmarks/results/<name>.json``. GSM8K: ``GSM8K_DIR`` (a local copy of openai/gsm8k) or the hub.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from itertools import product
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

from grpo_core.rollout import decode  # noqa: E402
from grpo_core.rollout.engines import Bf16Copy  # noqa: E402

LEVERS = {"shared_prefix": (decode, "SHARED_PREFIX_ATTENTION")}
"""Lever name -> (module, boolean attribute) that ``--levers`` switches off for the B runs."""


def mm_gflops(threads: int, n: int = 1024, reps: int = 15, dtype=torch.float32) -> float:
    """Median ``torch.mm`` rate (GFLOP/s) of an n x n x n product (fp32 unless ``dtype``)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times) / 1e9


def gsm8k_rows(split: str, n: int, max_steps: int | None) -> list[dict]:
    """The first ``n`` GSM8K rows of ``split`` with at most ``max_steps`` calculator annotations."""
    from grpo_core.data.tasks import gsm8k

    rows = gsm8k.rows(split, gsm8k.resolve_source("openai/gsm8k"))
    rows = [r for r in rows if max_steps is None or r["think"].count("<<") <= max_steps]
    if len(rows) < n:
        raise ValueError(f"--sampled/--greedy ask for {n} GSM8K {split} rows, only {len(rows)} exist")
    return rows[:n]


def load_model(name: str):
    """The policy (``models.load_policy``) or, for ``tiny``, a random-init Llama (smoke runs)."""
    from grpo_core.model.loading import build_tiny, load_policy

    model, tok = build_tiny("llama", hidden=32, layers=2, heads=4) if name == "tiny" else load_policy(name)
    return model.eval(), tok


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"8x8,8x16"`` -> [(8, 8), (8, 16)]; ``"64,128"`` -> [(64, 1), (128, 1)]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        n, _, g = part.partition("x")
        if not n.isdigit() or (g and not g.isdigit()):
            raise ValueError(f"shape {part!r}: write N (rows) or NxG (prompts x samples), e.g. 8x16")
        out.append((int(n), int(g or 1)))
    return out


def run_once(model, tok, rows: list[dict], G: int, cap: int, greedy: bool, seed: int) -> dict:
    """One ``generate_rollouts`` call: wall seconds, completion tokens, tokens/s."""
    from grpo_core.rollout.generate import generate_rollouts

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    batch = generate_rollouts(model, tok, rows, G, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=cap,
                              max_prompt_tokens=2048, greedy=greedy, engine="decoder", stop_loops=greedy)
    wall = time.perf_counter() - t0
    tokens = int(batch.completion_mask.sum())
    return {"s": wall, "tokens": tokens, "tok_s": tokens / wall, "steps": int(batch.completion_ids.shape[1]),
            "capped": int(batch.truncated.sum())}


def quartiles(xs: list[float]) -> list[float]:
    """[q1, median, q3] (the value itself for one run)."""
    if len(xs) == 1:
        return [xs[0]] * 3
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[1], q[2]]


def lever_states(names: list[str]) -> list[tuple[str, dict]]:
    """("all", every named lever on) and, per lever, ("no_<lever>", that one off, the others on).
    Each state sets every named lever explicitly: a lever's module default may be off
    (``decode.SHARED_PREFIX_ATTENTION`` is), and "all" must not mean "as the module happens to be"."""
    for name in names:
        if name not in LEVERS:
            raise ValueError(f"--levers: unknown lever {name!r}; known: {sorted(LEVERS)}")
    on = {n: True for n in names}
    return [("all", on)] + [(f"no_{n}", {**on, n: False}) for n in names]


@contextlib.contextmanager
def levers_set(values: dict):
    """The levers in ``values`` set so inside the block, each restored to what it was after it."""
    saved = {k: getattr(*LEVERS[k]) for k in values}
    for k, value in values.items():
        setattr(*LEVERS[k], value)
    try:
        yield {k: getattr(*LEVERS[k]) for k in values}
    finally:
        for k, value in saved.items():
            setattr(*LEVERS[k], value)


def measure(model, tok, args) -> list[dict]:
    """Every repeat runs every (shape, cap, lever state) once, in that order: A B A B."""
    sampled = [(n, g, False) for n, g in parse_shapes(args.sampled)]
    greedy = [(n, 1, True) for n, _ in parse_shapes(args.greedy)]
    caps = [int(c) for c in args.caps.split(",") if c]
    pools = {}
    if sampled:
        pools[False] = gsm8k_rows("train", max(n for n, *_ in sampled), args.max_steps)
    if greedy:
        pools[True] = gsm8k_rows("test", max(n for n, *_ in greedy), None)
    models = {p: model if p == "fp32" else Bf16Copy().sync(model) for p in args.precisions}
    records = []
    for rep in range(args.repeats):
        for n, G, is_greedy in sampled + greedy:
            for cap in caps:
                for (state, values), precision in product(lever_states(args.levers), args.precisions):
                    with levers_set(values) as levers:
                        rate = mm_gflops(args.threads, reps=5)  # this machine's speed drifts: the floor per run
                        r = run_once(models[precision], tok, pools[is_greedy][:n], G, cap, is_greedy, seed=1000 + rep)
                        r["floor_frac"] = r["tok_s"] / (rate * 1e9 / (2 * args.n_params))
                    r.update(mode="greedy" if is_greedy else "sampled", rows=n * G, prompts=n, G=G, cap=cap,
                             state=state, precision=precision, levers=levers, repeat=rep)
                    records.append(r)
                    print(f"  rep {rep} {r['mode']:7s} {n}x{G} cap {cap} {state:18s} {precision} {r['tokens']:6d} tok "
                          f"{r['s']:7.1f} s {r['tok_s']:7.1f} tok/s ({100 * r['floor_frac']:.0f}% of floor)",
                          flush=True)
    return records


def _stepper_with(values: dict, model, cache, mask, G: int, T: int):
    """A ``decode._Stepper`` built with the levers set as in ``values``, its buffers zeroed
    (unwritten slots hold garbage, denormals or NaN: time real numbers), warmed by one step."""
    from grpo_core.rollout.decode import _Stepper

    with levers_set(values):
        step = _Stepper(model, cache, mask, G, T)
    for buf in step.keys + step.values:
        buf.zero_()
    step(torch.zeros(mask.shape[0] * G, dtype=torch.long), T - 1)
    return step


def step_times(model, tok, args) -> list[dict]:
    """One decode step (``decode._Stepper``) at context prompt + ``--step-at`` for each ``--step-shapes``
    row count and lever state, timed ``--step-reps`` times per repeat, the states alternating
    step by step (A B A B): no sampling and
    no thinning, so this is the step's own cost per token at that batch."""
    from grpo_core.rollout.decode import no_grad_for_sampling, prefill
    from grpo_core.rollout.generate import encode_prompts

    shapes, t = parse_shapes(args.step_shapes), args.step_at
    pool = gsm8k_rows("train", max(n for n, _ in shapes), args.max_steps)
    records = []
    with no_grad_for_sampling(torch.device("cpu")):
        for rep in range(args.repeats):
            for n, G in shapes:
                ids, mask = encode_prompts(tok, [r["prompt"] for r in pool[:n]], 2048)
                _, cache = prefill(model, ids, mask)
                steppers = {}
                for state, values in lever_states(args.levers):
                    steppers[state] = _stepper_with(values, model, cache, mask, G, t + 1)
                tokens = torch.zeros(n * G, dtype=torch.long)
                for _ in range(args.step_reps):  # A B A B: the states see the same machine
                    for state, step in steppers.items():
                        t0 = time.perf_counter()
                        step(tokens, t)
                        wall = time.perf_counter() - t0
                        records.append({"mode": "step", "prompts": n, "G": G, "cap": t, "state": state,
                                        "precision": "fp32", "repeat": rep,
                                        "s": wall, "tokens": n * G, "tok_s": n * G / wall, "steps": 1, "capped": 0,
                                        "shared_prefix_layout": step.shared})
                print(f"  rep {rep} step {n}x{G} at {t} done", flush=True)
    return records


def summarize(records: list[dict], floor_tok_s: float) -> list[dict]:
    """Per (mode, prompts, G, cap, state): tokens/s [q1, median, q3] and its share of the floor (the
    median of the runs' shares of the floor measured just before each, where runs carry one)."""
    def key(r):
        return r["mode"], r["prompts"], r["G"], r["cap"], r["state"], r["precision"]

    keys = list(dict.fromkeys(key(r) for r in records))
    out = []
    for mode, n, G, cap, state, precision in keys:
        runs = [r for r in records if key(r) == (mode, n, G, cap, state, precision)]
        tok_s = quartiles([r["tok_s"] for r in runs])
        out.append({"mode": mode, "prompts": n, "G": G, "rows": n * G, "cap": cap, "state": state,
                    "precision": precision,
                    "tok_s_q1_med_q3": [round(x, 1) for x in tok_s], "floor_frac": round(statistics.median(
                        r.get("floor_frac", r["tok_s"] / floor_tok_s) for r in runs), 3),
                    "tokens_median": statistics.median(r["tokens"] for r in runs),
                    "steps_median": statistics.median(r["steps"] for r in runs),
                    "capped_median": statistics.median(r["capped"] for r in runs), "runs": len(runs)})
    return out


def write_report(report: dict, out_dir, name: str) -> Path:
    """``report`` as ``<out_dir>/<name>.json`` (indented; the folder made if missing), and where."""
    out = Path(out_dir) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="load_policy name, or 'tiny' (smoke)")
    p.add_argument("--sampled", default="8x8,8x16", help="NxG shapes sampled at temperature 1 ('' for none)")
    p.add_argument("--greedy", default="64,128,256", help="row counts decoded greedily ('' for none)")
    p.add_argument("--caps", default="256", help="comma list of max_new_tokens")
    p.add_argument("--max-steps", type=int, default=2, help="sampled prompts: at most this many <<...>> steps")
    p.add_argument("--levers", default="", help=f"comma list of levers also run switched off: {sorted(LEVERS)}")
    p.add_argument("--precisions", default="fp32", help="comma list of decode precisions: fp32, bf16")
    p.add_argument("--step-shapes", default="", help="NxG shapes timed one decode step at a time ('' for none)")
    p.add_argument("--step-at", type=int, default=128, help="the timed step's index (context: prompt + this)")
    p.add_argument("--step-reps", type=int, default=3, help="timed steps per shape, lever state and repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--name", default="decode")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    args.levers = [x for x in args.levers.split(",") if x]
    args.precisions = [x for x in args.precisions.split(",") if x]
    if not args.precisions or set(args.precisions) - {"fp32", "bf16"}:
        raise ValueError(f"--precisions: give a comma list of fp32 and bf16, got {args.precisions}")
    rate = mm_gflops(args.threads)
    rate_bf16 = mm_gflops(args.threads, dtype=torch.bfloat16) if "bf16" in args.precisions else None
    model, tok = load_model(args.model)
    n_params = args.n_params = sum(p.numel() for p in model.parameters())
    floor = rate * 1e9 / (2 * n_params)
    print(f"fp32 mm {rate:.1f} GFLOP/s, {n_params / 1e6:.1f}M params: floor {floor:.0f} tok/s "
          f"({args.threads} threads)", flush=True)
    records = measure(model, tok, args) + (step_times(model, tok, args) if args.step_shapes else [])
    rows = summarize(records, floor)
    for r in rows:
        q1, med, q3 = r["tok_s_q1_med_q3"]
        print(f"{r['mode']:7s} {r['prompts']}x{r['G']} cap {r['cap']} {r['state']:18s} {r['precision']} "
              f"{med:7.1f} tok/s "
              f"[{q1:.1f}, {q3:.1f}] = {100 * r['floor_frac']:.0f}% of floor")
    report = {"command": " ".join(sys.argv), "model": args.model, "threads": args.threads, "mm_gflops": round(rate, 1),
              "mm_gflops_bf16": rate_bf16 and round(rate_bf16, 1),
              "params": n_params, "floor_tok_s": round(floor, 1), "summary": rows,
              "runs": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for r in records]}
    write_report(report, args.out_dir, args.name)
    return report


if __name__ == "__main__":
    main()
