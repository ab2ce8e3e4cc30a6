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
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_core.algo.core import group_advantages, token_logprobs  # noqa: E402
from grpo_core.algo.losses import grpo_loss  # noqa: E402
from grpo_core.policy import dist, sharding  # noqa: E402
from grpo_core.policy.policy import wrap_ddp  # noqa: E402
from grpo_core.policy.scoring import completion_logprobs, groups_share_prompts, length_chunks  # noqa: E402
from grpo_core.rollout.batch import RolloutBatch  # noqa: E402
from grpo_core.rollout.decode import sample_inverse_cdf, sample_shared_prefix  # noqa: E402
from grpo_core.rollout.generate import _generate, completion_mask  # noqa: E402

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


# ----------------------------------------------------------------------------- single-process part

def correctness(dev, tmp: str, vocab: int) -> dict:
    print("== correctness on", dev, flush=True)
    res, g = {}, torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.bfloat16, (1e-4, 1e-2, 1e-6)), (torch.float32, (2e-5, 1e-4, 1e-7))):
        x = (torch.randn(3, 9, vocab, generator=g) * 3).to(dtype)
        tgt, w = torch.randint(0, vocab, (3, 9), generator=g), torch.randn(3, 9, generator=g)
        xd = x.clone().to(dev).requires_grad_(True)
        logp = token_logprobs(xd, tgt.to(dev), 0.7)
        (logp * w.to(dev)).sum().backward()
        x64 = x.double().requires_grad_(True)
        ref = torch.log_softmax(x64 / 0.7, -1).gather(-1, tgt[..., None])[..., 0]
        (ref * w.double()).sum().backward()
        err = (logp.detach().cpu().double() - ref.detach()).abs().max().item()
        gok = torch.allclose(xd.grad.cpu().double(), x64.grad, rtol=tol[1], atol=tol[2])
        check(f"token_logprobs {dtype} vs CPU float64", err < tol[0] and gok, f"(max |dlogp| {err:.2e})")
        res[f"token_logprobs_{str(dtype)[6:]}_max_err"] = err
    B, T = 8, 11
    lp, old, ref = (torch.randn(B, T, generator=g) * 0.5 - 2 for _ in range(3))
    adv, mask = torch.randn(B, generator=g), torch.rand(B, T, generator=g) > 0.2
    outs = []
    for d, dt in ((dev, torch.float32), (torch.device("cpu"), torch.float64)):
        x = lp.clone().to(d, dt).requires_grad_(True)
        loss, _ = grpo_loss(x, old.to(d, dt) + 0.1, ref.to(d, dt), adv.to(d, dt), mask.to(d), beta=0.04,
                            loss_type="dapo")
        loss.backward()
        outs.append((loss.item(), x.grad.cpu().double()))
    rel = abs(outs[0][0] - outs[1][0]) / abs(outs[1][0])
    check("grpo_loss fp32 vs CPU float64", rel < 1e-5 and torch.allclose(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-7),
          f"(rel loss err {rel:.1e})")
    res["grpo_loss_rel_err"] = rel
    # the decoder's inverse-CDF sampler on the device: frequencies, zero-probability tokens never drawn
    p, n = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0]), 200_000
    torch.manual_seed(0)
    freq = torch.bincount(sample_inverse_cdf(p.to(dev).expand(n, 5)).cpu(), minlength=5).double() / n
    dev_sd = (freq - p.double()).abs() / (p.double() * (1 - p.double()) / n).sqrt().clamp(min=1e-12)
    check("inverse-CDF sampler frequencies on the device", bool((dev_sd <= 4.5).all()) and freq[1] == freq[4] == 0,
          f"(worst {dev_sd.max().item():.1f} standard errors)")
    res["sampler_worst_standard_errors"] = dev_sd.max().item()
    # one Trainer.update on the device vs on CPU (same batch, fp32, shared-prefix scoring); half the
    # rows short, so scoring runs in two length chunks (rows picked by device indices)
    model_dir = tiny_dir(tmp)
    batch = fixed_batch(2, 8, T=40, lengths=torch.tensor([40, 2] * 8))
    assert groups_share_prompts(batch) and len(length_chunks(batch.completion_mask.sum(-1).tolist())) > 1
    got = {}
    for d in (dev, torch.device("cpu")):
        tr = trainer_for(model_dir, f"{tmp}/upd_{d.type}", dist.DistInfo(0, 1, 0, d), sampling={"group_size": 8})
        tr.update(copy.deepcopy(batch))
        got[d.type] = grads(tr.policy.model)
    ok, worst = close_grads(got[dev.type], got["cpu"])
    check("Trainer.update gradients, device vs CPU", ok, f"(worst rel diff {worst:.1e})")
    res["trainer_update_worst_rel_grad_diff"] = worst
    # precision = "bf16" (autocast, float32 weights) on the device vs the fp32 update there
    tr = trainer_for(model_dir, f"{tmp}/upd_bf16", dist.DistInfo(0, 1, 0, dev), sampling={"group_size": 8},
                     execution={"precision": "bf16"})
    tr.update(copy.deepcopy(batch))
    cos = cosine(grads(tr.policy.model), got[dev.type])
    check("Trainer.update precision=bf16 vs fp32 on the device", cos > 0.999 and all(
        p.dtype == torch.float32 for p in tr.policy.model.parameters()), f"(gradient cosine {cos:.6f})")
    res["trainer_update_bf16_grad_cosine"] = cos
    res.update(lora_checks(dev, tmp, model_dir, batch))
    # the shared-prefix decoder and scorer vs generate / full forward on the tiny fp32 model
    from grpo_core.model.loading import load_policy
    model, tok = load_policy(model_dir)
    model.to(dev).eval()
    ids = torch.randint(10, 60, (3, 9), generator=g).to(dev)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    eos, pad = tok.eos_token_id, tok.pad_token_id
    fast = sample_shared_prefix(model, ids, mask, 2, max_new_tokens=12, eos_id=eos, pad_id=pad, greedy=True)
    slow = _generate(model, ids, mask, 2, 12, eos, pad, temperature=1.0, top_p=1.0, top_k=0, greedy=True)
    check("greedy decoder == generate (tiny fp32)", torch.equal(fast, slow))
    res["scoring_fp32_max_diff"] = shared_vs_full(model, ids, mask, fast, 2, tok.eos_token_id)
    check("shared-prefix scoring == full forward (tiny fp32)", res["scoring_fp32_max_diff"] < 1e-4,
          f"(max |dlogp| {res['scoring_fp32_max_diff']:.1e})")
    return res


