"""A supervised warm start on GSM8K train solutions (issue #33): fine-tune a model on N easy problems.

Takes GSM8K train problems of at most ``--max-steps`` calculator steps, shuffles them with
``random.Random(7)`` (the tuning doc's probe order), keeps the first ``--probe`` (48) out as the
probe set and trains on the next ``--n``. Each example is the question rendered as the stage and the
evaluation render it (``rollout.generate.render_prompts``, the tokenizer's default system message),
then the reference solution with its ``<<...>>`` calculator annotations removed and its ``#### N``
line replaced by ``The answer is N.``, then eos. The loss covers the completion tokens only. One
epoch, AdamW in fp32 at a constant lr, 2 torch threads. Saves the model with
``model.loading.save_policy`` (safetensors) and prints the figures (loss, wall time, peak RSS),
also written as JSON to ``--json``.

    PYTHONPATH=$PWD GSM8K_DIR=/work/shared/data/gsm8k python benchmarks/gsm8k_warm_start.py \\
        --model $CUR --out /tmp/sft512 --n 512 --lr 1e-5 \\
        --json benchmarks/results/gsm8k_warm_start_n512_lr1e-5.json
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import time

import torch

from grpo_core.data.tasks import gsm8k
from grpo_core.model.loading import load_policy, save_policy
from grpo_core.pipeline.sft import collate
from grpo_core.rollout.generate import render_prompts

PROBE_SEED = 7  # the tuning doc's probe shuffle


def split_rows(source: str, max_steps: int, probe: int, n: int) -> tuple[list[dict], list[dict]]:
    """(probe rows, training rows): the shuffled easy train rows' first ``probe``, then the next ``n``."""
    rows = gsm8k.rows("train", source, gsm8k_max_steps=max_steps)
    random.Random(PROBE_SEED).shuffle(rows)
    if probe + n > len(rows):
        raise ValueError(f"--n {n} + --probe {probe} exceeds the {len(rows)} train rows of <= {max_steps} steps")
    held, train = rows[:probe], rows[probe:probe + n]
    assert not {r["id"] for r in held} & {r["id"] for r in train}
    return held, train


def solution_text(row: dict) -> str:
    """The reference solution without calculator annotations, ending in ``The answer is N.``"""
    think = gsm8k.CALCULATOR.sub("", row["think"]).strip()
    return f"{think}\nThe answer is {row['gold']}."


def encode(tok, rows: list[dict]) -> list[tuple[list[int], int]]:
    """(ids of rendered prompt + solution + eos, prompt length) per row."""
    prompts = render_prompts(tok, [r["prompt"] for r in rows])
    out = []
    for text, row in zip(prompts, rows):
        p = tok(text, add_special_tokens=False)["input_ids"]
        t = tok(solution_text(row), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((p + t, len(p)))
    return out


def train_epoch(model, tok, examples, *, lr: float, batch_size: int, seed: int) -> list[float]:
    """One epoch over ``examples`` in a seeded random order; returns the loss of each step."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    losses = []
    for start in range(0, len(order), batch_size):
        ids, attn, labels = collate([examples[i] for i in order[start:start + batch_size]], tok.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        print(f"[warm-start] step {len(losses)}/{-(-len(order) // batch_size)} loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="start model (dir or hub id)")
    p.add_argument("--out", required=True, help="where the fine-tuned model is saved")
    p.add_argument("--n", type=int, default=512, help="training problems")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=2, help="calculator steps bound of the problems")
    p.add_argument("--probe", type=int, default=48, help="leading shuffled rows kept out (the probe set)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures here too")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    torch.manual_seed(a.seed)
    _, rows = split_rows(gsm8k.resolve_source("openai/gsm8k"), a.max_steps, a.probe, a.n)
    model, tok = load_policy(a.model)
    examples = encode(tok, rows)
    t0 = time.perf_counter()
    losses = train_epoch(model, tok, examples, lr=a.lr, batch_size=a.batch_size, seed=a.seed)
    seconds = time.perf_counter() - t0
    save_policy(model, tok, a.out)
    k = max(1, len(losses) // 8)
    res = {"model": a.model, "out": a.out, "n": a.n, "lr": a.lr, "batch_size": a.batch_size,
           "max_steps": a.max_steps, "probe_held_out": a.probe, "steps": len(losses),
           "completion_tokens": sum(len(ids) - plen for ids, plen in examples),
           "tokens": sum(len(ids) for ids, _ in examples),
           "loss_first_eighth": sum(losses[:k]) / k, "loss_last_eighth": sum(losses[-k:]) / k,
           "train_seconds": round(seconds, 1),
           "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)}
    print(json.dumps(res), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
