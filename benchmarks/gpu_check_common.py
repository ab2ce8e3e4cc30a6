"""Shared by the GPU check's parts (``benchmarks/gpu_check.py``): the model shapes, the failure
list and ``check``, timing, random and tiny models, a fixed batch, a Trainer on any device,
gradient comparisons, shared-prefix vs full scoring, and the FLOPs of one training step.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from grpo_core.algo.core import group_advantages
from grpo_core.policy.scoring import completion_logprobs
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.generate import completion_mask

BIG = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
           intermediate_size=4864, vocab_size=151936)  # Qwen2-0.5B's shape
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152)  # SmolLM2-135M's shape (Llama, tied embeddings)
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=1000)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}  # dense spec
FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(f"{name} {detail}")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, reps: int):
    fn()  # warm-up
    sync(dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def big_model(shape: dict, dev, dtype, arch: str = "qwen2"):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config = LlamaConfig if arch == "llama" else Qwen2Config
    cfg = config(**shape, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model


def tiny_dir(tmp: str) -> str:
    from grpo_core.model.loading import build_tiny, save_policy

    model, tok = build_tiny("llama", 64, 2, 4, seed=0)
    return str(save_policy(model, tok, Path(tmp) / "tiny"))


def fixed_batch(n_groups: int, G: int, P: int = 6, T: int = 7, vocab: int = 60,
                lengths: torch.Tensor | None = None) -> RolloutBatch:
    """A batch with group-shared prompts, uneven completion lengths (random, or ``lengths``) and
    informative rewards."""
    g = torch.Generator().manual_seed(0)
    B = n_groups * G
    prompts = torch.randint(10, vocab, (n_groups, P), generator=g).repeat_interleave(G, 0)
    pmask = torch.ones(B, P, dtype=torch.long)
    pmask[::G, :2] = 0  # left padding in every group's prompt
    pmask = pmask[::G].repeat_interleave(G, 0)
    lengths = torch.randint(1, T + 1, (B,), generator=g) if lengths is None else lengths
    cmask = torch.arange(T)[None] < lengths[:, None]
    batch = RolloutBatch(prompts, pmask, torch.randint(10, vocab, (B, T), generator=g), cmask,
                         lengths == T, G, [""] * B, [""] * B)
    batch.rewards = torch.rand(B, generator=g)
    batch.advantages = group_advantages(batch.rewards, G)
    return batch


def trainer_for(model_dir: str, out: str, info, **over):
    from grpo_core.config.pipeline import deep_merge
    from grpo_core.config.stage import GRPOConfig
    from grpo_core.train.trainer import Trainer

    fields = dict(loss=dict(beta=0.04), optim=dict(lr=1e-2, max_grad_norm=0.0), sampling=dict(group_size=4),
                  prompts_per_iter=2, runtime=dict(model=model_dir, output_dir=out))
    cfg = GRPOConfig(**deep_merge(fields, over))
    return Trainer(cfg, info)


def grads(model) -> dict:
    return {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def close_grads(a: dict, b: dict, rtol=1e-3, atol=1e-6) -> tuple[bool, float]:
    worst = max(((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-12)).item() for k in b)
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=rtol, atol=atol) for k in b), worst


def cosine(a: dict, b: dict) -> float:
    """Cosine similarity of two gradients (name -> tensor), flattened in ``b``'s key order."""
    flat = lambda g: torch.cat([g[k].flatten().double() for k in sorted(b)])  # noqa: E731
    return torch.nn.functional.cosine_similarity(flat(a), flat(b), dim=0).item()


def shared_vs_full(model, ids, mask, comp, G: int, eos: int) -> float:
    import grpo_core.policy.scoring as scoring

    cmask, trunc = completion_mask(comp.clone(), eos)
    batch = RolloutBatch(ids.repeat_interleave(G, 0).cpu(), mask.repeat_interleave(G, 0).cpu(), comp.clone().cpu(),
                         cmask.cpu(), trunc.cpu(), G, [], [])
    saved, out = scoring.groups_share_prompts, []
    try:
        for share in (True, False):
            scoring.groups_share_prompts = lambda b, share=share: share
            with torch.no_grad():
                out.append(completion_logprobs(model, batch, 1.0)[0].float())
    finally:
        scoring.groups_share_prompts = saved
    return (out[0] - out[1]).abs()[batch.completion_mask.to(out[0].device)].max().item()


def flops_per_step(c: dict, N: int, G: int, P: int, T: int) -> float:
    d, L, f, V = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * d // c["num_attention_heads"]
    body = L * (2 * d * d + 2 * d * kv + 3 * d * f)  # matmul params per token
    B = N * G
    tokens = N * P + B * (T - 1)  # shared prefix: each prompt once, completions once
    attn = 4 * d * L * (N * P * (P + 1) / 2 + B * sum(P + t for t in range(1, T)))
    fwd = 2 * body * tokens + 2 * d * V * B * T + attn
    return 3 * fwd