def lora_checks(dev, tmp: str, model_dir: str, batch: RolloutBatch) -> dict:
    """LoRA (rank 4, peft): one Trainer.update's adapter gradients on the device vs CPU (fp32),
    and bf16 vs fp32 on the device."""
    lora = {}
    for d, prec in ((dev, "fp32"), (torch.device("cpu"), "fp32"), (dev, "bf16")):
        tr = trainer_for(model_dir, f"{tmp}/lora_{d.type}_{prec}", dist.DistInfo(0, 1, 0, d),
                         sampling={"group_size": 8}, execution={"precision": prec}, lora={"rank": 4, "alpha": 8.0})
        tr.update(copy.deepcopy(batch))
        lora[d.type, prec] = grads(tr.policy.model)
    ok, worst = close_grads(lora[dev.type, "fp32"], lora["cpu", "fp32"])
    check("LoRA Trainer.update adapter gradients, device vs CPU", ok and all("lora_" in k for k in lora["cpu", "fp32"]),
          f"(worst rel diff {worst:.1e})")
    cos = cosine(lora[dev.type, "bf16"], lora[dev.type, "fp32"])
    check("LoRA Trainer.update precision=bf16 vs fp32 on the device", cos > 0.999, f"(gradient cosine {cos:.6f})")
    return {"lora_update_worst_rel_grad_diff": worst, "lora_update_bf16_grad_cosine": cos}


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


