"""The GPU check's single-process part (``benchmarks/gpu_check.py single``): correctness on the
device against CPU references, then, per model shape, one step's gradient agreement and the
generation / reference-forward / training-step timings with their MFU.
"""
from __future__ import annotations

import copy
import os

import torch
from gpu_check_common import (
    BIG,
    PEAK_BF16,
    SMOKE,
    SMOLLM2,
    big_model,
    check,
    close_grads,
    cosine,
    fixed_batch,
    flops_per_step,
    grads,
    shared_vs_full,
    timed,
    tiny_dir,
    trainer_for,
)

from grpo_core.algo.core import group_advantages, token_logprobs
from grpo_core.algo.losses import grpo_loss
from grpo_core.policy import dist
from grpo_core.policy.scoring import completion_logprobs, groups_share_prompts, length_chunks
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.decode import sample_inverse_cdf, sample_shared_prefix
from grpo_core.rollout.generate import _generate, completion_mask

SHAPES = {"smollm2-135m": (SMOLLM2, "llama"), "qwen2-0.5b": (BIG, "qwen2")}

# ----------------------------------------------------------------------------- correctness


def correctness(dev, tmp: str, vocab: int) -> dict:
    """Every correctness check on ``dev``, in order (one generator ``g`` feeds them all)."""
    print("== correctness on", dev, flush=True)
    res, g = {}, torch.Generator().manual_seed(1)
    res.update(logprob_checks(dev, vocab, g))
    res.update(loss_check(dev, g))
    res.update(sampler_check(dev))
    # one Trainer.update on the device vs on CPU (same batch, fp32, shared-prefix scoring); half the
    # rows short, so scoring runs in two length chunks (rows picked by device indices)
    model_dir = tiny_dir(tmp)
    batch = fixed_batch(2, 8, T=40, lengths=torch.tensor([40, 2] * 8))
    assert groups_share_prompts(batch) and len(length_chunks(batch.completion_mask.sum(-1).tolist())) > 1
    res.update(update_checks(dev, tmp, model_dir, batch))
    res.update(lora_checks(dev, tmp, model_dir, batch))
    res.update(decoder_checks(dev, model_dir, g))
    return res


def logprob_checks(dev, vocab: int, g: torch.Generator) -> dict:
    """token_logprobs forward+backward, bf16 and fp32 logits on the device, vs CPU float64."""
    res = {}
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
    return res


def loss_check(dev, g: torch.Generator) -> dict:
    """grpo_loss forward+backward in fp32 on the device vs CPU float64."""
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
    return {"grpo_loss_rel_err": rel}


def sampler_check(dev) -> dict:
    """The decoder's inverse-CDF sampler on the device: frequencies, zero-probability tokens never drawn."""
    p, n = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0]), 200_000
    torch.manual_seed(0)
    freq = torch.bincount(sample_inverse_cdf(p.to(dev).expand(n, 5)).cpu(), minlength=5).double() / n
    dev_sd = (freq - p.double()).abs() / (p.double() * (1 - p.double()) / n).sqrt().clamp(min=1e-12)
    check("inverse-CDF sampler frequencies on the device", bool((dev_sd <= 4.5).all()) and freq[1] == freq[4] == 0,
          f"(worst {dev_sd.max().item():.1f} standard errors)")
    return {"sampler_worst_standard_errors": dev_sd.max().item()}


def update_checks(dev, tmp: str, model_dir: str, batch: RolloutBatch) -> dict:
    """One Trainer.update's gradients on the device vs CPU (fp32), and precision = "bf16" (autocast,
    float32 weights) vs the fp32 update on the device."""
    got = {}
    for d in (dev, torch.device("cpu")):
        tr = trainer_for(model_dir, f"{tmp}/upd_{d.type}", dist.DistInfo(0, 1, 0, d), sampling={"group_size": 8})
        tr.update(copy.deepcopy(batch))
        got[d.type] = grads(tr.policy.model)
    ok, worst = close_grads(got[dev.type], got["cpu"])
    check("Trainer.update gradients, device vs CPU", ok, f"(worst rel diff {worst:.1e})")
    tr = trainer_for(model_dir, f"{tmp}/upd_bf16", dist.DistInfo(0, 1, 0, dev), sampling={"group_size": 8},
                     execution={"precision": "bf16"})
    tr.update(copy.deepcopy(batch))
    cos = cosine(grads(tr.policy.model), got[dev.type])
    check("Trainer.update precision=bf16 vs fp32 on the device", cos > 0.999 and all(
        p.dtype == torch.float32 for p in tr.policy.model.parameters()), f"(gradient cosine {cos:.6f})")
    return {"trainer_update_worst_rel_grad_diff": worst, "trainer_update_bf16_grad_cosine": cos}


