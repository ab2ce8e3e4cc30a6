"""The bootstrap SFT of the offline default: a tiny model learns the answer format first.

GRPO needs a policy that already earns some reward (a group whose answers are all wrong
teaches nothing). Offline there is no pretrained model, so ``bootstrap`` builds the tiny model
and really fine-tunes it on the arithmetic training problems (never the validation or test ones) in the
``<think>a+b=c</think><answer>c</answer>`` format, optionally mixed with GSM8K train rows.
The loss covers completion tokens only.

    python -m grpo_core.pipeline.sft --out /tmp/sft --steps 1200
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from grpo_core.config.pipeline import SFTConfig
from grpo_core.data.prompts import sft_target
from grpo_core.data.tasks import arithmetic
from grpo_core.data.tasks import gsm8k as gsm8k_task
from grpo_core.model.loading import build_tiny, save_policy
from grpo_core.rollout.generate import render_prompts

THINK_END = "</think>"  # where the reasoning ends in the SFT target (data.SFT_FORMAT)
MAX_SFT_TOKENS = 512  # longer rows lose the end of their reasoning, never the answer


def encode_examples(tok, rows: list[dict], max_tokens: int = MAX_SFT_TOKENS) -> list[tuple[list[int], int]]:
    """(token ids of prompt + target + eos, prompt length) per row, at most ``max_tokens``.

    A longer row is cut inside its reasoning, so the ``</think><answer>N</answer>`` tail and eos
    always stay: cut from the end, half of the GSM8K rows taught long reasoning with no answer
    and no stop. A row whose prompt and tail alone do not fit is dropped."""
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = render_prompts(tok, [r["prompt"] for r in rows])
    out = []
    for text, row in zip(prompts, rows):
        p, target = enc(text), sft_target(row)
        t = enc(target) + [tok.eos_token_id]
        if len(p) + len(t) > max_tokens:
            head, tail = target[:target.rindex(THINK_END)], target[target.rindex(THINK_END):]
            tail_ids = enc(tail) + [tok.eos_token_id]
            room = max_tokens - len(p) - len(tail_ids)
            if room < 1:
                continue
            t = enc(head)[:room] + tail_ids
        out.append((p + t, len(p)))
    return out


def collate(examples, pad_id: int):
    """Right-padded ids, attention mask and labels (-100 on prompt and padding)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (seq, plen) in enumerate(examples):
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        labels[i, plen:len(seq)] = torch.tensor(seq[plen:])
    return ids, attn, labels


def bootstrap(cfg: SFTConfig, out_dir: str | Path, gsm8k: str = "openai/gsm8k") -> dict:
    """Build the tiny model, SFT it, save it to ``out_dir``; returns SFT metrics. ``gsm8k``: the
    GSM8K source the run fingerprinted (hub id or dir), for ``gsm8k_examples``."""
    torch.manual_seed(cfg.seed)
    model, tok = build_tiny(cfg.arch, cfg.hidden, cfg.layers, cfg.heads, seed=cfg.seed)
    rows = arithmetic.rows("train", cfg.arithmetic_ops, cfg.arithmetic_min, cfg.arithmetic_max)
    if cfg.gsm8k_examples:
        rows += gsm8k_task.rows("train", gsm8k_task.resolve_source(gsm8k), limit=cfg.gsm8k_examples)
    examples = encode_examples(tok, rows)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / max(cfg.steps, 1), 1.0))))
    g = torch.Generator().manual_seed(cfg.seed)
    model.train()
    t0, losses = time.perf_counter(), []
    for step in range(1, cfg.steps + 1):
        idx = torch.randint(len(examples), (cfg.batch_size,), generator=g).tolist()
        ids, attn, labels = collate([examples[i] for i in idx], tok.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 200 == 0 or step == cfg.steps:
            print(f"[sft] step {step}/{cfg.steps} loss {sum(losses[-50:]) / len(losses[-50:]):.4f}", flush=True)
    save_policy(model, tok, out_dir)
    return {"sft_steps": cfg.steps, "sft_final_loss": sum(losses[-50:]) / max(len(losses[-50:]), 1),
            "sft_seconds": time.perf_counter() - t0, "sft_examples": len(examples),
            "sft_rows_dropped": len(rows) - len(examples)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=SFTConfig.steps)
    p.add_argument("--hidden", type=int, default=SFTConfig.hidden)
    p.add_argument("--layers", type=int, default=SFTConfig.layers)
    a = p.parse_args(argv)
    print(json.dumps(bootstrap(SFTConfig(steps=a.steps, hidden=a.hidden, layers=a.layers), a.out)))


if __name__ == "__main__":
    main()
