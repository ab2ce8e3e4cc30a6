"""The lockstep protocol of the benchmark: one worker process per side, all started, then one
iteration of each side at a time, each waiting while the other runs, and the paired ratios of
the runs. Worker and parent talk through tagged stdout lines and "go" lines on stdin."""
from __future__ import annotations

import hashlib
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

READY, ITER, RESULT = "READY", "ITER ", "RESULT "  # tags of the worker's stdout lines (others are ignored)


def cpu_set(cpus: str) -> set[int]:
    return {int(c) for c in cpus.split(",")}


def _go(proc) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()


def _lines(proc, out: queue.Queue) -> None:
    for line in proc.stdout:
        out.put(line)
    out.put(None)  # EOF: the worker exited


def _next_tagged(side: str, lines: queue.Queue, tag: str, timeout: float, err) -> str:
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{side}: no {tag.strip()} line within {timeout} s") from None
        if line is None:
            err.seek(0)
            raise RuntimeError(f"{side} exited before its {tag.strip()} line:\n{err.read()[-4000:]}")
        if line.startswith(tag):
            return line[len(tag):]


def run_lockstep(script: str, sides: list[str], config: str, model_dir: Path, args) -> dict[str, dict]:
    """One run of every side, in lockstep: one worker process per side (so peak RSS is that side's
    alone; ``script --worker side ...`` prints the tagged lines below), all started, then iteration i of
    each side in turn (A B, then B A, ...), each waiting
    while the others run. Iteration i of ours and of TRL are seconds apart, so the per-iteration
    pairs see the same machine; this machine's speed drifts by +-25% between runs a minute apart.
    """
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error"}
    procs = {}
    try:
        for side in sides:
            cmd = [sys.executable, script, "--worker", side, "--config", config, "--model-dir", str(model_dir),
                   "--iters", str(args.iters), "--warmup", str(args.warmup), "--threads", str(args.threads),
                   "--cpus", args.cpus or ""]
            err = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty worker never blocks on it
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env=env, cwd=ROOT)
            lines = queue.Queue()
            threading.Thread(target=_lines, args=(proc, lines), daemon=True).start()
            procs[side] = (proc, lines, err)
        for side, (_, lines, err) in procs.items():  # every worker loaded and idle before the first iteration
            _next_tagged(side, lines, READY, args.timeout, err)
        n = args.iters + args.warmup
        for it in range(n):
            for side in (sides if it % 2 == 0 else sides[::-1]):
                proc, lines, err = procs[side]
                _go(proc)
                _next_tagged(side, lines, ITER, args.timeout, err)
                _next_tagged(side, lines, READY, args.timeout, err)  # idle again before the next side goes
        for proc, _, _ in procs.values():  # all done: let every worker wrap up and report
            _go(proc)
        return {side: json.loads(_next_tagged(side, lines, RESULT, args.timeout, err))
                for side, (_, lines, err) in procs.items()}
    finally:
        for proc, _, err in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            err.close()


def compare(runs: dict[str, list[dict]]) -> dict:
    med = lambda side, f: statistics.median(f(r) for r in runs[side])  # noqa: E731
    out = {}
    for side, rs in runs.items():
        out[side] = {"s_per_iter": med(side, lambda r: r["s_per_iter"]),
                     "cpu_s_per_iter": med(side, lambda r: r["cpu_s_per_iter"]),
                     "tokens_per_s": med(side, lambda r: r["tokens_per_s"]),
                     "peak_rss_mb": med(side, lambda r: r["peak_rss_mb"]),
                     "mean_completion_len": med(side, lambda r: r["mean_completion_len"]),
                     "split_s": {k: med(side, lambda r, k=k: r["split_s"][k]) for k in rs[0]["split_s"]},
                     "runs_s_per_iter": [round(r["s_per_iter"], 4) for r in rs]}
    base = "trl" if "trl" in runs else None
    for side in runs:
        if base and side != base:  # paired ratios: run i of this side against run i of the baseline
            pairs = [a["s_per_iter"] / b["s_per_iter"] for a, b in zip(runs[side], runs[base])]
            # and iteration i of this side against iteration i of the baseline (run in lockstep)
            iters = [x / y for a, b in zip(runs[side], runs[base])
                     for x, y in zip(a["all_s_per_iter"][a["iters_warmup"]:], b["all_s_per_iter"][b["iters_warmup"]:])]
            out[side].update(ratio_vs_trl=out[side]["s_per_iter"] / out[base]["s_per_iter"],
                             ratio_vs_trl_pairs_median=statistics.median(pairs),
                             ratio_vs_trl_pairs=[round(p, 3) for p in pairs],
                             ratio_vs_trl_iter_pairs_median=statistics.median(iters),
                             ratio_vs_trl_iter_pairs_iqr=[round(q, 3) for q in _quartiles(iters)],
                             cpu_ratio_vs_trl=out[side]["cpu_s_per_iter"] / out[base]["cpu_s_per_iter"],
                             rss_ratio_vs_trl=out[side]["peak_rss_mb"] / out[base]["peak_rss_mb"])
    return out


def prompts_digest(prompts: list[str]) -> str:
    """One iteration's distinct prompts, order-free, as 12 hex digits: two sides that were asked
    the same questions in an iteration have the same digest."""
    return hashlib.sha256("\n".join(sorted(set(prompts))).encode()).hexdigest()[:12]


def same_prompts(runs: dict[str, list[dict]]) -> bool | None:
    """Whether every side saw the same prompts in every iteration of every run (None: a side did
    not record them)."""
    seqs = [[r.get("prompt_digests") for r in rs] for rs in runs.values()]
    if not all(digests and all(digests) for seq in seqs for digests in seq):
        return None
    return all(seq == seqs[0] for seq in seqs)


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


def pin_cpus(cpus: list[int], threads: int) -> list[int]:
    """The CPUs every worker runs on: the last ``threads`` of those allowed. Only one worker runs at
    a time, so sharing them costs nothing, and every side gets the same cores. Unpinned, the OS
    kept each worker on its own vCPU, and on this VM two of our sides measured 1.065x apart per
    iteration (median) and up to 1.18x in decoding, which is the same code on both; pinned, 1.04x,
    and 1.00x with the two sides' order swapped (`ref`, 32 iteration pairs each)."""
    return cpus[-threads:] if threads < len(cpus) else cpus