def decoder_checks(dev, model_dir: str, g: torch.Generator) -> dict:
    """The shared-prefix decoder and scorer vs generate / full forward on the tiny fp32 model."""
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
    diff = shared_vs_full(model, ids, mask, fast, 2, tok.eos_token_id)
    check("shared-prefix scoring == full forward (tiny fp32)", diff < 1e-4, f"(max |dlogp| {diff:.1e})")
    return {"scoring_fp32_max_diff": diff}


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


# ----------------------------------------------------------------------------- timings


def timings(dev, smoke: bool, shape_name: str) -> dict:
    """One shape's figures: the step agreement (SmolLM2's shape), then generation, the reference
    forward and the training step timed on a random bf16 model, with FLOPs and MFU."""
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
    comp = generation_timings(model, ids, mask, G, T, eos, dev, reps, res)
    cmask, trunc = completion_mask(comp.clone(), eos)
    batch = RolloutBatch(ids.repeat_interleave(G, 0).cpu(), mask.repeat_interleave(G, 0).cpu(), comp.clone().cpu(),
                         cmask.cpu(), trunc.cpu(), G, [], [])
    batch.advantages = group_advantages(torch.rand(N * G, generator=g), G).to(dev)
    step_timings(model, ref_model, batch, ids, mask, T, eos, dev, reps, res)
    report_step_throughput(res, flops_per_step(shape, N, G, P, T), dev)
    return res


def generation_timings(model, ids, mask, G: int, T: int, eos: int, dev, reps: int, res: dict) -> torch.Tensor:
    """Our decoder's and generate's tokens/s, then (reported, not checked) the bf16 greedy token
    match and shared-prefix vs full scoring; adds them to ``res`` and returns our completions."""
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
    return comp


def step_timings(model, ref_model, batch: RolloutBatch, ids, mask, T: int, eos: int, dev, reps: int,
                 res: dict) -> None:
    """The reference forward, the policy forward+backward+AdamW step with bf16 weights, the same
    step with float32 weights under bf16 autocast (what precision = "bf16" trains with) and
    generation under autocast; adds the seconds to ``res``."""
    kw = dict(temperature=1.0, top_p=1.0, top_k=0)
    G = batch.group_size
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
    res.update(gen_tokens_per_s_autocast=comp_amp.numel() / t_gen_amp, gen_s_autocast=t_gen_amp,
               ref_forward_s=t_ref, train_step_s=t_step, train_step_autocast_s=t_amp)


def report_step_throughput(res: dict, flops: float, dev) -> None:
    """FLOP/s and MFU of the two timed training steps (peak: GPU_PEAK_TFLOPS, else the device's
    dense bf16 spec), added to ``res`` and printed."""
    t_ref, t_step, t_amp = res["ref_forward_s"], res["train_step_s"], res["train_step_autocast_s"]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = float(os.environ.get("GPU_PEAK_TFLOPS", 0)) * 1e12 or next(
        (v for k, v in PEAK_BF16.items() if k in name), None)
    res.update(train_step_flops=flops, device_name=name, peak_bf16_flops=peak, train_tflops=flops / t_step / 1e12,
               mfu=(flops / t_step / peak) if peak else None, mfu_autocast=(flops / t_amp / peak) if peak else None,
               peak_mem_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None)
    print(f"  reference forward {t_ref:.3f} s; policy fwd+bwd+AdamW {t_step:.3f} s = "
          f"{flops / t_step / 1e12:.1f} TFLOP/s" + (f", MFU {res['mfu']:.1%} of {peak / 1e12:.0f}" if peak else ""),
          flush=True)
    print(f"  generation with precision=bf16 (fp32 weights, autocast): {res['gen_tokens_per_s_autocast']:,.0f} "
          f"tok/s ({res['gen_s_autocast']:.3f} s)", flush=True)
    print(f"  the same step with precision=bf16 (fp32 weights + AdamW, autocast): {t_amp:.3f} s = "
          f"{flops / t_amp / 1e12:.1f} TFLOP/s" + (f", MFU {res['mfu_autocast']:.1%}" if peak else ""), flush=True)
