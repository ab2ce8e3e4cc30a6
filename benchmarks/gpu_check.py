"""GPU checks, then timings, for grpo_core on random models of SmolLM2-135M's and Qwen2-0.5B's
shapes in bf16 (random weights: the device machine reaches no registry, and the shape alone sets
the speed).

    bash benchmarks/gpu_check.sh                # a GPU machine; <= 8 minutes on one GPU
    bash benchmarks/gpu_check.sh --cpu-smoke    # anywhere: the same code paths on CPU, tiny config

``single`` (one process) checks, on the device against CPU references:
  1. token_logprobs forward+backward (bf16 and fp32 logits) vs CPU float64;
  2. grpo_loss forward+backward (fp32) vs CPU float64; the decoder's sampler's frequencies;
  3. one Trainer.update (tiny fp32 Llama) on the device vs the same update on CPU (gradients), and
     the update with precision = "bf16" (autocast) vs fp32 on the device (gradient cosine > 0.999);
  4. shared-prefix decoder vs transformers generate: greedy tokens equal (tiny fp32 model; the
     bf16 model's match rate is reported), shared-prefix scoring vs full forward (fp32: equal
     to 1e-4; bf16: reported);
then, per shape, checks one step's gradient (bf16 autocast on the device vs CPU fp32, SmolLM2's
shape: cosine > 0.99) and times generation tokens/s (our decoder and generate), the reference
forward, and the policy forward+backward+AdamW step (bf16 weights; then fp32 weights under
autocast, what ``precision = "bf16"`` trains with; its generation is timed too), with MFU = FLOPs / time / peak, FLOPs =
3 x forward, forward = 2 x matmul params x tokens processed (+ 2 x d x V per scored position)
+ causal attention 4 x d x keys per query and layer. ``ddp`` (under torchrun, nproc = GPU count)
checks an all_reduce and one DDP Trainer.update against the one-process gradient, then FSDP2
(``parallelism = "fsdp2"``: nccl all-gather / reduce-scatter, FSDP's bf16 mixed-precision policy):
the fp32 update equals the one-process gradient and the bf16 one points the same way (cosine >
0.99). On one GPU the trainer refuses fsdp2 (nothing to shard over), so the check shards the tiny
model over the 1-rank group directly: the same collectives and precision policy, unsplit. Failures are
collected, written to the JSON ($OUT or benchmarks/results) and make the exit code 1.

This file is the entry; the parts live beside it: ``gpu_check_single.py`` (correctness, timings),
``gpu_check_ddp.py`` (the torchrun part), ``gpu_check_common.py`` (what both use).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_check_common import BIG, FAILURES, SMOKE, flops_per_step  # noqa: E402, F401  (SMOKE, flops_per_step: tests)
from gpu_check_ddp import ddp_part  # noqa: E402
from gpu_check_single import SHAPES, correctness, timings  # noqa: E402

from grpo_core.policy import dist  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=("single", "ddp"))
    p.add_argument("--cpu-smoke", action="store_true", help="tiny config on CPU: proves the code paths")
    p.add_argument("--out", required=True, help="JSON file to write")
    a = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 checks compare true fp32 arithmetic
    tmp = tempfile.mkdtemp(prefix="gpu_check_")
    if a.part == "ddp":
        res = ddp_part(tmp)
        if int(os.environ.get("RANK", 0)) != 0:
            return 0
    else:
        if not a.cpu_smoke and not torch.cuda.is_available():
            print("no CUDA device visible; use --cpu-smoke to run the code paths on CPU", flush=True)
            return 2
        dev = torch.device("cpu" if a.cpu_smoke else "cuda")
        res = {"correctness": correctness(dev, tmp, 1000 if a.cpu_smoke else BIG["vocab_size"])}
        res["timings"] = {name: timings(dev, a.cpu_smoke, name) for name in SHAPES}
    res.update(failures=FAILURES, cpu_smoke=a.cpu_smoke, torch=torch.__version__)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {a.out}; {len(FAILURES)} failure(s)", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    code = main()
    if code == 0:
        dist.end_worker_process()  # under torchrun: skips a gloo teardown race (see grpo_core.policy.dist)
    sys.exit(code)
