"""The gap a bf16 sampling copy opens: its samples scored by the fp32 policy, as the update scores
them, and what each ``loss.rollout_is`` mode does with it.

    .venv/bin/python benchmarks/bench_rollout_gap.py                       # GSM8K shape, SmolLM2
    .venv/bin/python benchmarks/bench_rollout_gap.py --model tiny --sampled 2x2 --cap 5 --out-dir /tmp  # smoke

The engine of ``sampling.rollout_precision = "bf16"`` (``engines.InProcessEngine`` with its
``Bf16Copy``) samples ``NxG`` completions of easy GSM8K train prompts (``bench_decode.gsm8k_rows``)
at temperature 1; ``policy.scoring.completion_logprobs`` scores them with the fp32 model. Reported:
the per-token gap |old_logp - sampler_logp| (mean, max, signed mean), quantiles of each
completion's summed log-ratio and of its weight exp(sum), and per mode the share of tokens the cap
changed (``losses.rollout_is_weights``' ``capped``) and, for the mask modes, the completions left
with no weight. Results: ``benchmarks/results/<name>.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
RESULTS = ROOT / "benchmarks" / "results"

from bench_decode import gsm8k_rows, load_model, parse_shapes, write_report  # noqa: E402

MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def gap_report(old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, cap: float) -> dict:
    """The figures above from scored ``old`` and sampled ``sampler`` log-probs [B, T] on ``mask``."""
    from grpo_core.algo.losses import rollout_is_weights

    diff = torch.where(mask, old - sampler, torch.zeros_like(old))
    tokens = diff[mask]
    seq = diff.sum(-1).double()
    q = torch.tensor(QUANTILES, dtype=torch.float64)
    out = {"tokens": int(mask.sum()), "completions": int(mask.shape[0]), "gap_mean": float(tokens.abs().mean()),
           "gap_max": float(tokens.abs().max()), "signed_mean": float(tokens.mean()),
           "seq_logratio_quantiles": dict(zip(map(str, QUANTILES), torch.quantile(seq, q).tolist())),
           "seq_weight_quantiles": dict(zip(map(str, QUANTILES), torch.quantile(seq.exp(), q).tolist())),
           "modes": {}}
    for mode in MODES:
        w, stats = rollout_is_weights(old, sampler, mask, mode, cap)
        zeroed = int(((w * mask).sum(-1) == 0).sum()) if mode.endswith("mask") else None
        out["modes"][mode] = {"capped_token_frac": float(stats["capped"]) / float(stats["tokens"]),
                              "completions_zeroed": zeroed}
    return out


def main(argv=None) -> dict:
    from grpo_core.policy.scoring import completion_logprobs
    from grpo_core.rollout import engines

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="load_policy name, or 'tiny' (smoke)")
    p.add_argument("--sampled", default="8x16", help="NxG: N prompts, G samples each")
    p.add_argument("--cap", type=int, default=256, help="max_new_tokens")
    p.add_argument("--max-steps", type=int, default=2, help="prompts: at most this many <<...>> steps")
    p.add_argument("--is-cap", type=float, default=3.0, help="rollout_is_cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--name", default="rollout_gap_bf16")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    (n, G), = parse_shapes(args.sampled)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    engine = engines.build("decoder", tok, engines.EngineSpec(rollout_precision="bf16"))
    engine.sync_weights(model)
    torch.manual_seed(args.seed)
    batch = engine.generate(gsm8k_rows("train", n, args.max_steps), G,
                            engines.Sampling(max_new_tokens=args.cap, max_prompt_tokens=4096))
    with torch.no_grad():
        old, _ = completion_logprobs(model, batch, 1.0)
    report = {"command": " ".join(sys.argv), "model": args.model, "prompts": n, "G": G, "cap": args.cap,
              "is_cap": args.is_cap, "seed": args.seed,
              **gap_report(old, batch.sampler_logp, batch.completion_mask, args.is_cap)}
    print(json.dumps(report, indent=1))
    write_report(report, args.out_dir, args.name)
    return report


if __name__ == "__main__":
    main()