def step_agreement(dev, shape: dict, arch: str) -> float:
    """Gradient cosine of one GRPO loss step: the random ``shape`` model on the device in bf16
    autocast (fp32 weights) against the same model and batch on CPU in fp32 (2 prompts x G=2)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(10, shape["vocab_size"], (2, 16), generator=g)
    comp = torch.randint(10, shape["vocab_size"], (4, 12), generator=g)
    batch = RolloutBatch(ids.repeat_interleave(2, 0), torch.ones(4, 16, dtype=torch.long), comp,
                         torch.ones(4, 12, dtype=torch.bool), torch.zeros(4, dtype=torch.bool), 2, [], [])
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = []
    for d, amp in ((dev, True), (torch.device("cpu"), False)):
        model = big_model(shape, d, torch.float32, arch)
        with torch.autocast(device_type=d.type, dtype=torch.bfloat16, enabled=amp):
            logp, _ = completion_logprobs(model, batch, 1.0)
        loss, _ = grpo_loss(logp, logp.detach(), None, batch.advantages.to(d), batch.completion_mask.to(d),
                            beta=0.0, loss_type="dapo")
        loss.backward()
        out.append(torch.cat([p.grad.float().flatten().cpu() for p in model.parameters()]))
    return torch.nn.functional.cosine_similarity(*out, dim=0).item()


SHAPES = {"smollm2-135m": (SMOLLM2, "llama"), "qwen2-0.5b": (BIG, "qwen2")}


def timings(dev, smoke: bool, shape_name: str) -> dict:
    shape, arch = (SMOKE, SHAPES[shape_name][1]) if smoke else SHAPES[shape_name]
    N, G, P, T, reps = (2, 2, 8, 8, 2) if smoke else (16, 8, 64, 128, 3)
    print(f"== timings on {dev}: {shape_name}-shaped {shape}, bf16, {N} prompts x G={G}, P={P}, T={T}", flush=True)
    if shape_name == "smollm2-135m":
        cos = step_agreement(dev, shape, arch)
        check(f"{shape_name} step: bf16 autocast on the device vs CPU fp32", cos > 0.99, f"(gradient cosine {cos:.5f})")
    model = big_model(shape, dev, torch.bfloat16, arch)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(10, shape["vocab_size"], (N, P), generator=g).to(dev)
    mask = torch.ones_like(ids)
    mask[: N // 2, : P // 4] = 0  # left padding
    eos, res = shape["vocab_size"] - 1, {"params": params, "N": N, "G": G, "P": P, "T": T}
    kw = dict(temperature=1.0, top_p=1.0, top_k=0)
    t_fast, comp = timed(lambda: sample_shared_prefix(model, ids, mask, G, max_new_tokens=T, eos_id=eos,
                                                      pad_id=0, **kw), dev, reps)
    t_gen, _ = timed(lambda: _generate(model, ids, mask, G, T, eos, 0, greedy=False, **kw), dev, reps)
    n_tok = comp.numel()
    res.update(gen_tokens_per_s_ours=n_tok / t_fast, gen_tokens_per_s_generate=n_tok / t_gen,
               gen_s_ours=t_fast, gen_s_generate=t_gen)
    print(f"  generation: ours {n_tok / t_fast:,.0f} tok/s ({t_fast:.3f} s), generate {n_tok / t_gen:,.0f} "
          f"tok/s ({t_gen:.3f} s)", flush=True)
    greedy = [sample_shared_prefix(model, ids, mask, 1, max_new_tokens=16, eos_id=eos, pad_id=0, greedy=True),
              _generate(model, ids, mask, 1, 16, eos, 0, greedy=True, **kw)]
    res["greedy_match_rate_bf16"] = (greedy[0] == greedy[1]).float().mean().item()
    res["scoring_bf16_max_diff"] = shared_vs_full(model, ids[:2], mask[:2], greedy[0][:2], 1, eos)
    print(f"  bf16 greedy token match vs generate {res['greedy_match_rate_bf16']:.3f}; shared vs full "
          f"scoring max |dlogp| {res['scoring_bf16_max_diff']:.3f} (reported, not checked)", flush=True)
    cmask, trunc = completion_mask(comp.clone(), eos)
    batch = RolloutBatch(ids.repeat_interleave(G, 0).cpu(), mask.repeat_interleave(G, 0).cpu(), comp.clone().cpu(),
                         cmask.cpu(), trunc.cpu(), G, [], [])
    batch.advantages = group_advantages(torch.rand(N * G, generator=g), G).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    m = batch.completion_mask.to(dev)

    def ref_forward():
        with torch.no_grad():
            return completion_logprobs(ref_model, batch, 1.0)[0]

    t_ref, ref_logp = timed(ref_forward, dev, reps)

    def make_step(model, opt, amp: bool):
        def step():
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=amp):
                logp, _ = completion_logprobs(model, batch, 1.0, with_entropy=True)
            loss, _ = grpo_loss(logp, logp.detach(), ref_logp, batch.advantages, m, beta=0.04, loss_type="dapo")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return loss.item()
        return step

    t_step, loss = timed(make_step(model, opt, amp=False), dev, reps)
    check("training step loss is finite", loss == loss and abs(loss) < 1e6, f"(loss {loss:.3g})")
    # what the trainer runs with precision = "bf16": float32 weights and AdamW, autocast forward
    del opt
    model = model.float()
    step_autocast = make_step(model, torch.optim.AdamW(model.parameters(), lr=1e-6), amp=True)
    t_amp, loss = timed(step_autocast, dev, reps)
    check("autocast training step (fp32 weights) loss is finite", loss == loss and abs(loss) < 1e6,
          f"(loss {loss:.3g})")

    def decode_autocast():
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
            return sample_shared_prefix(model, ids, mask, G, max_new_tokens=T, eos_id=eos, pad_id=0, **kw)

    t_gen_amp, comp_amp = timed(decode_autocast, dev, reps)
    res.update(gen_tokens_per_s_autocast=comp_amp.numel() / t_gen_amp, gen_s_autocast=t_gen_amp)
    flops = flops_per_step(shape, N, G, P, T)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = float(os.environ.get("GPU_PEAK_TFLOPS", 0)) * 1e12 or next(
        (v for k, v in PEAK_BF16.items() if k in name), None)
    res.update(ref_forward_s=t_ref, train_step_s=t_step, train_step_flops=flops, device_name=name,
               peak_bf16_flops=peak, train_tflops=flops / t_step / 1e12,
               mfu=(flops / t_step / peak) if peak else None, train_step_autocast_s=t_amp,
               mfu_autocast=(flops / t_amp / peak) if peak else None,
               peak_mem_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None)
    print(f"  reference forward {t_ref:.3f} s; policy fwd+bwd+AdamW {t_step:.3f} s = "
          f"{flops / t_step / 1e12:.1f} TFLOP/s" + (f", MFU {res['mfu']:.1%} of {peak / 1e12:.0f}" if peak else ""),
          flush=True)
    print(f"  generation with precision=bf16 (fp32 weights, autocast): {comp_amp.numel() / t_gen_amp:,.0f} tok/s "
          f"({t_gen_amp:.3f} s)", flush=True)
    print(f"  the same step with precision=bf16 (fp32 weights + AdamW, autocast): {t_amp:.3f} s = "
          f"{flops / t_amp / 1e12:.1f} TFLOP/s" + (f", MFU {res['mfu_autocast']:.1%}" if peak else ""), flush=True)
    return res


# ----------------------------------------------------------------------------- DDP part (torchrun)

def ddp_part(tmp: str) -> dict:
    model_dir = tiny_dir(tmp)  # before the process group: transformers saves on rank 0 only once it exists
    info = dist.init()
    dev, world = info.device, info.world_size
    t = torch.tensor([float(info.rank + 1)], device=dev)
    torch.distributed.all_reduce(t)
    ok_reduce = t.item() == world * (world + 1) / 2
    full = fixed_batch(2 * world, 4)
    rows = torch.zeros(2 * world, dtype=torch.bool)
    rows[2 * info.rank: 2 * info.rank + 2] = True
    tr = trainer_for(model_dir, f"{tmp}/ddp{info.rank}", info, prompts_per_iter=2 * world)
    if not isinstance(tr.policy.trained, torch.nn.parallel.DistributedDataParallel):  # one GPU: still go through DDP
        tr.policy.trained = wrap_ddp(tr.policy.model, info)  # the trainer wraps only when world > 1
    tr.update(full.select_groups(rows))
    res = {"world_size": world, "backend": torch.distributed.get_backend(), "all_reduce_ok": ok_reduce}
    ddp_grads = grads(tr.policy.model)
    fsdp = {prec: fsdp2_grads(model_dir, tmp, info, full, rows, prec) for prec in ("fp32", "bf16")}
    dist.cleanup()  # the one-process reference below must not join collectives
    if info.is_main:
        print(f"== ddp: {world} rank(s), backend {res['backend']}", flush=True)
        check("all_reduce sum over ranks", ok_reduce)
        one = trainer_for(model_dir, f"{tmp}/one", dist.DistInfo(0, 1, 0, dev), prompts_per_iter=2 * world)
        one.update(copy.deepcopy(full))
        ok, worst = close_grads(ddp_grads, grads(one.model))
        check("DDP update gradients == one-process update (dapo)", ok, f"(worst rel diff {worst:.1e})")
        res["worst_rel_grad_diff"] = worst
        reference = grads(one.model) if world > 1 else direct_grads(model_dir, dev, full)
        ok, worst = close_grads(fsdp["fp32"], reference)
        check(f"FSDP2 fp32 gradients == one-process ({'trainer update' if world > 1 else '1-rank shard'})",
              ok, f"(worst rel diff {worst:.1e})")
        cos = cosine(fsdp["bf16"], reference)
        check("FSDP2 bf16 mixed-precision gradients ~ fp32 (cosine > 0.99)", 0.99 < cos, f"(cosine {cos:.5f})")
        res.update(fsdp2_worst_rel_grad_diff=worst, fsdp2_bf16_cosine=cos)
    return res


def fsdp2_grads(model_dir: str, tmp: str, info, full: RolloutBatch, rows, precision: str) -> dict:
    """Whole gradients (gathered from the shards) of one fsdp2 update on every rank's groups:
    the trainer's with >= 2 ranks; with one, the tiny model sharded over the 1-rank group
    directly, scoring all of ``full`` through FSDP's root (``direct_grads``' loss)."""
    if info.world_size > 1:
        tr = trainer_for(model_dir, f"{tmp}/fsdp-{precision}{info.rank}", info, prompts_per_iter=2 * info.world_size,
                         execution={"parallelism": "fsdp2", "precision": precision})
        tr.update(full.select_groups(rows))
        model = tr.policy.model
    else:
        from grpo_core.model.loading import load_policy

        model, _ = load_policy(model_dir)
        model.to(info.device)
        root = sharding.shard(model, precision)
        with torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logp, _ = root(copy.deepcopy(full), 1.0)
        (logp * full.completion_mask.to(info.device)).sum().backward()
    return {n: sharding.full_value(p.grad).detach().float().cpu() for n, p in model.named_parameters()
            if p.grad is not None}


def direct_grads(model_dir: str, dev, full: RolloutBatch) -> dict:
    """The unsharded fp32 gradient of the loss ``fsdp2_grads`` uses on one GPU."""
    from grpo_core.model.loading import load_policy

    model, _ = load_policy(model_dir)
    model.to(dev)
    logp, _ = completion_logprobs(model, copy.deepcopy(full), 1.0)
    (logp * full.completion_mask.to(dev)).sum().backward()
    return grads(model)


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
